"""The global-norm clipping piece: the norm of the gradient an update applies, on the device.

``max_grad_norm`` on every optimizer of the package. Per device, over every parameter of
the step::

    g = the applied gradient: the window's mean, unscaled (1 / loss scale), after the
        reduction across devices and workers (rescale_grad folded in)
    norm = sqrt(sum over all parameters of sum(g ** 2))
    c = min(1, max_grad_norm / (norm + 1e-6))
    the update runs on c * g, before weight decay is added; the trust ratio (LARS, LAMB)
    sees c * g

The norm is one sum-of-squares pass (``mx_lbsgd_sum_sq``, one call per device on CPU), and
with a loss scaler that pass is the step's finite check too. The kernels take ``c`` as a
device value: nothing is read back to the host and no gradient is rewritten (except on
MXNet's LAMB operators, whose rescale_grad is a float).

Where the norm is measured: under a gluon Trainer from the reduced gradients the step
hands over (the shell's `begin_step`); otherwise (Module, an accumulation window inside
the optimizer) over every call of the step, once the loss-scale gate has them all. A
kvstore that updates the weights itself (``update_on_kvstore=True``, or the servers of a
dist kvstore) updates each parameter as its gradient arrives, so it is refused.

Non-finite norms. With a loss scaler the norm's pass is the step's overflow check: the
step is skipped as a whole, the scale backs off and the overflow report names the
parameter. Without one, the weights never receive a NaN: the compiled CPU kernels read
``c`` on the device and write nothing when it is NaN (no host read; ``last_grad_norm``
shows it); MXNet's operators cannot skip on the device, so on their path (GPUs,
``MX_LBSGD_NATIVE=0``, ``fused=True/False``) a clipped step without a scaler reads the
norm once and skips with a RuntimeWarning naming the first non-finite gradient.

How it differs from the others:

- torch ``clip_grad_norm_(params, max_norm)``: the same formula and eps (1e-6); but it is
  a separate call that rewrites ``.grad`` in place, on the gradients as they stand (a
  micro-batch's, unless the user accumulated first), and lets NaN through unless
  ``error_if_nonfinite=True``.
- apex ``FusedLAMB(max_grad_norm=1.0)``: one global norm over all groups (since apex PR
  #819), computed on the device and divided out in the kernel, ``g / (norm / max)`` when
  ``norm > max``, no eps; it sees ``.grad`` as it stands (unscaled by amp first).
- GluonNLP ``clip_grad_global_norm(params, 1)`` (and ``gluon.utils.clip_global_norm``):
  ``max_norm / (norm + 1e-8)``, a host read of the norm every step (``check_isfinite``),
  a pass that rewrites the gradients, and on CPU no float16 (it squares with ``dot``). In
  the BERT scripts it runs on the summed window before ``trainer.update``; here the
  window's mean is clipped inside the update, communicated once.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

from mxnet import nd

from .. import _kernels
from ..families.base import GradNorm

#: added to the norm before dividing (torch's clip_grad_norm_ uses the same)
CLIP_EPS = 1e-6

#: {context: the norm of the step's gradients there}
StepNorms = Dict[Any, GradNorm]


class GlobalNormClip:
    """Measures the norms of one step (see the module docstring).

    Parameters
    ----------
    max_norm : float > 0
        ``max_grad_norm``.
    eps : float, default `CLIP_EPS`
        Added to the norm before dividing.

    Examples
    --------
    >>> import mxnet as mx
    >>> from mxnet import nd
    >>> from mx_lbsgd.pipeline import GlobalNormClip
    >>> clip = GlobalNormClip(max_norm=1.0)
    >>> norms = clip.measure([nd.array([3.0]), nd.array([4.0])], factor=1.0)
    >>> list(norms) == [mx.cpu()]
    True
    >>> norm = norms[mx.cpu()]          # a GradNorm: device values, no host read yet
    >>> print(norm.norm().asnumpy(), norm.coefficient().asnumpy().round(4))
    [5.] [0.2]
    >>> GlobalNormClip.all_finite(norms)
    True
    """

    def __init__(self, max_norm: float, eps: float = CLIP_EPS) -> None:
        self.max_norm = float(max_norm)
        self.eps = float(eps)

    def measure(self, grads: Sequence[nd.NDArray], factor: float) -> StepNorms:
        """The norm of `grads` times `factor`, per context (each device holds every
        parameter's reduced gradient), on the device."""
        return {ctx: GradNorm(_kernels.total_sum_squares(group), factor, self.max_norm,
                              self.eps) for ctx, group in _kernels.by_context(grads)}

    def from_sum(self, sum_sq: nd.NDArray, factor: float) -> StepNorms:
        """The norm of a sum of squares measured elsewhere (a sharded Trainer's, summed over
        every rank's shard)."""
        return {sum_sq.context: GradNorm(sum_sq, factor, self.max_norm, self.eps)}

    @staticmethod
    def all_finite(norms: StepNorms) -> bool:
        """Whether every device's norm is finite: one host read."""
        return math.isfinite(float(GlobalNormClip.total(norms).asscalar()))

    @staticmethod
    def total(norms: StepNorms) -> nd.NDArray:
        """The sum of every device's sum of squares, on the first device (not read)."""
        sums = [n.sum_sq for n in norms.values()]
        first = sums[0]
        return first if len(sums) == 1 else nd.add_n(
            first, *(s.as_in_context(first.context) for s in sums[1:]))


def refuse_kvstore_updates(owner: str) -> None:
    """Raise the refusal of clipping on a kvstore that updates the weights."""
    raise ValueError(
        '%s: max_grad_norm cannot run with update_on_kvstore=True (or on the servers of a '
        'dist kvstore): the kvstore updates each parameter as soon as its gradient arrives, '
        'so no update sees the global norm. Use gluon.Trainer(..., update_on_kvstore=False), '
        'or for Module set the environment variable MXNET_UPDATE_ON_KVSTORE=0' % owner)


def norm_of(groups: Sequence[Tuple[Sequence[nd.NDArray], float]]) -> nd.NDArray:
    """sqrt(sum over groups of factor ** 2 * sum(g ** 2 for g in grads)) as a (1,) float32
    array on the first gradient's device; `groups` is [(gradients, factor)], the
    gradients of one group on any devices."""
    parts: List[nd.NDArray] = []
    for grads, factor in groups:
        by_context: Dict[Any, list] = {}
        for g in grads:
            by_context.setdefault(g.context, []).append(g)
        for group in by_context.values():
            part = _kernels.total_sum_squares(group)
            if parts:
                part = part.as_in_context(parts[0].context)
            parts.append(part * (factor * factor))
    total = parts[0] if len(parts) == 1 else nd.add_n(*parts)
    return nd.sqrt(total)


def coefficient(max_norm: float, norm: float, eps: float = CLIP_EPS) -> float:
    """min(1, max_norm / (norm + eps)) for a norm read back to the host."""
    return min(1.0, max_norm / (norm + eps))
