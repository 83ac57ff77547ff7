"""Warmup learning-rate schedulers for any MXNet optimizer."""
from __future__ import annotations

import mxnet as mx

from ._checks import check_choice, check_int, check_real
from .schedules import WARMUP_SHAPES, decay_fraction, warmup_fraction

__all__ = ['WarmupScheduler']


class WarmupScheduler(mx.lr_scheduler.LRScheduler):
    """Warmup from `warmup_begin_lr` to `base_lr`, then constant, poly or cosine decay.

    A pure function of the update count: ``sched(t)`` twice gives the same value, and
    calling it never changes the scheduler (unlike MXNet's FactorScheduler)::

        t <  W:              warmup_begin_lr + (base_lr - warmup_begin_lr) * f(t / W)
        W <= t < max_update: final_lr + (base_lr - final_lr) * d((t - W) / (max_update - W))
        t >= max_update:     final_lr            (with a decay)

    with f = t, t**2 or sqrt(t) for strategy 'linear', 'power2', 'sqrt' and
    d = (1 - p)**power ('poly'), (1 + cos(pi p)) / 2 ('cosine') or 1 (decay=None).

    Parameters
    ----------
    base_lr : float >= 0, default 0.01
        The learning rate at the end of the warmup (the peak).
    warmup_steps : int >= 0, default 0
        Updates the warmup takes (W).
    strategy : {'linear', 'power2', 'sqrt'}, default 'linear'
        The warmup shape (`mx_lbsgd.schedules.WARMUP_SHAPES`).
    warmup_begin_lr : float >= 0, default 0
        The learning rate at update 0.
    decay : {None, 'poly', 'cosine'}, default None
        What follows the warmup: None keeps ``base_lr``.
    max_update : int > warmup_steps, or None
        Where the decay ends at ``final_lr``; required with a decay.
    final_lr : float >= 0, default 0
    power : float > 0, default 2
        Exponent of the 'poly' decay (1: linear, the BERT recipe).

    Raises
    ------
    ValueError
        An unknown ``strategy`` or ``decay``, a negative rate or step count, ``power <= 0``,
        or a decay without a ``max_update`` greater than ``warmup_steps``.
    TypeError
        A number of the wrong type (``warmup_steps=2.5``).

    Examples
    --------
    >>> import mx_lbsgd
    >>> sched = mx_lbsgd.WarmupScheduler(base_lr=0.1, warmup_steps=4, decay='poly',
    ...                                  max_update=8, power=1)
    >>> [round(sched(t), 4) for t in range(10)]
    [0.0, 0.025, 0.05, 0.075, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0]

    Any MXNet optimizer takes it as its ``lr_scheduler``:

    >>> import mxnet as mx
    >>> opt = mx.optimizer.create('lblamb', lr_scheduler=mx_lbsgd.WarmupScheduler(
    ...     base_lr=1e-3, warmup_steps=100))
    >>> opt.learning_rate
    0.0
    """

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0, strategy: str = 'linear',
                 warmup_begin_lr: float = 0.0, decay: str | None = None,
                 max_update: int | None = None, final_lr: float = 0.0,
                 power: float = 2.0) -> None:
        check_choice('strategy', strategy, tuple(WARMUP_SHAPES))
        check_choice('decay', decay, (None, 'poly', 'cosine'))
        check_int('warmup_steps', warmup_steps, 0)
        check_real('base_lr', base_lr, 0.0)
        check_real('warmup_begin_lr', warmup_begin_lr, 0.0)
        check_real('final_lr', final_lr, 0.0)
        check_real('power', power, 0.0, open_min=True)
        if decay is not None:
            if max_update is None:
                raise ValueError('decay=%r needs max_update (an integer > warmup_steps)'
                                 % decay)
            check_int('max_update', max_update, warmup_steps + 1)
        super().__init__(base_lr=base_lr)
        self.warmup_steps = warmup_steps
        self.strategy = strategy
        self.warmup_begin_lr = warmup_begin_lr
        self.decay = decay
        self.max_update = max_update
        self.final_lr = final_lr
        self.power = power

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            frac = warmup_fraction(num_update, self.warmup_steps, self.strategy)
            return self.warmup_begin_lr + (self.base_lr - self.warmup_begin_lr) * frac
        # max_update is None only with decay None, where decay_fraction returns 1 without
        # reading it
        keep = decay_fraction(num_update, self.warmup_steps,
                              self.max_update, self.decay,  # type: ignore[arg-type]
                              self.power)
        return self.final_lr + (self.base_lr - self.final_lr) * keep
