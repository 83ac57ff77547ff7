"""The optimizer's side of the step protocol with a gluon Trainer (`binding` drives it).

MXNet's Updater calls an optimizer per device and per dtype group, and nothing tells it
where a step starts. Under a Trainer, `binding` says so before the Updater runs
(`begin_step`, with every fresh gradient of the step, whether the Trainer closes an
accumulation window, and a device-side finite flag per micro-batch when asked); the
optimizer answers what the Trainer should do for it (`wants_*`, `accumulates_at_trainer`).
A `LossScaling` hook that skips a step accounts it here (`step_outside`).

Functions of the optimizer's values; the shell's methods of the same names delegate here.
`begin_step` returns the step as a frozen `Step`, which the shell keeps until the next one.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import mxnet as mx

from .. import _compat
from ..loss_scaling import gate as _scaling
from . import apply as _apply, clip as _clip_piece, lr_gain as _lr_gain, progress as _progress
from .plan import SliceNorms
from .step import Pieces, Step
from .step_info import StepInfo, TrainerSide

#: what a Trainer that the rescale_grad setter found is handed to: the Trainer layer
#: (`mx_lbsgd.gluon`, above the pipeline) registers its binder here
_TRAINER_BINDERS: List[Callable[[Any], Any]] = []


def register_trainer_binder(binder: Callable[[Any], Any]) -> None:
    """Call `binder(trainer)` whenever a gluon Trainer assigns an optimizer's
    rescale_grad (the start of ``Trainer.step``/``update``); idempotent binders only."""
    if binder not in _TRAINER_BINDERS:
        _TRAINER_BINDERS.append(binder)


def trainer_found(trainer: Any) -> None:
    """A Trainer steps this optimizer: hand it to the registered binders."""
    for binder in _TRAINER_BINDERS:
        binder(trainer)


def begin_step(opt: mx.optimizer.Optimizer, pieces: Pieces,
               gradients: Optional[Sequence[mx.nd.NDArray]],
               closes_window: Optional[bool], trainer: Any,
               local_flags: Optional[Dict[int, mx.nd.NDArray]],
               sum_sq: Optional[mx.nd.NDArray],
               slices: Optional[Dict[str, SliceNorms]] = None) -> Step:
    """A Trainer step starts: the `Step` it makes (the arguments are the shell's
    ``begin_step``'s, which says what they mean). With clipping, the norm is measured here
    when `gradients` are the ones the step applies."""
    clip = pieces.clip
    if pieces.trainer_feed is not None:
        pieces.trainer_feed.begin(trainer, opt.batch_scale, closes_window)
    applied = closes_window is True or closes_window is None and opt.batch_scale == 1
    trainer_norms = clip is not None and gradients is not None and applied
    norms = None
    if trainer_norms and gradients and clip is not None:
        scale = 1.0 if opt.loss_scaler is None else _apply.gradient_scale(opt)
        norms = (clip.measure(gradients, opt.rescale_grad / scale) if sum_sq is None
                 else clip.from_sum(sum_sq, opt.rescale_grad / scale))
    if opt.loss_scaler is not None or clip is not None:
        # a window in the optimizer: the gate holds the whole step for the norm
        pieces.gate.new_step(gradients if clip is None or applied else None)
    return Step(closes_window=closes_window,
                trainer=None if trainer is None else weakref.ref(trainer),
                local_flags=local_flags, trainer_norms=trainer_norms, sum_sq=sum_sq,
                norms=norms, slices=slices)


def step_outside(opt: mx.optimizer.Optimizer, pieces: Pieces, applied: bool) -> None:
    """A `LossScaling` hook decided a step of its own (see the shell's method)."""
    pieces.ledger.last_step_skipped = not applied
    if not applied:
        opt.num_update = pieces.ledger.skipped(opt.num_update, 1)


def wants_local_flags(opt: mx.optimizer.Optimizer, trainer: Any, window: bool) -> bool:
    """Whether the Trainer should keep a device-side finite flag of this worker's
    gradients before reducing them (see the shell's method)."""
    if opt.loss_scaler is None or not opt.loss_scaler.enabled:
        return False
    return window or (opt.check_local_overflow
                      and _compat.trainer_worker_count(trainer, 2) > 1)


def refuse_updates_on_kvstore(owner: str, pieces: Pieces, loss_scaler: Any) -> None:
    """Refuse what a kvstore that updates the weights cannot do, naming `owner`."""
    if pieces.lr_gain is not None:
        _lr_gain.refuse_kvstore_updates(owner, pieces.lr_gain.piece.rule,
                                        pieces.lr_gain.chooser is not None)
    if loss_scaler is not None:
        _scaling.refuse_kvstore_updates(owner)
    if pieces.clip is not None:
        _clip_piece.refuse_kvstore_updates(owner)


def step_info(opt: mx.optimizer.Optimizer, side: TrainerSide) -> StepInfo:
    """The `StepInfo` of a micro-batch of `side`'s Trainer, now.

    This worker's batch is the step's batch argument, read the way the docs' recipe for
    each engine passes it:

    - one device, several devices (``local``/``device`` kvstore), Horovod: the step's
      batch is this worker's (``trainer.step(batch_per_worker)``);
    - ``dist_*`` kvstores: the step's batch is the job's
      (``trainer.step(batch_per_worker * kv.num_workers)``, as Module's
      ``rescale_grad`` is: the servers sum, so only then does the update apply the
      mean gradient), and this worker's share is that over ``num_workers``.

    The step's batch: Trainer.step(batch_size) sets rescale_grad to scale / batch_size
    (Horovod's trainer folds its mean over workers into that scale: the quotient is
    still the argument). Under a `LossScaling` hook, whose Trainer.update sets
    rescale_grad only after the reduction (with 1/scale folded in): the batch of the
    hook's last step (NaN before its first, and the update is left out of the
    estimates). The loss scale is the hook's (1 when inactive), else the optimizer's
    scaler's."""
    return StepInfo(batch_scale=opt.batch_scale, rescale_grad=opt.rescale_grad,
                    loss_scale=functools.partial(_loss_scale, opt, side.hook),
                    worker_batch=functools.partial(_worker_batch, opt, side),
                    windows_at_reduction=side.windows_at_reduction,
                    window_position=lambda: opt.window_position,
                    micro_batches=functools.partial(_progress.micro_batches, opt))


def _worker_batch(opt: mx.optimizer.Optimizer, side: TrainerSide) -> float:
    """This worker's examples per step (`step_info`), now."""
    trainer = side.trainer
    if side.hook is not None:
        step_batch = float(side.hook.batch_size or math.nan)
    else:
        step_batch = _compat.trainer_scale(trainer) / opt.rescale_grad
    kind = _compat.trainer_kvstore_type(trainer)
    if kind and kind.startswith('dist'):
        return step_batch / _compat.trainer_worker_count(trainer, default=math.nan)
    return step_batch


def _loss_scale(opt: mx.optimizer.Optimizer, hook: Any) -> float:
    """The scale the observed gradients carry now: the hook's (1 when it is inactive), else
    the optimizer's loss scaler's."""
    if hook is not None:
        return float(hook.scale)
    scaler = getattr(opt, 'loss_scaler', None)
    return 1.0 if scaler is None else float(scaler.scale)
