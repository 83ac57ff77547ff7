"""Kernels every optimizer shares: routing, norms, LARS rates, accumulation, finite checks.

An optimizer's own update kernels are its kernel family (`_sgd`). Which path a family's
`single_tensor`/`multi_tensor` kernels take is decided by `route` from the tensor sizes (or
forced by ``fused``), once per group of tensors: per-tensor kernels are fastest for big
tensors (MXNet parallelises one big kernel over all cores), MXNet's multi-tensor kernels
(``multi_*``, ``preloaded_multi_*``) for many small ones (one call per 60 tensors). Nothing
here reads a value back to the host except `finite_flag`'s caller, which reads the one
flag, and `sparse_lars_factor`.

Learning rates come either as Python floats (``lrs``) or as a float32 vector on the device
(``lr_vector``, from `lars_lrs`): the ``preloaded_multi_*`` kernels read the latter without a
host sync, also for one tensor at a time.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _compat, _identity, _native

_T = TypeVar('_T')
#: (accumulators, gradients) of one CPU context, for one native accumulate call
_WindowGroups = List[Tuple[List[nd.NDArray], List[nd.NDArray]]]
#: a finite check of `_finite_plan`: (arrays, flag, first kernel of its context)
_Check = Callable[[Sequence[nd.NDArray], nd.NDArray, bool], None]
#: [(context, [(check, arrays)])]
_FinitePlan = List[Tuple[Any, List[Tuple[_Check, Sequence[nd.NDArray]]]]]
MAX_TENSORS_PER_KERNEL = 60        # limit of MXNet's multi_* and preloaded_multi_* ops
MAX_ARRAYS_PER_FINITE_CHECK = 200  # limit of multi_all_finite
# Tensors with at least this many elements run per-tensor kernels when the path is not
# forced. Measured on the CPU wheel (benchmarks/bench_shapes.py, 4M parameters in N equal
# tensors): per-tensor wins from ~40k elements (N=100, fp32: 14.6 vs 25.1 ms; fp16 with
# master copies: 40.8 vs 64.3 ms), multi-tensor below (N=1000, fp32: 47 vs 111 ms). On a
# GPU one multi-tensor launch beats many per-tensor ones.
#: keyed by device type, or by (device type, dtype name) for a dtype of its own
PER_TENSOR_MIN_SIZE: Dict[Union[str, Tuple[str, Optional[str]]], int] = {
    'cpu': 1 << 15, 'gpu': 1 << 62}


def route(sizes: Sequence[int], device_type: str, fused: Optional[bool],
          dtype: Any = None) -> Tuple[List[int], List[int]]:
    """(per-tensor positions, multi-tensor positions) for tensors of `sizes` elements.

    fused=True/False forces one path; None routes by size (`PER_TENSOR_MIN_SIZE`, by
    device type and weight dtype)."""
    if fused is not None:
        every = list(range(len(sizes)))
        return ([], every) if fused else (every, [])
    limit = PER_TENSOR_MIN_SIZE.get(
        (device_type, None if dtype is None else np.dtype(dtype).name),
        PER_TENSOR_MIN_SIZE.get(device_type, PER_TENSOR_MIN_SIZE['gpu']))
    big = [i for i, n in enumerate(sizes) if n >= limit]
    small = [i for i, n in enumerate(sizes) if n < limit]
    return big, small


# On CPU a multi-tensor call runs on one engine thread: calls of at most this many elements
# let the engine spread a group over its threads. Measured (4M parameters, N equal tensors,
# lbsgd / MXNet SGD default): fp32 N=1000 0.66 at 2**16 vs 1.02 at 2**14; fp16 with master
# copies (mp kernels) N=1000 1.05 at 2**14 vs 1.22 at 2**16.
CPU_ELEMENTS_PER_KERNEL: Dict[Optional[str], int] = {'float16': 1 << 14, None: 1 << 16}


def spans(tensors: Sequence[nd.NDArray]) -> List[Tuple[int, int]]:
    """(start, end) index ranges of at most 60 tensors (and, on CPU, of at most
    CPU_ELEMENTS_PER_KERNEL elements unless one tensor alone is larger)."""
    limit = None
    if tensors[0].context.device_type == 'cpu':
        limit = CPU_ELEMENTS_PER_KERNEL.get(np.dtype(tensors[0].dtype).name,
                                            CPU_ELEMENTS_PER_KERNEL[None])
    out, start, total = [], 0, 0
    for i, t in enumerate(tensors):
        size = t.size
        if i > start and (i - start == MAX_TENSORS_PER_KERNEL
                          or (limit is not None and total + size > limit)):
            out.append((start, i))
            start, total = i, 0
        total += size
    out.append((start, len(tensors)))
    return out


def chunks(seq: Sequence[_T], size: int = MAX_TENSORS_PER_KERNEL) -> List[Sequence[_T]]:
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def device_vector(values: Sequence[float], ctx: mx.Context) -> nd.NDArray:
    """A float32 vector on `ctx` (built on the host, copied without blocking the engine)."""
    host = nd.array(np.asarray(values, dtype=np.float32), ctx=mx.cpu(), dtype=np.float32)
    return host if ctx == mx.cpu() else host.as_in_context(ctx)


def sum_squares(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """fp32 vector of the sums of squares of `arrays` (one dtype, one context).

    On CPU the package's native operator does it in one call (float32 squares, double
    sums) when it is built. MXNet's CPU `multi_sum_sq` squares in the input dtype, so
    float16 values above 256 give inf; without the native operator float16 inputs are cast
    to float32 first. The GPU kernel already squares and sums in float32.
    """
    if arrays[0].context.device_type == 'cpu' and (ops := _native.ops()) is not None \
            and np.dtype(arrays[0].dtype).name in ('float32', 'float16'):
        # one call, at the memory bandwidth; MXNet's multi_sum_sq reads at a third of it
        return _native.call(ops.sum_sq, arrays,
                            nd.empty((len(arrays),), ctx=arrays[0].context),
                            num_arrays=len(arrays))
    if arrays[0].context.device_type != 'gpu' and arrays[0].dtype == np.float16:
        arrays = [a.astype(np.float32) for a in arrays]
    parts = [nd.multi_sum_sq(*chunk, num_arrays=len(chunk)) for chunk in chunks(arrays)]
    return parts[0] if len(parts) == 1 else nd.concat(*parts, dim=0)


def total_sum_squares(arrays: Sequence[nd.NDArray]) -> nd.NDArray:
    """The sum of the squares of every element of `arrays` (one context; any float dtypes;
    row_sparse and csr arrays by their stored values), a float32 (1,) array on the device.
    On CPU with the native operators one call over the float32 and float16 arrays. The
    grouping is computed once per tuple of dense arrays (a Trainer hands the same gradient
    arrays every step)."""
    ctx, mine, groups = _planned(_SUM_SQ_PLANS, arrays, lambda: _sum_sq_plan(arrays))
    parts: List[nd.NDArray] = []
    if mine:
        parts.append(_native.call(_native.ops().sum_sq,  # type: ignore[union-attr]  # (set)
                                  mine, nd.empty((1,), ctx=ctx), num_arrays=len(mine), total=1))
    for group in groups:
        parts.append(nd.sum(sum_squares(group), keepdims=True).reshape((1,)))
    if not parts:
        return nd.zeros((1,), ctx=ctx, dtype=np.float32)
    return parts[0] if len(parts) == 1 else nd.add_n(*parts)


#: `total_sum_squares`'s plans (`_identity.kept`)
_SUM_SQ_PLANS: _identity.Cache = {}


def _sum_sq_plan(arrays: Sequence[nd.NDArray]
                 ) -> Tuple[Any, List[nd.NDArray], List[List[nd.NDArray]]]:
    """(context, the arrays of the native call, the other non-empty arrays by dtype); a
    sparse array by its stored values."""
    values = [a.data if a.stype != 'default' else a for a in arrays]
    ctx = values[0].context
    native = ctx.device_type == 'cpu' and _native.ops() is not None
    mine = [a for a in values if native and a.dtype in _NATIVE_DTYPES and a.size]
    by_dtype: Dict[Any, List[nd.NDArray]] = {}
    taken = {id(m) for m in mine}
    for a in values:
        if a.size and id(a) not in taken:
            by_dtype.setdefault(a.dtype, []).append(a)
    return ctx, mine, list(by_dtype.values())


def by_context(arrays: Sequence[nd.NDArray]) -> List[Tuple[Any, List[nd.NDArray]]]:
    """[(context, the arrays on it)], in order of first appearance; computed once per
    tuple of arrays."""
    def make() -> List[Tuple[Any, List[nd.NDArray]]]:
        groups: Dict[Any, List[nd.NDArray]] = {}
        for a in arrays:
            groups.setdefault(a.context, []).append(a)
        return list(groups.items())
    return _planned(_CONTEXT_PLANS, arrays, make)


_CONTEXT_PLANS: _identity.Cache = {}


def _planned(cache: _identity.Cache, arrays: Sequence[nd.NDArray], make: Callable[[], _T]) -> _T:
    """``make()``, kept in `cache` while a call passes the same (dense) array objects; the
    plan of arrays with a sparse one is made every time (its stored values change)."""
    return _identity.kept(cache, (len(arrays), id(arrays[0]) if arrays else None), arrays, make,
                          keep_if=lambda: all(a.stype == 'default' for a in arrays))


def scale_gradients(grads: Sequence[nd.NDArray], coefficient: nd.NDArray) -> List[nd.NDArray]:
    """Each gradient times the device scalar `coefficient`: dense ones in place, row_sparse
    ones as new arrays over the same rows. Returns the gradients to update with."""
    out: List[nd.NDArray] = []
    for g in grads:
        c = coefficient if coefficient.dtype == g.dtype else coefficient.astype(g.dtype)
        if g.stype == 'row_sparse':
            out.append(nd.sparse.row_sparse_array((nd.broadcast_mul(g.data, c), g.indices),
                                                  shape=g.shape, ctx=g.context))
        else:
            nd.broadcast_mul(g, c, out=g)
            out.append(g)
    return out


def lars_lrs(*, weights: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
             lrs: Sequence[float], wds: Sequence[float], keep_lr: Sequence[bool], eta: float,
             eps: float, rescale_grad: float, lars_min: float, lars_max: float,
             grad_coefficient: Optional[nd.NDArray] = None,
             sums: Optional[Tuple[nd.NDArray, nd.NDArray]] = None) -> nd.NDArray:
    """Per-layer learning rates ``lr * clip(eta*|w| / (|rescale_grad*g| + wd*|w| + eps))``,
    a float32 vector on the device. Layers with keep_lr[i], or a zero weight or gradient
    norm, keep ``lr``. `lrs`, `wds` and `keep_lr` are Python lists. `grad_coefficient`: a
    (1,) device array the gradients are multiplied by (global-norm clipping). `sums`:
    (|w|^2, |g|^2) per entry, float32 device vectors, when the layers' norms come from
    elsewhere (the pieces of a tensor split over ranks: its whole norms), instead of
    `weights` and `grads`.
    """
    ctx = weights[0].context
    wss, gss = sums if sums is not None else (sum_squares(weights), sum_squares(grads))
    if grad_coefficient is not None:
        gss = nd.broadcast_mul(gss, nd.square(grad_coefficient))
    lr_vec = device_vector(lrs, ctx)
    wd_vec = device_vector(wds, ctx)
    if lars_direct(lars_min, lars_max, keep_lr):
        return nd.multi_lars(lr_vec, wss, gss, wd_vec, eta=eta, eps=eps,
                             rescale_grad=rescale_grad)
    ones = nd.ones((len(weights),), ctx=ctx, dtype=np.float32)
    ratio = nd.multi_lars(ones, wss, gss, wd_vec, eta=eta, eps=eps, rescale_grad=rescale_grad)
    if lars_min > 0.0 or not math.isinf(lars_max):
        ratio = nd.clip(ratio, lars_min, min(lars_max, float(np.finfo(np.float32).max)))
    apply = device_vector([0.0 if k else 1.0 for k in keep_lr], ctx)
    keep = (wss > 0) * (gss > 0) * apply
    return nd.where(keep, ratio, ones) * lr_vec


def lars_direct(lars_min: float, lars_max: float, keep_lr: Sequence[bool]) -> bool:
    """Whether `lars_lrs` is MXNet's ``multi_lars`` alone (nothing clipped or kept), whose
    arithmetic ``lr * eta * |w| / ...`` rounds differently from ``ratio * lr``."""
    return lars_min <= 0.0 and math.isinf(lars_max) and not any(keep_lr)


def accumulate(*, accs: Sequence[nd.NDArray], grads: Sequence[nd.NDArray], first: bool,
               rescale_grad: float, scratch: dict, check_finite: bool = False,
               fused: Optional[bool] = None) -> Optional[nd.NDArray]:
    """accs[i] = rescale_grad * grads[i] (first micro-batch of a window), else
    accs[i] += rescale_grad * grads[i].

    Accumulators are float32 (or wider). On CPU with the native operators, one
    ``mx_lbsgd_accumulate`` call per context over every float32 accumulator (float16
    gradients widened on the fly, no host sync). Otherwise per tensor: a float16 gradient
    is cast through `scratch` (see `cast_into`), and ``sgd_update`` with lr=-1, wd=0 and
    `rescale_grad` is an in-place axpy, so scaling costs no extra pass. Both give the same
    bits.

    Returns None, or with `check_finite` ``finite_flag(grads, fused)`` (the same value): on
    CPU with the native operators the accumulate's own output, from the pass it makes
    anyway, so the check costs no call; for the other tensors a `finite_flag` of its own.
    The accumulators are written whatever the flag says.
    """
    rest, flags = _native_window_call(accs, grads, check_finite, mode=0 if first else 1,
                                      factor=rescale_grad)
    flag = _rest_flag(grads, rest, flags, check_finite, fused)
    for j in rest:
        acc, grad = accs[j], grads[j]
        if first:
            if grad.dtype == acc.dtype:
                _compat.mul_scalar(grad, scalar=rescale_grad, out=acc)
            else:
                nd.Cast(grad, dtype=acc.dtype, out=acc)
                if rescale_grad != 1.0:
                    _compat.mul_scalar(acc, scalar=rescale_grad, out=acc)
            continue
        if grad.dtype != acc.dtype:
            grad = cast_into(grad, acc.dtype, scratch)
        nd.sgd_update(acc, grad, out=acc, lr=-1.0, wd=0.0, rescale_grad=rescale_grad)
    return flag


def write_mean(*, grads: Sequence[nd.NDArray], accs: Sequence[nd.NDArray],
               rescale_grad: float, mean_factor: float, scratch: dict,
               check_finite: bool = False, fused: Optional[bool] = None,
               into_accs: bool = False) -> Optional[nd.NDArray]:
    """grads[i] = mean_factor * (accs[i] + rescale_grad * grads[i]) in the gradient's dtype: the
    accumulated window written back into the gradient buffers, ready to be communicated
    once. One native call per context on CPU (as `accumulate`), else per tensor. With
    `check_finite`, returns the finite flag of the gradients as they were before (see
    `accumulate`), else None. With `into_accs` the mean goes into the float32 accumulators
    instead (the gradients stay as they are), in the same arithmetic: a float32 gradient's
    mean is the same bits either way."""
    # one pass for a float32 gradient: sgd_update gives (1 - lr*wd) * grad - lr * acc,
    # which with lr = -m and wd = (m*rescale_grad - 1)/m is m * (acc + rescale_grad * grad)
    m = mean_factor
    lr, wd = -m, (m * rescale_grad - 1.0) / m
    rest, flags = _native_window_call(accs, grads, check_finite, mode=3 if into_accs else 2,
                                      factor=rescale_grad, lr=lr, wd=wd,
                                      mean_factor=mean_factor)
    # pushed before the per-tensor means overwrite the rest of the gradients
    flag = _rest_flag(grads, rest, flags, check_finite, fused)
    for j in rest:
        acc, grad = accs[j], grads[j]
        if acc.dtype == grad.dtype:
            nd.sgd_update(grad, acc, out=acc if into_accs else grad, lr=lr, wd=wd,
                          rescale_grad=1.0)
        else:
            accumulate(accs=[acc], grads=[grad], first=False, rescale_grad=rescale_grad,
                       scratch=scratch)
            _compat.mul_scalar(acc, scalar=mean_factor, out=acc)
            if not into_accs:
                nd.Cast(acc, dtype=grad.dtype, out=grad)
    return flag


def _rest_flag(grads: Sequence[nd.NDArray], rest: Sequence[int], flags: List[nd.NDArray],
               check_finite: bool, fused: Optional[bool]) -> Optional[nd.NDArray]:
    """The finite flag of every gradient: the native calls' `flags` AND a `finite_flag` of
    the `rest` (None without `check_finite`)."""
    if not check_finite:
        return None
    if rest:
        flags = flags + [finite_flag([grads[j] for j in rest], fused)]
    return _and_flags(flags)


#: {ids of (accumulators, gradients): (those arrays, `_window_plan` of them)}
_WINDOW_PLANS: Dict[Tuple[int, ...],
                    Tuple[List[nd.NDArray], Tuple[_WindowGroups, List[int]]]] = {}


def _native_window_call(accs: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
                        check_finite: bool, mode: int,
                        **attrs: float) -> Tuple[Sequence[int], List[nd.NDArray]]:
    """Run ``mx_lbsgd_accumulate`` (`mode` 0 write, 1 add, 2 mean) once per context over
    the tensors it takes; return the positions left to MXNet's operators and, with
    `check_finite`, the calls' finite flags (one per context, else []). The grouping is
    computed once per tuple of arrays (a Trainer hands the same buffers every step)."""
    ops = _native.ops()
    if ops is None:
        return range(len(accs)), []
    key = tuple(id(a) for a in accs) + tuple(id(g) for g in grads)
    plan = _WINDOW_PLANS.get(key)
    if plan is None or any(a is not b for a, b in zip(plan[0], list(accs) + list(grads))):
        plan = (list(accs) + list(grads), _window_plan(accs, grads))
        _WINDOW_PLANS[key] = plan
        if len(_WINDOW_PLANS) > 64:          # bound the cache (changing gradient sets)
            _WINDOW_PLANS.pop(next(iter(_WINDOW_PLANS)))
    groups, rest = plan[1]
    flags = []
    for group_accs, group_grads in groups:
        out = _native.call(ops.accumulate, group_accs + group_grads,
                           nd.empty((1,), ctx=group_accs[0].context),
                           num_tensors=len(group_accs), mode=mode,
                           check_finite=int(bool(check_finite)), **attrs)
        if check_finite:
            flags.append(out)
    return rest, flags


def _window_plan(accs: Sequence[nd.NDArray],
                 grads: Sequence[nd.NDArray]) -> Tuple[_WindowGroups, List[int]]:
    """([(accumulators, gradients) per CPU context], positions the native operator does
    not take: non-float32 accumulators, other gradient dtypes, sparse storage, GPUs)."""
    groups: Dict[Any, Tuple[List[nd.NDArray], List[nd.NDArray]]] = {}
    rest: List[int] = []
    for j, (acc, grad) in enumerate(zip(accs, grads)):
        if (acc.context.device_type == 'cpu' and grad.context == acc.context
                and acc.dtype == np.float32 and grad.dtype in _NATIVE_DTYPES
                and acc.stype == 'default' and grad.stype == 'default'):
            group = groups.setdefault(acc.context, ([], []))
            group[0].append(acc)
            group[1].append(grad)
        else:
            rest.append(j)
    return list(groups.values()), rest


def cast_into(array: nd.NDArray, dtype: Any, scratch: dict) -> nd.NDArray:
    """`array` cast into a view of a flat buffer that `scratch` (a dict) keeps per
    (context, dtype) and reuses from step to step."""
    key = (array.context, np.dtype(dtype).name)
    flat = scratch.get(key)
    if flat is None or flat.size < array.size:
        flat = nd.empty((array.size,), ctx=array.context, dtype=dtype)
        scratch[key] = flat
    view = flat[:array.size].reshape(array.shape)
    nd.Cast(array, dtype=dtype, out=view)
    return view


#: {(ids of the arrays, fused): (those arrays, `_finite_plan` of them)}
_FINITE_PLANS: Dict[Tuple[Tuple[int, ...], Optional[bool]],
                    Tuple[List[nd.NDArray], _FinitePlan]] = {}
_NATIVE_DTYPES = (np.float32, np.float16)


def _check_one(arrays: Sequence[nd.NDArray], flag: nd.NDArray, first: bool) -> None:
    nd.all_finite(arrays[0], init_output=first, out=flag)


def _check_many(arrays: Sequence[nd.NDArray], flag: nd.NDArray, first: bool) -> None:
    nd.multi_all_finite(*arrays, num_arrays=len(arrays), init_output=first, out=flag)


def _check_native(arrays: Sequence[nd.NDArray], flag: nd.NDArray, first: bool) -> None:
    # writes the whole flag (no AND with an earlier value), so it is planned first
    _native.call(_native.ops().all_finite,  # type: ignore[union-attr]  # planned when set
                 arrays, flag, num_arrays=len(arrays))


def finite_flag(arrays: Sequence[nd.NDArray], fused: Optional[bool]) -> nd.NDArray:
    """A float32 (1,) array on the first array's context: 1 if every element of every array
    is finite, else 0. Works across contexts and dtypes; reads nothing back to the host.

    On CPU with the native operators, one `mx_lbsgd_all_finite` per context over every
    float32 and float16 array (MXNet's `multi_all_finite` costs about 1 ms on 20 small
    arrays on CPU, mostly per-array launches; this one pass reads the exponent bits).
    Otherwise routed like the update (`route`): `multi_all_finite` over the small arrays of
    a (context, dtype) in chunks of 200, `all_finite` per big array. All are AND-ed into one
    flag per context (the first kernel of a context initialises it). The grouping is
    computed once per tuple of arrays (a Trainer hands the same gradient arrays every step).
    """
    key = (tuple(id(a) for a in arrays), fused)
    plan = _FINITE_PLANS.get(key)
    if plan is None or any(a is not b for a, b in zip(plan[0], arrays)):
        sparse = any(a.stype != 'default' for a in arrays)
        plan = (list(arrays), _finite_plan(arrays, fused))
        if not sparse:                        # (sparse: stored rows change every step)
            _FINITE_PLANS[key] = plan
            if len(_FINITE_PLANS) > 64:       # bound the cache (changing gradient sets)
                _FINITE_PLANS.pop(next(iter(_FINITE_PLANS)))
    flags: List[nd.NDArray] = []
    for ctx, calls in plan[1]:
        flag = nd.empty((1,), ctx=ctx, dtype=np.float32)
        for n, (check, group) in enumerate(calls):
            check(group, flag, n == 0)
        flags.append(flag)
    return _and_flags(flags)


def all_finite_now(arrays: Sequence[nd.NDArray], fused: Optional[bool]) -> bool:
    """Whether every element of every array is finite, read now: one host sync.

    With the native library and ``fused=None``, dense float16/float32 CPU arrays are
    checked on the calling thread as soon as they are written (`_native.host_all_finite`):
    the same bits as `finite_flag`, without an operator's round trip through MXNet's engine
    (0.03 ms against 0.13-0.18 ms for 20 small gradients here). Otherwise `finite_flag`,
    read back."""
    if not arrays:
        return True
    if fused is None:
        finite = _native.host_all_finite(arrays, _HOST_CHECKS)
        if finite is not None:
            return finite
    return bool(finite_flag(arrays, fused).asscalar())


#: `all_finite_now`'s prepared calls (a Trainer hands the same gradient arrays every step)
_HOST_CHECKS: Dict[Any, Any] = {}


def _and_flags(flags: List[nd.NDArray]) -> nd.NDArray:
    """One flag from per-context flags: on the first one's context, 1 when all are 1."""
    if not flags:
        return nd.ones((1,), dtype=np.float32)
    first, *rest = flags
    for flag in rest:
        first = nd.minimum(first, flag.as_in_context(first.context))
    return first


