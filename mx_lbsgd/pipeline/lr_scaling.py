"""The learning-rate scaling piece: how the lr tuned at a base batch grows with the batch.

One micro-batch on one worker is the base batch (b examples); an update that applies the
mean of S base batches (S = batch_scale x workers) multiplies the lr by a gain::

    'linear':    gain = S                                  # Goyal et al., 2017
    'sqrt':      gain = sqrt(S)                            # Krizhevsky, 2014
    'adascale':  r = (sigma2 + mu2) / (sigma2 / S + mu2)   # Johnson et al., ICML 2020
                 gain = r ** power                         # power 1 for SGD, 0.5 for LAMB
    progress += S ('linear', 'sqrt') or r ('adascale')    # what the lr scheduler sees

sigma2 = tr(Sigma) / b is the variance of one base batch's gradient and mu2 = |G|^2 the
squared norm of the true gradient, from the noise-scale estimator below (the one
`mx_lbsgd.GradientNoiseScale` uses): per update, the mean squared norm of the small
gradients (b_small examples each) and the squared norm of the applied one (b_big)::

    |G|^2     = (b_big * |g_big|^2 - b_small * |g_small|^2) / (b_big - b_small)
    tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1 / b_small - 1 / b_big)

each smoothed by an exponential moving average whose decay per update is
``smoothing ** S`` (``smoothing`` per base batch, as AdaptDL's AdaScale), bias-corrected
by the sum of its weights. Before the first estimate the gain is 1.

With a single gradient per update (S = 1 on one device) there is no small gradient to
compare: AdaptDL's difference estimator then takes the last two updates' gradients as the
small ones and their mean as the big one (b_big = 2 b_small). It is biased (the two were
taken at different weights), so the averages restart when unbiased estimates begin.

No mxnet here: the piece is plain floats, and its state (`LrScalingState`) pickles and
goes into checkpoints as a dict.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

#: the rules of ``lr_scaling=``; None keeps the optimizer's own behaviour
RULES = ('linear', 'sqrt', 'adascale')


def noise_moments(small_sq: float, big_sq: float, b_small: float,
                  b_big: float) -> Tuple[float, float]:
    """(|G|^2, tr(Sigma)) per example from the squared norms of mean gradients at two
    batch sizes b_small < b_big (McCandlish et al. 2018, Appendix A.1)."""
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


@dataclasses.dataclass
class SmoothedMoments:
    """Bias-corrected moving averages of |G|^2 and tr(Sigma) (plain floats)."""

    g2_sum: float = 0.0
    trace_sum: float = 0.0
    weight: float = 0.0
    samples: int = 0
    #: whether the averages hold difference (biased) estimates
    biased: bool = False

    def add(self, g2: float, trace: float, decay: float, biased: bool = False) -> None:
        """One estimate; the first unbiased one after biased ones restarts the averages
        (as AdaptDL's estimator)."""
        if self.biased and not biased:
            self.g2_sum = self.trace_sum = self.weight = 0.0
        self.biased = biased
        self.g2_sum = decay * self.g2_sum + (1.0 - decay) * g2
        self.trace_sum = decay * self.trace_sum + (1.0 - decay) * trace
        self.weight = decay * self.weight + (1.0 - decay)
        self.samples += 1

    @property
    def gradient_sq(self) -> Optional[float]:
        """Smoothed |G|^2, None before the first sample."""
        return self.g2_sum / self.weight if self.weight > 0 else None

    @property
    def trace_sigma(self) -> Optional[float]:
        """Smoothed tr(Sigma) per example, None before the first sample."""
        return self.trace_sum / self.weight if self.weight > 0 else None

    @property
    def noise_scale(self) -> Optional[float]:
        """B_noise = tr(Sigma) / |G|^2 in examples (McCandlish et al. 2018), clamped at 0;
        inf when |G|^2 <= 0, None before the first sample."""
        g2, trace = self.gradient_sq, self.trace_sigma
        if g2 is None or trace is None:
            return None
        return math.inf if g2 <= 0.0 else max(trace, 0.0) / g2


def adascale_gain(gradient_sq: Optional[float], trace_sigma: Optional[float],
                  base_batch: float, scale: float) -> float:
    """AdaScale's r at `scale` base batches of `base_batch` examples; 1 without estimates.
    Negative estimates (noise on a small sample) count as 0, as AdaptDL clamps them."""
    if gradient_sq is None or trace_sigma is None:
        return 1.0
    mu2, sigma2 = max(gradient_sq, 0.0), max(trace_sigma, 0.0) / base_batch
    if mu2 + sigma2 <= 0.0:
        return 1.0
    return (sigma2 + mu2) / (sigma2 / scale + mu2)


@dataclasses.dataclass
class LrScalingState:
    """What a run of the piece has learned; resumed from checkpoints.

    ``progress``: scale-invariant steps, the sum of the gains of applied updates (the
    scheduler's step); ``last_gain``: the lr multiplier of the last update; ``last_scale``:
    its S; ``moments``: the smoothed estimates.

    Examples
    --------
    >>> from mx_lbsgd.pipeline import LrScaling, LrScalingState
    >>> piece = LrScaling('linear', smoothing=0.999, power=1.0)
    >>> piece.advance(4), piece.advance(4)
    (4.0, 4.0)
    >>> saved = piece.state.as_dict()           # plain values, as checkpoints keep them
    >>> saved['progress'], saved['last_gain'], saved['last_scale']
    (8.0, 4.0, 4.0)
    >>> LrScalingState.from_dict(saved) == piece.state
    True
    """

    progress: float = 0.0
    last_gain: float = 1.0
    last_scale: float = 1.0
    moments: SmoothedMoments = dataclasses.field(default_factory=SmoothedMoments)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> 'LrScalingState':
        """The state `as_dict` gave; TypeError or ValueError for anything else."""
        fields = dict(saved)
        fields['moments'] = SmoothedMoments(**fields.get('moments', {}))
        state = cls(**fields)
        numbers = [state.progress, state.last_gain, state.last_scale,
                   state.moments.g2_sum, state.moments.trace_sum, state.moments.weight]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) \
                or not isinstance(state.moments.samples, int) \
                or not isinstance(state.moments.biased, bool):
            raise TypeError('lr_scaling state fields must be numbers: %r' % (saved,))
        return state


