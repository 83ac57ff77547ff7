"""The ``lr_scaling`` gain of each update (`lr_scaling` over `noise_probe`), and the
goodput-chosen window of ``batch_scale='auto'`` (`batch_choice`): one estimator, fed by a
gluon Trainer's step or by a Module's micro-batches through the two adapters of
`gain_feeds`.

Per update under a Trainer (`gluon.binding` -> the shell -> `gain_feeds.TrainerFeed` ->
here)::

    each micro-batch, first:                  a window begins: take the chosen length
    each micro-batch, before the reduction:   probe the local norms      (measuring)
    the reduction that closes the window:     probe the reduced norm     (measuring), with
                                              the last window's seconds riding along
    begin_step:                               S = batch_scale x workers, base batch b
    the finite check (loss scaling):          read the flag and the norms together
    the first Updater call of the update:     read the norms (no loss scaling), estimate,
                                              gain = rule(S), progress += S or r;
                                              'auto': count the window's seconds, and every
                                              few updates choose the next length
    a skipped update:                         nothing is estimated, advanced or chosen

Under Module or a bare Updater no Trainer says where an update begins; the step gate holds
each micro-batch's calls together, and `gain_feeds.ModuleFeed` takes the norms of the
gradients the Updater passes (already reduced over the devices and workers: the base batch
is the Module's batch, 1 / rescale_grad, and S = batch_scale): each micro-batch's, and at
the window's end the accumulated window's (at S = 1, the difference estimator's, read with
the loss scaler's flag when there is one).

Measuring ('adascale', or ``batch_scale='auto'``) costs one pass over the gradients per
micro-batch and one over the reduced gradient (at S = 1 on one device, the difference
estimator's four passes and a float32 copy of the gradients instead), a reduction of a few
numbers over the workers (so that every worker computes the same gain and chooses the same
window), and one host read per update, which is the loss scaler's flag read when there is
one; 'linear' and 'sqrt' alone read nothing. A window's seconds are the host time between
two updates' reads.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import mxnet as mx

from .. import _kernels
from .._checks import check_choice, check_real
from . import noise_probe as _probe
from .batch_choice import BatchChoice, BatchChoiceState
from .clip import GlobalNormClip, StepNorms
from .lr_scaling import RULES, LrScaling, LrScalingState


@dataclasses.dataclass
class _Update:
    """The update begun: its scale and norms, read once."""

    scale: float
    observation: Optional[_probe.Observation]
    length: int
    #: the length of the window whose seconds ride along with the norms (0: none)
    timed: int = 0
    values: Optional[List[float]] = None
    gain: Optional[float] = None


class LrGain:
    """See the module docstring. `piece` holds the rule and its state; `chooser` the
    window choice (``batch_scale='auto'``) or None; `clock` gives host seconds."""

    def __init__(self, piece: LrScaling, chooser: Optional[BatchChoice] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.piece, self.chooser = piece, chooser
        self._clock = clock
        #: the norms' probe, made at the first micro-batch measured
        self.probe: Optional[_probe.NormProbe] = None
        self._update: Optional[_Update] = None
        # the host time of the last update's read ('auto'); the length of the window whose
        # seconds went out with the last reduction
        self._last_read: Optional[float] = None
        self._timed = 0
        # a checkpoint's previous gradient (difference estimator), for a one-device probe
        self._saved_previous: Optional[Tuple[float, list]] = None

    @property
    def measures(self) -> bool:
        """Whether the updates' gradient norms are taken."""
        return self.piece.measures or self.chooser is not None

    def pending_small(self) -> Optional[Tuple[int, List[Tuple[float, float]]]]:
        """(devices, [(sum of squares, factor)] of the small norms taken so far in an open
        window): what a checkpoint in the middle of a window keeps (one host read)."""
        if self.probe is None or not self.probe.small:
            return None
        values = _probe.read([a for a, _ in self.probe.small])
        return self.probe.devices, [(v, f) for v, (_, f) in zip(values, self.probe.small)]

    def restore_small(self, devices: int, pairs: List[Tuple[float, float]]) -> None:
        """Resume `pending_small` (a checkpoint saved in the middle of a window); the sums
        were float32, so they come back exactly."""
        self._ensure_probe(devices)
        cast(_probe.NormProbe, self.probe).small = [
            (mx.nd.array([v], dtype='float32'), float(f)) for v, f in pairs]

    def previous_gradient(self) -> Optional[Tuple[float, list]]:
        """The difference estimator's last gradient (a checkpoint keeps it), or None."""
        if self._saved_previous is not None:
            return self._saved_previous
        previous = None if self.probe is None else self.probe.previous
        return None if previous is None else previous.saved()

    def restore_previous(self, saved: Tuple[float, list]) -> None:
        """Resume `previous_gradient` at the next micro-batch, if the Trainer has one
        device."""
        self._saved_previous = (float(saved[0]), list(saved[1]))
        if self.probe is not None and self.probe.previous is not None:
            self.probe.previous.forget()

    def _ensure_probe(self, devices: int) -> None:
        if self.probe is None or self.probe.devices != devices:
            self.probe = _probe.NormProbe(devices, small_every=1, difference=True)

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
        self._read_at(update)
        update.values = values[1:]
        return values[0]

    def _read_at(self, update: _Update) -> None:
        """An update's read ended: ('auto') the window since the last read is timed."""
        if self.chooser is None:
            return
        now = self._clock()
        if self._last_read is not None:
            self.chooser.state.unsent = [update.length, now - self._last_read]
        self._last_read = now

    def gain(self) -> float:
        """The lr gain of the update begun: estimated and accounted once, at its first
        Updater call (the step applies; a skipped one never comes here)."""
        update = self._update
        if update is None:
            raise RuntimeError('lr_scaling: an update began without begin_step')
        if update.gain is None:
            seen, base = update.observation, 1.0
            if seen is not None:
                self.read_pending()
                norms = seen.resolve(cast(List[float], update.values))
                base = norms.b_worker
                if not math.isfinite(norms.big_raw):   # skipped (clipping), or applied as is
                    update.gain = self.piece.gain(update.scale, base)
                    return update.gain
                if all(map(math.isfinite, norms.small + [norms.big])):
                    self.piece.observe(norms.small, norms.big, norms.b_small, norms.b_big,
                                       update.scale, biased=norms.biased)
                if self.chooser is not None:
                    if update.timed and norms.extra:
                        self.chooser.measured(update.timed, norms.extra[0])
                    self.chooser.applied(base, seen.workers,
                                         self.piece.state.moments.noise_scale)
            update.gain = self.piece.advance(update.scale, base)
        return update.gain

    def read_pending(self) -> None:
        """Read the norms of the update begun, unless read already (one host read)."""
        update = self._update
        if update is not None and update.observation is not None and update.values is None:
            update.values = _probe.read(update.observation.arrays())
            self._read_at(update)

    def start_update(self, scale: float, observation: Optional[_probe.Observation],
                     length: int) -> None:
        """An update of `length` micro-batches at S = `scale` begins, with its norms
        `observation` (None: not measured); the last window's seconds ride along."""
        self._update = _Update(scale=scale, observation=observation, length=length,
                               timed=self._timed)
        self._timed = 0

    def take_window(self, micro_batches: Callable[[], int]) -> Optional[int]:
        """At a window boundary ('auto'): the chosen length, which takes effect (None: the
        length stays); `micro_batches` counts the micro-batches so far."""
        if self.chooser is not None and self.chooser.state.pending is not None:
            # (only then: counting the micro-batches is a pass over the parameters)
            return self.chooser.window_begins(micro_batches())
        return None

    def probe_of(self, devices: int) -> _probe.NormProbe:
        """The probe (made for `devices` devices if there is none yet), with a checkpoint's
        previous gradient put back (one device: the difference estimator's)."""
        if self.probe is None:
            self.probe = _probe.NormProbe(devices, small_every=1, difference=True)
        probe = self.probe
        if self._saved_previous is not None:
            if probe.devices == 1:
                cast(_probe.PreviousGradient, probe.previous).restore(*self._saved_previous)
            self._saved_previous = None
        return probe

    def unsent_seconds(self) -> Tuple[float, ...]:
        """('auto') the seconds of the last window timed on this worker, which go with this
        update's norms (reduced with them, on several workers)."""
        if self.chooser is None:
            return ()
        unsent, self.chooser.state.unsent = self.chooser.state.unsent, None
        self._timed, seconds = unsent if unsent is not None else (0, math.nan)
        return (seconds,)

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
    if gain is None or not gain.pending():
        return _kernels.all_finite_now(grads, fused)
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
    resuming the states `pickled` kept there (which it removes). With a chooser, the
    optimizer's window length is then ``gain.chooser.state.window``."""
    saved = attributes.pop('_lr_scaling_state', None)
    chosen = attributes.pop('_batch_choice_state', None)
    rule = attributes.setdefault('lr_scaling', None)       # pickled before it existed
    bounds = attributes.setdefault('batch_scale_bounds', None)
    if rule is None:
        return None
    state = None if saved is None else LrScalingState.from_dict(saved)
    chooser = None
    if bounds is not None:
        chooser = BatchChoice(tuple(bounds), attributes.get('batch_scale_interval', 16),
                              None if chosen is None else BatchChoiceState.from_dict(chosen))
    return LrGain(LrScaling(rule, attributes.get('lr_scaling_smoothing', 0.999), power,
                            state), chooser)


