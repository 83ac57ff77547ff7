"""The ``lr_scaling`` gain of each update under a gluon Trainer (`lr_scaling` over
`noise_probe`).

Per update, driven by the step protocol (`binding` -> the optimizer -> here)::

    each micro-batch, before the reduction:   probe the local norms      ('adascale')
    the reduction that closes the window:     probe the reduced norm     ('adascale')
    begin_step:                               S = batch_scale x workers, base batch b
    the finite check (loss scaling):          read the flag and the norms together
    the first Updater call of the update:     read the norms (no loss scaling), estimate,
                                              gain = rule(S), progress += S or r
    a skipped update:                         nothing is estimated or advanced

So 'adascale' costs one pass over the gradients per micro-batch and one over the reduced
gradient, a reduction of one number over the workers (so that every worker computes the
same gain), and one host read per update, which is the loss scaler's flag read when there
is one; 'linear' and 'sqrt' read nothing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, cast

import mxnet as mx

from .. import _compat, _kernels
from .._checks import check_choice, check_real
from . import noise_probe as _probe
from .clip import GlobalNormClip, StepNorms
from .lr_scaling import RULES, LrScaling, LrScalingState

if TYPE_CHECKING:
    from .shell import PipelineOptimizer


@dataclasses.dataclass
class _Update:
    """The update begun: its scale and norms, read once."""

    scale: float
    observation: Optional[_probe.Observation]
    values: Optional[List[float]] = None
    gain: Optional[float] = None


class LrGain:
    """See the module docstring. `piece` holds the rule and its state."""

    def __init__(self, piece: LrScaling) -> None:
        self.piece = piece
        self._probe: Optional[_probe.NormProbe] = None
        self._observation: Optional[_probe.Observation] = None
        self._update: Optional[_Update] = None

    def micro_batch(self, trainer: mx.gluon.Trainer, opt: PipelineOptimizer,
                    window_at_trainer: bool) -> None:
        if not self.piece.measures:
            return
        if self._probe is None:
            self._probe = _probe.NormProbe(
                len(_compat.trainer_params(trainer)[0].list_ctx()), small_every=1)
        self._probe.before_reduction(trainer, opt, window_at_trainer)

    def pending_small(self) -> Optional[Tuple[int, List[Tuple[float, float]]]]:
        """(devices, [(sum of squares, factor)] of the small norms taken so far in an open
        window): what a checkpoint in the middle of a window keeps (one host read)."""
        if self._probe is None or not self._probe.small:
            return None
        values = _probe.read([a for a, _ in self._probe.small])
        return self._probe.devices, [(v, f) for v, (_, f) in zip(values, self._probe.small)]

    def restore_small(self, devices: int, pairs: List[Tuple[float, float]]) -> None:
        """Resume `pending_small` (a checkpoint saved in the middle of a window); the sums
        were float32, so they come back exactly."""
        self._probe = _probe.NormProbe(devices, small_every=1)
        self._probe.small = [(mx.nd.array([v], dtype='float32'), float(f)) for v, f in pairs]

    def reduced(self, trainer: mx.gluon.Trainer, opt: PipelineOptimizer,
                closes_window: bool) -> None:
        if self._probe is not None:
            self._observation = self._probe.after_reduction(trainer, opt, closes_window,
                                                            across_workers=True)

    def begin(self, trainer: mx.gluon.Trainer, opt: PipelineOptimizer,
              closes_window: Optional[bool]) -> None:
        """A Trainer step begins; `closes_window` as `begin_step`'s (False: a micro-batch
        that only accumulates)."""
        if closes_window is False:
            return
        if self.piece.measures and closes_window is None and opt.batch_scale > 1:
            raise ValueError(
                "lr_scaling='adascale' with batch_scale=%d needs the accumulation window at "
                "the Trainer's reduction, where the window's gradient is measured; this "
                'Trainer accumulates inside the optimizer (row_sparse gradients, or '
                "GradientNoiseScale/LossScaling set up without a window). Use lr_scaling="
                "'linear' or 'sqrt', or dense gradients" % opt.batch_scale)
        seen, self._observation = self._observation, None
        workers = _compat.trainer_worker_count(trainer, default=1)
        self._update = _Update(scale=float(opt.batch_scale * workers), observation=seen)

    def pending(self) -> bool:
        """Whether the update begun has norms still to read."""
        update = self._update
        return not (update is None or update.observation is None
                    or update.values is not None)

    def read_along(self, first: mx.nd.NDArray) -> float:
        """The host value of `first` (a (1,) array), read with this update's norms (when
        `pending`) in one host read."""
        update = cast(_Update, self._update)
        seen = cast(_probe.Observation, update.observation)
        values = _probe.read([first] + seen.arrays())
        update.values = values[1:]
        return values[0]

    def gain(self) -> float:
        """The lr gain of the update begun: estimated and accounted once, at its first
        Updater call (the step applies; a skipped one never comes here)."""
        update = self._update
        if update is None:
            raise RuntimeError('lr_scaling: an update began without begin_step')
        if update.gain is None:
            seen, base = update.observation, 1.0
            if seen is not None:
                if update.values is None:
                    update.values = _probe.read(seen.arrays())
                norms = seen.resolve(update.values)
                base = norms.b_worker
                if not math.isfinite(norms.big_raw):   # skipped (clipping), or applied as is
                    update.gain = self.piece.gain(update.scale, base)
                    return update.gain
                if all(map(math.isfinite, norms.small + [norms.big])):
                    self.piece.observe(norms.small, norms.big, norms.b_small, norms.b_big,
                                       update.scale)
            update.gain = self.piece.advance(update.scale, base)
        return update.gain

    def known_finite(self) -> Optional[bool]:
        """Whether the update's reduced gradient is finite, when its norm was read (clipping
        without a loss scaler then needs no read of its own); else None."""
        update = self._update
        if update is None or update.observation is None or update.values is None:
            return None
        return math.isfinite(update.observation.resolve(update.values).big_raw)



def all_finite(gain: Optional[LrGain], grads: Sequence[mx.nd.NDArray],
               fused: Optional[bool]) -> bool:
    """The loss-scale gate's finite check of `grads` (one host read, which also brings the
    norms of `gain`'s update when they are pending)."""
    return value_is_finite(gain, _kernels.finite_flag(grads, fused), flag=True)


