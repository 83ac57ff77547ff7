"""The values the optimizer shell hands to the functions that run an update.

- `Pieces`: the shell's own pieces, one value built by `build_pieces` (the preset's
  kernel pieces, ``_family``, ``_warmup`` and ``_trust``, are the preset's attributes).
- `Step`: what a gluon Trainer said of the step under way (`protocol.begin_step` makes
  it, frozen; a new step makes a new one). Module and bare Updaters run under
  `NO_TRAINER`: the gate finds their step boundaries itself.
- `Reports`: what the last update left to report (``last_lr``, the clipping norms).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, NamedTuple, Optional, Tuple

import mxnet as mx
import numpy as np

from ..loss_scaling import gate as _scaling, overflow
from . import lr_gain as _lr_gain, progress as _progress
from .clip import GlobalNormClip, StepNorms
from .gain_feeds import ModuleFeed, TrainerFeed
from .lr_gain import LrGain
from .plan import PlanCache, SliceNorms
from .window import InOptimizerWindow


class Pieces(NamedTuple):
    """The shell's pieces (never pickled; `build_pieces` makes them again on unpickling)."""

    clip: Optional[GlobalNormClip]
    #: the ``lr_scaling`` gain (None without), and the adapters that feed it the norms of
    #: a Trainer's step and of a Module's micro-batches
    lr_gain: Optional[LrGain]
    trainer_feed: Optional[TrainerFeed]
    module_feed: Optional[ModuleFeed]
    gate: _scaling.StepGate[Any]
    ledger: _progress.SkipLedger
    overflow: overflow.OverflowMonitor
    accumulator: InOptimizerWindow
    plans: PlanCache
    #: reused device buffers, by purpose
    scratch: Dict[Any, Any]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step as a gluon Trainer announced it (`protocol.begin_step`)."""

    #: None: the window is the optimizer's (or there is none); False: the Trainer summed
    #: this micro-batch (nothing to apply); True: it reduced a window's mean (apply it)
    closes_window: Optional[bool] = None
    #: the Trainer of this step (whose rank a report names), None under Module
    trainer: Optional[weakref.ref] = None
    #: {micro-batch (0: the step): device-side finite flag} taken before the reduction
    local_flags: Optional[Dict[int, mx.nd.NDArray]] = None
    #: whether `norms` were measured from the gradients the step applies (clipping)
    trainer_norms: bool = False
    #: the sum of squares of every rank's reduced gradients (`mx_lbsgd.ShardedTrainer`)
    sum_sq: Optional[mx.nd.NDArray] = None
    #: the clipping norms measured for this step, by device
    norms: Optional[StepNorms] = None
    #: {dtype name: the pieces of tensors a sharded Trainer split over ranks}
    slices: Optional[Dict[str, SliceNorms]] = None

    def slices_of(self, dtype: Any) -> Optional[SliceNorms]:
        """The `SliceNorms` of the weights of `dtype`, or None."""
        return None if self.slices is None else self.slices.get(np.dtype(dtype).name)

    def trainer_object(self) -> Any:
        """The Trainer of this step, or None (Module, or the Trainer is gone)."""
        return None if self.trainer is None else self.trainer()


#: Module and bare Updaters: no Trainer announces a step
NO_TRAINER = Step()


@dataclasses.dataclass
class Reports:
    """What the last update leaves to report: its lr for a parameter without an lr_mult
    (``last_lr``) and its clipping norms (``last_grad_norm``)."""

    last_lr: Optional[float] = None
    last_norms: Optional[StepNorms] = None


def build_pieces(attributes: Dict[str, Any], gain_power: float, fused: Optional[bool],
                 finite_check: Any) -> Pieces:
    """The pieces of an optimizer whose ``__dict__`` is `attributes` (its arguments, and
    what a pickle kept of the pieces' states, which are taken out)."""
    max_norm = attributes.setdefault('max_grad_norm', None)    # pickled before it existed
    ledger = _progress.SkipLedger(attributes.get('count_skipped_steps', False))
    ledger.skipped_updates = attributes.pop('_skipped_updates', 0)
    ledger.last_step_skipped = bool(attributes.pop('last_step_skipped', False))
    gain = _lr_gain.build(attributes, gain_power)
    return Pieces(
        clip=GlobalNormClip(max_norm) if max_norm else None, lr_gain=gain,
        trainer_feed=None if gain is None else TrainerFeed(gain),
        module_feed=None if gain is None else ModuleFeed(gain),
        gate=_scaling.StepGate(fused, check=finite_check), ledger=ledger,
        overflow=overflow.OverflowMonitor(
            attributes.get('overflow_history_size', overflow.HISTORY_SIZE),
            attributes.get('overflow_log_interval', overflow.LOG_INTERVAL),
            attributes.get('overflow_alert', overflow.ALERT)),
        accumulator=InOptimizerWindow(), plans=PlanCache(), scratch={})


def pickled(state: Dict[str, Any], transient: Tuple[str, ...], pieces: Pieces,
            reports: Reports, idx2name: Dict[Any, str], param_dict: Dict[Any, Any],
            window_length: int) -> Dict[str, Any]:
    """The pickled state of an optimizer (MXNet's `state`, its ``__dict__`` less the
    param_dict): the `transient` attributes out, the pieces' states in as plain values,
    and the window's length as the plain attribute ``batch_scale`` (as files have it)."""
    # param_dict is not pickled; keep its names (LARS exclusions on kvstore servers)
    state['idx2name'] = dict(idx2name)
    state['idx2name'].update((i, p.name) for i, p in param_dict.items())
    for name in transient:
        state.pop(name, None)
    state['batch_scale'] = window_length
    state['_skipped_updates'] = pieces.ledger.skipped_updates
    state['last_step_skipped'] = pieces.ledger.last_step_skipped
    if reports.last_lr is not None:
        state['_last_lr'] = reports.last_lr
    return _lr_gain.pickled(pieces.lr_gain, state)
