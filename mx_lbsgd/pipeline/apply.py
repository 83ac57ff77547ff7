"""Running an Updater call: the gate, accumulation, the clipping norm and the plans.

Functions of (the optimizer's MXNet counters, its `Pieces`, the `Step` under way, the
calls), shaped like `plan.run_plan`. The shell's ``update_multi_precision`` is `update`::

    update(call):      a micro-batch a Trainer only summed: count it, apply nothing
                       no loss scaler, nothing to hold: apply_step([call])
                       else the gate holds the step's calls: gated_update
    gated_update:      the gate decides the step (finite_check: one host read), reports a
                       skipped one, rewinds its window, then apply_step(the step's calls)
    apply_step(calls): for each call: count the micro-batch; accumulate it (a window in
                       the optimizer); calls whose window closed: norm per device
                       (clipping), lr x gain (``lr_scaling``), then `run_plan`

`opt` is the MXNet optimizer: its counters (``_index_update_count``, ``num_update``),
per-parameter multipliers and hyperparameters, read through `mx_lbsgd._compat`, and the
preset's kernel pieces (``_family``, ``_warmup``, ``_trust``). What a step changes goes
back as values: `apply_step` returns the step with its norms consumed; `Reports` keeps
``last_lr`` and the norms.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, cast

import mxnet as mx

from .. import _compat, _kernels
from ..loss_scaling import gate as _scaling, graph as _graph_scale, overflow
from ..loss_scaling.scaler import DynamicLossScaler
from . import lr_gain as _lr_gain, progress as _progress
from .clip import GlobalNormClip, StepNorms
from .gain_feeds import ModuleFeed
from .lr_gain import LrGain
from .plan import Plan, run_plan
from .step import Pieces, Step

#: An Updater call: (indices, weights, gradients, states), lists of one length.
Call = Tuple[List[Any], List[mx.nd.NDArray], List[mx.nd.NDArray], List[Any]]

#: the gate's scaler when there is no loss scaler: it never checks, never skips
_HOLD_ONLY = DynamicLossScaler(enabled=False)

#: an index that names no parameter: MXNet's _get_lrs gives it no lr_mult
_NO_MULT = object()


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


# -- the Updater's call ---------------------------------------------------------------------
def update(opt: mx.optimizer.Optimizer, pieces: Pieces, call: Call) -> None:
    """``update_multi_precision`` of the shell, on a call already validated."""
    step: Step = opt._this_step
    index = call[0]
    if step.closes_window is False:
        count_micro_batch(opt, pieces, index)   # summed at the Trainer; nothing to apply yet
        pieces.ledger.last_step_skipped = False
        return
    held = _held_by_gate(opt, pieces.lr_gain, at_trainer=step.trainer is not None)
    if opt.loss_scaler is None and not held and (pieces.clip is None or step.trainer_norms):
        opt._this_step = apply_step(opt, pieces, step, [call], unscale=1.0)
        return
    if isinstance(index[0], str):     # Module's kvstore updater passes parameter names
        opt.refuse_updates_on_kvstore()
    # without a loss scaler: the gate only holds the step's calls, so that clipping
    # measures the norm over all of them (a disabled scaler never skips)
    gated_update(opt, pieces, call, opt.loss_scaler or _HOLD_ONLY)


def gated_update(opt: mx.optimizer.Optimizer, pieces: Pieces, call: Call,
                 scaler: DynamicLossScaler) -> None:
    """Run a call through the loss-scale gate: the step's calls run when it is decided,
    applied or skipped as a whole."""
    index, weight, grad, _ = call
    gate = pieces.gate
    runs = gate.submit([(w.context, i) for i, w in zip(index, weight)], grad, call, scaler,
                       1.0 if opt.loss_scaler is None else gradient_scale(opt))
    window = opt.batch_scale if opt._this_step.closes_window else 1
    decision = gate.take_decision()
    if decision is not None:
        report(opt, pieces, *decision)
    for held, apply_ in runs:
        pieces.ledger.last_step_skipped = not apply_
        if not apply_ and window > 1:
            _compat.count_on_device(opt, held[1][0].context)
            _progress.rewind(opt, held[0], window - 1)
    opt._this_step = apply_step(opt, pieces, opt._this_step,
                                [held for held, apply_ in runs if apply_],
                                unscale=_scaling.unscale_factor(gate.loss_scale))
    if runs and gate.take_skip():
        opt.num_update = pieces.ledger.skipped(
            opt.num_update, 1 if opt.counts_applied_updates else window)
    if opt.loss_scaler is not None:
        _graph_scale.serve(opt.scale_key, opt.loss_scaler)


def finite_check(opt: mx.optimizer.Optimizer, pieces: Pieces,
                 grads: Sequence[mx.nd.NDArray], fused: Optional[bool]) -> bool:
    """The gate's finite check. With clipping, when the gradients checked are the ones
    applied, the norm's sum-of-squares pass is the check (one pass, one host read)."""
    step: Step = opt._this_step
    gain, clip = pieces.lr_gain, pieces.clip
    if step.sum_sq is not None:        # a sharded Trainer's, over every rank
        opt._reports.last_norms = step.norms or opt._reports.last_norms
        return _lr_gain.value_is_finite(gain, step.sum_sq)
    # (an lr_scaling='adascale' update's norms come along in the same read)
    factor = opt.rescale_grad / pieces.gate.loss_scale
    _module_check(opt, pieces, grads, factor, at_trainer=step.trainer is not None)
    if clip is None or not (opt.batch_scale == 1 or step.closes_window):
        return _lr_gain.all_finite(gain, grads, fused)
    if not step.trainer_norms or step.norms is None:
        step = opt._this_step = dataclasses.replace(step, norms=clip.measure(grads, factor))
    opt._reports.last_norms = step.norms
    return _lr_gain.norms_finite(gain, cast(StepNorms, step.norms))


