"""What the Trainer binding sees of the optimizer shell: a declared view
(``typing.Protocol``), so that it names no class of the shell and imports nothing that
imports it back.

`StepOptimizer` lists what the binding reads and calls on the optimizer it finds on a
Trainer: the step protocol (the shell's ``begin_step``, ``step_info``, ``wants_*``, ...)
and the refusals before a kvstore updates the weights. The gain pieces see no optimizer:
they are handed a `step_info.StepInfo`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence

import mxnet as mx

from .step_info import StepInfo, TrainerSide


class StepOptimizer(Protocol):
    """The optimizer as the Trainer binding drives it."""

    param_dict: Dict[Any, Any]
    fused: Optional[bool]

    @property
    def batch_scale(self) -> int: ...

    @property
    def rescale_grad(self) -> float: ...

    @property
    def window_position(self) -> int: ...

    def step_info(self, side: TrainerSide) -> StepInfo: ...

    def begin_micro_batch(self, side: TrainerSide) -> None: ...

    def observe_micro_batch(self, side: TrainerSide, window_at_trainer: bool) -> None: ...

    def observe_reduction(self, side: TrainerSide, closes_window: bool) -> None: ...

    def accumulates_at_trainer(self) -> bool: ...

    def wants_local_flags(self, trainer: Any, window: bool) -> bool: ...

    def wants_step_gradients(self) -> bool: ...

    def begin_step(self, gradients: Optional[Sequence[mx.nd.NDArray]],
                   closes_window: Optional[bool] = None, trainer: Any = None,
                   local_flags: Optional[Dict[int, mx.nd.NDArray]] = None,
                   sum_sq: Optional[mx.nd.NDArray] = None,
                   slices: Optional[Dict[str, Any]] = None) -> None: ...

    def split_state(self, weight: mx.nd.NDArray, state: Any) -> Any: ...

    def refuse_updates_on_kvstore(self) -> None: ...

    def trust_ratio_applies(self, name: str) -> bool: ...
