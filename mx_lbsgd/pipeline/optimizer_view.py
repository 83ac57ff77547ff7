"""What the pieces and the Trainer binding see of the optimizer shell: declared views
(``typing.Protocol``), so that they name no class of the shell and import nothing that
imports them back.

- `GainView`: what the gain pieces (`lr_gain.LrGain`, `noise_probe.NormProbe`) read of
  the optimizer, and the one value `LrGain` writes (``batch_scale``, the window length
  ``batch_scale='auto'`` chose).
- `StepOptimizer`: what the Trainer binding calls on the optimizer it finds on a Trainer
  (the step protocol of `protocol.StepProtocol`, and the refusals before a kvstore
  updates the weights).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence

import mxnet as mx


class GainView(Protocol):
    """The optimizer as the gain pieces see it."""

    batch_scale: int
    begin_num_update: int
    #: weakref to the Trainer of the step under way, None for Module's (or a bare Updater's)
    _step_trainer: Any

    @property
    def rescale_grad(self) -> float: ...

    @property
    def window_position(self) -> int: ...


class StepOptimizer(GainView, Protocol):
    """The optimizer as the Trainer binding drives it."""

    param_dict: Dict[Any, Any]
    fused: Optional[bool]

    def begin_micro_batch(self, trainer: Any) -> None: ...

    def observe_micro_batch(self, trainer: Any, window_at_trainer: bool) -> None: ...

    def observe_reduction(self, trainer: Any, closes_window: bool) -> None: ...

    def accumulates_at_trainer(self) -> bool: ...

    def wants_local_flags(self, trainer: Any, window: bool) -> bool: ...

    def wants_step_gradients(self) -> bool: ...

    def begin_step(self, gradients: Optional[Sequence[mx.nd.NDArray]],
                   closes_window: Optional[bool] = None, trainer: Any = None,
                   local_flags: Optional[Dict[int, mx.nd.NDArray]] = None,
                   sum_sq: Optional[mx.nd.NDArray] = None) -> None: ...

    def split_state(self, weight: mx.nd.NDArray, state: Any) -> Any: ...

    def refuse_updates_on_kvstore(self) -> None: ...

    def trust_ratio_applies(self, name: str) -> bool: ...
