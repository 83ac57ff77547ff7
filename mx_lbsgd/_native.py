"""The package's compiled CPU operators (``csrc/native_ops.cc``), loaded on first use.

``pip install`` builds ``mx_lbsgd/_native_ops*.so`` where a C++ compiler and MXNet's
``lib_api.h`` are found; `ops` loads it with the public ``mx.library.load``, which adds
``mx.nd.mx_lbsgd_sum_sq``, ``mx.nd.mx_lbsgd_all_finite``, ``mx.nd.mx_lbsgd_sgd_update``,
``mx.nd.mx_lbsgd_lamb_update`` and ``mx.nd.mx_lbsgd_accumulate`` (whose output, with
``check_finite=1``, is ``mx_lbsgd_all_finite``'s flag of the gradients it read).
Without the library, or with ``MX_LBSGD_NATIVE=0``, `ops` returns None and the kernel
families run MXNet's own operators; ``MX_LBSGD_NATIVE=1`` makes a missing library an error
(CI uses it to test the built path).
"""
from __future__ import annotations

import glob
import os
from typing import Iterable

import mxnet as mx

_LIBRARY_GLOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_native_ops*.so')
# [ops] once loading was tried; ops is None when it failed or is disabled
_loaded: list[_Ops | None] = []


class _Ops:
    """The loaded operators, as ``mx.nd`` functions."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sum_sq = mx.nd.mx_lbsgd_sum_sq
        self.all_finite = mx.nd.mx_lbsgd_all_finite
        self.sgd_update = mx.nd.mx_lbsgd_sgd_update
        self.lamb_update = mx.nd.mx_lbsgd_lamb_update
        self.accumulate = mx.nd.mx_lbsgd_accumulate


def native_library() -> str | None:
    """The path of the native CPU operators in use (loaded on this call if need be), or None
    when ``pip install`` could not build them or ``MX_LBSGD_NATIVE=0`` turns them off; then
    every optimizer runs MXNet's own operators.

    Returns
    -------
    str or None
        The path of ``mx_lbsgd/_native_ops*.so``, or None.

    Raises
    ------
    ValueError
        ``MX_LBSGD_NATIVE`` is set to something else than '0' or '1'.
    RuntimeError
        ``MX_LBSGD_NATIVE=1`` and the library was not built.

    Examples
    --------
    >>> import mx_lbsgd
    >>> path = mx_lbsgd.native_library()
    >>> path is None or path.endswith('.so')
    True
    """
    loaded = ops()
    return None if loaded is None else loaded.path


def attribute_list(values: Iterable[float]) -> str:
    """Numbers as an operator attribute: comma-separated, each exact (repr of a float)."""
    return ','.join(repr(float(v)) for v in values)


def _library_path() -> str | None:
    found = sorted(glob.glob(_LIBRARY_GLOB))
    return found[0] if found else None


def ops() -> _Ops | None:
    """The native operators, loaded once per process, or None (not built, or disabled by
    ``MX_LBSGD_NATIVE=0``). Loading re-registers MXNet's Python operator functions (about
    half a second, once)."""
    if not _loaded:
        _loaded.append(_load())
    return _loaded[0]


def _load() -> _Ops | None:
    setting = os.environ.get('MX_LBSGD_NATIVE', '')
    if setting not in ('', '0', '1'):
        raise ValueError("MX_LBSGD_NATIVE must be '0' (MXNet's operators), '1' (the native "
                         "library, or an error) or unset (the library when built); got %r"
                         % setting)
    path = _library_path()
    if setting == '1' and path is None:
        raise RuntimeError('MX_LBSGD_NATIVE=1 but mx_lbsgd was installed without its native '
                           'library (no C++ compiler, or MXNet not importable when pip built '
                           "it); reinstall with g++ available, or unset MX_LBSGD_NATIVE")
    if setting == '0' or path is None:
        return None
    if not hasattr(mx.nd, 'mx_lbsgd_accumulate'):
        mx.library.load(path, verbose=False)
    return _Ops(path)
