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
    from `WARMUP_SHAPES`. With warmup_steps <= 0 the warmup is already over (1).

    Parameters
    ----------
    step : float
        Steps done (negative counts as 0).
    warmup_steps : float
        Length of the warmup.
    mode : {'linear', 'power2', 'sqrt'}
        The shape, a key of `WARMUP_SHAPES`.

    Returns
    -------
    float
        In [0, 1].

    Raises
    ------
    ValueError
        `mode` is not a key of `WARMUP_SHAPES`.

    Examples
    --------
    >>> from mx_lbsgd.schedules import warmup_fraction
    >>> [warmup_fraction(s, 4, 'power2') for s in range(6)]
    [0.0, 0.0625, 0.25, 0.5625, 1.0, 1.0]
    >>> warmup_fraction(1, 4, 'sqrt')
    0.5
    """
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

    Parameters
    ----------
    step : float
        Micro-batches done.
    warmup_steps : float
        Micro-batches the warmup takes (W); <= 0: no warmup (`max_mult` at once).
    max_mult : float
        The final multiplier (LBSGD's ``batch_scale``).
    mode : {'linear', 'power2', 'sqrt'}
        The shape, a key of `mx_lbsgd.schedules.WARMUP_SHAPES`.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        `mode` is not a warmup shape (``'lars'`` has none).

    Examples
    --------
    >>> import mx_lbsgd
    >>> [mx_lbsgd.warmup_multiplier(n, 4, 8, 'linear') for n in range(6)]
    [1.0, 2.75, 4.5, 6.25, 8.0, 8.0]
    >>> mx_lbsgd.warmup_multiplier(1, 4, 8, 'sqrt')
    4.5
    """
    return 1.0 + (float(max_mult) - 1.0) * warmup_fraction(step, warmup_steps, mode)


def strategy_table() -> str:
    """Markdown rows ``| strategy | multiplier |`` for the docs, read from the registry.

    Returns
    -------
    str
        A Markdown table: a header, then one row per warmup shape and one for 'lars'.

    Examples
    --------
    >>> from mx_lbsgd.schedules import strategy_table
    >>> print(strategy_table())
    | strategy | lr multiplier at micro-batch n (t = n / W) |
    |---|---|
    | `linear` | `1 + (B - 1) * t` |
    | `power2` | `1 + (B - 1) * t ** 2` |
    | `sqrt` | `1 + (B - 1) * sqrt(t)` |
    | `lars` | `clip(eta * |w| / (|g| + wd * |w| + eps), lars_min, lars_max)` |
    """
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

    Parameters
    ----------
    step : float
    begin, end : float
        Where the decay starts (fraction 1) and ends (fraction 0); with ``end <= begin``
        the fraction drops from 1 to 0 at `end`.
    mode : {'poly', 'cosine', None}
    power : float, default 2
        Exponent of 'poly'.

    Returns
    -------
    float
        In [0, 1].

    Raises
    ------
    ValueError
        An unknown `mode`.

    Examples
    --------
    >>> from mx_lbsgd.schedules import decay_fraction
    >>> [decay_fraction(s, 0, 4, 'poly', power=1) for s in range(5)]
    [1.0, 0.75, 0.5, 0.25, 0.0]
    >>> [round(decay_fraction(s, 0, 4, 'cosine'), 4) for s in range(5)]
    [1.0, 0.8536, 0.5, 0.1464, 0.0]
    >>> decay_fraction(3, 0, 4, None)
    1.0
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