def report(opt: mx.optimizer.Optimizer, pieces: Pieces, skipped: bool,
           grads: Sequence[mx.nd.NDArray], calls: List[Call]) -> None:
    """Keep the overflow report of a decided step (None for a finite one). Runs before
    the skipped window's counts are rewound, so the window position is this step's."""
    if not skipped:
        pieces.overflow.finite()
        return
    step: Step = opt._this_step
    pieces.overflow.report_skip(
        scaler=opt.loss_scaler, scale=pieces.gate.loss_scale,
        named_grads=overflow.name_gradients(grads, calls, opt._param_name, opt.param_dict),
        optimizer=opt, trainer=step.trainer_object(), fallback_worker=opt._module_worker,
        at_trainer=bool(step.closes_window) and opt.batch_scale > 1,
        local_flags=step.local_flags)


def gradient_scale(opt: mx.optimizer.Optimizer) -> float:
    """The loss scale this step's gradients carry: Gluon scales the loss by the
    optimizer's scaler; a Module graph by the scaler its scale_gradient op was served
    when backward ran (another optimizer's, right after Module.load_optimizer_states).
    (Only with a loss_scaler.)"""
    return _graph_scale.gradient_scale(cast(DynamicLossScaler, opt.loss_scaler),
                                       opt.scale_key, gluon=bool(opt.param_dict))


# -- applying a step ------------------------------------------------------------------------
def apply_step(opt: mx.optimizer.Optimizer, pieces: Pieces, step: Step, calls: List[Call],
               unscale: float) -> Step:
    """Apply the calls of one step (all of them when clipping measures the norm here):
    accumulate each, then update those whose window closes, clipped by the global norm
    of their gradients on each device. Returns `step` as it stands after: norms that the
    Trainer measured serve every call of its step, others are used once."""
    norms = step.norms
    if not step.trainer_norms and norms is not None:
        step = dataclasses.replace(step, norms=None)
    ready = _accumulate(opt, pieces, step, calls, unscale)
    if not ready:
        return step
    if pieces.clip is not None:
        norms = _clipping_norms(opt, pieces, ready, norms)
        if norms is None:
            return step
    for r in ready:
        run_plan(r.plan, family=opt._family, trust=opt._trust, weight=r.weight,
                 grad=r.grad, lrs=_learning_rates(opt, pieces.lr_gain, r), wds=r.wds,
                 steps=r.steps, rescale_grad=r.rescale_grad,
                 clip_gradient=opt.clip_gradient, scratch=pieces.scratch,
                 grad_norm=None if norms is None else norms[r.weight[0].context],
                 index=r.index, slices=step.slices_of(r.weight[0].dtype))
    return step


def _accumulate(opt: mx.optimizer.Optimizer, pieces: Pieces, step: Step,
                calls: List[Call], unscale: float) -> List[_Ready]:
    """Count and accumulate each call: those whose window closed, with the gain's norms
    read (before clipping, which then needs no read of its own)."""
    gain = pieces.lr_gain
    module = gain if step.trainer is None else None
    if module is not None and module.chooser is not None and opt.window_position == 0:
        # Module or a bare Updater: the chosen length takes effect at a window boundary,
        # before the micro-batch is counted
        module.take_window(functools.partial(_progress.micro_batches, opt))
    ready = [r for r in (_prepare(opt, pieces, step, c, unscale) for c in calls)
             if r is not None]
    if module is not None:
        _module_step(opt, cast(ModuleFeed, pieces.module_feed), calls, ready, unscale)
    if ready and gain is not None:
        gain.read_pending()
    return ready


