"""Counting host syncs and kernel launches, for tests and benchmarks: a claim such as "one
host read per loss-scaled step" is checked by counting, not by timing."""
import contextlib

import mxnet as mx

from . import _compat

__all__ = ['count_host_syncs', 'count_kernel_launches']

_METHODS = [(mx.nd.NDArray, 'asnumpy'), (mx.nd.NDArray, 'asscalar'),
            (mx.nd.NDArray, 'wait_to_read')]


@contextlib.contextmanager
def count_host_syncs(include_waitall=True):
    """Yields a list that receives the name of every host sync made inside the block
    (the outermost call only: `asscalar` calling `asnumpy` counts once)."""
    calls = []
    depth = [0]
    targets = _METHODS + ([(mx.nd, 'waitall')] if include_waitall else [])
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, original in originals:
        def counting(*args, _original=original, _name=name, **kwargs):
            if not depth[0]:
                calls.append(_name)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(owner, name, counting)
    try:
        yield calls
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def count_kernel_launches():
    """Yields a list that receives one entry per MXNet operator call (one engine push,
    a kernel launch on GPU) made through mx.nd inside the block."""
    calls = []
    undo = _compat.patch_operator_invoke(calls.append)
    try:
        yield calls
    finally:
        undo()
