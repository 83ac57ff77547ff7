"""Counters and checkpoint progress: MXNet's per-parameter update counts, ``num_update``,
and the ledger of skipped steps, which together say where a run is.

MXNet counts every Updater call per parameter (``_index_update_count``, through
`mx_lbsgd._compat`); the shell reads the window position and the warmup position from those
counts, so that checkpoints (MXNet's own included) restore them. A skipped window rewinds
its micro-batches; `SkipLedger` keeps ``num_update`` (what an ``lr_scheduler`` sees) in step.
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional

import mxnet as mx

from .. import _compat
from ..loss_scaling.scaler import DynamicLossScaler

from .batch_choice import BatchChoiceState
from .lr_scaling import LrScalingState

if TYPE_CHECKING:
    from .lr_gain import LrGain
    from .warmup import Warmup


class SkipLedger:
    """The accounting of skipped steps, with its explicit state (pickled with the
    optimizer, restored from checkpoints)::

        on a skipped step of `window` micro-batches (B for a window reduced at a Trainer,
        else 1): num_update -= window - 1         # its micro-batches were counted as they came
            if count_skipped_steps: skipped_updates += window; num_update += window
        after each counted micro-batch: num_update >= top count + skipped_updates

    ``last_step_skipped`` says whether the last step was skipped.
    """

    def __init__(self, count_skipped_steps: bool = False) -> None:
        self.count_skipped_steps = bool(count_skipped_steps)
        self.skipped_updates = 0
        self.last_step_skipped = False

    def skipped(self, num_update: int, window: int) -> int:
        """num_update after a skipped step of `window` micro-batches."""
        num_update -= window - 1
        if self.count_skipped_steps:
            self.skipped_updates += window
            num_update += window
        return num_update

    def counted(self, num_update: int, top: int) -> int:
        """num_update after micro-batches were counted up to `top`."""
        if self.skipped_updates:
            return max(num_update, top + self.skipped_updates)
        return num_update


def micro_batches(opt: mx.optimizer.Optimizer) -> int:
    """Micro-batches counted so far by `opt` (a skipped window is not counted), without
    ``begin_num_update``."""
    _, counts = _compat.update_counts(opt)
    return max(counts.values(), default=opt.begin_num_update) - opt.begin_num_update


def num_update_after_count(opt: mx.optimizer.Optimizer, ledger: SkipLedger,
                           index: Iterable[Any], updates_of: Callable[[int], int],
                           counts_applied_updates: bool) -> int:
    """``num_update`` once the parameters `index` were counted: micro-batches (as MXNet's
    LBSGD counts), or applied updates when `counts_applied_updates` (`updates_of`: applied
    updates after a number of micro-batches)."""
    _, counts = _compat.update_counts(opt)
    top = max(counts[i] for i in index)
    if counts_applied_updates:
        first = opt.begin_num_update
        return first + updates_of(top - first) + ledger.skipped_updates
    return ledger.counted(opt.num_update, top)


def windows(gain: Optional[LrGain]) -> Optional[BatchChoiceState]:
    """The window lengths taken so far (``batch_scale='auto'``), else None."""
    return None if gain is None or gain.chooser is None else gain.chooser.state


def rewind(opt: mx.optimizer.Optimizer, index: Iterable[Any], micro_batches: int) -> None:
    """Take `micro_batches` back from the counts of `index` (a skipped window)."""
    _, counts = _compat.update_counts(opt)
    for i in index:
        counts[i] -= micro_batches


def progress(opt: mx.optimizer.Optimizer, ledger: SkipLedger,
             scaler: Optional[DynamicLossScaler]) -> Dict[str, Any]:
    """What resuming bit for bit needs besides the per-parameter states (plain values)."""
    counts, _ = _compat.update_counts(opt)
    return {'index_update_counts': {k: dict(v) for k, v in counts.items()},
            'num_update': opt.num_update, 'skipped_updates': ledger.skipped_updates,
            'loss_scaler': None if scaler is None else scaler.state_dict()}


def load_progress(opt: mx.optimizer.Optimizer, ledger: SkipLedger,
                  scaler: Optional[DynamicLossScaler], saved: Dict[str, Any]) -> None:
    """Resume `saved` (from `progress`) in place: the live scaler object takes the saved
    scaler state, so code holding it keeps seeing the live one."""
    if scaler is not None and saved.get('loss_scaler') is not None:
        scaler.load_state_dict(saved['loss_scaler'])
    _compat.set_update_counts(opt, saved['index_update_counts'])
    opt.num_update = int(saved['num_update'])
    ledger.skipped_updates = int(saved.get('skipped_updates', 0))


def keep_live_scaler(loaded: Any) -> None:
    """One scaler, always: when MXNet's ``Updater.set_states`` (``Trainer.load_states``,
    ``Module.load_optimizer_states``) unpickles optimizer `loaded` to replace a live one, the
    file's scaler state goes into the live optimizer's scaler object, which `loaded` then
    uses (as PyTorch's ``GradScaler.load_state_dict`` restores into the live scaler): code
    that scales the loss by ``scaler.scale`` keeps working. A plain copy (pickle,
    ``copy.deepcopy``) keeps its own scaler."""
    live = _compat.optimizer_replaced_by_unpickling()
    if live is None or live is loaded:
        return
    mine, held = loaded.loss_scaler, getattr(live, 'loss_scaler', None)
    if mine is not None and isinstance(held, DynamicLossScaler):
        if held is not mine:
            held.load_state_dict(mine.state_dict())
            loaded.loss_scaler = held
    elif mine is not None:
        warnings.warn('the optimizer loaded from the states file scales the loss (loss '
                      'scale %g) and replaces a %s that did not: multiply the loss by '
                      'trainer.optimizer.loss_scaler.scale from now on'
                      % (mine.scale, type(live).__name__), RuntimeWarning)
    elif held is not None:
        warnings.warn('the optimizer loaded from the states file does not scale the loss '
                      'and replaces one whose loss_scaler (scale %g) did: stop '
                      'multiplying the loss by that scale' % getattr(held, 'scale', 1.0),
                      RuntimeWarning)


class ProgressViews:
    """Mixed into `PipelineOptimizer`: its counters as a run's progress (``micro_batches``,
    ``window_position``, ``applied_updates``, the warmup multiplier) and as checkpoint
    progress (`progress`, `load_progress`, which `mx_lbsgd.checkpoint` reads and restores).
    ``_ledger``, ``_warmup``, ``loss_scaler`` and ``batch_scale`` are the shell's."""

    _ledger: SkipLedger
    _warmup: Warmup
    _lr_gain: Optional[LrGain]
    _last_lr: Optional[float]
    loss_scaler: Optional[DynamicLossScaler]
    batch_scale: int
    counts_applied_updates: bool
    num_update: int
    lr: float

    def progress(self) -> Dict[str, Any]:
        """What resuming bit for bit needs besides the per-parameter states: counters, the
        loss-scaler state and the ``lr_scaling`` state (plain Python values)."""
        saved = progress(self, self._ledger, self.loss_scaler)
        if self._lr_gain is not None:
            saved['lr_scaling'] = self._lr_gain.piece.state.as_dict()
            saved['lr_scaling_window'] = self._lr_gain.pending_small()
            saved['lr_scaling_previous'] = self._lr_gain.previous_gradient()
            chosen = windows(self._lr_gain)
            saved['batch_choice'] = None if chosen is None else chosen.as_dict()
        return saved

    def load_progress(self, saved: Dict[str, Any]) -> None:
        """Resume `progress()` in place (objects that hold this optimizer's scaler keep
        seeing the live one)."""
        load_progress(self, self._ledger, self.loss_scaler, saved)
        if saved.get('lr_scaling') is not None:
            if self._lr_gain is None:
                warnings.warn('the checkpoint holds an lr_scaling state (progress %.6g) and '
                              'this optimizer has lr_scaling=None: it is not used'
                              % saved['lr_scaling'].get('progress', math.nan), RuntimeWarning)
            else:
                self._lr_gain.piece.state = LrScalingState.from_dict(saved['lr_scaling'])
                if saved.get('lr_scaling_window'):
                    self._lr_gain.restore_small(*saved['lr_scaling_window'])
                if saved.get('lr_scaling_previous'):
                    self._lr_gain.restore_previous(saved['lr_scaling_previous'])
        chooser = None if self._lr_gain is None else self._lr_gain.chooser
        if saved.get('batch_choice') is not None:
            if chooser is None:
                warnings.warn("the checkpoint holds a batch_scale='auto' state (window %s) "
                              'and this optimizer has a fixed batch_scale=%d: it is not used'
                              % (saved['batch_choice']['segments'][-1]['length'],
                                 self.batch_scale), RuntimeWarning)
            else:
                chooser.state = BatchChoiceState.from_dict(saved['batch_choice'])
                self.batch_scale = chooser.state.window

    def check_progress(self, saved: Dict[str, Any]) -> None:
        """ValueError (before anything loads) when `saved` cannot resume into this optimizer:
        with ``batch_scale='auto'``, a run of a fixed batch_scale under way, or window
        lengths outside this optimizer's ``batch_scale_bounds``."""
        chooser = None if self._lr_gain is None else self._lr_gain.chooser
        if chooser is None:
            return
        if saved.get('batch_choice') is None:
            if saved.get('num_update', 0) > getattr(self, 'begin_num_update', 0):
                raise ValueError(
                    "the checkpoint was written with a fixed batch_scale, and this optimizer "
                    "has batch_scale='auto', whose window arithmetic starts from its own "
                    'states: resume with the fixed batch_scale')
            return
        state = BatchChoiceState.from_dict(saved['batch_choice'])
        low, high = chooser.bounds
        taken = [state.window] + ([] if state.pending is None else [state.pending])
        if not all(low <= n <= high for n in taken):
            raise ValueError('the checkpoint has window length(s) %s, outside this '
                             'optimizer\'s batch_scale_bounds=%r' % (taken, chooser.bounds))

    @property
    def learning_rate(self) -> float:
        """As MXNet's (``lr``, or the lr scheduler's rate, before per-parameter
        multipliers and warmup), with ``lr_scaling`` at ``scale_invariant_steps``, the step
        the scheduler sees (reading it never moves a scheduler past the run's progress);
        the update's lr is this times ``last_gain``."""
        scheduler = getattr(self, 'lr_scheduler', None)
        if scheduler is None:
            return self.lr
        if self._lr_gain is None:
            return scheduler(self.num_update)
        return scheduler(self._lr_gain.piece.state.progress)

    @property
    def scale_invariant_steps(self) -> Optional[float]:
        """With ``lr_scaling``: the sum of the gains of the applied updates ('adascale':
        AdaScale's r; 'linear'/'sqrt': S), in base-batch iterations: the step the lr
        scheduler sees. None without."""
        return None if self._lr_gain is None else self._lr_gain.piece.state.progress

    @property
    def last_lr(self) -> Optional[float]:
        """The learning rate of the last update (applied or skipped), as the kernels took
        it for a parameter without an ``lr_mult``: the schedule's rate times the warmup's
        multiplier and, with ``lr_scaling``, the gain; a LARS trust ratio, which differs
        per layer, not included. A host float, kept as the update is prepared: reading it
        waits for nothing. None before the first update.

        Examples
        --------
        >>> import mxnet as mx, mx_lbsgd
        >>> opt = mx_lbsgd.LBSGD(learning_rate=0.1, warmup_strategy='linear',
        ...                      warmup_epochs=1, updates_per_epoch=4, batch_scale=2)
        >>> updater = mx.optimizer.get_updater(opt)
        >>> for _ in range(2):                   # one window of 2 micro-batches
        ...     updater(0, mx.nd.ones(3), mx.nd.zeros(3))
        >>> opt.last_lr                          # 0.1 * (1 + (2 - 1) * 2 / 4)
        0.15000000000000002
        """
        return self._last_lr

    @property
    def last_gain(self) -> Optional[float]:
        """With ``lr_scaling``: the lr multiplier of the last applied update (1.0 before
        the first). None without."""
        return None if self._lr_gain is None else self._lr_gain.piece.state.last_gain

    @property
    def micro_batches(self) -> int:
        """Micro-batches counted so far, a skipped window not counted. It is the warmup
        position, without ``begin_epoch * updates_per_epoch``."""
        return micro_batches(self)

    @property
    def window_position(self) -> int:
        """Micro-batches of the open accumulation window (0 at a window boundary, where
        MXNet's own ``Trainer.save_states`` keeps every device's state)."""
        chosen = windows(self._lr_gain)
        if chosen is not None:
            return chosen.position(self.micro_batches)
        return self.micro_batches % self.batch_scale

    @property
    def applied_updates(self) -> int:
        """Updates that changed the weights, ``micro_batches // batch_scale`` (with
        ``batch_scale='auto'``: over the window lengths taken)."""
        return self._updates_of(self.micro_batches)

    @property
    def window_history(self) -> Optional[list]:
        """With ``batch_scale='auto'``: [(applied updates before it, window length)] of
        every length taken, in order. None without."""
        chosen = windows(self._lr_gain)
        if chosen is None:
            return None
        return [(s.first_update, s.length) for s in chosen.segments]

    def _updates_of(self, micro_batches: int) -> int:
        """Applied updates once `micro_batches` micro-batches were counted."""
        chosen = windows(self._lr_gain)
        if chosen is not None:
            return chosen.update_of(micro_batches)
        return micro_batches // self.batch_scale

    def lr_multiplier(self, position: Optional[int] = None) -> float:
        """The warmup learning-rate multiplier at micro-batch `position` (default: the last
        one counted, `micro_batches`); a trust ratio multiplies it per layer."""
        return self._warmup.multiplier(self.micro_batches if position is None else position)

    def _count_micro_batch(self, index: Any) -> None:
        _compat.count_update(self, index)     # MXNet's count, then num_update from it
        self.num_update = num_update_after_count(
            self, self._ledger, index, self._updates_of, self.counts_applied_updates)
