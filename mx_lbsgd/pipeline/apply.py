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
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, cast

import mxnet as mx

from .. import _compat
from . import lr_gain as _lr_gain_mod
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
    #: the parameters' micro-batch counts (1-based), which place the warmup
    positions: List[int]
    wds: List[float]
    steps: List[int]
    rescale_grad: float



#: an index that names no parameter: MXNet's _get_lrs gives it no lr_mult
_NO_MULT = object()


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
    _step_trainer: Any
    window_position: int
    #: the lr of the last update for a parameter without an lr_mult (`last_lr`)
    _last_lr: Optional[float] = None

    def _apply_step(self, calls: List[Call], unscale: float) -> None:
        """Apply the calls of one step (all of them when clipping measures the norm here):
        accumulate each, then update those whose window closes, clipped by the global norm
        of their gradients on each device."""
        # norms measured for this step (by begin_step or the gate's check); a Trainer's
        # serve every call of its step
        norms, self._norms = self._norms, self._norms if self._trainer_norms else None
        ready = self._accumulate(calls, unscale)
        if not ready:
            return
        if self._clip is not None:
            norms = self._clipping_norms(ready, norms)
            if norms is None:
                return
        for r in ready:
            run_plan(r.plan, family=self._family, trust=self._trust, weight=r.weight,
                     grad=r.grad, lrs=self._learning_rates(r), wds=r.wds, steps=r.steps,
                     rescale_grad=r.rescale_grad, clip_gradient=self.clip_gradient,
                     scratch=self._scratch,
                     grad_norm=None if norms is None else norms[r.weight[0].context])

    def _accumulate(self, calls: List[Call], unscale: float) -> List[_Ready]:
        """Count and accumulate each call: those whose window closed, with the gain's norms
        read (before clipping, which then needs no read of its own)."""
        gain = self._lr_gain
        module = gain if self._step_trainer is None else None
        if module is not None and module.chooser is not None and self.window_position == 0:
            # Module or a bare Updater: the chosen length takes effect at a window boundary,
            # before the micro-batch is counted
            module.take_window(cast(Any, self))
        ready = [r for r in (self._prepare(*c, unscale=unscale) for c in calls)
                 if r is not None]
        if module is not None:
            self._module_step(module, calls, ready, unscale)
        if ready and gain is not None:
            gain.read_pending()
        return ready

    def _clipping_norms(self, ready: List[_Ready],
                        norms: Optional[StepNorms]) -> Optional[StepNorms]:
        """The step's clipping norms per device (measured here unless `begin_step` or the
        gate's check did); None when the step is skipped (not finite, no loss scaler)."""
        if norms is None:
            norms = cast('GlobalNormClip', self._clip).measure(
                [g for r in ready for g in r.grad], ready[0].rescale_grad)
        self._last_norms = norms
        if self.loss_scaler is None and not self._clip_safe(
                [r.plan for r in ready], [g for r in ready for g in r.grad], norms,
                [i for r in ready for i in r.index]):
            return None
        return norms

    def _prepare(self, index: List[Any], weight: List[mx.nd.NDArray],
                 grad: List[mx.nd.NDArray], state: List[Any],
                 unscale: float) -> Optional[_Ready]:
        """Count the micro-batch and accumulate it; on a window's last one, what to update
        with ``rescale_grad`` = the Trainer's rescale_grad x `unscale` (1 / loss scale): one
        micro-batch, or an accumulated window's mean (`InOptimizerWindow`; else None)."""
        _compat.count_on_device(self, weight[0].context)
        self._count_micro_batch(index)
        plan = self._plan(index, weight, grad, state)
        _, counts = _compat.update_counts(self)
        positions = [counts[i] - self.begin_num_update for i in index]
        rescale_grad = self.rescale_grad * unscale
        if self.batch_scale > 1 and self._step_window is None:
            window = self._accumulator.add(accs=plan.accs, grads=grad,
                                           positions=self._in_window(positions),
                                           rescale_grad=rescale_grad, sparse=plan.sparse,
                                           scratch=self._scratch, size=self.batch_scale)
            if window is None:
                return None
            grad, rescale_grad = window
        return _Ready(plan=plan, index=index, weight=weight, grad=grad, positions=positions,
                      wds=_compat.weight_decays(self, index), rescale_grad=rescale_grad,
                      steps=self._update_numbers(positions))

    def _update_numbers(self, positions: List[int]) -> List[int]:
        """The update number t of each parameter after its `positions` micro-batches."""
        return _per_position(positions, self._updates_of)

    def _learning_rates(self, r: _Ready) -> List[float]:
        """The learning rates of a call whose window closed: the schedule's (at the
        scale-invariant progress with ``lr_scaling``), times the warmup and the gain. The
        same for a parameter without an lr_mult is kept as ``last_lr``."""
        index, positions = list(r.index) + [_NO_MULT], list(r.positions) + [r.positions[0]]
        if self._lr_gain is None:
            lrs = self._warmup.scale_lrs(_compat.learning_rates(self, index), positions)
        else:
            gain = self._lr_gain.gain()       # estimated and accounted once per update
            lrs = _compat.learning_rates(self, index,
                                         schedule_step=self._lr_gain.piece.state.progress)
            lrs = self._warmup.scale_lrs(lrs, positions, target=gain)
        self._last_lr = lrs.pop()
        return lrs

    def _in_window(self, positions: List[int]) -> List[int]:
        """The accumulator's positions (1 .. window length) of micro-batch counts: with
        ``batch_scale='auto'`` counted from the window length's first window."""
        chosen = _lr_gain_mod.windows(self._lr_gain)
        if chosen is None:
            return positions
        return _per_position(positions, lambda k: chosen.position(k) or self.batch_scale)

    def _module_step(self, gain: LrGain, calls: List[Call], ready: List[_Ready],
                     unscale: float) -> None:
        """Module or a bare Updater (no Trainer says where an update begins; the gate held
        the micro-batch's calls together): the gain's norms on the first device."""
        device = calls[0][1][0].context if calls else None
        micro = [g for c in calls if c[1][0].context == device for g in c[2]]
        window = [g for r in ready if r.weight[0].context == device for g in r.grad] \
            if self.batch_scale > 1 else None
        # a dense window holds its mean as a Trainer's reduced gradient does (`InOptimizerWindow`)
        mean_unit = None if any(r.plan.sparse for r in ready) else unscale
        gain.module_step(cast(Any, self), micro, self.rescale_grad * unscale,
                         closes=bool(ready), window=window, window_unit=mean_unit)


def _per_position(positions: List[int], value: Callable[[int], int]) -> List[int]:
    """`value` of each micro-batch count, computed once when the counts are all equal (as
    they are but after a skipped window)."""
    if positions.count(positions[0]) == len(positions):
        return [value(positions[0])] * len(positions)
    return [value(k) for k in positions]