class LrScaling:
    """The lr gain of one rule at S base batches per update (b examples each)::

        'linear':    gain = S
        'sqrt':      gain = sqrt(S)
        'adascale':  r = (sigma2 + mu2) / (sigma2 / S + mu2);  gain = r ** power
        progress += S ('linear', 'sqrt') or r ('adascale')

    ``sigma2 = tr(Sigma) / b`` and ``mu2 = |G|^2`` come from `noise_moments` of each
    update's squared gradient norms (`observe`), smoothed with decay ``smoothing ** S``
    per update.
    Johnson et al., "AdaScale SGD: A User-Friendly Algorithm for Distributed Training"
    (ICML 2020). fairscale's AdaScale wraps torch SGD, and the training loop adds its
    ``gain()`` to a step counter of its own and drives the scheduler with it; here the
    optimizer advances the progress, which the MXNet scheduler sees, and the moments are
    those `mx_lbsgd.GradientNoiseScale` reports. As in AdaptDL, negative estimates are
    clamped and the gain is 1 before the first estimate; the decay per base batch is
    AdaptDL's, where fairscale's default is ``max(1 - S / 1000, 0)`` per update.

    Parameters
    ----------
    rule : {'linear', 'sqrt', 'adascale'}
    smoothing : float in [0, 1)
        Decay of the estimates per base batch ('adascale').
    power : float
        The lr gain is r ** power ('adascale'): 1 for SGD, 0.5 for Adam-type updates.
    state : LrScalingState, optional

    Examples
    --------
    >>> from mx_lbsgd.pipeline.lr_scaling import LrScaling
    >>> piece = LrScaling('adascale', smoothing=0.0, power=1.0)
    >>> piece.gain(scale=8, base_batch=32)            # nothing measured yet
    1.0
    >>> piece.observe([0.5], 0.1, b_small=32, b_big=256, scale=8)
    >>> piece.gain(scale=8, base_batch=32)     # (sigma2 + mu2) / (sigma2 / 8 + mu2)
    5.0
    >>> piece.advance(8, base_batch=32), piece.state.progress
    (5.0, 5.0)
    >>> LrScaling('sqrt', 0.999, 1.0).gain(scale=16, base_batch=32)
    4.0
    """

    def __init__(self, rule: str, smoothing: float, power: float,
                 state: Optional[LrScalingState] = None) -> None:
        self.rule, self.smoothing, self.power = rule, smoothing, power
        self.state = state if state is not None else LrScalingState()

    @property
    def measures(self) -> bool:
        """Whether the gain needs the gradient norms."""
        return self.rule == 'adascale'

    def observe(self, small_sq: list, big_sq: float, b_small: float, b_big: float,
                scale: float, biased: bool = False) -> None:
        """One update's squared norms (per-example units): the small gradients' and the
        applied one's (`biased`: the difference estimator's). Skipped (not finite) updates
        must not come here."""
        if not small_sq or b_big <= b_small:
            return
        values = list(small_sq) + [big_sq]
        if not all(math.isfinite(v) for v in values):
            return
        g2, trace = noise_moments(sum(small_sq) / len(small_sq), big_sq, b_small, b_big)
        self.state.moments.add(g2, trace, self.smoothing ** scale, biased)

    def ratio(self, scale: float, base_batch: float) -> float:
        """AdaScale's r at `scale` from the current estimates."""
        moments = self.state.moments
        return adascale_gain(moments.gradient_sq, moments.trace_sigma, base_batch, scale)

    def gain(self, scale: float, base_batch: float) -> float:
        """The lr multiplier of an update of `scale` base batches."""
        if self.rule == 'linear':
            return float(scale)
        if self.rule == 'sqrt':
            return math.sqrt(scale)
        return self.ratio(scale, base_batch) ** self.power

    def advance(self, scale: float, base_batch: float = 1.0) -> float:
        """Account an applied update of `scale` base batches; returns its lr gain."""
        gain = self.gain(scale, base_batch)
        step = self.ratio(scale, base_batch) if self.rule == 'adascale' else float(scale)
        self.state.progress += step
        self.state.last_gain, self.state.last_scale = gain, float(scale)
        return gain
