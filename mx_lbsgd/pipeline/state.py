"""The state layout: per parameter, the kernel family's state (MXNet's own layout, master
copy included), then an fp32 accumulator when ``batch_scale > 1``::

    batch_scale == 1:  family_state                      # e.g. SGD: mom or (mom, weight32)
    batch_scale > 1:   family_state parts + (accumulator,)

So states written by MXNet's own optimizer load at ``batch_scale=1`` with the same settings.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, NamedTuple, Optional

import numpy as np
from mxnet import nd

from .. import _compat, _legacy
from ..families.base import KernelFamily


class StateParts(NamedTuple):
    """One parameter's state, split."""

    family_state: Any                    # what the family's kernels take
    master: Optional[nd.NDArray]         # the fp32 master copy, or None
    accumulator: Optional[nd.NDArray]    # the window's fp32 sum (batch_scale > 1), or None


def uses_master(weight: nd.NDArray, multi_precision: bool) -> bool:
    """Whether `weight` gets an fp32 master copy."""
    return multi_precision and weight.dtype == np.float16


def make_state(family: KernelFamily, weight: nd.NDArray, dtype: Any,
               master: Optional[nd.NDArray], batch_scale: int, sparse_accumulator: bool) -> Any:
    """The family's state for `weight`, then an accumulator when batch_scale > 1 (row_sparse
    when `sparse_accumulator`: a gluon Parameter with a row_sparse gradient)."""
    base = family.make_state(weight, dtype, master)
    if batch_scale == 1:
        return base
    acc = nd.zeros(weight.shape, weight.context,
                   dtype=np.promote_types(weight.dtype, np.float32),
                   stype='row_sparse' if sparse_accumulator else 'default')
    return (base if isinstance(base, tuple) else (base,)) + (acc,)


def split_state(family: KernelFamily, weight: nd.NDArray, state: Any, *, batch_scale: int,
                multi_precision: bool, owner: str) -> StateParts:
    """`state` split by this layout; a `ValueError` naming `owner` (the optimizer's class)
    when it does not fit (states of MXNet's own optimizer fit at batch_scale=1)."""
    master = uses_master(weight, multi_precision)
    parts = state if isinstance(state, tuple) else (state,)
    if parts and isinstance(parts[-1], _legacy.Ledger):
        raise ValueError(_legacy.LEDGER_IN_STATE)
    acc = None
    if batch_scale > 1 and len(parts) >= 2:
        acc, parts = parts[-1], parts[:-1]
    split = None
    if acc is not None or batch_scale == 1:
        split = family.split(parts[0] if len(parts) == 1 else parts, master)
    if split is None:
        raise ValueError(
            'optimizer state of shape %s does not fit %s(%s, multi_precision=%s, '
            'batch_scale=%d): it holds %d arrays. States written by MXNet\'s %s load '
            'with batch_scale=1 and the same settings; otherwise start from fresh '
            'optimizer states (skip load_states / load_optimizer_states)'
            % (weight.shape, owner, family.describe(), multi_precision, batch_scale,
               len(state) if isinstance(state, tuple) else 1, family.name))
    return StateParts(split[0], split[1], acc)


def create_master(family: KernelFamily, weight: nd.NDArray, capacity: int,
                  sparse: bool) -> Any:
    """The state of a float16 `weight` with an fp32 master copy (accumulators when the
    longest window, `capacity`, is > 1; row_sparse ones when `sparse`)."""
    return make_state(family, weight, np.float32, weight.astype(np.float32), capacity,
                      sparse)


def warn_float16(weight: nd.NDArray, made: Any) -> Any:
    """`made`, after MXNet's warning when a float16 `weight` has no master copy."""
    if weight.dtype == np.float16:
        warnings.warn('Accumulating with float16 in optimizer can lead to poor accuracy '
                      'or slow convergence. Consider multi_precision=True.')
    return made


def create_plain(family: KernelFamily, weight: nd.NDArray, *, capacity: int,
                 sparse: bool) -> Any:
    """``create_state``: the state of `weight` in its own dtype."""
    if weight.dtype == np.float16 and capacity > 1:
        raise ValueError('windows of up to batch_scale=%d with float16 weights need '
                         'multi_precision=True: the float32 accumulated gradient updates '
                         'the float32 master copy' % capacity)
    return make_state(family, weight, weight.dtype, None, capacity, sparse)


def sparse_gradient(param_dict: Dict[Any, Any], index: Any) -> bool:
    """Whether parameter `index` is a gluon Parameter with a row_sparse gradient (its
    accumulator is row_sparse too)."""
    param = param_dict.get(index)
    return param is not None and _compat.grad_stype(param) == 'row_sparse'
