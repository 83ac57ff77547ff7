"""The SGD kernel family: MXNet SGD's update and state layout, on four kernel paths.

`_native_sgd` (the package's compiled ``mx_lbsgd_sgd_update``: every tensor in one call
and one pass, on CPU, for float32 weights or float16 with master copies, when built),
`_single_tensor_sgd` and `_multi_tensor_sgd` (MXNet's operators) share one keyword-only
signature (as torch's ``optim/sgd.py`` kernels do); `_sparse_sgd` runs tensors with
non-default storage one by one. The native kernel's results are MXNet's operators' bit for
bit (``tests/test_native.py``).
Per tensor, with ``lr`` either a float or an entry of a device vector (LARS)::

    g' = clip(c * rescale_grad * g, clip_gradient)
    if not nesterov:                    # MXNet's sgd_mom_update
        mom = momentum * mom - lr * (g' + wd * w)
        w = w + mom                     # w: the fp32 master copy when there is one
    else:                               # MXNet's nag_mom_update (NAG)
        m = momentum * mom
        w_new = w - m + (momentum + 1) * (m - lr * (g' + wd * w))
        mom = m - lr * (g' + wd * w_new)
        w = w_new

NAG's momentum term decays with the new weight: MXNet's kernel writes the weight in place
before it reads it again for the momentum, and every kernel here keeps that order, so
``nesterov=True`` gives MXNet's ``'nag'`` bit for bit. MXNet has no multi-tensor or
preloaded (device learning rate) NAG operator: with ``nesterov`` the multi-tensor path runs
``nag_mom_update`` (``sgd_update`` without momentum) per tensor, and device rates (LARS,
clipping) run the rule above as elementwise operators. Without ``nesterov`` every path runs
SGD's ``multi_sgd_*`` operators (one tensor a call on the per-tensor path), as MXNet's
``'sgd'`` does: MXNet reads the rates of those as correctly rounded tuples, but a per-tensor
operator's ``lr`` with its own parser, one float32 ulp off for some values
(``tests/test_rounding.py``); the native kernel reads each value as the operator it
reproduces.

``c`` is 1, or with global-norm clipping the `GradNorm` coefficient: the native kernel
multiplies its rescale_grad by it; MXNet's operators take ``lr * c`` and ``wd / c`` as
device vectors (the ``preloaded_multi_sgd_*`` kernels), so no path rewrites a gradient.

`SGDFamily` tells the optimizer shell how states are laid out (MXNet SGD's: ``mom``,
``(mom, weight_fp32)`` or None) and runs a kernel with the family's hyperparameters. A
kernel family is what an optimizer preset chooses; the shell's accumulation, warmup, trust
ratio and loss-scale gate do not depend on it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from mxnet import nd

from .. import _kernels, _native
from .base import (Arrays, FamilyBase, FamilyState, Floats, GradNorm, KernelTrust, Masters,
                   SliceSums, native_clip, update_kwargs)
from .base import cast_down as _cast_down


def _kernel_kwargs(momentum: float, rescale_grad: float,
                   clip_gradient: Optional[float]) -> dict:
    return update_kwargs(rescale_grad, clip_gradient,
                         **({'momentum': momentum} if momentum > 0 else {}))


def _native_mp(weight: nd.NDArray, grad: nd.NDArray,
               master: Optional[nd.NDArray]) -> bool:
    """fp16 weight and gradient with an fp32 master copy on a GPU: the mp_* kernels.
    On CPU (no F16C) casting the gradient into an fp32 buffer and running the fp32 kernel
    on the master copy is 1.5x faster."""
    return master is not None and grad.dtype == weight.dtype and \
        weight.context.device_type == 'gpu'


def _device_rates(weights: Arrays, masters: Masters, grads: Arrays, lrs: Floats, wds: Floats,
                  trust: Optional[KernelTrust], rescale_grad: float,
                  grad_norm: Optional[GradNorm]
                  ) -> Tuple[Optional[nd.NDArray], Optional[nd.NDArray]]:
    """(lr vector, wd vector) on the device for the preloaded kernels, or (None, None) when
    the rates stay Python floats: the trust-ratio rates (`trust`, of the master copies) or
    `lrs`, times the clip coefficient c, and wds / c, so that lr * (c*g + wd*w) is what the
    kernel computes."""
    if trust is None and grad_norm is None:
        return None, None
    ctx = weights[0].context
    lr_vec = _kernels.device_vector(lrs, ctx) if trust is None else trust.rates(
        weights=[w if m is None else m for w, m in zip(weights, masters)], grads=grads,
        lrs=lrs, wds=wds, rescale_grad=rescale_grad, grad_norm=grad_norm)
    wd_vec = _kernels.device_vector(wds, ctx)
    if grad_norm is not None:
        c = grad_norm.coefficient()
        lr_vec = nd.broadcast_mul(lr_vec, c)
        # (c > 0 whenever these kernels run: a non-finite norm never reaches them)
        wd_vec = nd.broadcast_div(wd_vec, nd.maximum(c, _SMALLEST_COEFFICIENT))
    return lr_vec, wd_vec


_SMALLEST_COEFFICIENT = 1e-30


def _nag_device_rates(target: nd.NDArray, g: nd.NDArray, m: nd.NDArray, lr: nd.NDArray,
                      wd: nd.NDArray, momentum: float, rescale_grad: float,
                      clip_gradient: Optional[float]) -> None:
    """nag_mom_update's rule with the learning rate and weight decay as (1,) device arrays
    (LARS rates, clipping's ``lr * c`` and ``wd / c``), in its operation order, in place."""
    grad = g * rescale_grad
    if clip_gradient:
        grad = nd.clip(grad, -clip_gradient, clip_gradient)
    m_decayed = m * momentum
    step = nd.broadcast_mul(lr, grad + nd.broadcast_mul(wd, target))
    new = target - m_decayed + (momentum + 1.0) * (m_decayed - step)
    nd.broadcast_sub(m_decayed, nd.broadcast_mul(lr, grad + nd.broadcast_mul(wd, new)), out=m)
    new.copyto(target)


def _single_tensor_sgd(*, weights: Arrays, grads: Arrays, moms: Masters, masters: Masters,
                       lrs: Floats, wds: Floats, trust: Optional[KernelTrust],
                       momentum: float, nesterov: bool, rescale_grad: float,
                       clip_gradient: Optional[float], scratch: dict,
                       grad_norm: Optional[GradNorm]) -> None:
    kwargs = _kernel_kwargs(momentum, rescale_grad, clip_gradient)
    lr_vector, wd_vector = _device_rates(weights, masters, grads, lrs, wds, trust,
                                         rescale_grad, grad_norm)
    for i, (w, g, m, w32) in enumerate(zip(weights, grads, moms, masters)):
        native = _native_mp(w, g, w32)
        if w32 is not None and not native and g.dtype != w32.dtype:
            g = _kernels.cast_into(g, w32.dtype, scratch)
        target = w if (w32 is None or native) else w32
        tensors = [target, g] + ([] if m is None else [m]) + ([w32] if native else [])
        nag = nesterov and m is not None
        if lr_vector is None and nesterov:      # NAG's operators
            op = {(False, False): nd.sgd_update, (False, True): nd.nag_mom_update,
                  (True, False): nd.mp_sgd_update,
                  (True, True): nd.mp_nag_mom_update}[(native, m is not None)]
            op(*tensors, out=target, lr=lrs[i], wd=wds[i], **kwargs)
        elif lr_vector is None:                 # SGD's: one tensor of its multi_* operators
            _multi(native, m is not None)(*tensors, out=[target], num_weights=1,
                                          lrs=(lrs[i],), wds=(wds[i],), **kwargs)
        elif nag:
            if native:          # fp16 weight and gradient on a GPU: the rule on fp32 copies
                target, g = w32, g.astype('float32')
            _nag_device_rates(target, g, m, lr_vector[i:i + 1],
                              wd_vector[i:i + 1],  # type: ignore[index]  # set with lr_vector
                              momentum, rescale_grad, clip_gradient)
            if native:
                nd.Cast(w32, dtype=w.dtype, out=w)
        else:
            _preloaded(native, m is not None)(
                *tensors, lr_vector[i:i + 1],
                wd_vector[i:i + 1],  # type: ignore[index]  # set whenever lr_vector is
                out=[target], num_weights=1, **kwargs)
        if w32 is not None and not native:
            nd.Cast(w32, dtype=w.dtype, out=w)


def _native_sgd(*, weights: Arrays, grads: Arrays, moms: Masters, masters: Masters,
                lrs: Floats, wds: Floats, trust: Optional[KernelTrust], momentum: float,
                nesterov: bool, rescale_grad: float, clip_gradient: Optional[float],
                scratch: dict, grad_norm: Optional[GradNorm]) -> None:
    """Every tensor in one call of the native ``mx_lbsgd_sgd_update``: one pass over
    memory, MXNet's arithmetic (``sgd_mom_update``, ``sgd_update``, and with LARS rates
    ``preloaded_multi_sgd_*``), float16 gradients widened on the fly (float16 weights with
    master copies take float16 or float32 gradients: an accumulated window). With
    `grad_norm` the operator computes the clip coefficient itself and writes nothing when
    the norm is not finite. With `trust` it computes the LARS rates too, a group of
    tensors at a time: the update reads the weights and gradients the norms have just
    brought into the cache (one call, and about one pass fewer over memory than the norms
    and the update apart)."""
    mp = masters[0] is not None
    with_mom = moms[0] is not None
    arrays = list(weights) + list(grads) + (list(moms) if with_mom else []) + \
        (list(masters) if mp else [])
    attrs: Dict[str, Any] = {} if grad_norm is None else dict(grad_norm.native_attrs())
    if trust is not None:
        attrs.update(trust.native_attrs())
    attrs.update(num_tensors=len(weights), has_momentum=int(with_mom),
                 momentum=momentum if with_mom else 0.0, nesterov=int(nesterov),
                 multi_precision=int(mp), preloaded=0,
                 lrs=_native.attribute_list(lrs), wds=_native.attribute_list(wds),
                 rescale_grad=rescale_grad, clip_gradient=native_clip(clip_gradient))
    _native.invoke(_native.ops().sgd_update,  # type: ignore[union-attr]  # ops() is set
                   arrays, attrs, scratch,
                   loose=[grad_norm.sum_sq] if grad_norm is not None else [])



def _multi(mp: bool, with_mom: bool) -> Callable[..., Any]:
    return {(False, False): nd.multi_sgd_update,
            (False, True): nd.multi_sgd_mom_update,
            (True, False): nd.multi_mp_sgd_update,
            (True, True): nd.multi_mp_sgd_mom_update}[(mp, with_mom)]


def _preloaded(mp: bool, with_mom: bool) -> Callable[..., Any]:
    return {(False, False): nd.preloaded_multi_sgd_update,
            (False, True): nd.preloaded_multi_sgd_mom_update,
            (True, False): nd.preloaded_multi_mp_sgd_update,
            (True, True): nd.preloaded_multi_mp_sgd_mom_update}[(mp, with_mom)]


def _multi_tensor_sgd(*, weights: Arrays, grads: Arrays, moms: Masters, masters: Masters,
                      lrs: Floats, wds: Floats, trust: Optional[KernelTrust],
                      momentum: float, nesterov: bool, rescale_grad: float,
                      clip_gradient: Optional[float], scratch: dict,
                      grad_norm: Optional[GradNorm]) -> None:
    if nesterov:                                # MXNet has no multi-tensor NAG operator
        _single_tensor_sgd(weights=weights, grads=grads, moms=moms, masters=masters, lrs=lrs,
                           wds=wds, trust=trust, momentum=momentum, nesterov=True,
                           rescale_grad=rescale_grad, clip_gradient=clip_gradient,
                           scratch=scratch, grad_norm=grad_norm)
        return
    kwargs = _kernel_kwargs(momentum, rescale_grad, clip_gradient)
    # fp16 gradients with master copies: the mp_* kernels (one scratch buffer cannot hold
    # the fp32 casts of a whole chunk)
    native = masters[0] is not None and grads[0].dtype == weights[0].dtype
    cast_down = masters[0] is not None and not native
    targets = masters if cast_down else weights
    with_mom = moms[0] is not None
    lr_vector, wd_vector = _device_rates(weights, masters, grads, lrs, wds, trust,
                                         rescale_grad, grad_norm)
    for start, end in _kernels.spans(weights):
        part = slice(start, end)
        columns = [targets[part], grads[part]]
        if with_mom:
            columns.append(moms[part])
        if native:
            columns.append(masters[part])
        tensors = [x for row in zip(*columns) for x in row]
        if lr_vector is None:
            _multi(native, with_mom)(*tensors, out=targets[part], num_weights=end - start,
                                     lrs=tuple(lrs[part]), wds=tuple(wds[part]), **kwargs)
        else:
            _preloaded(native, with_mom)(
                *tensors, lr_vector[start:end],
                wd_vector[start:end],  # type: ignore[index]  # set whenever lr_vector is
                out=targets[part], num_weights=end - start, **kwargs)
    if cast_down:
        _cast_down(weights, masters)



def _sparse_sgd(*, weights: Arrays, grads: Arrays, moms: Masters, masters: Masters,
                lrs: Floats, wds: Floats, momentum: float, nesterov: bool, rescale_grad: float,
                clip_gradient: Optional[float], lazy_update: bool) -> None:
    """One tensor at a time with MXNet's sgd_update / sgd_mom_update and `lazy_update`,
    as mx.optimizer.SGD calls them for non-default storage: a row_sparse gradient updates
    only its rows when lazy (weight, momentum, weight decay), every row otherwise; csr or
    row_sparse weights go through MXNet's own storage fallback. With an fp32 master copy
    the (row_sparse) gradient is cast to fp32 and the master copy is updated, lazily too,
    then cast into the weight (MXNet's mp_sgd_* kernels have no sparse path and fall back
    to a dense update). With `nesterov`, MXNet's nag_mom_update, which has no sparse
    kernel: MXNet's storage fallback updates every row, as ``mx.optimizer.NAG`` does."""
    kwargs = _kernel_kwargs(momentum, rescale_grad, clip_gradient)
    for w, g, m, w32, lr, wd in zip(weights, grads, moms, masters, lrs, wds):
        target = w if w32 is None else w32
        if w32 is not None and g.dtype != w32.dtype:
            g = g.astype(w32.dtype)
        if nesterov and m is not None:
            nd.nag_mom_update(target, g, m, out=target, lr=lr, wd=wd, **kwargs)
        elif m is None:
            nd.sgd_update(target, g, out=target, lazy_update=lazy_update, lr=lr, wd=wd,
                          **kwargs)
        else:
            nd.sgd_mom_update(target, g, m, out=target, lazy_update=lazy_update, lr=lr, wd=wd,
                              **kwargs)
        if w32 is not None:
            nd.Cast(w32, dtype=w.dtype, out=w)


class SGDFamily(FamilyBase):
    """MXNet SGD: momentum (lr inside the buffer), weight decay added to the gradient; with
    ``nesterov``, MXNet NAG's rule on the same state.

    Parameters
    ----------
    momentum : float
        0: no momentum buffer (state None).
    lazy_update : bool
        With a row_sparse gradient, update only its rows (as ``mx.optimizer.SGD``).
    nesterov : bool, default False
        MXNet's ``nag_mom_update`` rule (``mx.optimizer.NAG``) instead of
        ``sgd_mom_update``; the state is NAG's: a dense momentum (with ``momentum > 0``).

    Examples
    --------
    >>> import numpy as np
    >>> from mxnet import nd
    >>> from mx_lbsgd.families import SGDFamily
    >>> family = SGDFamily(momentum=0.9, lazy_update=True)
    >>> weight = nd.ones((2, 3))
    >>> mom = family.make_state(weight, np.float32, None)
    >>> mom.shape, family.describe()
    ((2, 3), 'momentum=0.9')
    >>> state, master = family.split(mom, with_master=False)
    >>> state is mom, master
    (True, None)
    >>> family.split(None, with_master=False) is None      # no momentum buffer: no fit
    True
    """

    name = 'SGD'
    supports_sparse = True
    trust_in_kernel = False   # LARS: the shell's trust-ratio piece gives `KernelTrust`
    native = staticmethod(_native_sgd)
    single_tensor = staticmethod(_single_tensor_sgd)
    multi_tensor = staticmethod(_multi_tensor_sgd)

    def __init__(self, momentum: float, lazy_update: bool, nesterov: bool = False) -> None:
        self.momentum = float(momentum)
        self.lazy_update = bool(lazy_update)
        self.nesterov = bool(nesterov)

    def make_state(self, weight: nd.NDArray, dtype: Any,
                   master: Optional[nd.NDArray]) -> FamilyState:
        """MXNet SGD's state: mom, or (mom, weight_fp32); the momentum takes the weight's
        storage type when lazy_update, as SGD's does (dense with nesterov, as NAG's)."""
        stype = weight.stype if self.lazy_update and not self.nesterov else 'default'
        mom = (nd.zeros(weight.shape, weight.context, dtype=dtype, stype=stype)
               if self.momentum != 0.0 else None)
        return mom if master is None else (mom, master)

    def split(self, base: FamilyState, with_master: bool) -> Optional[tuple]:
        """(momentum or None, master or None) of an SGD state, or None when it does not fit."""
        parts = base if isinstance(base, tuple) else (base,)
        if len(parts) != 1 + with_master or (parts[0] is None) != (self.momentum == 0.0):
            return None
        return parts[0], parts[1] if with_master else None

    def describe(self) -> str:
        return 'momentum=%g%s' % (self.momentum, ', nesterov' if self.nesterov else '')

    def run(self, kernel: Callable[..., None], *, states: list, steps: list,  # noqa: ARG002
            ratio_applies: Optional[list], sums: Optional[SliceSums] = None,
            **common: Any) -> None:
        """Run `kernel` (LARS reaches it as `trust`; SGD has no step count). With `sums`
        (pieces of split tensors), the LARS norms are the whole tensors': ``|w|^2`` of the
        master copies (else the weights) and ``|g|^2``, summed over the ranks."""
        if sums is not None:
            weights = [w if m is None else m for w, m in zip(common['weights'],
                                                             common['masters'])]
            totals = sums(_kernels.sum_squares(weights), _kernels.sum_squares(common['grads']))
            if common['trust'] is not None:
                common['trust'] = dataclasses.replace(common['trust'], sums=totals)
        kernel(moms=states, momentum=self.momentum, nesterov=self.nesterov, **common)

    def run_sparse(self, *, states: list, lrs: Floats, **common: Any) -> None:
        _sparse_sgd(moms=states, lrs=lrs, momentum=self.momentum, nesterov=self.nesterov,
                    lazy_update=self.lazy_update, **common)

