"""What the gain pieces are handed of a step, instead of the optimizer or a registry.

- `TrainerSide`: what the Trainer binding knows of its Trainer at a call: whether it keeps
  windows at its reduction, and the `LossScaling` hook over it.
- `StepInfo`: what `lr_gain.LrGain` and `noise_probe.NormProbe` read of a micro-batch:
  the window length, the optimizer's rescale_grad, the loss scale the gradients carry, this
  worker's batch. `protocol.step_info` makes it from the optimizer and a `TrainerSide`.
  What costs a pass or depends on the moment (the counts, the hook's scale) is read when
  a piece asks for it.

The pieces return what they decide (a gain, the next window length); the shell writes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class TrainerSide:
    """The Trainer binding's view of its Trainer, at one call into the optimizer."""

    #: the gluon.Trainer whose gradients are observed and reduced
    trainer: Any
    #: whether the Trainer keeps accumulation windows at its reduction (dense gradients,
    #: and no hook that reduces every micro-batch)
    windows_at_reduction: bool = True
    #: the `LossScaling` hook over the Trainer (its ``scale`` and last ``batch_size``), or
    #: None
    hook: Optional[Any] = None


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One micro-batch as the gain pieces see it."""

    #: the window length (micro-batches per update)
    batch_scale: int
    #: the optimizer's rescale_grad (the Trainer's scale / the step's batch)
    rescale_grad: float
    #: the scale the gradients carry now: the optimizer's loss scaler's, or the hook's
    loss_scale: Callable[[], float]
    #: examples per step on this worker, over its devices (NaN: unknown)
    worker_batch: Callable[[], float]
    #: whether the Trainer keeps windows at its reduction
    windows_at_reduction: bool
    #: micro-batches of the open window, counted on demand (a pass over MXNet's counts)
    window_position: Callable[[], int]
    #: micro-batches counted so far, on demand (the same pass)
    micro_batches: Callable[[], int]
