"""What the optimizer shell reports, as functions of its values: its counters as a run's
progress and as checkpoint progress (`progress`, `load_progress`, which
`mx_lbsgd.checkpoint` reads and restores), and what clipping measured (`last_norm`). The
shell's properties are one-line delegations to these.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional

import mxnet as mx

from . import apply as _apply, lr_gain as _lr_gain, progress as _progress
from .batch_choice import BatchChoiceState
from .lr_gain import LrGain
from .lr_scaling import LrScalingState
from .step import Pieces, Reports


def progress(opt: mx.optimizer.Optimizer, pieces: Pieces) -> Dict[str, Any]:
    """What resuming bit for bit needs besides the per-parameter states: counters, the
    loss-scaler state and the ``lr_scaling`` state (plain Python values)."""
    gain = pieces.lr_gain
    saved = _progress.progress(opt, pieces.ledger, opt.loss_scaler)
    if gain is not None:
        saved['lr_scaling'] = gain.piece.state.as_dict()
        saved['lr_scaling_window'] = gain.pending_small()
        saved['lr_scaling_previous'] = gain.previous_gradient()
        chosen = _lr_gain.windows(gain)
        saved['batch_choice'] = None if chosen is None else chosen.as_dict()
    return saved


def load_progress(opt: mx.optimizer.Optimizer, pieces: Pieces, saved: Dict[str, Any]) -> None:
    """Resume `progress()` in place (objects that hold this optimizer's scaler keep
    seeing the live one)."""
    gain = pieces.lr_gain
    _progress.load_progress(opt, pieces.ledger, opt.loss_scaler, saved)
    if saved.get('lr_scaling') is not None:
        if gain is None:
            warnings.warn('the checkpoint holds an lr_scaling state (progress %.6g) and '
                          'this optimizer has lr_scaling=None: it is not used'
                          % saved['lr_scaling'].get('progress', math.nan), RuntimeWarning)
        else:
            gain.piece.state = LrScalingState.from_dict(saved['lr_scaling'])
            if saved.get('lr_scaling_window'):
                gain.restore_small(*saved['lr_scaling_window'])
            if saved.get('lr_scaling_previous'):
                gain.restore_previous(saved['lr_scaling_previous'])
    chooser = None if gain is None else gain.chooser
    if saved.get('batch_choice') is not None:
        if chooser is None:
            warnings.warn("the checkpoint holds a batch_scale='auto' state (window %s) "
                          'and this optimizer has a fixed batch_scale=%d: it is not used'
                          % (saved['batch_choice']['segments'][-1]['length'],
                             opt.batch_scale), RuntimeWarning)
        else:
            chooser.state = BatchChoiceState.from_dict(saved['batch_choice'])


def window_length(pieces: Optional[Pieces], fixed: int) -> int:
    """The window length: `fixed`, or the chooser's (``batch_scale='auto'``)."""
    chosen = None if pieces is None else _lr_gain.windows(pieces.lr_gain)
    return fixed if chosen is None else chosen.window


def check_progress(opt: mx.optimizer.Optimizer, gain: Optional[LrGain],
                   saved: Dict[str, Any]) -> None:
    """ValueError (before anything loads) when `saved` cannot resume into this optimizer:
    with ``batch_scale='auto'``, a run of a fixed batch_scale under way, or window
    lengths outside this optimizer's ``batch_scale_bounds``."""
    chooser = None if gain is None else gain.chooser
    if chooser is None:
        return
    if saved.get('batch_choice') is None:
        if saved.get('num_update', 0) > getattr(opt, 'begin_num_update', 0):
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


def window_position(opt: mx.optimizer.Optimizer, gain: Optional[LrGain]) -> int:
    """Micro-batches of the open accumulation window."""
    chosen = _lr_gain.windows(gain)
    micro_batches = _progress.micro_batches(opt)
    if chosen is not None:
        return chosen.position(micro_batches)
    return micro_batches % opt.batch_scale


def applied_updates(opt: mx.optimizer.Optimizer, gain: Optional[LrGain]) -> int:
    """Updates that changed the weights."""
    return _apply.updates_of(gain, opt.batch_scale, _progress.micro_batches(opt))


def window_history(gain: Optional[LrGain]) -> Optional[list]:
    """With ``batch_scale='auto'``: [(applied updates before it, window length)]."""
    chosen = _lr_gain.windows(gain)
    if chosen is None:
        return None
    return [(s.first_update, s.length) for s in chosen.segments]


def last_norm(reports: Reports, what: str) -> Optional[mx.nd.NDArray]:
    """The last update's clipping `what` ('norm' or 'coefficient') on its first device,
    or None."""
    norms = reports.last_norms
    return None if not norms else getattr(next(iter(norms.values())), what)()


def of_gain_state(gain: Optional[LrGain], field: str) -> Any:
    """A field of the ``lr_scaling`` state ('progress', 'last_gain'), None without."""
    return None if gain is None else getattr(gain.piece.state, field)


def param_name(param_dict: Dict[Any, Any], idx2name: Dict[Any, str],
               index: Any) -> Optional[str]:
    """The name of parameter `index` (a report's), or None when the optimizer knows no
    names at all."""
    if index in param_dict:
        return param_dict[index].name
    if not param_dict and not idx2name:
        return None
    return idx2name.get(index, str(index))
