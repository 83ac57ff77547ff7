"""The LAMB kernel family: MXNet LAMB's update and state layout, on two kernel paths.

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(2019), https://arxiv.org/abs/1904.00962. Per tensor, at its t-th applied update::

    g = clip(c * rescale_grad * grad, clip_gradient)    # c: 1, or the global-norm clip
    mean = beta1 * mean + (1 - beta1) * g
    var = beta2 * var + (1 - beta2) * g ** 2
    m, v = (mean / (1 - beta1 ** t), var / (1 - beta2 ** t)) if bias_correction else (mean, var)
    d = m / (sqrt(v) + epsilon) + wd * w
    r1 = clip(|w|, lower_bound, upper_bound)     # a bound applies when it is set and > 0
    ratio = r1 / |d| if r1 > 0 and |d| > 0 else 1   # 1 for layers excluded by name
    w = w - lr * ratio * d                       # w: the fp32 master copy when there is one

Three kernels share one keyword-only signature:

- `_native_lamb`: the package's compiled ``mx_lbsgd_lamb_update`` (``csrc/native_ops.cc``),
  all tensors in one call and two passes over memory, norms included. It takes float32
  weights, or float16 weights with fp32 master copies (and float16 gradients, or float32
  ones: an accumulated window), on CPU, when ``pip install`` built
  the library; the shell routes every such group to it unless ``fused`` forces a path.
- `_single_tensor_lamb`: MXNet's ``lamb_update_phase1``/``phase2`` per tensor (on the fp32
  master copy when there is one: MXNet 1.9.1's ``mp_lamb_update_phase2`` never writes the
  master copy, so ``mx.optimizer.LAMB`` with ``aggregate_num=1`` and fp16 weights keeps its
  master copy at the initial weights).
- `_multi_tensor_lamb`: ``multi_lamb_update`` / ``multi_mp_lamb_update`` (at most 45
  tensors a call; the GPU path). ``multi_mp_lamb_update`` takes float16 gradients only, so
  float32 ones (an accumulated window) update the master copies with ``multi_lamb_update``,
  which are then cast into the float16 weights. The trust ratio lives inside MXNet's
  kernels, so here a layer excluded from it takes the per-tensor path, which passes zero
  norms (MXNet's phase2 then keeps lr).

With global-norm clipping the native kernel folds the coefficient ``c`` into its
rescale_grad (and writes nothing when the norm is not finite); MXNet's LAMB operators take
rescale_grad as a float only, so on their paths the gradients are multiplied by ``c`` in
place first (one extra pass, the GPU path's cost).

Differences from MXNet's ``mx.optimizer.LAMB``: none in the update (the native kernel's
moments are MXNet's bit for bit; its norms are summed in double, so the weights differ from
MXNet's in the last bits of the trust ratio); the family runs
inside the pipeline shell, which adds accumulation, loss scaling, exclusions by name and
checkpoints, and counts ``t`` in applied updates. Compared with PyTorch implementations
(there is no LAMB in torch.optim; NVIDIA apex's FusedLAMB): MXNet's epsilon placement
(outside the square root of the corrected variance) and weight decay inside ``d``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mxnet import nd

from .. import _kernels, _native
from .base import (Arrays, FamilyBase, FamilyState, Floats, GradNorm, KernelTrust, Masters,
                   SliceSums, native_clip, update_kwargs)
from .base import cast_down as _cast_down

MAX_TENSORS_PER_KERNEL = 45    # MXNet's multi_lamb_update (MXNET_OPTIMIZER_AGGREGATION_SIZE)
#: (mean, var) of one tensor
Moments = Tuple[nd.NDArray, nd.NDArray]


def _pick(pos: List[int], kwargs: dict) -> dict:
    """kwargs with every list argument reduced to the entries at `pos`."""
    return {k: [v[j] for j in pos] if isinstance(v, list) else v for k, v in kwargs.items()}


def _single_tensor_lamb(*, weights: Arrays, grads: Arrays, states: List[Moments],
                        masters: Masters, lrs: Floats, wds: Floats, steps: List[int],
                        ratio_applies: Optional[List[bool]], bounds: Dict[str, float],
                        beta1: float, beta2: float, epsilon: float, bias_correction: bool,
                        rescale_grad: float, clip_gradient: Optional[float],
                        scratch: dict, grad_norm: Optional[GradNorm] = None,
                        sums: Optional[SliceSums] = None) -> None:
    """MXNet's two phases per tensor. With `sums` (pieces of tensors split over ranks),
    phase 1 runs on every piece first, then ``|w|`` and ``|d|`` are the whole tensors'
    (the pieces' partial sums of squares summed over the ranks), then phase 2."""
    if grad_norm is not None:
        grads = _kernels.scale_gradients(grads, grad_norm.coefficient())
    kwargs = update_kwargs(rescale_grad, clip_gradient, beta1=beta1, beta2=beta2,
                           epsilon=epsilon, bias_correction=bias_correction)
    targets, directions = [], []
    for i, (w, g, (mean, var), w32) in enumerate(zip(weights, grads, states, masters)):
        target = w if w32 is None else w32
        if w32 is not None and g.dtype != w32.dtype:
            # not mp_lamb_update_phase2: in MXNet 1.9.1 it never writes the fp32 master
            # copy (measured), so the fp32 phase ops run on the master copy instead
            g = _kernels.cast_into(g, w32.dtype, scratch)
        d = nd.lamb_update_phase1(target, g, mean, var, t=steps[i], wd=wds[i], **kwargs)
        if sums is None:
            _lamb_phase2(w, target, d, None, lrs[i], ratio_applies, i, bounds)
        else:
            targets.append(target)
            directions.append(d)
    if sums is not None:
        w_sq, d_sq = sums(_kernels.sum_squares(targets), _kernels.sum_squares(directions))
        norms = (nd.sqrt(w_sq), nd.sqrt(d_sq))
        for i, (w, target, d) in enumerate(zip(weights, targets, directions)):
            _lamb_phase2(w, target, d, norms, lrs[i], ratio_applies, i, bounds)


def _lamb_phase2(w: nd.NDArray, target: nd.NDArray, d: nd.NDArray,
                 norms: Optional[Tuple[nd.NDArray, nd.NDArray]], lr: float,
                 ratio_applies: Optional[List[bool]], i: int, bounds: Dict[str, float]) -> None:
    """Phase 2 of tensor `i` (`norms`: every tensor's |w| and |d|, else its own), then the
    master copy `target` cast into the weight `w`."""
    if ratio_applies is None or ratio_applies[i]:
        r1, r2 = (target.norm(), d.norm()) if norms is None else \
            (norms[0][i:i + 1], norms[1][i:i + 1])
        phase2_bounds = bounds
    else:        # zero norms: phase2 keeps lr (and no bound may lift r1 above 0)
        r1 = r2 = nd.zeros((1,), ctx=w.context, dtype=d.dtype)
        phase2_bounds = {}
    nd.lamb_update_phase2(target, d, r1, r2, lr=lr, out=target, **phase2_bounds)
    if target is not w:
        nd.Cast(target, dtype=w.dtype, out=w)


def _native_lamb(*, weights: Arrays, grads: Arrays, states: List[Moments], masters: Masters,
                 lrs: Floats, wds: Floats, steps: List[int],
                 ratio_applies: Optional[List[bool]], bounds: Dict[str, float], beta1: float,
                 beta2: float, epsilon: float, bias_correction: bool, rescale_grad: float,
                 clip_gradient: Optional[float], scratch: dict,
                 grad_norm: Optional[GradNorm]) -> None:
    """All tensors in one call of the native ``mx_lbsgd_lamb_update`` (two passes over
    memory, norms included; excluded layers take ratio 1 in the same call; with
    `grad_norm` the clip coefficient is computed inside, and a non-finite norm writes
    nothing)."""
    mp = masters[0] is not None
    arrays = (list(weights) + list(grads) + [s[0] for s in states] + [s[1] for s in states]
              + (list(masters) if mp else []))
    attrs: Dict[str, Any] = {} if grad_norm is None else dict(grad_norm.native_attrs())
    applies = [1] * len(weights) if ratio_applies is None else [int(a) for a in ratio_applies]
    numbers = _native.attribute_list
    attrs.update(num_tensors=len(weights), multi_precision=int(mp), lrs=numbers(lrs),
                 wds=numbers(wds), steps=numbers(steps), applies=numbers(applies),
                 beta1=beta1, beta2=beta2, epsilon=epsilon,
                 bias_correction=int(bias_correction), rescale_grad=rescale_grad,
                 clip_gradient=native_clip(clip_gradient),
                 lower_bound=bounds.get('lower_bound', -1.0),
                 upper_bound=bounds.get('upper_bound', -1.0))
    _native.invoke(_native.ops().lamb_update,  # type: ignore[union-attr]  # ops() is set
                   arrays, attrs, scratch,
                   loose=[grad_norm.sum_sq] if grad_norm is not None else [])


def _multi_tensor_lamb(*, weights: Arrays, grads: Arrays, states: List[Moments],
                       masters: Masters, lrs: Floats, wds: Floats, steps: List[int],
                       ratio_applies: Optional[List[bool]], bounds: Dict[str, float],
                       beta1: float, beta2: float, epsilon: float, bias_correction: bool,
                       rescale_grad: float, clip_gradient: Optional[float],
                       scratch: dict,  # pylint: disable=unused-argument
                       grad_norm: Optional[GradNorm] = None) -> None:
    if grad_norm is not None:
        grads = _kernels.scale_gradients(grads, grad_norm.coefficient())
    kwargs = update_kwargs(rescale_grad, clip_gradient, beta1=beta1, beta2=beta2,
                           epsilon=epsilon, bias_correction=bias_correction, **bounds)
    means = [s[0] for s in states]
    variances = [s[1] for s in states]
    # multi_mp_lamb_update takes gradients of the weights' dtype only: float32 gradients
    # of float16 weights (an accumulated window) update the master copies with the float32
    # kernel, then the weights get the master copies cast to float16
    cast_down = masters[0] is not None and grads[0].dtype != weights[0].dtype
    targets = masters if cast_down else weights
    for start in range(0, len(weights), MAX_TENSORS_PER_KERNEL):
        part = slice(start, start + MAX_TENSORS_PER_KERNEL)
        common = dict(out=targets[part], step_count=steps[part], lrs=lrs[part],
                      wds=wds[part], **kwargs)
        if masters[0] is None or cast_down:
            nd.contrib.multi_lamb_update(targets[part], grads[part], means[part],
                                         variances[part], **common)
        else:
            nd.contrib.multi_mp_lamb_update(weights[part], grads[part], means[part],
                                            variances[part], masters[part], **common)
    if cast_down:
        _cast_down(weights, masters)


class LAMBFamily(FamilyBase):
    """MXNet LAMB: state (mean, var), or (weight_fp32, (mean, var)) with master copies.

    Parameters
    ----------
    beta1, beta2 : float
    epsilon : float
    lower_bound, upper_bound : float or None
        Clip range of ``|w|`` in the trust ratio (unset when None or 0).
    bias_correction : bool

    Examples
    --------
    >>> import numpy as np
    >>> from mxnet import nd
    >>> from mx_lbsgd.families import LAMBFamily
    >>> family = LAMBFamily(0.9, 0.999, 1e-6, None, None, bias_correction=True)
    >>> weight = nd.ones((2, 3), dtype='float16')
    >>> master = weight.astype('float32')
    >>> state = family.make_state(weight, np.float32, master)
    >>> state[0] is master, [m.shape for m in state[1]]
    (True, [(2, 3), (2, 3)])
    >>> moments, kept = family.split(state, with_master=True)
    >>> kept is master, family.describe()
    (True, 'beta1=0.9, beta2=0.999')
    """

    name = 'LAMB'
    supports_sparse = False
    trust_in_kernel = True
    native = staticmethod(_native_lamb)
    single_tensor = staticmethod(_single_tensor_lamb)
    multi_tensor = staticmethod(_multi_tensor_lamb)

    def __init__(self, beta1: float, beta2: float, epsilon: float,
                 lower_bound: Optional[float], upper_bound: Optional[float],
                 bias_correction: bool) -> None:
        self.hyper = dict(beta1=float(beta1), beta2=float(beta2), epsilon=float(epsilon),
                          bias_correction=bool(bias_correction))
        self.bounds: Dict[str, float] = {}
        if lower_bound:
            self.bounds['lower_bound'] = float(lower_bound)
        if upper_bound:
            self.bounds['upper_bound'] = float(upper_bound)

    def make_state(self, weight: nd.NDArray, dtype: Any,
                   master: Optional[nd.NDArray]) -> FamilyState:
        stype = weight.stype
        moments = (nd.zeros(weight.shape, weight.context, dtype=dtype, stype=stype),
                   nd.zeros(weight.shape, weight.context, dtype=dtype, stype=stype))
        return moments if master is None else (master, moments)

    def split(self, base: FamilyState, with_master: bool) -> Optional[tuple]:
        """((mean, var), master or None) of a LAMB state, or None when it does not fit."""
        if not isinstance(base, tuple) or len(base) != 2:
            return None
        if with_master:
            master, moments = base
            if not isinstance(moments, tuple) or len(moments) != 2:
                return None
            return moments, master
        if isinstance(base[1], tuple):
            return None
        return base, None

    def describe(self) -> str:
        return 'beta1=%g, beta2=%g' % (self.hyper['beta1'], self.hyper['beta2'])

    def sparse_refusal(self, names: Sequence[str]) -> str:
        return ('LAMB has no sparse update (neither has mx.optimizer.LAMB): parameter(s) %s '
                'have row_sparse gradients or non-default storage. Use dense gradients '
                "(Embedding(sparse_grad=False)), or 'lbsgd' for those parameters"
                % ', '.join(map(repr, names)))

    def run(self, kernel: Callable[..., None], *, states: List[Moments], steps: List[int],
            ratio_applies: Optional[List[bool]], trust: Optional[KernelTrust],  # noqa: ARG002
            grad_norm: Optional[GradNorm], sums: Optional[SliceSums] = None,
            **common: Any) -> None:
        """Run `kernel`; tensors excluded from the trust ratio take the per-tensor path
        (`ratio_applies`: LAMB's kernels hold the ratio, so `trust` is always None).
        With `grad_norm`, MXNet's operators get gradients scaled in place by its
        coefficient; the native kernel takes it as an input. With `sums` (pieces of split
        tensors) every tensor takes the per-tensor path, in two phases around `sums`."""
        if sums is not None:
            path: Callable[..., None] = _single_tensor_lamb
            path(bounds=self.bounds, states=states, steps=steps, ratio_applies=ratio_applies,
                 grad_norm=grad_norm, sums=sums, **common, **self.hyper)
            return
        if grad_norm is not None:
            if kernel is _native_lamb:
                kernel(bounds=self.bounds, states=states, steps=steps,
                       ratio_applies=ratio_applies, grad_norm=grad_norm, **common,
                       **self.hyper)
                return
            common['grads'] = _kernels.scale_gradients(common['grads'],
                                                       grad_norm.coefficient())
        groups: List[Tuple[Callable[..., None], List[int]]] = [
            (kernel, list(range(len(states))))]
        if kernel is _multi_tensor_lamb and ratio_applies is not None \
                and not all(ratio_applies):
            groups = [(_multi_tensor_lamb, [j for j, a in enumerate(ratio_applies) if a]),
                      (_single_tensor_lamb, [j for j, a in enumerate(ratio_applies) if not a])]
        lists = dict(common, states=states, steps=steps, ratio_applies=ratio_applies)
        for path, pos in groups:
            if pos:
                path(bounds=self.bounds, grad_norm=None, **_pick(pos, lists), **self.hyper)
