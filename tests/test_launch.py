"""Local dist_sync launcher: real scheduler/server/worker processes on the loopback."""
import io
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import launch_probe
import mx_lbsgd.launch as launch_module
from mx_lbsgd.launch import launch, main

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = 'MX_LBSGD_TEST_TAG'
# The launcher's --timeout in these tests: a bound that keeps a broken launcher from hanging
# the suite, never a deadline a slow (loaded) machine can miss. That a job ended by itself
# and not at this bound is checked by its exit status (124 is the timeout's).
LIMIT = 600


def _tagged(tag):
    """Pids of live processes (zombies excluded) whose environment holds ``TAG=tag``."""
    needle = f'{TAG}={tag}'.encode()
    pids = []
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                with open(f'/proc/{name}/environ', 'rb') as f:
                    if needle in f.read().split(b'\0'):   # a zombie's environ is empty
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def _alive(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in 'ZX'
    except OSError:
        return False


def _tagged_role(tag, role):
    """Pids of live processes tagged ``tag`` with ``DMLC_ROLE=role``."""
    found = []
    for pid in _tagged(tag):
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                if f'DMLC_ROLE={role}'.encode() in f.read().split(b'\0'):
                    found.append(pid)
        except OSError:
            pass
    return found


def _assert_gone(tag, pids=()):
    # a bound, not a wait: it ends as soon as every process is gone (SIGKILL is delivered at
    # once, but a loaded machine may take seconds to reap)
    deadline = time.monotonic() + 30
    while (_tagged(tag) or any(map(_alive, pids))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tagged(tag) == []
    assert [p for p in pids if _alive(p)] == []


@pytest.fixture
def tag():
    return uuid.uuid4().hex


def _run(tmp_path, tag, source, num_workers, **kwargs):
    script = tmp_path / 'worker.py'
    script.write_text(textwrap.dedent(source))
    out = kwargs.pop('stream', None) or io.StringIO()
    env = {TAG: tag, 'PYTHONPATH': ROOT, 'PROBE_DIR': str(tmp_path)}
    start = time.monotonic()
    code = launch([sys.executable, str(script)], num_workers, env=env, stream=out,
                  timeout=kwargs.pop('timeout', LIMIT), **kwargs)
    return code, out.getvalue(), time.monotonic() - start


def test_dist_sync_two_workers(tmp_path, tag):
    report = {}
    code, out, elapsed = _run(tmp_path, tag, """
        import os
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        assert kv.num_workers == 2
        kv.init(3, mx.nd.zeros((4,)))
        kv.push(3, mx.nd.ones((4,)) * (kv.rank + 1))
        out = mx.nd.zeros((4,))
        kv.pull(3, out=out)
        assert (out.asnumpy() == 3).all(), out
        print('rank', kv.rank, 'label', os.environ['MX_LBSGD_RANK'], 'role', os.environ['DMLC_ROLE'])
        print('at', os.environ['DMLC_PS_ROOT_URI'], os.environ['DMLC_NODE_HOST'],
              os.environ['DMLC_PS_ROOT_PORT'])
    """, 2, report=report)
    assert code == 0, out
    for rank in (0, 1):
        assert f'[worker {rank}] rank ' in out
        assert f'rank {rank} label' in out
    assert out.count('role worker') == 2
    assert '[launch]' not in out      # the servers and the scheduler stopped by themselves
    host, port = report['host'], report['port']
    assert out.count(f'at {host} {host} {port}') == 2
    assert host.startswith('127.') and host != '127.0.0.1'
    low, high = launch_module._ephemeral_range()
    assert not low <= port <= high and not 10000 <= port < 50000
    _assert_gone(tag)


def test_worker_failure_stops_everything(tmp_path, tag):
    started = {}
    code, out, elapsed = _run(tmp_path, tag, """
        import os, subprocess, sys, time
        if os.environ['MX_LBSGD_RANK'] == '1':
            child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
            print('grandchild', child.pid)
            sys.exit(3)
        time.sleep(600)
    """, 2, on_start=started.update)
    assert code == 3, out
    # no kvstore: the labels are the launch order, marked '#'
    assert '[launch] worker #1 exited with code 3' in out
    assert sorted(started) == ['scheduler', 'server 0', 'worker #0', 'worker #1']
    grandchild = int(out.split('grandchild ')[1].split()[0])
    _assert_gone(tag, list(started.values()) + [grandchild])


def test_worker_killed_while_other_waits(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import os, signal
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(0, mx.nd.ones((3,)))
        if kv.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print('waiting', flush=True)
        kv.push(0, mx.nd.ones((3,)))
        out = mx.nd.zeros((3,))
        kv.pull(0, out=out)          # needs worker 1's push: waits forever
        out.wait_to_read()
        print('unreachable')
    """, 2)
    assert code == 128 + signal.SIGKILL, out
    assert 'killed by signal 9' in out and 'unreachable' not in out
    _assert_gone(tag)


def test_timeout(tag, monkeypatch, capsys):
    monkeypatch.setenv(TAG, tag)
    start = time.monotonic()
    code = main(['-n', '2', '--timeout', '3', '--',
                 sys.executable, '-c', 'import time; time.sleep(600)'])
    elapsed = time.monotonic() - start
    assert code == 124
    assert 3 <= elapsed < 300           # at the timeout, not at the workers' end
    assert '[launch] timeout after 3 s' in capsys.readouterr().out
    _assert_gone(tag)


def test_port_in_use(tag, monkeypatch, capsys):
    monkeypatch.setenv(TAG, tag)
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(['-n', '1', '--port', str(port), '--', sys.executable, '-c', 'pass']) == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and f'port {port} is already in use' in err
        started = []
        with pytest.raises(ValueError, match=f'port {port}'):
            launch([sys.executable, '-c', 'pass'], 1, port=port, on_start=started.append)
        assert started == [] and _tagged(tag) == []


@pytest.mark.parametrize('argv, name', [
    (['-n', '0', '--', 'python'], '-n/--num-workers'),
    (['-n', 'two', '--', 'python'], '-n/--num-workers'),
    (['--', 'python'], '-n/--num-workers'),
    (['-n', '1', '-s', '0', '--', 'python'], '-s/--num-servers'),
    (['-n', '1', '--timeout', '0', '--', 'python'], '--timeout'),
    (['-n', '1', '--port', '70000', '--', 'python'], '--port'),
    (['-n', '1'], 'command'),
    (['-n', '1', '--'], 'command'),
])
def test_bad_arguments(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_command_line(monkeypatch):
    import mx_lbsgd.launch as module
    calls = []
    monkeypatch.setattr(module, 'launch', lambda *a, **k: calls.append((a, k)) or 7)
    assert main(['-n', '2', '--timeout', '9.5', '--', 'python', 't.py', '-n', '5']) == 7
    assert main(['-n', '3', '-s', '2', '--port', '1234', 'python', 't.py', '--', 'x']) == 7
    assert calls == [((['python', 't.py', '-n', '5'], 2, 1), dict(port=None, timeout=9.5)),
                     ((['python', 't.py', '--', 'x'], 3, 2), dict(port=1234, timeout=None))]


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match='num_workers'):
        launch(['python'], 0)
    with pytest.raises(ValueError, match='command'):
        launch([], 1)


def test_lbsgd_optimizer_runs_on_server(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import mxnet as mx
        import mx_lbsgd
        opt = mx.optimizer.create('lbsgd', learning_rate=0.1)
        assert type(opt) is mx_lbsgd.LBSGD
        kv = mx.kv.create('dist_sync')
        kv.set_optimizer(opt)
        kv.init(0, mx.nd.ones((3,)))
        kv.push(0, mx.nd.ones((3,)) * (kv.rank + 1))
        got = mx.nd.zeros((3,))
        kv.pull(0, out=got)
        # what the server should have done: one update with the summed gradient 1 + 2
        want = mx.nd.ones((3,))
        update = mx.optimizer.get_updater(mx.optimizer.create('lbsgd', learning_rate=0.1))
        update(0, mx.nd.ones((3,)) * 3, want)
        assert abs(want.asnumpy() - 1).min() > 0.1, want
        assert abs(got.asnumpy() - want.asnumpy()).max() < 1e-6, (got, want)
        print('updated', got.asnumpy())
    """, 2)
    assert code == 0, out
    assert '[worker 0] updated' in out and '[worker 1] updated' in out
    _assert_gone(tag)


def test_unloadable_optimizer_fails_the_job(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import mxnet as mx
        class Local(mx.optimizer.SGD):   # lives in the worker's __main__ only
            pass
        kv = mx.kv.create('dist_sync')
        kv.set_optimizer(Local(learning_rate=0.1))
        kv.init(0, mx.nd.ones((3,)))
        kv.push(0, mx.nd.ones((3,)))
        out = mx.nd.zeros((3,))
        kv.pull(0, out=out)
        out.wait_to_read()
    """, 1)
    assert code == 1, out
    assert "[server 0] AttributeError: Can't get attribute 'Local'" in out
    assert '[launch] server 0 exited with code 1' in out
    _assert_gone(tag)


def _launcher(tag, worker_code, num_workers=2):
    """``python -m mx_lbsgd.launch`` in its own process; returns (Popen, queue of its
    output lines, None at the end)."""
    env = dict(os.environ, **{TAG: tag, 'PYTHONPATH': ROOT})
    cmd = [sys.executable, '-m', 'mx_lbsgd.launch', '-n', str(num_workers), '--',
           sys.executable, '-c', worker_code]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _wait_for_lines(proc, lines, out, predicate, bound=600):
    """Block on the launcher's output until ``predicate(out)`` holds: an event, not a fixed
    deadline; ``bound`` only keeps a broken launcher from hanging the test. On failure the
    launcher gets SIGTERM (it stops its nodes), never SIGKILL."""
    deadline = time.monotonic() + bound
    while not predicate(out):
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = 'no such output in %d s' % bound
        if line is None or line.startswith('no such output'):
            proc.terminate()
            pytest.fail('%s; launcher output:\n%s' % (
                line or 'launcher ended (exit %s)' % proc.wait(), ''.join(out)))
        out.append(line)


def _end(proc, lines, out, bound=120):
    """The launcher's exit status (it must end within ``bound`` s) and all its output."""
    try:
        code = proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        with open('/proc/%d/status' % proc.pid) as f:
            masks = [l.strip() for l in f if l.startswith(('SigIgn', 'SigCgt', 'State'))]
        proc.terminate()
        pytest.fail('launcher still running %d s after the signal; %s; its output:\n%s'
                    % (bound, masks, ''.join(out)))
    while True:
        line = lines.get(timeout=bound)
        if line is None:
            return code
        out.append(line)


SLEEPER = "print('ready', flush=True); import time; time.sleep(600)"


@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher(signum, status, tag):
    proc, lines = _launcher(tag, SLEEPER)
    out = []
    try:
        _wait_for_lines(proc, lines, out, lambda o: sum(l.endswith('] ready\n') for l in o) == 2)
        proc.send_signal(signum)
        # teardown takes at most 3 s of grace and 2 s of output draining
        assert _end(proc, lines, out) == status, ''.join(out)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    _assert_gone(tag)


@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_nodes_start(signum, status, tag):
    """A signal as soon as the scheduler runs, while the other nodes are still starting:
    every node ends, nothing is left over."""
    proc, lines = _launcher(tag, SLEEPER)
    out = []
    try:
        deadline = time.monotonic() + 600
        while not _tagged_role(tag, 'scheduler'):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signum)
        assert _end(proc, lines, out) == status, ''.join(out)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    assert '[launch] ' in ''.join(out)
    _assert_gone(tag)


def test_launcher_killed_takes_its_nodes_along(tag):
    """SIGKILL, which the launcher cannot catch: its nodes (each in its own session) die
    with it (PR_SET_PDEATHSIG) instead of waiting in ps-lite for ever."""
    proc, lines = _launcher(tag, SLEEPER)
    out = []
    try:
        _wait_for_lines(proc, lines, out, lambda o: sum(l.endswith('] ready\n') for l in o) == 2)
        nodes = _tagged(tag)
        assert len(_tagged_role(tag, 'scheduler')) == 1 and len(nodes) >= 4, nodes
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    _assert_gone(tag, nodes)


def test_worker_labels_are_kv_ranks(tmp_path, tag):
    """ps-lite hands out kv.rank by the workers' ports, not in launch order: a worker's
    lines are [worker #i] (i: launch order) until it has its rank R, then [worker R]; the
    launcher's messages and report use the same labels. (With 4 workers, launch order
    and kv.rank all agree in 1 job of 24: the labels by launch order failed this test.)"""
    report = {}
    code, out, _ = _run(tmp_path, tag, """
        import os
        launched = os.environ['MX_LBSGD_RANK']
        print('launched', launched, flush=True)
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        print('kv.rank', kv.rank, 'launched', launched, flush=True)
        kv.init(0, mx.nd.zeros((2,)))
        kv.push(0, mx.nd.ones((2,)))
        got = mx.nd.zeros((2,))
        kv.pull(0, out=got)
        got.wait_to_read()
        if kv.rank == 1:
            raise SystemExit(7)
    """, 4, report=report)
    assert code == 7, out
    ranks = {}
    for line in out.splitlines():
        words = line.split()
        if 'launched' in words and 'kv.rank' not in words:
            assert line == '[worker #%s] launched %s' % (words[-1], words[-1]), out
        if 'kv.rank' in words:
            rank, launched = int(words[-3]), int(words[-1])
            assert line.startswith('[worker %d] ' % rank), out
            ranks[rank] = launched
    assert sorted(ranks) == [0, 1, 2, 3] and sorted(ranks.values()) == [0, 1, 2, 3], out
    assert '[launch] worker 1 exited with code 7' in out
    assert report['processes']['worker 1']['status'] == 7
    assert 'is connected to others' not in out and 'Bind to' not in out   # ps-lite's info
    _assert_gone(tag)


def test_worker_stuck_after_final_barrier_is_stopped(tmp_path, tag, monkeypatch):
    """A worker stuck after ps-lite's final barrier (the scheduler has left it, so every
    worker's work is done) is stopped after _EXIT_HANG s; the job succeeds and the launcher
    says how every process ended."""
    import mx_lbsgd.launch as module
    monkeypatch.setattr(module, '_EXIT_HANG', 2.0)
    report = {}
    code, out, elapsed = _run(tmp_path, tag, """
        import gc, time
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(0, mx.nd.zeros((2,)))
        kv.push(0, mx.nd.ones((2,)))
        out = mx.nd.zeros((2,))
        kv.pull(0, out=out)
        rank = kv.rank
        print('rank', rank, 'done', out.asnumpy(), flush=True)
        del kv
        gc.collect()                 # ~KVStoreDist: barriers, ps::Finalize
        if rank == 1:
            print('stuck', flush=True)
            time.sleep(600)          # as if stuck in ps-lite's exit
    """, 2, report=report)
    assert code == 0, out
    assert 'stuck in ps-lite' in out and '[launch] exit status: ' in out, out
    procs = report['processes']
    assert report['status'] == 0
    assert procs['scheduler'] == dict(status=0, note='') and procs['server 0']['status'] == 0
    stuck = int(out.split('] stuck')[0].rsplit('[worker ', 1)[1])
    assert procs[f'worker {1 - stuck}'] == dict(status=0, note='')
    assert procs[f'worker {stuck}']['status'] is None
    assert 'hung in ps-lite exit' in procs[f'worker {stuck}']['note']
    _assert_gone(tag)


def test_report_of_clean_and_failed_jobs(tmp_path, tag):
    report = {}
    code, out, _ = _run(tmp_path, tag, "import sys; sys.exit(0)", 1, report=report)
    # a worker that never creates a kvstore: the scheduler and server wait for it forever
    assert code == 0, out
    assert report['processes']['worker #0'] == dict(status=0, note='')
    assert 'stopped' in report['processes']['scheduler']['note']
    assert '[launch] exit status: scheduler: still running after the workers succeeded' in out
    report = {}
    code, out, _ = _run(tmp_path, tag, "import sys, time; sys.exit(5)", 1, report=report)
    assert code == 5 and report['status'] == 5
    assert report['processes']['worker #0'] == dict(status=5, note='')
    assert 'worker #0: exit 5' in out
    _assert_gone(tag)


def test_workers_exiting_without_freeing_the_kvstore(tmp_path, tag):
    """The exit hang's symptom, made deterministic: workers that exit without destroying
    their kvstore never enter ps-lite's final barrier, so the scheduler and server would
    wait forever; the launcher stops them and the job, whose work is done, exits 0."""
    report = {}
    code, out, wall = _run(tmp_path, tag, """\
        import os
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(3, mx.nd.zeros((2,)))
        kv.push(3, mx.nd.ones((2,)))
        got = mx.nd.zeros((2,))
        kv.pull(3, out=got)
        assert got.asnumpy().tolist() == [2.0, 2.0]
        print('rank', kv.rank, 'done', flush=True)
        os._exit(0)        # no KVStore destructor, so no ps::Finalize
        """, 2, report=report)
    assert code == 0, out
    assert out.count(' done') == 2
    for label in ('scheduler', 'server 0'):
        assert report['processes'][label]['note'] == \
            'still running after the workers succeeded; stopped', out
    for label in ('worker 0', 'worker 1'):
        assert report['processes'][label] == dict(status=0, note='')
    assert wall < LIMIT * 0.75     # stopped, not timed out
    _assert_gone(tag)


# -- ports: no process of another job can reach this job's nodes ----------------------------

# a worker that syncs once with the others, says 'up', and syncs again once PROBE_DIR/go exists
WAITING_WORKER = """
    import os, time
    import mxnet as mx
    kv = mx.kv.create('dist_sync')
    kv.init(0, mx.nd.zeros((2,)))
    def sync():
        kv.push(0, mx.nd.ones((2,)))
        out = mx.nd.zeros((2,))
        kv.pull(0, out=out)
        return out.asnumpy().tolist()
    print('up', sync(), flush=True)
    while not os.path.exists(os.path.join(os.environ['PROBE_DIR'], 'go')):
        time.sleep(0.05)
    print('synced again', sync(), flush=True)
"""


class _Watched(io.StringIO):
    """The launcher's output; ``seen`` is set once ``marker`` has appeared ``count`` times."""

    def __init__(self, marker, count):
        super().__init__()
        self.marker, self.count, self.seen = marker, count, threading.Event()

    def write(self, text):
        written = super().write(text)
        if self.getvalue().count(self.marker) >= self.count:
            self.seen.set()
        return written


def test_scheduler_ports_outside_what_the_kernel_and_ps_lite_hand_out(tmp_path, monkeypatch):
    low, high = launch_module._ephemeral_range()
    drawn = {launch_module._choose_port() for _ in range(200)}
    assert len(drawn) > 150                     # drawn at random, not a sequence
    assert all(not low <= p <= high and not 10000 <= p < 50000 and 1024 <= p for p in drawn)
    socks = []
    try:
        for _ in range(300):        # what ps-lite's GetAvailablePort gets for a node: bind(0)
            socks.append(socket.socket())
            socks[-1].bind(('', 0))
        assert all(low <= s.getsockname()[1] <= high for s in socks)
    finally:
        for sock in socks:
            sock.close()
    assert len({launch_module._job_host() for _ in range(50)}) == 50
    ranges = tmp_path / 'ip_local_port_range'
    ranges.write_text('1024\t65535\n')
    monkeypatch.setattr(launch_module, '_PORT_RANGE_FILE', str(ranges))
    with pytest.raises(ValueError, match=r'ephemeral range 1024-65535 .*\(--port\)'):
        launch([sys.executable, '-c', 'pass'], 1)


@pytest.mark.parametrize('given, holder_seen', [
    pytest.param(True, True, id='given-port'),
    pytest.param(True, False, id='given-port-scheduler-aborts'),
    pytest.param(False, True, id='drawn-port-draws-another'),
])
def test_port_taken_before_the_scheduler_binds(given, holder_seen, tmp_path, tag, monkeypatch):
    """The issue's first mechanism, forced: another process listens on the scheduler's port
    after the launcher checked it and before the scheduler binds it. No server or worker
    starts on a port the scheduler does not hold."""
    env = {TAG: tag, 'PYTHONPATH': ROOT}
    port, intruders = launch_module._choose_port(), []
    job_host, choose_port = launch_module._job_host, launch_module._choose_port

    def host_after_intruding():           # runs between the port check and the scheduler
        intruders.append(launch_probe.start_intruder(port, env))
        return job_host()
    monkeypatch.setattr(launch_module, '_job_host', host_after_intruding)
    monkeypatch.setattr(launch_module, '_choose_port',
                        lambda tried=(): choose_port(tried) if tried else port)
    if not holder_seen:          # the launcher learns it from the scheduler's abort only
        monkeypatch.setattr(launch_module, '_blocking_listeners', lambda host, port: [])
    started, report = [], {}
    try:
        code, out, elapsed = _run(tmp_path, tag, "print('worker ran')", 1, report=report,
                                  port=port if given else None, on_start=started.append)
    finally:
        for proc in intruders:
            launch_probe.stop(proc)
    holder = f'(pid {intruders[0].pid}: '
    if given:
        assert code == 2, out
        assert out.count('\n') == 1, out       # the scheduler's abort is not shown
        assert out.startswith(f'[launch] the scheduler cannot listen on {report["host"]}:{port}'
                              ': the port is already in use'), out
        assert (holder in out) == holder_seen, out
        assert started == [] and report['processes'] == {}
    else:
        assert code == 0, out
        assert f'[launch] port {port} was taken before the scheduler bound it {holder}' in out
        assert report['port'] != port and f'trying port {report["port"]}' in out
        assert '[worker #0] worker ran' in out      # no kvstore: the launch order
    _assert_gone(tag)


@pytest.mark.parametrize('target, shared_address', [
    pytest.param('scheduler', True, id='scheduler-port-one-address-for-all-jobs-control'),
    pytest.param('scheduler', False, id='scheduler-port'),
    pytest.param('server', True, id='server-port-one-address-for-all-jobs-control'),
    pytest.param('server', False, id='server-port'),
])
def test_stale_worker_of_an_earlier_job(target, shared_address, tmp_path, tag, monkeypatch):
    """The issue's second mechanism, forced: a worker of an earlier job (at 127.0.0.1, as
    every job was before) keeps reconnecting to its scheduler's port with its registration
    queued, and the next job's scheduler or server 0 listens on that port. With one address
    for all jobs (the control) the registration reaches the new job: server 0 aborts with the
    issue's ``Check failed: is_scheduler_``; the new scheduler takes the stale worker for
    one of its own. With the job's own address it cannot."""
    if shared_address:
        monkeypatch.setattr(launch_module, '_job_host', lambda: '127.0.0.1')
        monkeypatch.setattr(launch_module, '_EXIT_HANG', 2.0)
    env = {'PYTHONPATH': ROOT}
    stale, started, killed = [], {}, []
    out = _Watched('] up ', 1)
    if target == 'scheduler':
        port = launch_module._choose_port()
        stale.append(launch_probe.start_stale_worker('127.0.0.1', port, env))
        (tmp_path / 'go').touch()
    else:
        port = None

        def stale_on_server_port():
            if out.seen.wait(LIMIT):
                server = started['server 0']
                launch_probe.wait_for(lambda: launch_probe.listening_ports(server), 120,
                                      'listening port of server 0')
                [server_port] = launch_probe.listening_ports(server)
                stale.append(launch_probe.start_stale_worker('127.0.0.1', server_port, env))
                time.sleep(2)                  # ZeroMQ reconnects every 100-200 ms
                (tmp_path / 'go').touch()
        thread = threading.Thread(target=stale_on_server_port, daemon=True)
        thread.start()
    try:
        code, text, _ = _run(tmp_path, tag, WAITING_WORKER, 1, stream=out, port=port,
                             on_start=started.update)
        if target == 'server':
            thread.join()
        assert stale, text
        stale_alive = stale[0].poll() is None
    finally:
        for proc in stale:
            launch_probe.stop(proc)
    if not shared_address:
        assert code == 0, text
        assert '[worker 0] synced again [1.0, 1.0]' in text
        assert stale_alive            # still waiting for an answer nobody sends
    elif target == 'server':
        assert code == 128 + signal.SIGABRT, text
        assert '[launch] server 0 killed by signal 6' in text
        assert 'Check failed: is_scheduler_' in text
    else:       # the new scheduler counts the stale worker as one of the job's: depending on
        # who registers first, the real worker never runs (the stale one takes its slot and
        # the job ends 0), or the scheduler aborts; either way the job does not do its work
        assert code != 0 or '[worker 0] synced again' not in text, text
    _assert_gone(tag, list(started.values()))


@pytest.mark.parametrize('victim', ['scheduler', 'server 0', 'worker #1'])
def test_sigkill_drill(victim, tmp_path, tag):
    """SIGKILL one process of a running job: the job ends at once (not at the launcher's
    timeout: the survivors would wait in ps-lite for ever), non-zero, the launcher names
    the process, nothing is left."""
    out, started, killed_at = _Watched('] up ', 2), {}, []

    def kill_when_up():
        if out.seen.wait(LIMIT):
            killed_at.append(time.monotonic())
            os.kill(started[victim], signal.SIGKILL)
    thread = threading.Thread(target=kill_when_up, daemon=True)
    thread.start()
    code, text, _ = _run(tmp_path, tag, WAITING_WORKER, 2, stream=out, on_start=started.update)
    ended = time.monotonic()
    thread.join()
    assert killed_at, text
    assert code == 128 + signal.SIGKILL, text
    # on_start has the labels at start: the worker started second, '#1', is labelled by its
    # kv.rank by the time it is killed
    named = 'worker [01]' if victim == 'worker #1' else victim
    assert re.search(rf'\[launch\] {named} killed by signal 9; stopping all processes', text), text
    assert ended - killed_at[0] < LIMIT / 2
    _assert_gone(tag, list(started.values()))


SUM_WORKER = """
    import mxnet as mx
    kv = mx.kv.create('dist_sync')
    kv.init(3, mx.nd.zeros((4,)))
    kv.push(3, mx.nd.ones((4,)) * (kv.rank + 1))
    out = mx.nd.zeros((4,))
    kv.pull(3, out=out)
    assert (out.asnumpy() == 3).all(), out
    print('summed', flush=True)
"""


def test_back_to_back_jobs_under_load(tmp_path, tag):
    """CI-sized soak: jobs back to back while a process spins on a core and a worker of an
    earlier job keeps reconnecting to its scheduler at 127.0.0.1 (full soak: benchmarks/
    soak_dist.py)."""
    spinner = subprocess.Popen([sys.executable, '-c', 'while True: pass'],
                               start_new_session=True)
    stale = launch_probe.start_stale_worker('127.0.0.1', launch_module._choose_port(),
                                            {'PYTHONPATH': ROOT})
    addresses = set()
    try:
        for job in range(5):
            report = {}
            code, out, _ = _run(tmp_path, f'{tag}-{job}', SUM_WORKER, 2, report=report)
            assert code == 0, out
            assert out.count('] summed') == 2, out
            addresses.add((report['host'], report['port']))
            _assert_gone(f'{tag}-{job}')
        assert stale.poll() is None
    finally:
        launch_probe.stop(spinner)
        launch_probe.stop(stale)
    assert len(addresses) == 5


def test_servers_and_scheduler_import_this_very_mx_lbsgd():
    """A server's or the scheduler's bootstrap imports mx_lbsgd from the folder that holds
    the package the launcher runs from, not from wherever else it is installed."""
    import mx_lbsgd
    from mx_lbsgd.distributed import launch as launch_module
    job = launch_module._Job(io.StringIO(), dict(os.environ, PYTHONPATH=''), [])
    # no `import mxnet` (it would enter the server loop): where would mx_lbsgd come from?
    probe = [sys.executable, '-c', 'import importlib.util, sys; '
             'print("FOUND", importlib.util.find_spec("mx_lbsgd").origin, sys.path[1], "END")']
    for role in ('server', 'scheduler'):
        proc = job.spawn(role, role, 0, probe)
        assert proc.wait(timeout=120) == 0, job.stream.getvalue()
    for thread in job.threads:
        thread.join(timeout=30)
    out = job.stream.getvalue()
    here = os.path.abspath(mx_lbsgd.__file__)
    assert out.count('FOUND %s %s END' % (here, os.path.dirname(os.path.dirname(here)))) == 2, out
