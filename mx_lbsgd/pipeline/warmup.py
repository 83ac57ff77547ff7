"""The warmup piece: a learning-rate multiplier per micro-batch position (no mxnet).

MXNet LBSGD's warmup rises from 1 to the batch scale B over W micro-batches::

    mult(n) = warmup_multiplier(offset + n, W, B, shape)     # schedules.WARMUP_SHAPES

where n counts this run's micro-batches (skipped windows are not counted) and ``offset``
is ``begin_epoch * updates_per_epoch``. With an ``lr_scaling`` rule the warmup rises to
the rule's gain of the update instead of B (`lr_scaling`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..schedules import warmup_multiplier


class Warmup:
    """Multipliers of one warmup: `shape` from `schedules.WARMUP_SHAPES`, or None (1).

    Parameters
    ----------
    shape : str or None
        A key of `mx_lbsgd.schedules.WARMUP_SHAPES`; None: no warmup (multiplier 1).
    warmup_steps : float
        Micro-batches the warmup takes (W).
    batch_scale : int
        The final multiplier (B).
    offset : int
        Micro-batches before this run (``begin_epoch * updates_per_epoch``).

    Examples
    --------
    >>> from mx_lbsgd.pipeline import Warmup
    >>> warmup = Warmup('linear', warmup_steps=4, batch_scale=8, offset=0)
    >>> [warmup.multiplier(n) for n in range(6)]
    [1.0, 2.75, 4.5, 6.25, 8.0, 8.0]
    >>> warmup.scale_lrs([0.1, 0.1], positions=[1, 2])
    [0.275, 0.45]
    >>> Warmup(None, 4, 8, 0).multiplier(1)
    1.0
    """

    def __init__(self, shape: Optional[str], warmup_steps: float, batch_scale: int,
                 offset: int) -> None:
        self.shape = shape
        self.warmup_steps = warmup_steps
        self.batch_scale = batch_scale
        self.offset = offset

    def multiplier(self, position: int, target: Optional[float] = None) -> float:
        """The learning-rate multiplier at micro-batch `position` of this run, rising to
        `target` (an ``lr_scaling`` gain) instead of the batch scale when given."""
        final = self.batch_scale if target is None else target
        if self.shape is None:
            return 1.0 if target is None else target
        return warmup_multiplier(self.offset + position, self.warmup_steps, final,
                                 self.shape)

    def scale_lrs(self, lrs: List[float], positions: Sequence[int],
                  target: Optional[float] = None) -> List[float]:
        """lrs[i] * multiplier(positions[i], target); parameters of one call mostly share
        a position, so each position is computed once."""
        if self.shape is None and target is None:
            return lrs
        mults: Dict[int, float] = {}
        for p in positions:
            if p not in mults:
                mults[p] = self.multiplier(p, target)
        return [lr * mults[p] for lr, p in zip(lrs, positions)]