def _finite_plan(arrays: Sequence[nd.NDArray], fused: Optional[bool]) -> _FinitePlan:
    """[(context, [(check, arrays)])] for `finite_flag`: `_check_native` (first in its
    context), `_check_one` or `_check_many`."""
    groups: Dict[Any, Dict[Any, List[nd.NDArray]]] = {}
    for a in arrays:
        if a.stype != 'default':
            a = a.data          # the stored values only (row_sparse rows, csr entries)
        groups.setdefault(a.context, {}).setdefault(a.dtype, []).append(a)
    plan: _FinitePlan = []
    native = _native.ops() is not None
    for ctx, by_dtype in groups.items():
        calls: List[Tuple[_Check, Sequence[nd.NDArray]]] = []
        if native and ctx.device_type == 'cpu':
            mine = [a for dtype in _NATIVE_DTYPES for a in by_dtype.pop(dtype, [])]
            if mine:
                calls.append((_check_native, mine))
        for dtype, group in by_dtype.items():
            single, multi = route([a.size for a in group], ctx.device_type, fused, dtype)
            calls += [(_check_one, [group[i]]) for i in single]
            calls += [(_check_many, chunk) for chunk in
                      chunks([group[i] for i in multi], MAX_ARRAYS_PER_FINITE_CHECK)]
        plan.append((ctx, calls))
    return plan