def norms_finite(gain: Optional[LrGain], norms: StepNorms) -> bool:
    """Whether clipping's norms are finite (the gate's check with clipping): one host read,
    as `all_finite`."""
    return value_is_finite(gain, GlobalNormClip.total(norms))


def value_is_finite(gain: Optional[LrGain], array: mx.nd.NDArray, flag: bool = False) -> bool:
    """Whether the (1,) `array` (a flag when `flag`: 1 for finite) holds a finite value: one
    host read, which also brings the norms of `gain`'s update when they are pending."""
    if gain is None or not gain.pending():
        value = float(array.asscalar())
    else:
        value = gain.read_along(array)
    return bool(value) if flag else math.isfinite(value)


def build(attributes: Dict[str, Any], power: float) -> Optional[LrGain]:
    """The gain of an optimizer whose ``__dict__`` is `attributes` (None without a rule),
    resuming the state `pickled` kept there (which it removes)."""
    saved = attributes.pop('_lr_scaling_state', None)
    rule = attributes.setdefault('lr_scaling', None)       # pickled before it existed
    if rule is None:
        return None
    state = None if saved is None else LrScalingState.from_dict(saved)
    return LrGain(LrScaling(rule, attributes.get('lr_scaling_smoothing', 0.999), power,
                            state))


def pickled(gain: Optional[LrGain], state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's pickled `state` with the gain's state (plain values) added."""
    if gain is not None:
        state['_lr_scaling_state'] = gain.piece.state.as_dict()
    return state


def check_args(rule: Any, smoothing: Any) -> None:
    check_choice('lr_scaling', rule, (None,) + RULES)
    check_real('lr_scaling_smoothing', smoothing, 0.0, 1.0, open_max=True)


def refuse_without_trainer(owner: str, rule: Any) -> None:
    raise ValueError(
        "%s(lr_scaling=%r) needs a gluon Trainer (gluon.Trainer, Horovod's "
        'DistributedTrainer or mx_lbsgd.ShardedTrainer), which says where each update '
        "begins and how many workers reduce it; Module.fit and bare Updaters are not "
        'supported yet. Use lr_scaling=None and scale the learning rate yourself'
        % (owner, rule))