def _clipping_norms(opt: mx.optimizer.Optimizer, pieces: Pieces, ready: List[_Ready],
                    norms: Optional[StepNorms]) -> Optional[StepNorms]:
    """The step's clipping norms per device (measured here unless `begin_step` or the
    gate's check did); None when the step is skipped (not finite, no loss scaler)."""
    if norms is None:
        norms = cast(GlobalNormClip, pieces.clip).measure(
            [g for r in ready for g in r.grad], ready[0].rescale_grad)
    opt._reports.last_norms = norms
    if opt.loss_scaler is None and not _clip_safe(
            opt, pieces, [r.plan for r in ready], [g for r in ready for g in r.grad], norms,
            [i for r in ready for i in r.index]):
        return None
    return norms


def _clip_safe(opt: mx.optimizer.Optimizer, pieces: Pieces, plans: Sequence[Plan],
               grads: List[mx.nd.NDArray], norms: StepNorms, index: Sequence[Any]) -> bool:
    """Without a loss scaler: whether the step may run. The compiled kernels skip a
    non-finite norm on the device (no host read); MXNet's operators cannot, so for
    them the norm is read once and a non-finite step is skipped, with a warning that
    names the first non-finite gradient."""
    # an lr_scaling='adascale' step has read its reduced gradient's norm already
    known = None if pieces.lr_gain is None else pieces.lr_gain.known_finite()
    # (with slices every rank reads the one global norm, and all skip or all run: a rank
    # that ran while another skipped would wait for the other's norms' collective)
    if all(p.skips_on_device for p in plans) and opt._this_step.slices is None or known or \
            (known is None and GlobalNormClip.all_finite(norms)):
        return True
    first = next((i for i, g in zip(index, grads)
                  if not _kernels.finite_flag([g], None).asscalar()), None)
    warnings.warn('%s: the gradient norm is not finite (first non-finite gradient: %r); '
                  'the update was skipped, weights and states untouched. Use a '
                  'loss_scaler to back off and count such steps'
                  % (type(opt).__name__, opt._param_name(first) if first is not None
                     else None), RuntimeWarning)
    pieces.ledger.last_step_skipped = True
    return False


def _prepare(opt: mx.optimizer.Optimizer, pieces: Pieces, step: Step, call: Call,
             unscale: float) -> Optional[_Ready]:
    """Count the micro-batch and accumulate it; on a window's last one, what to update
    with ``rescale_grad`` = the Trainer's rescale_grad x `unscale` (1 / loss scale): one
    micro-batch, or an accumulated window's mean (`InOptimizerWindow`; else None)."""
    index, weight, grad, state = call
    _compat.count_on_device(opt, weight[0].context)
    count_micro_batch(opt, pieces, index)
    plan = opt._plan(index, weight, grad, state)
    _, counts = _compat.update_counts(opt)
    positions = [counts[i] - opt.begin_num_update for i in index]
    rescale_grad = opt.rescale_grad * unscale
    if opt.batch_scale > 1 and step.closes_window is None:
        window = pieces.accumulator.add(
            accs=plan.accs, grads=grad, positions=_in_window(opt, pieces.lr_gain, positions),
            rescale_grad=rescale_grad, sparse=plan.sparse, scratch=pieces.scratch,
            size=opt.batch_scale)
        if window is None:
            return None
        grad, rescale_grad = window
    return _Ready(plan=plan, index=index, weight=weight, grad=grad, positions=positions,
                  wds=_compat.weight_decays(opt, index), rescale_grad=rescale_grad,
                  steps=_per_position(positions, lambda k: updates_of(
                      pieces.lr_gain, opt.batch_scale, k)))


def _learning_rates(opt: mx.optimizer.Optimizer, gain: Optional[LrGain],
                    r: _Ready) -> List[float]:
    """The learning rates of a call whose window closed: the schedule's (at the
    scale-invariant progress with ``lr_scaling``), times the warmup and the gain. The
    same for a parameter without an lr_mult is kept as ``last_lr``."""
    index, positions = list(r.index) + [_NO_MULT], list(r.positions) + [r.positions[0]]
    # the gain first: estimated and accounted once per update, it moves the progress that
    # the scheduler sees with lr_scaling
    target = None if gain is None else gain.gain()
    lrs = _compat.learning_rates(opt, index, scheduled_lr(opt, gain))
    lrs = opt._warmup.scale_lrs(lrs, positions, target=target)
    opt._reports.last_lr = lrs.pop()
    return lrs


def scheduled_lr(opt: mx.optimizer.Optimizer, gain: Optional[LrGain]) -> float:
    """The rate before per-parameter multipliers, warmup and gain: ``lr``, or the lr
    scheduler's at ``num_update`` (with ``lr_scaling``: at the scale-invariant progress)."""
    scheduler = opt.lr_scheduler
    if scheduler is None:
        return opt.lr
    if gain is None:
        return scheduler(opt.num_update)
    return scheduler(gain.piece.state.progress)


