"""A Horovod job that ends with collectives still queued in MXNet's engine exits cleanly.

Without the package's exit drain (`mx_lbsgd.distributed.horovod_exit`), Horovod's atexit shutdown runs
before MXNet's and fails the queued collectives: every such job prints MXNet's
"Exception ignored in atexit callback ... Horovod has been shut down", and some segfault,
abort in glibc or hang (tests/hvd_exit_worker.py --unprotected shows it).
"""
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

pytest.importorskip('horovod.mxnet')

from harness import CRASH_MARKS, horovodrun  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, 'hvd_exit_worker.py')
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
SHUT_DOWN = 'Horovod has been shut down'


def _run(*args, env=None):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(HERE), os.environ.get('PYTHONPATH')])), **(env or {}))
    start = time.monotonic()
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, WORKER] + list(args),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=120, env=env)
    return proc.returncode, proc.stdout, time.monotonic() - start


def test_exit_with_collectives_queued_is_clean():
    """lblamb under hvd.DistributedTrainer, then 96 allreduce_ calls nobody waits for, then
    the end of the script: both ranks finish every collective before Horovod shuts down."""
    code, log, _ = _run('queued')
    assert code == 0, log
    for rank in range(2):
        assert '[%d]<stdout>:steps done on rank %d' % (rank, rank) in log, log
    assert SHUT_DOWN not in log and 'operation still queued at exit failed' not in log, log


def test_exception_with_collectives_in_flight_fails_fast():
    """Rank 1 raises right after its trainer.step pushed that step's allreduces (and 8 more
    of its own that rank 0 never runs): the job exits non-zero within seconds, the
    exception in the log, no crash or hang. Rank 1's drain gives up on the collectives its
    peer never runs after 5 s; rank 0, in its drain, ends with status 1 once Horovod sees
    rank 1 gone (scripts/horovod-0.28.1-lost-peer-exit.patch; without it Horovod fails
    the queued collectives into MXNet's engine: 2 aborts in 150 runs beside two CPU
    burners), or is stopped by horovodrun."""
    code, log, seconds = _run('raise')
    assert code != 0, log
    assert 'RuntimeError: worker 1 fails at step 3 with collectives in flight' in log, log
    assert not [m for m in CRASH_MARKS if m in log], log     # horovodrun() checks it too
    assert seconds < 60, (seconds, log)


def test_the_drain_waits_no_longer_than_its_timeout():
    """MX_LBSGD_HOROVOD_EXIT_TIMEOUT bounds a clean exit's wait: rank 1 ends with an
    allreduce that rank 0 (asleep for 60 s) has not run; after 3 s rank 1 says so and exits
    with status 1 instead of running Horovod's shutdown over it, and horovodrun stops the
    job."""
    code, log, seconds = _run('stuck', env={'MX_LBSGD_HOROVOD_EXIT_TIMEOUT': '3'})
    assert code != 0, log
    assert '[1]<stderr>:mx_lbsgd: MXNet\'s engine still ran Horovod work 3s after the ' \
        'script ended' in log, log
    assert seconds < 50, (seconds, log)
