"""The package's compiled CPU operators (``csrc/native_ops.cc``), loaded on first use.

``pip install`` builds ``mx_lbsgd/_native_ops*.so`` where a C++ compiler and MXNet's
``lib_api.h`` are found; `ops` registers it with MXNet (`mx_lbsgd._compat.load_operator_library`)
and keeps one function per operator: ``mx_lbsgd_sum_sq``, ``mx_lbsgd_all_finite``,
``mx_lbsgd_sgd_update``, ``mx_lbsgd_lamb_update`` and ``mx_lbsgd_accumulate`` (whose output,
with ``check_finite=1``, is ``mx_lbsgd_all_finite``'s flag of the gradients it read).
Unlike ``mx.library.load``, loading changes no function of ``mx.nd``, ``mx.sym``, ``mx.np``
or ``mx.npx``: ``contrib.amp``'s wrappers, and any a user put there, stay in place.
Without the library, or with ``MX_LBSGD_NATIVE=0``, `ops` returns None and the kernel
families run MXNet's own operators; ``MX_LBSGD_NATIVE=1`` makes a missing library an error
(CI uses it to test the built path).
"""
from __future__ import annotations

import glob
import os
from typing import Any, Callable, Iterable, Sequence, cast

from . import _compat

_LIBRARY_GLOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_native_ops*.so')
# [ops] once loading was tried; ops is None when it failed or is disabled
_loaded: list[_Ops | None] = []


_OPERATORS = ('mx_lbsgd_sum_sq', 'mx_lbsgd_all_finite', 'mx_lbsgd_sgd_update',
              'mx_lbsgd_lamb_update', 'mx_lbsgd_accumulate')


class _Ops:
    """The loaded operators, as ``mx.nd``-style functions (not attributes of ``mx.nd``),
    and the library's one plain C function, ``mx_lbsgd_host_all_finite`` (`host_all_finite`).
    """

    def __init__(self, path: str) -> None:
        import ctypes
        functions = _compat.load_operator_library(path, _OPERATORS)
        self.path = path
        library = self.library = ctypes.CDLL(path)
        self.host_all_finite = library.mx_lbsgd_host_all_finite
        #: whether LARS's pushed updates keep the weights' norms (`_compat.track_engine_versions`)
        self.tracks_versions = _compat.track_engine_versions(library)
        #: operator -> its number for the library's ``mx_lbsgd_push`` (`call`, `invoke`)
        self.pushed = {functions[name]: k for k, name in enumerate(_OPERATORS)}
        self.sum_sq = functions['mx_lbsgd_sum_sq']
        self.all_finite = functions['mx_lbsgd_all_finite']
        self.sgd_update = functions['mx_lbsgd_sgd_update']
        self.lamb_update = functions['mx_lbsgd_lamb_update']
        self.accumulate = functions['mx_lbsgd_accumulate']


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
    """Numbers as an operator attribute: comma-separated, each exact (repr of a float).
    The last few strings are kept: the per-tensor rates of a step are mostly the ones of
    the step before (a tuple's hash and compare cost a tenth of the formatting)."""
    key = tuple(values)
    text = _ATTRIBUTES.get(key)
    if text is None:
        text = ','.join(repr(float(v)) for v in key)
        if len(_ATTRIBUTES) >= _ATTRIBUTES_KEPT:
            _ATTRIBUTES.pop(next(iter(_ATTRIBUTES), ()), None)    # (two threads may race)
        _ATTRIBUTES[key] = text
    return text


#: attribute_list's last strings, oldest first (lrs and wds of a few plans)
_ATTRIBUTES: dict[tuple, str] = {}
_ATTRIBUTES_KEPT = 16


def invoke(function: Callable[..., Any], arrays: Sequence[Any], attrs: dict,
           scratch: dict, loose: Sequence[Any] = ()) -> None:
    """Call `function` (an operator of `ops`) on `arrays` then `loose` with `attrs`,
    dropping its output: pushed to MXNet's engine directly where the library can
    (`mx_lbsgd._compat.push_prepared`), else through MXNet's imperative call
    (`mx_lbsgd._compat.invoke_prepared`). What is prepared for `arrays` is kept in
    `scratch` while the calls pass the same array objects; `loose` are inputs new at every
    call (a norm)."""
    cache = scratch.setdefault('native_calls', {})
    loaded = cast(_Ops, ops())
    if not _compat.push_prepared(loaded.library, loaded.pushed[function], function, arrays,
                                 attrs, cache, loose=loose):
        _compat.invoke_prepared(function, list(arrays) + list(loose), attrs, cache)


def call(function: Callable[..., Any], arrays: Sequence[Any], out: Any,
         **attrs: Any) -> Any:
    """`function` (an operator of `ops`) on `arrays` with `attrs`, written into `out` (a
    float32 NDArray of its output's shape), which it returns: pushed to MXNet's engine
    directly where the library can (`mx_lbsgd._compat.push_prepared`; the inputs' prepared
    copies kept while calls pass the same array objects), else MXNet's imperative call."""
    loaded = cast(_Ops, ops())
    if not _compat.push_prepared(loaded.library, loaded.pushed[function], function, arrays,
                                 attrs, _CALLS, outputs=[out]):
        function(*arrays, out=out, **attrs)
    return out


#: `call`'s prepared inputs (the most recent few; `mx_lbsgd._identity.kept`)
_CALLS: dict = {}


def host_all_finite(arrays: Sequence[Any], cache: dict) -> bool | None:
    """Whether every element of `arrays` is finite, checked on the calling thread once
    each array's pending writes are done (`_compat.host_all_finite`): one host sync, without
    an operator's round trip through the engine. None when the library is not loaded or an
    array is not a dense float16/float32 CPU array (then use an operator and read its flag).
    `cache` keeps the handle arrays while the arrays stay the same objects."""
    loaded = ops()
    prepared = None if loaded is None else _compat.host_check_arrays(arrays, cache)
    if prepared is None:
        return None
    return _compat.host_all_finite(loaded.host_all_finite,  # type: ignore[union-attr]
                                   prepared)


def _library_path() -> str | None:
    found = sorted(glob.glob(_LIBRARY_GLOB))
    return found[0] if found else None


def ops() -> _Ops | None:
    """The native operators, loaded once per process, or None (not built, or disabled by
    ``MX_LBSGD_NATIVE=0``)."""
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
    return _Ops(path)
