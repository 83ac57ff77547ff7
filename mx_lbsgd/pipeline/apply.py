"""Applying a step: accumulate each call, measure the clipping norm, run the plans.

`StepApplier` is mixed into `PipelineOptimizer` (whose attributes it declares). A step's
calls come here together when the loss-scale gate held them (Module, a bare Updater, or a
window inside the optimizer with clipping), else one by one (a Trainer's step, whose norm
`begin_step` measured)::

    for each call: count the micro-batch; accumulate it (a window in the optimizer)
    calls whose window closed: norm per device (clipping), lr x gain (``lr_scaling``),
                               then `run_plan`
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import mxnet as mx

from .. import _compat
from .plan import Plan, run_plan

if TYPE_CHECKING:
    from ..families.base import KernelFamily
    from ..loss_scaling.scaler import DynamicLossScaler
    from .clip import GlobalNormClip, StepNorms
    from .lr_gain import LrGain
    from .trust_ratio import TrustRatio
    from .warmup import Warmup
    from .window import InOptimizerWindow

#: An Updater call: (indices, weights, gradients, states), lists of one length.
Call = Tuple[List[Any], List[mx.nd.NDArray], List[mx.nd.NDArray], List[Any]]


@dataclasses.dataclass(frozen=True)
class _Ready:
    """A call whose window closed: what `run_plan` updates it with."""

    plan: Plan
    index: List[Any]
    weight: List[mx.nd.NDArray]
    grad: List[mx.nd.NDArray]
    lrs: List[float]
    wds: List[float]
    steps: List[int]
    rescale_grad: float



class StepApplier:
    """See the module docstring; the attributes below are the shell's."""

    _family: KernelFamily
    _trust: Optional[TrustRatio]
    _warmup: Warmup
    _accumulator: InOptimizerWindow
    _clip: Optional[GlobalNormClip]
    _lr_gain: Optional[LrGain]
    _norms: Optional[StepNorms]
    _trainer_norms: bool
    _last_norms: Optional[StepNorms]
    _step_window: Optional[bool]
    _scratch: dict
    loss_scaler: Optional[DynamicLossScaler]
    batch_scale: int
    rescale_grad: float
    clip_gradient: Optional[float]
    begin_num_update: int
    _plan: Callable[..., Plan]
    _count_micro_batch: Callable[[Any], None]
    _updates_of: Callable[[int], int]
    _clip_safe: Callable[..., bool]

    def _apply_step(self, calls: List[Call], unscale: float) -> None:
        """Apply the calls of one step (all of them when clipping measures the norm here):
        accumulate each, then update those whose window closes, clipped by the global norm
        of their gradients on each device."""
        # norms measured for this step (by begin_step or the gate's check); a Trainer's
        # serve every call of its step
        norms, self._norms = self._norms, self._norms if self._trainer_norms else None
        ready = [r for r in (self._prepare(*c, unscale=unscale) for c in calls)
                 if r is not None]
        if not ready:
            return
        if self._clip is not None:
            if norms is None:
                norms = self._clip.measure([g for r in ready for g in r.grad],
                                           ready[0].rescale_grad)
            self._last_norms = norms
            if self.loss_scaler is None and not self._clip_safe(
                    [r.plan for r in ready], [g for r in ready for g in r.grad], norms,
                    [i for r in ready for i in r.index]):
                return
        for r in ready:
            run_plan(r.plan, family=self._family, trust=self._trust, weight=r.weight,
                     grad=r.grad, lrs=r.lrs, wds=r.wds, steps=r.steps,
                     rescale_grad=r.rescale_grad, clip_gradient=self.clip_gradient,
                     scratch=self._scratch,
                     grad_norm=None if norms is None else norms[r.weight[0].context])

    def _prepare(self, index: List[Any], weight: List[mx.nd.NDArray],
                 grad: List[mx.nd.NDArray], state: List[Any],
                 unscale: float) -> Optional[_Ready]:
        """Count the micro-batch and accumulate it; on a window's last one, what to update
        with ``rescale_grad`` = the Trainer's rescale_grad x `unscale` (1 / loss scale) for
        one micro-batch, 1 / batch_scale for an accumulated window (else None)."""
        self._count_micro_batch(index)
        plan = self._plan(index, weight, grad, state)
        _, counts = _compat.update_counts(self)
        positions = [counts[i] - self.begin_num_update for i in index]
        rescale_grad = self.rescale_grad * unscale
        if self.batch_scale > 1 and self._step_window is None:
            window = self._accumulator.add(accs=plan.accs, grads=grad, positions=positions,
                                           rescale_grad=rescale_grad, sparse=plan.sparse,
                                           scratch=self._scratch)
            if window is None:
                return None
            grad, rescale_grad = window
        if self._lr_gain is None:
            lrs = self._warmup.scale_lrs(_compat.learning_rates(self, index), positions)
        else:
            gain = self._lr_gain.gain()       # estimated and accounted once per update
            lrs = _compat.learning_rates(self, index,
                                         schedule_step=self._lr_gain.piece.state.progress)
            lrs = self._warmup.scale_lrs(lrs, positions, target=gain)
        return _Ready(plan=plan, index=index, weight=weight, grad=grad, lrs=lrs,
                      wds=_compat.weight_decays(self, index), rescale_grad=rescale_grad,
                      steps=[self._updates_of(k) for k in positions])   # update number t