def scale_in_place(arrays: Iterable[nd.NDArray], multiplier: float) -> None:
    """arrays[i] *= multiplier (unscaling gradients for clipping)."""
    for a in arrays:
        a *= multiplier


def sparse_lars_factor(*, weight: nd.NDArray, grad: nd.NDArray, wd: float, eta: float,
                       eps: float, rescale_grad: float, lars_min: float,
                       lars_max: float) -> float:
    """The LARS trust ratio of one layer with a row_sparse gradient, over the rows present
    (norms on the device, one value read back: the sparse kernels take lr as a float)."""
    rows = grad.indices
    wn = float(nd.norm(nd.take(weight, rows).astype(np.float32)).asscalar())
    gn = float(nd.norm(grad.data.astype(np.float32)).asscalar()) * rescale_grad
    if wn == 0.0 or gn == 0.0:
        return 1.0
    return min(max(eta * wn / (gn + wd * wn + eps), lars_min), lars_max)


def accumulate_sparse(*, acc: nd.NDArray, grad: nd.NDArray, first: bool,
                      rescale_grad: float) -> None:
    """acc = rescale_grad * grad (first) or acc + rescale_grad * grad, for a row_sparse gradient: a
    row_sparse accumulator keeps the union of the rows (memory proportional to the rows
    touched); a dense one is updated on the gradient's rows only."""
    scaled = grad * rescale_grad if rescale_grad != 1.0 else grad
    if scaled.dtype != acc.dtype:
        scaled = scaled.astype(acc.dtype)
    if acc.stype == 'row_sparse':
        (scaled if first else acc + scaled).copyto(acc)
        return
    if first:
        acc[:] = 0
    nd.sgd_update(acc, scaled, out=acc, lr=-1.0, wd=0.0, lazy_update=True)
