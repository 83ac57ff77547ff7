"""The goodput-chosen window (``batch_scale='auto'``): Pollux's batch-size choice, made over
the accumulation window with the noise scale that ``lr_scaling`` already estimates.

An update applies a window of B micro-batches of b examples on each of W workers::

    examples     M(B) = B * b * W
    seconds      T(B) = B * t_micro + t_update        # fitted to measured windows
    efficiency   E(B) = (B_noise + b) / (B_noise + M(B))
    goodput      G(B) = E(B) * M(B) / T(B)            # examples of base-batch progress per s

E is the progress an example makes at M(B) relative to one at the base batch b (it is
AdaScale's r / S), so G counts base-batch progress per second. Every ``interval`` applied
updates the window length becomes the B in ``[lo, hi]`` and in ``[B / 2, 2 B]`` with the
largest G, if it beats the current one's by ``margin``; it takes effect at the next window.

``t_micro`` (forward, backward and accumulation of one micro-batch) and ``t_update`` (the
reduction, the update and the step's host read) are the least-squares line through the mean
seconds of each window length of 2 or more measured so far. A window of 1 has no
accumulation pass (its gradient is reduced as it is), so its own measured time stands for
it, off the line (a line through 1 and 2 overestimates every longer window). While the
line lacks points (fewer than two lengths of 2 or more measured, where the bounds hold
two), the choice is twice the current length (half of it at hi), whatever the goodput; a
length whose measurement shows it slower is left at the next choice. Window seconds are
host times between consecutive updates' host reads: the reads wait for the window's work,
so the time between them is the window's period.

Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning"
(OSDI 2021). AdaptDL (Pollux's code, PyTorch) picks the per-replica batch and the
accumulation steps from a fitted model of compute and network time with overlap, and re-fits
every 30 s on rank 0; here the micro-batch size is the user's, only the window length
changes, and the choice is made from values that are the same on every worker (the seconds
are reduced with the gradient norms), so every worker takes the same length at the same
update without a broadcast.

No mxnet here: plain values, and the state (`BatchChoiceState`) pickles and goes into
checkpoints as a dict.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Sequence, Tuple

from .._checks import check_int

#: running means of window seconds weigh at most this many windows (so they follow drift)
MEAN_WINDOWS = 32
#: after this many windows of a length, a window above OUTLIER x its mean is not counted
#: (an evaluation or a checkpoint between two updates)
OUTLIER = 3.0
OUTLIER_AFTER = 4


@dataclasses.dataclass
class WindowTiming:
    """Measured seconds of windows of one length."""

    length: int
    count: int = 0
    seconds: float = 0.0        # running mean

    def add(self, seconds: float) -> bool:
        """Count one window; False (not counted) for a non-finite or outlying one."""
        if not math.isfinite(seconds) or seconds <= 0.0:
            return False
        if self.count >= OUTLIER_AFTER and seconds > OUTLIER * self.seconds:
            return False
        self.count += 1
        self.seconds += (seconds - self.seconds) / min(self.count, MEAN_WINDOWS)
        return True


@dataclasses.dataclass
class Segment:
    """Windows of one length: from micro-batch `first_micro_batch` (counted from the run's
    start, ``micro_batches``), after `first_update` applied updates."""

    first_micro_batch: int
    first_update: int
    length: int


@dataclasses.dataclass
class BatchChoiceState:
    """What the chooser has learned and done; resumed from checkpoints.

    ``segments``: the window lengths taken so far, each from where it started (the last one
    is the current length); ``timings``: measured seconds per length; ``pending``: a length
    chosen and not yet in effect (it starts with the next window); ``since_choice``: applied
    updates since the last choice; ``unsent``: a window timed on this worker whose seconds
    have not gone out with the norms yet.

    Examples
    --------
    >>> from mx_lbsgd.pipeline.batch_choice import BatchChoiceState
    >>> state = BatchChoiceState.start(2)
    >>> state.begin_window(micro_batches=0, length=4)     # at a window boundary
    >>> state.window, state.update_of(9), state.position(9)
    (4, 2, 1)
    >>> BatchChoiceState.from_dict(state.as_dict()) == state
    True
    """

    segments: List[Segment]
    timings: List[WindowTiming] = dataclasses.field(default_factory=list)
    pending: Optional[int] = None
    since_choice: int = 0
    #: [length, seconds] of the last window timed on this worker, not yet reduced
    unsent: Optional[list] = None

    @classmethod
    def start(cls, length: int) -> 'BatchChoiceState':
        return cls(segments=[Segment(0, 0, length)])

    @property
    def window(self) -> int:
        """The current window length."""
        return self.segments[-1].length

    def _segment(self, micro_batches: int) -> Segment:
        for segment in reversed(self.segments):
            if segment.first_micro_batch <= micro_batches:
                return segment
        return self.segments[0]

    def update_of(self, micro_batches: int) -> int:
        """Applied updates once `micro_batches` micro-batches were counted."""
        seg = self._segment(micro_batches)
        return seg.first_update + (micro_batches - seg.first_micro_batch) // seg.length

    def position(self, micro_batches: int) -> int:
        """Micro-batches of the open window once `micro_batches` were counted."""
        seg = self._segment(micro_batches)
        return (micro_batches - seg.first_micro_batch) % seg.length

    def begin_window(self, micro_batches: int, length: int) -> None:
        """Windows of `length` from micro-batch `micro_batches` on (a window boundary).
        Segments at or after it (a rewound skipped window) are replaced."""
        if self.position(micro_batches):
            raise RuntimeError('the window length changes inside a window (micro-batch %d)'
                               % micro_batches)
        first_update = self.update_of(micro_batches)
        while len(self.segments) > 1 and self.segments[-1].first_micro_batch >= micro_batches:
            self.segments.pop()
        if self.segments[-1].first_micro_batch >= micro_batches:
            self.segments[-1] = Segment(micro_batches, first_update, length)
        elif self.segments[-1].length != length:
            self.segments.append(Segment(micro_batches, first_update, length))

    def timing(self, length: int) -> WindowTiming:
        for timing in self.timings:
            if timing.length == length:
                return timing
        self.timings.append(WindowTiming(length))
        return self.timings[-1]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> 'BatchChoiceState':
        """The state `as_dict` gave; TypeError or ValueError for anything else."""
        fields = dict(saved)
        state = cls(segments=[Segment(**s) for s in fields.pop('segments')],
                    timings=[WindowTiming(**t) for t in fields.pop('timings', [])], **fields)
        if not _well_formed(state):
            raise TypeError('batch_scale state fields must be non-negative integers (window '
                            'lengths >= 1, segments in order) and seconds finite floats >= 0: '
                            '%r' % (saved,))
        return state


def _counts(state: BatchChoiceState) -> List[Any]:
    return [v for s in state.segments for v in dataclasses.astuple(s)] + \
        [t.length for t in state.timings] + [t.count for t in state.timings] + \
        [state.since_choice] + ([] if state.pending is None else [state.pending])


def _well_formed(state: BatchChoiceState) -> bool:
    if not state.segments or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                     for v in _counts(state)):
        return False
    lengths = [s.length for s in state.segments] + [t.length for t in state.timings] + \
        ([] if state.pending is None else [state.pending])
    starts = [s.first_micro_batch for s in state.segments]
    seconds_ok = all(isinstance(t.seconds, float) and math.isfinite(t.seconds)
                     and t.seconds >= 0.0 for t in state.timings)
    unsent = state.unsent
    unsent_ok = unsent is None or (len(unsent) == 2 and isinstance(unsent[0], int)
                                   and isinstance(unsent[1], float))
    return seconds_ok and unsent_ok and min(lengths) >= 1 and starts == sorted(set(starts))


def fit_window_time(timings: Sequence[WindowTiming]) -> Optional[Tuple[float, float]]:
    """(t_micro, t_update) of T(B) = B * t_micro + t_update through the measured mean
    seconds (least squares weighted by windows counted, both terms >= 0), None before any
    measurement; one length measured: half of its time each way. Once two lengths of 2 or
    more are measured, the line goes through those only: a window of 1 skips the
    accumulation (its one gradient is reduced as it is), so it lies below the line of the
    others, and a line through it and 2 overestimates the cost of every longer window
    (see the module docstring)."""
    seen = [t for t in timings if t.count > 0]
    if not seen:
        return None
    longer = [t for t in seen if t.length >= 2]
    if len(longer) >= 2:
        seen = longer
    if len(seen) == 1:
        t = seen[0]
        return t.seconds / (2.0 * t.length), t.seconds / 2.0
    weight = [float(min(t.count, MEAN_WINDOWS)) for t in seen]
    total = sum(weight)
    mean_b = sum(w * t.length for w, t in zip(weight, seen)) / total
    mean_t = sum(w * t.seconds for w, t in zip(weight, seen)) / total
    var_b = sum(w * (t.length - mean_b) ** 2 for w, t in zip(weight, seen))
    cov = sum(w * (t.length - mean_b) * (t.seconds - mean_t) for w, t in zip(weight, seen))
    slope = cov / var_b
    intercept = mean_t - slope * mean_b
    if intercept < 0.0 or slope <= 0.0:
        # the line through the origin (no per-update cost), or a flat one
        slope = max(sum(w * t.length * t.seconds for w, t in zip(weight, seen))
                    / sum(w * t.length ** 2 for w, t in zip(weight, seen)), 0.0)
        intercept = 0.0 if slope > 0.0 else mean_t
    return slope, intercept


def single_window_time(timings: Sequence[WindowTiming]) -> Optional[float]:
    """The measured seconds of a window of 1 when the line leaves it out
    (`fit_window_time`), else None (the line gives it)."""
    seen = {t.length: t for t in timings if t.count > 0}
    if 1 not in seen or len([n for n in seen if n >= 2]) < 2:
        return None
    return seen[1].seconds


def goodput(length: int, t_micro: float, t_update: float, base_batch: float, workers: int,
            noise_scale: float, seconds: Optional[float] = None) -> float:
    """G(B) of the module docstring (base-batch examples per second); `seconds`: T(B) when
    measured apart from the line."""
    examples = length * base_batch * workers
    if seconds is None:
        seconds = length * t_micro + t_update
    efficiency = 1.0 if math.isinf(noise_scale) else \
        (noise_scale + base_batch) / (noise_scale + examples)
    return efficiency * examples / seconds if seconds > 0.0 else 0.0


def choose_window(current: int, bounds: Tuple[int, int], t_micro: float, t_update: float,
                  base_batch: float, workers: int, noise_scale: float,
                  margin: float = 0.02, single: Optional[float] = None) -> int:
    """The window length to take next (see the module docstring): `current` unless another
    in the bounds and within a factor 2 of it has `margin` more goodput. `single`: the
    measured seconds of a window of 1 (`single_window_time`), else the line's."""
    current = min(max(current, bounds[0]), bounds[1])
    low = max(bounds[0], -(-current // 2))
    high = min(bounds[1], 2 * current)

    def of(length: int) -> float:
        return goodput(length, t_micro, t_update, base_batch, workers, noise_scale,
                       single if length == 1 else None)

    best = max(range(low, high + 1), key=lambda b: (of(b), -abs(b - current)))
    return best if of(best) > (1.0 + margin) * of(current) else current


class BatchChoice:
    """The chooser: `measured` counts a window's seconds, `applied` an update and, every
    `interval` of them, chooses the next window length (see the module docstring).

    Parameters
    ----------
    bounds : (int, int)
        The window lengths allowed, lo <= hi.
    interval : int >= 1
        Applied updates between choices.
    state : BatchChoiceState, optional

    Examples
    --------
    >>> from mx_lbsgd.pipeline.batch_choice import BatchChoice
    >>> chooser = BatchChoice((1, 8), interval=2)
    >>> chooser.measured(1, 0.010)          # a window of 1 micro-batch took 10 ms
    >>> chooser.applied(base_batch=32, workers=2, noise_scale=1e4)
    >>> chooser.applied(base_batch=32, workers=2, noise_scale=1e4)   # the choice: double
    >>> chooser.state.pending
    2
    """

    def __init__(self, bounds: Tuple[int, int], interval: int,
                 state: Optional[BatchChoiceState] = None) -> None:
        self.bounds, self.interval = bounds, interval
        self.state = state if state is not None else BatchChoiceState.start(bounds[0])

    def measured(self, length: int, seconds: float) -> None:
        """A window of `length` micro-batches took `seconds` (NaN: unknown)."""
        self.state.timing(length).add(seconds)

    def applied(self, base_batch: float, workers: int, noise_scale: Optional[float]) -> None:
        """An update was applied; every `interval` of them, choose (into ``pending``).
        While the line lacks points (`exploring`), the choice is twice the current length
        (half of it at hi), whatever the goodput, once the current one is measured."""
        state = self.state
        state.since_choice += 1
        if state.since_choice < self.interval or noise_scale is None or not base_batch > 0:
            return
        exploring = self.exploring()
        fit = fit_window_time(state.timings)
        if fit is None or (exploring and not any(t.length == state.window and t.count
                                                 for t in state.timings)):
            return                          # the length taken last is not measured yet
        state.since_choice = 0
        if exploring:
            low, high = self.bounds
            window = state.window
            neighbour = min(2 * window, high) if window < high else max(-(-window // 2), low)
            state.pending = neighbour if neighbour != window else None
            return
        chosen = choose_window(state.window, self.bounds, fit[0], fit[1], base_batch,
                               workers, noise_scale,
                               single=single_window_time(state.timings))
        state.pending = chosen if chosen != state.window else None

    def exploring(self) -> bool:
        """Whether the line still lacks points: fewer than two lengths measured, or (where
        the bounds hold two lengths of 2 or more) fewer than two such lengths."""
        low, high = self.bounds
        measured = [t.length for t in self.state.timings if t.count > 0]
        longer = len([n for n in measured if n >= 2])
        return low < high and (len(measured) < 2 or longer < min(2, high - max(low, 2) + 1))

    def window_begins(self, micro_batches: int) -> int:
        """A window begins after `micro_batches` micro-batches: take the pending length.
        Returns the window length."""
        state = self.state
        if state.pending is not None and state.position(micro_batches) == 0:
            state.begin_window(micro_batches, state.pending)
            state.pending = None
        return state.window


def capacity(batch_scale: int, bounds: Optional[Tuple[int, int]]) -> int:
    """The longest window: `batch_scale`, or hi of 'auto''s bounds."""
    return batch_scale if bounds is None else bounds[1]


def check_args(batch_scale: Any, bounds: Any, interval: Any,
               lr_scaling: Any) -> Tuple[int, Optional[Tuple[int, int]]]:
    """(the first window length, the bounds) of ``batch_scale`` (an integer >= 1: it and
    None; 'auto' with ``batch_scale_bounds`` and an ``lr_scaling`` rule: lo and (lo, hi));
    a ValueError or TypeError that names the parameter otherwise."""
    check_int('batch_scale_interval', interval, 1)
    if isinstance(batch_scale, str):
        if batch_scale != 'auto':
            raise ValueError("batch_scale=%r is not supported; expected an integer >= 1 or "
                             "'auto'" % (batch_scale,))
    else:
        check_int('batch_scale', batch_scale, 1)
        if bounds is not None:
            raise ValueError("batch_scale_bounds=%r needs batch_scale='auto'; got "
                             'batch_scale=%r' % (bounds, batch_scale))
        return int(batch_scale), None
    if bounds is None:
        raise ValueError("batch_scale='auto' needs batch_scale_bounds=(lo, hi): the window "
                         'lengths in micro-batches it may choose, integers 1 <= lo <= hi')
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise TypeError('batch_scale_bounds must be a pair (lo, hi) of integers >= 1; got %r'
                        % (bounds,))
    low = check_int('batch_scale_bounds[0]', bounds[0], 1)
    high = check_int('batch_scale_bounds[1]', bounds[1], 1)
    if low > high:
        raise ValueError('batch_scale_bounds must be ordered, lo <= hi; got %r' % (bounds,))
    if lr_scaling is None:
        raise ValueError("batch_scale='auto' needs lr_scaling='adascale', 'linear' or "
                         "'sqrt': the rule that sets the lr of each window length "
                         "('adascale' follows the measured gain)")
    return low, (low, high)
