"""Why a loss-scaled step was skipped: an `OverflowReport` per skipped step, at no cost on
finite steps.

The step's one finite flag decides; only when it says "not finite" is the detail computed,
on the devices, and read back only when someone looks at it::

    per gradient copy: inf = count(|g| == inf), nan = count(g != g)      # kernels, no read
    looked at (last_overflow, history, tally, a log record, the warning): one host read of
        those counts and of the device-side flags kept before the reduction, then
    per parameter: kind = 'inf' | 'nan' | 'inf+nan' (over its device copies),
                   count = the most non-finite elements in one copy

PyTorch's GradScaler keeps one found-inf flag per device and tells nothing more; DeepSpeed
logs "OVERFLOW! Rank 0 Skipping step" on rank 0 with the old and new scale. Here the report
names the parameters, kinds, counts, micro-batch, step, scale and rank, and says what the
reduction hid (`OverflowReport.note`).

Where each alert goes, one channel each:

- a skipped step: an INFO record on logger 'mx_lbsgd' (at most one per ``log_interval``
  seconds), whose text (``str(report)``) names the `NAMED_OFFENDERS` parameters with the
  most non-finite values and "and N more"; the record carries the whole report
  (``record.overflow_report``), as ``last_overflow`` and ``overflow_history`` do;
- the falling-scale alert (`DynamicLossScaler`'s warn_* rules): ``alert='warn'`` (the
  default) warns with `LossScaleFallingWarning` (a `RuntimeWarning`: filter it, or make it
  an error, with `warnings`), ``alert='log'`` writes a WARNING record on 'mx_lbsgd' instead
  (``record.offenders``); never both.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
import types
import warnings
from typing import (TYPE_CHECKING, Any, Callable, Counter, Deque, Dict, Iterable, List,
                    Mapping, Optional, Protocol, Sequence, Tuple, cast, runtime_checkable)

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat

if TYPE_CHECKING:
    from .scaler import DynamicLossScaler

_log = logging.getLogger('mx_lbsgd')

#: defaults of the optimizers' and LossScaling's overflow settings
HISTORY_SIZE = 32
LOG_INTERVAL = 30.0       # seconds between two log records of skipped steps
TOP_OFFENDERS = 3         # parameters the falling-scale alert names
NAMED_OFFENDERS = 5       # parameters the text of a skipped step's report names
#: where the falling-scale alert goes (``overflow_alert`` / ``LossScaling(alert=...)``)
ALERT_CHANNELS = ('warn', 'log')
ALERT = 'warn'


class LossScaleFallingWarning(RuntimeWarning):
    """The loss scale keeps falling (see `DynamicLossScaler`'s warn_* settings).
    ``offenders``: [(parameter name, skipped steps it overflowed in)], most first.

    A `RuntimeWarning`: the optimizers and `LossScaling` warn with it once per descent
    (``warnings.filterwarnings('error', category=mx_lbsgd.LossScaleFallingWarning)`` stops a
    run there), unless they were created with ``overflow_alert='log'`` (optimizers) /
    ``alert='log'`` (`LossScaling`), which write the same text as a WARNING record on
    logger 'mx_lbsgd' instead.

    Parameters
    ----------
    message : str
    offenders : iterable of (str, int), default ()

    Examples
    --------
    >>> import warnings
    >>> import mx_lbsgd
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter('always')
    ...     warnings.warn(mx_lbsgd.LossScaleFallingWarning(
    ...         'loss scale falling', [('fc_weight', 7), ('fc_bias', 2)]))
    >>> caught[0].category.__name__, caught[0].message.offenders[0]
    ('LossScaleFallingWarning', ('fc_weight', 7))
    """

    def __init__(self, message: str, offenders: Iterable[Tuple[str, int]] = ()) -> None:
        super().__init__(message)
        self.offenders = list(offenders)


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """One skipped loss-scaled step (a frozen dataclass; ``str()`` gives one line, which
    names the `NAMED_OFFENDERS` (5) parameters with the most non-finite values and "and N
    more"; `parameters` and `counts` hold every one).

    Parameters
    ----------
    step : int
        The loss scaler's step number (1-based, skipped steps included; with a window
        at the Trainer one step is one window).
    scale : float
        The scale the gradients carried.
    scale_after : float
        The scale after this step's backoff.
    parameters : mapping
        {name: 'inf' | 'nan' | 'inf+nan'}, ordered by count, most first.
    counts : mapping
        {name: non-finite elements}, in the same order.
    micro_batch : int or None
        1..batch_scale when batch_scale > 1 and it is known, else None.
    rank, num_workers : int or None, int
        This worker's rank under dist_sync or Horovod (None, 1 alone).
    originated_here : bool or None
        True when this worker's own gradients held non-finite values before the
        reduction, False when they did not, None when that cannot be known.
    note : str
        What was checked and what the reduction hid.

    Examples
    --------
    The optimizers and `LossScaling` make them (``last_overflow``, ``overflow_history``);
    one by hand:

    >>> import mx_lbsgd
    >>> report = mx_lbsgd.OverflowReport(
    ...     step=3, scale=65536.0, scale_after=32768.0,
    ...     parameters={'fc_weight': 'inf+nan'}, counts={'fc_weight': 5},
    ...     rank=1, num_workers=2)
    >>> print(report)
    step 3 skipped (loss scale 65536 -> 32768), rank 1 of 2: fc_weight inf+nan (5).
    >>> dict(report.counts), report.originated_here
    ({'fc_weight': 5}, None)

    Seven parameters overflowed: the line names the five with the most values, the report
    keeps all seven:

    >>> counts = {'p%d' % i: 10 - i for i in range(7)}
    >>> big = mx_lbsgd.OverflowReport(step=4, scale=8.0, scale_after=4.0,
    ...                               parameters={n: 'inf' for n in counts}, counts=counts)
    >>> print(big)
    step 4 skipped (loss scale 8 -> 4): p0 inf (10), p1 inf (9), p2 inf (8), p3 inf (7),
    p4 inf (6) and 2 more.
    >>> len(big.parameters)
    7
    """
    step: int
    scale: float
    scale_after: float
    parameters: Mapping[str, str]
    counts: Mapping[str, int]
    micro_batch: Optional[int] = None
    rank: Optional[int] = None
    num_workers: int = 1
    originated_here: Optional[bool] = None
    note: str = ''

    def __str__(self) -> str:
        where = '' if self.rank is None else ', rank %d of %d' % (self.rank, self.num_workers)
        if self.micro_batch is not None:
            where += ', micro-batch %d' % self.micro_batch
        named = list(self.parameters.items())[:NAMED_OFFENDERS]
        found = ', '.join('%s %s (%d)' % (n, k, self.counts[n])
                          for n, k in named) or 'no parameter named'
        if len(self.parameters) > NAMED_OFFENDERS:
            found += ' and %d more' % (len(self.parameters) - NAMED_OFFENDERS)
        return 'step %d skipped (loss scale %g -> %g)%s: %s.%s' % (
            self.step, self.scale, self.scale_after, where, found,
            ' ' + self.note if self.note else '')


def _device_values(grads: Sequence[nd.NDArray],
                   local_flags: Optional[Mapping[int, nd.NDArray]]) -> Optional[nd.NDArray]:
    """One float32 vector on the CPU, computed on the devices without a host read: per
    gradient its inf and nan counts (fp16 counted in fp32, exact to 2**24 per tensor), then
    the local flags in key order."""
    parts = []
    for g in grads:
        g = g.data if g.stype != 'default' else g
        if g.dtype == np.float16:
            g = g.astype(np.float32)
        parts += [(nd.abs(g) == np.inf).sum(), (g != g).sum()]
    flags = local_flags or {}
    parts += [flags[k] for k in sorted(flags)]
    if not parts:
        return None
    return nd.concat(*[p.astype(np.float32, copy=False).as_in_context(mx.cpu())
                       for p in parts], dim=0)


def _by_parameter(names: Sequence[str],
                  counts: Sequence[Tuple[int, int]]) -> Dict[str, Tuple[str, int]]:
    """{name: (kind, count)} ordered by count, most first; copies of one parameter merge
    (kind over the copies, count of the copy with the most)."""
    merged: Dict[str, Tuple[bool, bool, int]] = {}
    for name, (inf, nan) in zip(names, counts):
        if inf or nan:
            had_inf, had_nan, most = merged.get(name, (False, False, 0))
            merged[name] = (had_inf or inf > 0, had_nan or nan > 0, max(most, inf + nan))
    order = sorted(merged, key=lambda n: (-merged[n][2], n))
    return {n: ('inf+nan' if merged[n][0] and merged[n][1] else 'inf' if merged[n][0]
                else 'nan', merged[n][2]) for n in order}


class _Pending:
    """A skipped step's report as device values; `report()` reads them (one host read) the
    first time someone looks: `last_overflow`, the history, a log record, the tally."""

    def __init__(self, names: List[str], values: Optional[nd.NDArray], local_keys: List[int],
                 meta: Dict[str, Any]) -> None:
        self._names, self._values, self._keys, self._meta = names, values, local_keys, meta
        self._report: Optional[OverflowReport] = None

    def report(self) -> OverflowReport:
        if self._report is None:
            host = ([] if self._values is None
                    else self._values.asnumpy().astype(np.int64).tolist())
            n = len(self._names)
            counts = [(host[2 * j], host[2 * j + 1]) for j in range(n)]
            flags = dict(zip(self._keys, (bool(v) for v in host[2 * n:])))
            found = _by_parameter(self._names, counts)
            meta = dict(self._meta)
            micro_batch, here, note = _locate(flags=flags, **meta.pop('where'))
            self._report = OverflowReport(
                parameters=types.MappingProxyType({k: v for k, (v, _) in found.items()}),
                counts=types.MappingProxyType({k: c for k, (_, c) in found.items()}),
                micro_batch=micro_batch, originated_here=here, note=note, **meta)
            self._values = None
        return self._report


def _locate(*, flags: Dict[int, bool], micro_batch: Optional[int], num_workers: int,
            window: int, shard: bool = False) -> Tuple[Optional[int], Optional[bool], str]:
    """(micro_batch, originated_here, note) from what this worker can know; `flags`:
    {micro-batch (0: the step): finite?} of this worker's gradients before the reduction."""
    failed = [k for k, ok in flags.items() if not ok]
    distributed = num_workers > 1
    notes = ['This rank checked its own gradients of every parameter, before the '
             'reduce-scatter (a ShardedTrainer); a rank whose gradients were finite names '
             'none.'] if shard else []
    # the engine sums (kvstore servers, Horovod on CPU/gloo) or averages (Horovod with
    # NCCL >= 2.10); a positive factor changes no kind or count, so the note names both
    reduced = (' reduced over %d workers (their sum, or their mean where the allreduce '
               'averages)' % num_workers if distributed else '')
    if window:
        micro_batch = min(failed) if failed and min(failed) > 0 else None
        notes.append('Checked: the mean of the window of %d micro-batches%s, so kinds and '
                     'counts are those of the values checked (inf + -inf = nan).'
                     % (window, reduced))
    elif distributed:
        notes.append('Checked: the gradients%s, so kinds and counts are those of the values '
                     'checked (inf + -inf = nan).' % reduced)
    if not distributed:
        return micro_batch, True, ' '.join(notes)
    if not flags:
        notes.append("Whether this worker's own gradients overflowed is not known: the "
                     'reduction overwrote them (check_local_overflow=True keeps one '
                     'device-side flag per step to know it).')
        return micro_batch, None, ' '.join(notes)
    if failed:
        mine = ('micro-batch(es) %s' % ', '.join(map(str, failed)) if min(failed) > 0
                else 'gradients')
        notes.append("This worker's own %s held non-finite values before the reduction; "
                     'whether other workers did too is not known without communication.'
                     % mine)
        return micro_batch, True, ' '.join(notes)
    notes.append("This worker's gradients were finite before the reduction: another worker's "
                 '(which one is not known without communication) or the reduction itself (an '
                 'fp16 sum can overflow) produced the non-finite values.')
    return micro_batch, False, ' '.join(notes)


@runtime_checkable
class OverflowViews(Protocol):
    """`last_overflow`, `overflow_history` and `overflow_tally`: what the loss-scaled
    optimizers and the LossScaling hook report of their `OverflowMonitor` (each delegates
    the three to its monitor). ``isinstance`` checks an object for the three.

    Examples
    --------
    >>> import mx_lbsgd
    >>> from mx_lbsgd.loss_scaling import OverflowViews
    >>> opt = mx_lbsgd.LossScaledSGD()
    >>> isinstance(opt, OverflowViews), opt.last_overflow, len(opt.overflow_history)
    (True, None, 0)
    """

    @property
    def last_overflow(self) -> Optional[OverflowReport]:
        """The `OverflowReport` of the last step if it was skipped, else None."""

    @property
    def overflow_history(self) -> Deque[OverflowReport]:
        """The last reports (a deque, oldest first)."""

    @property
    def overflow_tally(self) -> Counter[str]:
        """How many skipped steps each parameter overflowed in, as a Counter (by name)."""


class OverflowMonitor:
    """The reports of one optimizer or hook: `last`, a bounded `history`, a `tally` of the
    skipped steps each parameter overflowed in, rate-limited log records and the early
    warning (the scaler's alert, with the top offenders), in one channel.

    A skipped step only launches the counting kernels; the host read waits until a report
    is looked at, logged (INFO enabled for 'mx_lbsgd'), warned about, or is about to leave
    the history untallied.

    Parameters
    ----------
    history_size : int >= 0, default 32
        Reports kept in `history`.
    log_interval : float >= 0, default 30
        Seconds between two log records of skipped steps (logger 'mx_lbsgd', INFO).
    alert : {'warn', 'log'}, default 'warn'
        Where the falling-scale alert goes: ``warnings.warn(LossScaleFallingWarning)``, or
        a WARNING record on logger 'mx_lbsgd' (the module docstring); checked by the
        optimizers and `LossScaling` (ValueError naming their parameter).

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd import DynamicLossScaler
    >>> from mx_lbsgd.loss_scaling import OverflowMonitor
    >>> scaler = DynamicLossScaler(init_scale=16.0)
    >>> monitor = OverflowMonitor(history_size=4)
    >>> grads = [('fc_weight', nd.array([1.0, float('inf'), float('nan')])),
    ...          ('fc_bias', nd.array([0.5]))]
    >>> scaler.update(found_overflow=True)
    False
    >>> monitor.skipped(scaler=scaler, scale=16.0, named_grads=grads)
    >>> print(monitor.last)
    step 1 skipped (loss scale 16 -> 8): fc_weight inf+nan (2).
    >>> monitor.tally
    Counter({'fc_weight': 1})
    >>> monitor.finite()                     # a finite step: no last report
    >>> monitor.last is None, len(monitor.history)
    (True, 1)
    """

    def __init__(self, history_size: int = HISTORY_SIZE,
                 log_interval: float = LOG_INTERVAL, alert: str = ALERT) -> None:
        self.history_size = history_size
        self.alert = alert
        self._tally: Counter[str] = collections.Counter()
        self.log_interval = log_interval
        self._last: Optional[_Pending] = None
        self._recent: Deque[_Pending] = collections.deque(maxlen=history_size)
        self._untallied: Deque[_Pending] = collections.deque()
        self._clock: Callable[[], float] = time.monotonic
        self._last_log: Optional[float] = None
        self._suppressed = 0

    @property
    def last(self) -> Optional[OverflowReport]:
        """The report of the last step if it was skipped, else None."""
        return None if self._last is None else self._last.report()

    @property
    def history(self) -> Deque[OverflowReport]:
        """The last `history_size` reports, oldest first."""
        return collections.deque((p.report() for p in self._recent), maxlen=self.history_size)

    @property
    def tally(self) -> Counter[str]:
        """How many skipped steps each parameter overflowed in, as a Counter (by name)."""
        self._settle(len(self._untallied))
        return self._tally

    def finite(self) -> None:
        """Account a finite step (`last` becomes None)."""
        self._last = None

    def skipped(self, *, scaler: DynamicLossScaler, scale: float,
                named_grads: Sequence[Tuple[str, nd.NDArray]], micro_batch: Optional[int] = None,
                local_flags: Optional[Mapping[int, nd.NDArray]] = None,
                rank: Optional[int] = None, num_workers: int = 1, window: int = 0,
                shard: bool = False) -> None:
        """Keep the report of a skipped step (device values), log it, warn on the scaler's
        alert. `window`: the window's size when the checked gradient is a Trainer window's
        mean. `shard`: this rank checked only the parameters it owns (a sharded Trainer)."""
        meta = dict(step=scaler.total_steps, scale=float(scale),
                    scale_after=float(scaler.scale), rank=rank, num_workers=int(num_workers),
                    where=dict(micro_batch=micro_batch, num_workers=int(num_workers),
                               window=window, shard=shard))
        pending = _Pending([n for n, _ in named_grads],
                           _device_values([g for _, g in named_grads], local_flags),
                           sorted(local_flags or ()), meta)
        self._last = pending
        self._recent.append(pending)
        self._untallied.append(pending)
        self._settle(len(self._untallied) - max(self.history_size, 1))
        self._log(pending)
        alert = scaler.take_alert()
        if alert:
            self._warn(alert)

    def report_skip(self, *, scaler: Any, scale: float,
                    named_grads: List[Tuple[str, nd.NDArray]], optimizer: Any = None,
                    trainer: Any = None, fallback_worker: Optional[Tuple[Any, int]] = None,
                    at_trainer: bool = False,
                    local_flags: Optional[Mapping[int, nd.NDArray]] = None) -> None:
        """Keep the report of a skipped step as the optimizers and the Trainer hook make it:
        the micro-batch when `optimizer` accumulates its window itself (not `at_trainer`),
        and the rank and worker count of `trainer`'s reduction (else `fallback_worker`, or
        Horovod's)."""
        rank, workers = step_worker(trainer, fallback_worker)
        batch_scale = getattr(optimizer, 'batch_scale', 1)
        micro_batch = None
        if batch_scale > 1 and not at_trainer and hasattr(optimizer, 'window_position'):
            micro_batch = optimizer.window_position + 1
        self.skipped(scaler=scaler, scale=scale, named_grads=named_grads,
                     micro_batch=micro_batch, local_flags=local_flags, rank=rank,
                     num_workers=workers, window=batch_scale if at_trainer else 0,
                     shard=hasattr(trainer, 'step_sum_of_squares'))

    def _settle(self, n: int) -> None:
        for _ in range(max(n, 0)):
            self._tally.update(self._untallied.popleft().report().parameters.keys())

    def _log(self, pending: _Pending) -> None:
        now = self._clock()
        if self._last_log is not None and now - self._last_log < self.log_interval:
            self._suppressed += 1
            return
        if not _log.isEnabledFor(logging.INFO):
            return
        report = pending.report()
        # (steps are suppressed only after a first record, so _last_log is set then)
        tail = ('' if not self._suppressed else ' [%d more skipped step(s) not logged in the '
                'last %.0f s]' % (self._suppressed, now - cast(float, self._last_log)))
        _log.info('%s%s', report, tail, extra={'overflow_report': report,
                                              'suppressed': self._suppressed})
        self._last_log, self._suppressed = now, 0

    def top_offenders(self, n: int = TOP_OFFENDERS) -> List[Tuple[str, int]]:
        return self.tally.most_common(n)

    def _warn(self, alert: str) -> None:
        """The falling-scale alert, in the one channel `alert` chose."""
        top = self.top_offenders()
        named = ', '.join('%s (%d step(s))' % item for item in top) or 'none named'
        message = ('%s. Parameters that overflowed most: %s. Lower the learning rate, clip '
                   'gradients, or look at these layers before the scale reaches min_scale.'
                   % (alert, named))
        if self.alert == 'log':
            _log.warning(message, extra={'offenders': top})
        else:
            warnings.warn(LossScaleFallingWarning(message, top), stacklevel=4)


def step_worker(trainer: Any = None,
                fallback: Optional[Tuple[Any, int]] = None) -> Tuple[Any, int]:
    """(rank or None, number of workers) of a step's reduction: `trainer`'s, else
    `fallback` (Module's kvstore), else Horovod's, else one worker."""
    if trainer is not None:
        return _compat.trainer_rank(trainer), _compat.trainer_worker_count(trainer, 1)
    return fallback or _compat.horovod_worker() or (None, 1)


def name_gradients(grads: Sequence[nd.NDArray], calls: Iterable[Tuple[Any, Any, Any, Any]],
                   name_of: Callable[[Any], Optional[str]],
                   param_dict: Mapping[Any, Any]) -> List[Tuple[str, nd.NDArray]]:
    """[(parameter name, gradient)] for an optimizer's checked gradients: names from the
    Updater calls' indices (`name_of`: Gluon's param_dict, Module's idx2name), then from
    every gradient copy of `param_dict`'s Parameters, else ``#k``."""
    names = {}
    for index, _, call_grads, _ in calls:
        for i, g in zip(index, call_grads):
            names[_compat.buffer_id(g)] = name_of(i) or str(i)
    for param in param_dict.values():
        try:
            copies = param.list_grad()
        except (RuntimeError, mx.MXNetError):      # grad_req='null', not initialized
            continue
        for g in copies:
            names[_compat.buffer_id(_compat.legacy(g))] = param.name
    return [(names.get(_compat.buffer_id(g), '#%d' % k), g) for k, g in enumerate(grads)]
