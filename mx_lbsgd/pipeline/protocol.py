"""The optimizer's side of the step protocol with a gluon Trainer (`binding` drives it).

MXNet's Updater calls an optimizer per device and per dtype group, and nothing tells it
where a step starts. Under a Trainer, `binding` says so before the Updater runs
(`begin_step`, with every fresh gradient of the step, whether the Trainer closes an
accumulation window, and a device-side finite flag per micro-batch when asked); the
optimizer answers what the Trainer should do for it (`wants_*`, `accumulates_at_trainer`).
A `LossScaling` hook that skips a step accounts it here (`step_outside`).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, cast

import mxnet as mx

from .. import _compat
from ..loss_scaling import gate as _scaling
from . import binding as _binding, clip as _clip_piece, lr_gain as _lr_gain

if TYPE_CHECKING:
    from ..loss_scaling.scaler import DynamicLossScaler
    from .clip import GlobalNormClip, StepNorms
    from .lr_gain import LrGain
    from .progress import SkipLedger


class StepProtocol:
    """Mixed into `PipelineOptimizer`: ``_ledger``, ``_gate``, ``loss_scaler`` and
    ``batch_scale`` are the shell's."""

    _ledger: SkipLedger
    _gate: _scaling.StepGate[Any]
    loss_scaler: Optional[DynamicLossScaler]
    batch_scale: int
    check_local_overflow: bool
    num_update: int
    _rescale_grad: float
    _clip: Optional[GlobalNormClip]
    _lr_gain: Optional[LrGain]
    _norms: Optional[StepNorms]
    _trainer_norms: bool
    _step_sum_sq: Optional[mx.nd.NDArray]
    _gradient_scale: Callable[[], float]

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped (an overflow with loss scaling)."""
        return self._ledger.last_step_skipped

    @property
    def rescale_grad(self) -> float:
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value: float) -> None:
        self._rescale_grad = value
        # gluon.Trainer.step/update set rescale_grad before they reduce or update: the one
        # moment MXNet gives an optimizer to learn its Trainer. Binding is idempotent.
        trainer = _compat.trainer_assigning_rescale_grad(self)
        if trainer is not None:
            _binding.bind(trainer)

    def begin_step(self, gradients: Optional[Sequence[mx.nd.NDArray]],
                   closes_window: Optional[bool] = None, trainer: Any = None,
                   local_flags: Optional[Dict[int, mx.nd.NDArray]] = None,
                   sum_sq: Optional[mx.nd.NDArray] = None) -> None:
        """A Trainer step starts. `gradients`: every fresh gradient of the step, on every
        device (the loss-scale gate decides over them at once), or None when this optimizer
        does not want them (`wants_step_gradients`). `closes_window`: None when this
        optimizer accumulates itself; False when the Trainer summed this micro-batch
        locally (count it, apply nothing); True when the Trainer reduced the window's
        mean (apply it as one step). `trainer`: whose rank a report names. `local_flags`:
        {micro-batch (0: the step): device-side finite flag taken before the reduction}.

        With clipping, the norm is measured here when `gradients` are the ones the step
        applies (reduced, and the window's mean when the Trainer closes a window); with a
        window inside the optimizer the gate holds the step's calls and it is measured
        over the accumulators. `sum_sq`: the sum of squares of every rank's reduced
        gradients (`mx_lbsgd.ShardedTrainer`, whose `gradients` are this rank's shard):
        then the finite check and the clipping norm use it."""
        self._step_window = closes_window
        self._step_trainer = None if trainer is None else weakref.ref(trainer)
        if self._lr_gain is not None:
            self._lr_gain.begin(trainer, cast(Any, self), closes_window)
        self._local_flags = local_flags
        applied = closes_window is True or closes_window is None and self.batch_scale == 1
        self._trainer_norms = self._clip is not None and gradients is not None and applied
        self._norms = None
        self._step_sum_sq = sum_sq
        if self._trainer_norms and gradients:
            scale = 1.0 if self.loss_scaler is None else self._gradient_scale()
            clip = cast('GlobalNormClip', self._clip)       # set: _trainer_norms
            self._norms = (clip.measure(gradients, self.rescale_grad / scale) if sum_sq is None
                           else clip.from_sum(sum_sq, self.rescale_grad / scale))
        if self.loss_scaler is not None or self._clip is not None:
            # a window in the optimizer: the gate holds the whole step for the norm
            self._gate.new_step(gradients if self._clip is None or applied else None)

    def begin_micro_batch(self, trainer: Any) -> None:
        """A Trainer step begins, before its reduction reads the window (a window length
        chosen by ``batch_scale='auto'`` takes effect at a window boundary)."""
        if self._lr_gain is not None:
            self._lr_gain.window_begins(trainer, cast(Any, self))

    def observe_micro_batch(self, trainer: Any, window_at_trainer: bool) -> None:
        """A micro-batch's gradients, before the Trainer reduces (or sums) them."""
        if self._lr_gain is not None:
            self._lr_gain.micro_batch(trainer, cast(Any, self), window_at_trainer)

    def observe_reduction(self, trainer: Any, closes_window: bool) -> None:
        """The Trainer reduced the gradients (`closes_window`: a window's mean)."""
        if self._lr_gain is not None:
            self._lr_gain.reduced(trainer, cast(Any, self), closes_window)

    def step_outside(self, applied: bool) -> None:
        """A `LossScaling` hook decided a step of its own (this optimizer has no
        loss_scaler): a skipped step never reaches the optimizer, so it is accounted here as
        the optimizer's own gate accounts one of its micro-batches (``last_step_skipped``;
        with ``count_skipped_steps`` it advances ``num_update``, so an ``lr_scheduler``)."""
        self._ledger.last_step_skipped = not applied
        if not applied:
            self.num_update = self._ledger.skipped(self.num_update, 1)

    def wants_local_flags(self, trainer: Any, window: bool) -> bool:
        """Whether the Trainer should keep a device-side finite flag of this worker's
        gradients before reducing them: per micro-batch of a window at the Trainer (to name
        the micro-batch), per step with ``check_local_overflow`` on a distributed job."""
        if self.loss_scaler is None or not self.loss_scaler.enabled:
            return False
        return window or (self.check_local_overflow
                          and _compat.trainer_worker_count(trainer, 2) > 1)

    def wants_step_gradients(self) -> bool:
        """Whether `begin_step` needs the step's gradients (listing them costs a pass)."""
        return self.loss_scaler is not None or self._clip is not None

    def accumulates_at_trainer(self) -> bool:
        """Whether a Trainer should keep this optimizer's window at its reduction."""
        return self.batch_scale > 1

    def refuse_updates_on_kvstore(self) -> None:
        if self._lr_gain is not None:
            _lr_gain.refuse_kvstore_updates(type(self).__name__, self._lr_gain.piece.rule,
                                            self._lr_gain.chooser is not None)
        if self.loss_scaler is not None:
            _scaling.refuse_kvstore_updates(type(self).__name__)
        if self._clip is not None:
            _clip_piece.refuse_kvstore_updates(type(self).__name__)
