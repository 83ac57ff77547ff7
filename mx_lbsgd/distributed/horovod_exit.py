"""Drain MXNet's engine before Horovod shuts down at interpreter exit.

Why: ``hvd.init()`` registers ``hvd.shutdown`` with ``atexit`` after ``import mxnet``
registered ``mxnet.base._notify_shutdown``; ``atexit`` runs the last registered first, so at
exit Horovod shuts down while MXNet's engine may still hold Horovod collectives (Horovod's
MXNet ops are asynchronous engine operations). Horovod's background thread then fails every
queued collective; MXNet 1.9.1 records those failures in the engine's list of exceptions
(``ThreadedEngine::OnComplete``) from several threads without a lock, and its own exit hook
(``MXNotifyShutdown`` -> ``WaitForAll``) walks that list: a segfault, a glibc heap abort, or
(a collective pushed after the shutdown never completes) a hang. Draining the engine before
Horovod's hook runs leaves nothing for it to fail.

The package registers `drain_at_exit` when one of its Horovod paths first sees an initialized
Horovod (`mx_lbsgd._compat`: a Horovod DistributedTrainer bound, an optimizer created under
Horovod, the worker checks of overflow reports and the noise-scale monitor), and registers it
again at each later Trainer binding or optimizer creation, so that it stays after the hook of
an ``hvd.init()`` called again in between.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

import mxnet as mx

from .. import _compat

__all__ = ['install', 'drain_at_exit']

#: Seconds the exit hook waits for MXNet's engine (environment variable, float).
_TIMEOUT_ENV = 'MX_LBSGD_HOROVOD_EXIT_TIMEOUT'
_DEFAULT_TIMEOUT = 120.0
#: After an uncaught exception: the collectives the peers also run finish in well under a
#: second; one they never run (they went on to another step) never finishes, and waiting
#: for it only delays the job's failure.
_FAILED_TIMEOUT = 5.0


_registered = [False]


def install(refresh: bool = False) -> None:
    """Register the drain with ``atexit`` (once), so that it runs before every
    ``hvd.shutdown`` registered so far. `refresh`: register it again even if it was (moved
    to the front of the LIFO order, after an ``hvd.init()`` called since); for the rare call
    sites only (a Trainer bound, an optimizer created): CPython's ``atexit.unregister``
    leaves a slot behind.

    The package calls it itself; a script that runs Horovod collectives of its own on
    MXNet's engine outside the package's paths may call it after ``hvd.init()``.

    Parameters
    ----------
    refresh : bool, default False

    Examples
    --------
    In a Horovod job (skipped here: installing it in the test process would drain its
    engine at exit):

    >>> import horovod.mxnet as hvd                              # doctest: +SKIP
    >>> from mx_lbsgd.distributed import horovod_exit
    >>> hvd.init()                                               # doctest: +SKIP
    >>> horovod_exit.install()                                   # doctest: +SKIP
    """
    if _registered[0] and not refresh:
        return
    atexit.unregister(drain_at_exit)
    atexit.register(drain_at_exit)
    _registered[0] = True


def _timeout(failed: bool) -> float:
    raw = os.environ.get(_TIMEOUT_ENV)
    try:
        value = float(raw) if raw else _DEFAULT_TIMEOUT
    except ValueError:
        sys.stderr.write('mx_lbsgd: ignoring %s=%r (not a number of seconds); using %g\n'
                         % (_TIMEOUT_ENV, raw, _DEFAULT_TIMEOUT))
        value = _DEFAULT_TIMEOUT
    return min(value, _FAILED_TIMEOUT) if failed else value


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def drain_at_exit() -> None:
    """atexit hook: ``mx.nd.waitall()`` in a helper thread, bounded by the timeout. On time
    out (a peer gone, a collective nobody else runs), print why and end the process with
    status 1 before Horovod's and MXNet's exit hooks, which would crash or hang on the
    queued work. An operation that failed is reported on stderr (MXNet's own hook would have
    raised it there too); the engine is empty afterwards either way.

    The wait is ``$MX_LBSGD_HOROVOD_EXIT_TIMEOUT`` seconds (default 120; at most 5 after
    an uncaught exception).

    Examples
    --------
    Called directly, it waits for the engine and returns:

    >>> from mxnet import nd
    >>> from mx_lbsgd.distributed.horovod_exit import drain_at_exit
    >>> pending = nd.ones((64, 64)) * 2
    >>> drain_at_exit()
    >>> float(pending[0, 0].asscalar())
    2.0
    """
    # sys.last_value: set by the interpreter when an uncaught exception ended the script
    failed = getattr(sys, 'last_value', None) is not None
    timeout = _timeout(failed)
    outcome: dict[str, Any] = {}       # 'error': the exception, 'done': True

    def wait() -> None:
        try:
            mx.nd.waitall()
        except Exception as err:        # an async op's stored error (MXNetError, ...)
            outcome['error'] = err
        outcome['done'] = True

    waiter = threading.Thread(target=wait, name='mx_lbsgd-horovod-exit-drain', daemon=True)
    try:
        waiter.start()
    except RuntimeError:                # an interpreter that refuses threads at exit
        wait()
    else:
        waiter.join(timeout)
    if 'done' not in outcome:
        _flush()
        sys.stderr.write(
            'mx_lbsgd: MXNet\'s engine still ran Horovod work %gs after the script ended '
            '(a peer exited or is stuck; %s=%s sets the wait); exiting with status 1 before '
            'Horovod\'s and MXNet\'s exit hooks, which would crash or hang on it\n'
            % (timeout, _TIMEOUT_ENV, os.environ.get(_TIMEOUT_ENV, '%g' % _DEFAULT_TIMEOUT)))
        _flush()
        os._exit(1)
    if 'error' in outcome:
        first = str(outcome['error']).strip().splitlines()
        sys.stderr.write('mx_lbsgd: an operation still queued at exit failed: %s\n'
                         % (first[0] if first else type(outcome['error']).__name__))
        _flush()


_compat.register_exit_drain(install)