def _in_window(opt: mx.optimizer.Optimizer, gain: Optional[LrGain],
               positions: List[int]) -> List[int]:
    """The accumulator's positions (1 .. window length) of micro-batch counts: with
    ``batch_scale='auto'`` counted from the window length's first window."""
    chosen = _lr_gain.windows(gain)
    if chosen is None:
        return positions
    return _per_position(positions, lambda k: chosen.position(k) or opt.batch_scale)


def _module_step(opt: mx.optimizer.Optimizer, feed: ModuleFeed, calls: List[Call],
                 ready: List[_Ready], unscale: float) -> None:
    """Module or a bare Updater (no Trainer says where an update begins; the gate held
    the micro-batch's calls together): the gain's norms on the first device."""
    device = calls[0][1][0].context if calls else None
    micro = [g for c in calls if c[1][0].context == device for g in c[2]]
    window = [g for r in ready if r.weight[0].context == device for g in r.grad] \
        if opt.batch_scale > 1 else None
    # a dense window holds its mean as a Trainer's reduced gradient does (`InOptimizerWindow`)
    mean_unit = None if any(r.plan.sparse for r in ready) else unscale
    feed.step(opt.batch_scale, opt.rescale_grad, micro, opt.rescale_grad * unscale,
              closes=bool(ready), window=window, window_unit=mean_unit)


def _held_by_gate(opt: mx.optimizer.Optimizer, gain: Optional[LrGain],
                  at_trainer: bool) -> bool:
    """Whether the gain of `opt`'s update needs the step gate to hold a micro-batch's calls
    together (Module or a bare Updater, not `at_trainer`: no Trainer says where an update
    begins); refuses 'auto' there on several workers."""
    if gain is None or at_trainer:
        return False
    if gain.chooser is not None:
        _refuse_auto_on_workers(opt._module_worker)
    return True


def _refuse_auto_on_workers(module_worker: Optional[Tuple[int, int]]) -> None:
    """``batch_scale='auto'`` under Module or a bare Updater chooses from this process's
    clock alone: refused (before anything changes) where several workers reduce."""
    workers = module_worker or _compat.horovod_worker()
    if workers is not None and workers[1] > 1:
        raise ValueError(
            "batch_scale='auto' under Module (or a bare Updater) on %d workers: each worker "
            'would time its own windows and choose its own lengths, and the reductions '
            'would no longer match. Use a gluon Trainer (gluon.Trainer with a dist kvstore, '
            "Horovod's DistributedTrainer or mx_lbsgd.ShardedTrainer), whose window times "
            'are reduced with the norms, or a fixed batch_scale' % workers[1])


def _module_check(opt: mx.optimizer.Optimizer, pieces: Pieces,
                  grads: Sequence[mx.nd.NDArray], factor: float, at_trainer: bool) -> None:
    """The gate's finite check of a Module's micro-batch (`grads`: the step's, on every
    device; `factor`: rescale_grad / loss scale): at a window boundary a chosen length
    takes effect first ('auto'), and at S = 1 the difference estimator's norms are taken,
    so that the check's one read brings them (`ModuleFeed.step`)."""
    gain, feed = pieces.lr_gain, pieces.module_feed
    if gain is None or feed is None or at_trainer:
        return
    if gain.chooser is not None and opt.window_position == 0:
        gain.take_window(functools.partial(_progress.micro_batches, opt))
    if opt.batch_scale == 1:
        first = [g for g in grads if g.context == grads[0].context]
        feed.step(opt.batch_scale, opt.rescale_grad, first, factor, closes=True,
                  window=None, early=True)


# -- counting ---------------------------------------------------------------------------------
def count_micro_batch(opt: mx.optimizer.Optimizer, pieces: Pieces, index: Any) -> None:
    """MXNet's count of the parameters `index`, then ``num_update`` from it."""
    _compat.count_update(opt, index)
    opt.num_update = _progress.num_update_after_count(
        opt, pieces.ledger, index, lambda k: updates_of(pieces.lr_gain, opt.batch_scale, k),
        opt.counts_applied_updates)


def updates_of(gain: Optional[LrGain], batch_scale: int, micro_batches: int) -> int:
    """Applied updates once `micro_batches` micro-batches were counted."""
    chosen = _lr_gain.windows(gain)
    if chosen is not None:
        return chosen.update_of(micro_batches)
    return micro_batches // batch_scale


def _per_position(positions: List[int], value: Callable[[int], int]) -> List[int]:
    """`value` of each micro-batch count, computed once when the counts are all equal (as
    they are but after a skipped window)."""
    if positions.count(positions[0]) == len(positions):
        return [value(positions[0])] * len(positions)
    return [value(k) for k in positions]