def pickled(gain: Optional[LrGain], state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's pickled `state` with the gain's and the chooser's states (plain
    values) added."""
    if gain is not None:
        state['_lr_scaling_state'] = gain.piece.state.as_dict()
        if gain.chooser is not None:
            state['_batch_choice_state'] = gain.chooser.state.as_dict()
    return state


def check_args(rule: Any, smoothing: Any) -> None:
    check_choice('lr_scaling', rule, (None,) + RULES)
    check_real('lr_scaling_smoothing', smoothing, 0.0, 1.0, open_max=True)


def refuse_kvstore_updates(owner: str, rule: Any, auto: bool) -> None:
    """Raise the refusal of ``lr_scaling`` where a kvstore updates the weights."""
    raise ValueError(
        "%s(lr_scaling=%r%s) cannot run on the kvstore's servers, which update key by key "
        "and never see a whole update; use gluon.Trainer(..., update_on_kvstore=False) "
        '(Module: kvstore=None, or the environment variable MXNET_UPDATE_ON_KVSTORE=0)'
        % (owner, rule, ", batch_scale='auto'" if auto else ''))


def windows(gain: Optional[LrGain]) -> Optional[BatchChoiceState]:
    """The window lengths taken so far (``batch_scale='auto'``), else None."""
    return None if gain is None or gain.chooser is None else gain.chooser.state
