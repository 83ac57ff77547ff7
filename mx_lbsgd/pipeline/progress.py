"""Counters and checkpoint progress: MXNet's per-parameter update counts, ``num_update``,
and the ledger of skipped steps, which together say where a run is.

MXNet counts every Updater call per parameter (``_index_update_count``, through
`mx_lbsgd._compat`); the shell reads the window position and the warmup position from those
counts, so that checkpoints (MXNet's own included) restore them. A skipped window rewinds
its micro-batches; `SkipLedger` keeps ``num_update`` (what an ``lr_scheduler`` sees) in step.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, Optional

import mxnet as mx

from .. import _compat
from ..loss_scaling.scaler import DynamicLossScaler



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
