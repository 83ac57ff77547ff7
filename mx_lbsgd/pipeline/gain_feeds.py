"""The two ways an update's norms reach the gain estimator (`lr_gain.LrGain`), each a small
adapter over it:

- `TrainerFeed`: a gluon Trainer's step protocol (`gluon.binding` -> the shell -> here).
  Each micro-batch its local norms before the reduction; the reduced gradient's after it;
  at ``begin_step`` the update starts at S = batch_scale x workers.
- `ModuleFeed`: Module or a bare Updater, where no Trainer says where an update begins:
  the step gate holds each micro-batch's calls together and the shell hands over the
  gradients the Updater passes (already reduced): each micro-batch's, and at the window's
  end the accumulated window's (at S = 1, the difference estimator's).

Both hand the estimator the same thing: an update's scale, its norms (a
`noise_probe.Observation`) and its window length (`LrGain.start_update`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Set, cast

import mxnet as mx

from .. import _compat
from . import noise_probe as _probe
from .lr_gain import LrGain
from .step_info import StepInfo


class TrainerFeed:
    """A gluon Trainer's micro-batches and updates, into `gain`."""

    def __init__(self, gain: LrGain) -> None:
        self.gain = gain
        # the norms of the last reduction, until the update it closes begins
        self._observation: Optional[_probe.Observation] = None

    def window_begins(self, info: StepInfo) -> Optional[int]:
        """A micro-batch begins, before anything reads the window: at a window boundary the
        chosen length, which takes effect (None: the length stays). 'auto' is refused here,
        before anything changes, where the window cannot be at the Trainer's reduction."""
        if self.gain.chooser is None:
            return None
        if not info.windows_at_reduction:
            raise ValueError(
                "batch_scale='auto' needs the accumulation window at the Trainer's "
                'reduction, where windows of any length are summed and measured; this '
                'Trainer reduces every micro-batch (row_sparse gradients, or a LossScaling '
                "hook: give the optimizer its own loss_scaler). Use a fixed batch_scale, or "
                'dense gradients')
        return self.gain.take_window(info.micro_batches)

    def micro_batch(self, trainer: mx.gluon.Trainer, info: StepInfo,
                    window_at_trainer: bool) -> None:
        """A micro-batch's local gradients, before the reduction."""
        if not self.gain.measures:
            return
        probe = self.gain.probe
        devices = probe.devices if probe is not None else \
            len(_compat.trainer_params(trainer)[0].list_ctx())
        self.gain.probe_of(devices).before_reduction(trainer, info, window_at_trainer)

    def reduced(self, trainer: mx.gluon.Trainer, info: StepInfo,
                closes_window: bool) -> None:
        """The reduced gradients (`closes_window`: a window's mean)."""
        probe = self.gain.probe
        if probe is None:
            return
        extra = self.gain.unsent_seconds()
        self._observation = probe.after_reduction(trainer, info, closes_window,
                                                  across_workers=True, extra=extra)

    def begin(self, trainer: mx.gluon.Trainer, batch_scale: int,
              closes_window: Optional[bool]) -> None:
        """A Trainer step begins, with a window of `batch_scale`; `closes_window` as
        `begin_step`'s (False: a micro-batch that only accumulates)."""
        if closes_window is False:
            return
        if self.gain.piece.measures and closes_window is None and batch_scale > 1:
            raise ValueError(
                "lr_scaling='adascale' with batch_scale=%d needs the accumulation window at "
                "the Trainer's reduction, where the window's gradient is measured; this "
                'Trainer accumulates inside the optimizer (row_sparse gradients, or '
                "GradientNoiseScale/LossScaling set up without a window). Use lr_scaling="
                "'linear' or 'sqrt', or dense gradients" % batch_scale)
        seen, self._observation = self._observation, None
        workers = _compat.trainer_worker_count(trainer, default=1)
        self.gain.start_update(float(batch_scale * workers), seen, batch_scale)


@dataclasses.dataclass
class _MeasuredDevice:
    """The device whose micro-batches a Module's estimates take: the first one seen, until
    another device delivers twice while it does not (the optimizer moved on to a Module
    bound elsewhere, whose first device it then is)."""

    device: Optional[mx.Context] = None
    elsewhere: Set[mx.Context] = dataclasses.field(default_factory=set)

    def measures(self, device: mx.Context, early: bool) -> bool:
        """Whether a micro-batch on `device` is measured; an `early` call and the step's
        own call that follows it deliver once."""
        if self.device is None or device in self.elsewhere:
            self.device = device
        if device == self.device:
            self.elsewhere.clear()
            return True
        if not early:
            self.elsewhere.add(device)
        return False


class ModuleFeed:
    """The micro-batches of a Module or a bare Updater, into `gain`."""

    def __init__(self, gain: LrGain) -> None:
        self.gain = gain
        self._early = False
        self._device = _MeasuredDevice()

    def step(self, batch_scale: int, rescale_grad: float, micro: Sequence[mx.nd.NDArray],
             factor: float, closes: bool, window: Optional[Sequence[mx.nd.NDArray]],
             early: bool = False, window_unit: Optional[float] = None) -> None:
        """One micro-batch, whose calls the step gate held together: `micro` its gradients
        on one device (the Updater's are reduced over the devices and workers already),
        times `factor` mean per-example gradients of the Module's batch b = 1 /
        rescale_grad (the base batch: S = batch_scale); `window` the accumulated gradients
        when it `closes` a window of more than one (their mean per example: times 1 /
        batch_scale; with `window_unit` the window's mean in the units of a Trainer's
        reduced gradient, times `window_unit` / b). At S = 1, the difference estimator.
        With a loss scaler at S = 1 the gate's finite check calls this `early`, before its
        flag read, which then brings the norms; the step's own call is then a no-op."""
        if micro and not self._device.measures(micro[0].context, early):
            return          # another device's copy (the first step decides device by device)
        if self._early:             # taken early: the step's own call
            self._early = early
            return
        if not micro:               # a skipped step
            return
        self._early = early
        seen = self._observation(batch_scale, 1.0 / rescale_grad, micro, factor, closes,
                                 window, window_unit) if self.gain.measures else None
        if closes:
            self.gain.start_update(float(batch_scale), seen, batch_scale)

    def _observation(self, batch_scale: int, batch: float, micro: Sequence[mx.nd.NDArray],
                     factor: float, closes: bool, window: Optional[Sequence[mx.nd.NDArray]],
                     window_unit: Optional[float] = None) -> Optional[_probe.Observation]:
        probe = self.gain.probe_of(1)
        dense = all(g.stype == 'default' for g in micro)
        if window is None and closes:        # a window of one: one gradient per update
            previous = cast(_probe.PreviousGradient, probe.previous)
            pair = previous.pair(micro, factor) if dense else None
            extra = self.gain.unsent_seconds()
            if pair is None:
                return _probe.Observation(small=[], big=(_probe.sum_squares(micro),
                                                         factor * batch), batch=batch,
                                          devices=1, workers=1, window=1, extra=extra)
            return _probe.Observation(small=pair[0], big=pair[1], batch=batch, devices=1,
                                      workers=1, window=1, extra=extra, difference=True)
        cast(_probe.PreviousGradient, probe.previous).forget()
        probe.small.append((_probe.sum_squares(micro), factor * factor))
        if not closes or window is None:
            return None
        unit = batch / batch_scale if window_unit is None else window_unit
        seen = _probe.Observation(small=probe.small, big=(_probe.sum_squares(window), unit),
                                  batch=batch, devices=1, workers=1, window=batch_scale,
                                  extra=self.gain.unsent_seconds())
        probe.small = []
        return seen
