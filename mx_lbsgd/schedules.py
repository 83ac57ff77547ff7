"""Pure warmup math, shared by the optimizers, the LR schedulers and the CLI.

Nothing here imports mxnet: every function is a plain function of its arguments.
"""
import math

from ._checks import check_choice

WARMUP_STRATEGIES = ('linear', 'power2', 'sqrt', 'lars')
WARMUP_SHAPES = ('linear', 'power2', 'sqrt')


def warmup_fraction(step, warmup_steps, mode):
    """Fraction of the warmup done after `step` steps: f(min(step / warmup_steps, 1)).

    f is t (linear), t**2 (power2) or sqrt(t) (sqrt). With warmup_steps <= 0 the warmup
    is already over and the fraction is 1.
    """
    check_choice('mode', mode, WARMUP_SHAPES)
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    t = max(float(step), 0.0) / float(warmup_steps)
    if mode == 'linear':
        return t
    if mode == 'power2':
        return t * t
    return math.sqrt(t)


def warmup_multiplier(step, warmup_steps, max_mult, mode):
    """Learning-rate multiplier of MXNet's LBSGD warmup after `step` micro-batches.

    Rises from 1 to `max_mult` (the batch scale) over `warmup_steps`::

        linear:  1 + (max_mult - 1) * step / warmup_steps
        power2:  1 + (max_mult - 1) * (step / warmup_steps) ** 2
        sqrt:    1 + (max_mult - 1) * sqrt(step / warmup_steps)

    and equals `max_mult` once step >= warmup_steps.
    """
    return 1.0 + (float(max_mult) - 1.0) * warmup_fraction(step, warmup_steps, mode)


def decay_fraction(step, begin, end, mode, power=2.0):
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
