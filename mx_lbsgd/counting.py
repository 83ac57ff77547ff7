"""Counting host syncs and kernel launches, for tests and benchmarks: a claim such as "one
host read per loss-scaled step" is checked by counting, not by timing."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import mxnet as mx

from . import _compat

__all__ = ['count_host_syncs', 'count_kernel_launches']

_METHODS = [(mx.nd.NDArray, 'asnumpy'), (mx.nd.NDArray, 'asscalar'),
            (mx.nd.NDArray, 'wait_to_read'), (_compat, 'host_all_finite')]


@contextlib.contextmanager
def count_host_syncs(include_waitall: bool = True) -> Iterator[list[str]]:
    """Yields a list that receives the name of every host sync made inside the block
    (the outermost call only: `asscalar` calling `asnumpy` counts once).

    Counted: ``NDArray.asnumpy``, ``NDArray.asscalar``, ``NDArray.wait_to_read``, the
    package's finite check on the host (``host_all_finite``: it waits for the gradients and
    reads them) and, with `include_waitall`, ``mx.nd.waitall``.

    Parameters
    ----------
    include_waitall : bool, default True

    Yields
    ------
    list of str
        The names of the calls, in order.

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd.counting import count_host_syncs
    >>> a = nd.array([1.0, 2.0])
    >>> with count_host_syncs() as syncs:
    ...     total = (a * 2).sum().asscalar()
    ...     values = a.asnumpy()
    >>> syncs
    ['asscalar', 'asnumpy']
    """
    calls: list[str] = []
    depth = [0]
    targets = _METHODS + ([(mx.nd, 'waitall')] if include_waitall else [])
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
    for owner, name, original in originals:
        def counting(*args: Any, _original: Callable[..., Any] = original, _name: str = name,
                     **kwargs: Any) -> Any:
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
def count_kernel_launches() -> Iterator[list[Any]]:
    """Yields a list that receives one entry per MXNet operator call (one engine push,
    a kernel launch on GPU) made through mx.nd inside the block.

    Yields
    ------
    list
        One operator handle per call.

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd.counting import count_kernel_launches
    >>> a = nd.array([1.0, 2.0])
    >>> with count_kernel_launches() as launches:
    ...     b = a * 2 + 1
    >>> len(launches)
    2
    """
    calls: list[Any] = []          # one operator handle per call
    undo = _compat.patch_operator_invoke(calls.append)
    try:
        yield calls
    finally:
        undo()
