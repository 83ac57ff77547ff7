"""The accumulation window at a gluon Trainer's reduction: the rule of
`mx_lbsgd.pipeline.window`, run before the gradients are reduced, so that they are
communicated once per update::

    micro-batch k < B:  acc = r * g if k == 1 else acc + r * g      # summed, not reduced
    micro-batch B:      g = (acc + r * g) / (r * B)                 # then reduced, applied
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from mxnet import nd

from .. import _kernels


class TrainerWindow:
    """The window at a Trainer's reduction. Its state, `position` (micro-batches of the open
    window already summed, 0 .. size-1), is read from the optimizer's micro-batch count at
    every reduction: one source of truth, which checkpoints (MXNet's own included) restore,
    and which a skipped window rewinds."""

    def __init__(self) -> None:
        self.position = 0
        # the last `add`'s finite flag (check_finite), else None
        self.flag: Optional[nd.NDArray] = None
        self._scratch: Dict[Any, nd.NDArray] = {}

    def add(self, *, accs: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
            rescale_grad: float, size: int, position: int, check_finite: bool = False,
            fused: Optional[bool] = None) -> bool:
        """Take micro-batch `position + 1`. Returns True when it closes the window: the
        window's mean is then in `grads`, ready to be reduced; otherwise it was summed into
        `accs`. With `check_finite`, ``self.flag`` is then ``_kernels.finite_flag(grads,
        fused)`` of the gradients as they came (a device-side (1,) array), else None."""
        position += 1
        if position < size:
            self.flag = _kernels.accumulate(accs=accs, grads=grads, first=position == 1,
                                            rescale_grad=rescale_grad, scratch=self._scratch,
                                            check_finite=check_finite, fused=fused)
            self.position = position
            return False
        self.flag = _kernels.write_mean(grads=grads, accs=accs, rescale_grad=rescale_grad,
                                        mean_factor=1.0 / (rescale_grad * size),
                                        scratch=self._scratch, check_finite=check_finite,
                                        fused=fused)
        self.position = 0
        return True
