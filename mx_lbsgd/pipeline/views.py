"""What the optimizer shell reports: its counters as a run's progress and as checkpoint
progress (`ProgressViews`), and what clipping measured (`ClipViews`). Both are mixed into
`PipelineOptimizer`; the attributes they declare are the shell's.
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from mxnet import nd

from .. import _compat, _kernels
from ..families.base import GradNorm
from ..loss_scaling.scaler import DynamicLossScaler
from . import lr_gain as _lr_gain, progress as _progress
from .batch_choice import BatchChoiceState
from .clip import GlobalNormClip, StepNorms
from .lr_scaling import LrScalingState
from .progress import SkipLedger

if TYPE_CHECKING:
    from .lr_gain import LrGain
    from .warmup import Warmup


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
        saved = _progress.progress(self, self._ledger, self.loss_scaler)
        if self._lr_gain is not None:
            saved['lr_scaling'] = self._lr_gain.piece.state.as_dict()
            saved['lr_scaling_window'] = self._lr_gain.pending_small()
            saved['lr_scaling_previous'] = self._lr_gain.previous_gradient()
            chosen = _lr_gain.windows(self._lr_gain)
            saved['batch_choice'] = None if chosen is None else chosen.as_dict()
        return saved

    def load_progress(self, saved: Dict[str, Any]) -> None:
        """Resume `progress()` in place (objects that hold this optimizer's scaler keep
        seeing the live one)."""
        _progress.load_progress(self, self._ledger, self.loss_scaler, saved)
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
        return _progress.micro_batches(self)

    @property
    def window_position(self) -> int:
        """Micro-batches of the open accumulation window (0 at a window boundary, where
        MXNet's own ``Trainer.save_states`` keeps every device's state)."""
        chosen = _lr_gain.windows(self._lr_gain)
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
        chosen = _lr_gain.windows(self._lr_gain)
        if chosen is None:
            return None
        return [(s.first_update, s.length) for s in chosen.segments]

    def _updates_of(self, micro_batches: int) -> int:
        """Applied updates once `micro_batches` micro-batches were counted."""
        chosen = _lr_gain.windows(self._lr_gain)
        if chosen is not None:
            return chosen.update_of(micro_batches)
        return micro_batches // self.batch_scale

    def lr_multiplier(self, position: Optional[int] = None) -> float:
        """The warmup learning-rate multiplier at micro-batch `position` (default: the last
        one counted, `micro_batches`); a trust ratio multiplies it per layer."""
        return self._warmup.multiplier(self.micro_batches if position is None else position)

    def _count_micro_batch(self, index: Any) -> None:
        _compat.count_update(self, index)     # MXNet's count, then num_update from it
        self.num_update = _progress.num_update_after_count(
            self, self._ledger, index, self._updates_of, self.counts_applied_updates)


class ClipViews:
    """Mixed into `PipelineOptimizer`: what clipping reports, and the host-side guard of
    MXNet's operators. ``_clip``, ``_last_norms``, ``_ledger`` and ``_name`` are the
    shell's."""

    _clip: Optional[GlobalNormClip]
    _last_norms: Optional[StepNorms]
    _ledger: SkipLedger
    _lr_gain: Optional[LrGain]
    _name: Callable[[Any], Optional[str]]

    def _last(self) -> Optional[GradNorm]:
        return None if not self._last_norms else next(iter(self._last_norms.values()))

    @property
    def last_grad_norm(self) -> Optional[nd.NDArray]:
        """The global L2 norm of the gradient the last update applied, before clipping.

        A (1,) float32 NDArray on the first device (reading its value waits for the step;
        keeping it does not). None without ``max_grad_norm`` or before the first update.
        NaN or inf when that step's gradients were not finite (the update was skipped)."""
        last = self._last()
        return None if last is None else last.norm()

    @property
    def last_clip_coefficient(self) -> Optional[nd.NDArray]:
        """``min(1, max_grad_norm / (last_grad_norm + 1e-6))``, the factor the last
        update's gradient was multiplied by (1: clipping was not active; NaN: the norm was
        not finite and the update skipped), a (1,) float32 NDArray; None as
        `last_grad_norm`."""
        last = self._last()
        return None if last is None else last.coefficient()

    def _clip_safe(self, plans: Sequence[Any], grads: List[nd.NDArray],
                   norms: StepNorms, index: Sequence[Any]) -> bool:
        """Without a loss scaler: whether the step may run. The compiled kernels skip a
        non-finite norm on the device (no host read); MXNet's operators cannot, so for
        them the norm is read once and a non-finite step is skipped, with a warning that
        names the first non-finite gradient."""
        # an lr_scaling='adascale' step has read its reduced gradient's norm already
        known = None if self._lr_gain is None else self._lr_gain.known_finite()
        if all(p.skips_on_device for p in plans) or known or \
                (known is None and GlobalNormClip.all_finite(norms)):
            return True
        first = next((i for i, g in zip(index, grads)
                      if not _kernels.finite_flag([g], None).asscalar()), None)
        warnings.warn('%s: the gradient norm is not finite (first non-finite gradient: %r); '
                      'the update was skipped, weights and states untouched. Use a '
                      'loss_scaler to back off and count such steps'
                      % (type(self).__name__, self._name(first) if first is not None
                         else None), RuntimeWarning)
        self._ledger.last_step_skipped = True
        return False
