"""Pure warmup math, shared by the optimizers, the LR schedulers, the CLI and the docs.

Nothing here imports mxnet: every function is a plain function of its arguments.
`WARMUP_SHAPES` is the one registry of warmup shapes: a new strategy is one entry here
(plus its test); the optimizers, the CLI choices and the docs table read it.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

from ._checks import check_choice

__all__ = ['WARMUP_SHAPES', 'WARMUP_STRATEGIES', 'warmup_fraction', 'warmup_multiplier',
           'decay_fraction', 'strategy_table']

#: name -> (f(t) for t in [0, 1] the fraction of the warmup done, the formula as text)
WARMUP_SHAPES: Dict[str, Tuple[Callable[[float], float], str]] = {
    'linear': (lambda t: t, 't'),
    'power2': (lambda t: t * t, 't ** 2'),
    'sqrt': (math.sqrt, 'sqrt(t)'),
}
#: Every `LBSGD` warmup strategy: the shapes, and 'lars' (per-layer rates, no warmup shape).
WARMUP_STRATEGIES = tuple(WARMUP_SHAPES) + ('lars',)


def warmup_fraction(step: float, warmup_steps: float, mode: str) -> float:
    """Fraction of the warmup done after `step` steps: f(min(step / warmup_steps, 1)), f
    from `WARMUP_SHAPES`. With warmup_steps <= 0 the warmup is already over (1)."""
    check_choice('mode', mode, tuple(WARMUP_SHAPES))
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return WARMUP_SHAPES[mode][0](max(float(step), 0.0) / float(warmup_steps))


def warmup_multiplier(step: float, warmup_steps: float, max_mult: float, mode: str) -> float:
    """Learning-rate multiplier of MXNet's LBSGD warmup after `step` micro-batches.

    Rises from 1 to `max_mult` (the batch scale) over `warmup_steps`::

        linear:  1 + (max_mult - 1) * step / warmup_steps
        power2:  1 + (max_mult - 1) * (step / warmup_steps) ** 2
        sqrt:    1 + (max_mult - 1) * sqrt(step / warmup_steps)

    and equals `max_mult` once step >= warmup_steps.
    """
    return 1.0 + (float(max_mult) - 1.0) * warmup_fraction(step, warmup_steps, mode)


def strategy_table() -> str:
    """Markdown rows `| strategy | multiplier |` for the docs, read from the registry."""
    rows = ['| strategy | lr multiplier at micro-batch n (t = n / W) |', '|---|---|']
    rows += ['| `%s` | `1 + (B - 1) * %s` |' % (name, text)
             for name, (_, text) in WARMUP_SHAPES.items()]
    rows.append('| `lars` | `clip(eta * |w| / (|g| + wd * |w| + eps), lars_min, lars_max)` |')
    return '\n'.join(rows)


def decay_fraction(step: float, begin: float, end: float, mode: str | None,
                   power: float = 2.0) -> float:
    """Fraction of the peak kept at `step` of a decay running from `begin` to `end`.

    mode 'poly': (1 - p) ** power; 'cosine': (1 + cos(pi * p)) / 2; None: 1,
    with p = (step - begin) / (end - begin) clipped to [0, 1].
    """
    if mode is None:
        return 1.0
    check_choice('decay', mode, ('poly', 'cosine', None))
    if end <= begin:
        return 0.0 if step >= end else 1.0
    p = min(max((float(step) - begin) / float(end - begin), 0.0), 1.0)
    if mode == 'poly':
        return (1.0 - p) ** power
    return 0.5 * (1.0 + math.cos(math.pi * p))
