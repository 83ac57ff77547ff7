"""The optimizer shell: MXNet's `Optimizer` interface over one update pipeline.

Every call of the Updater runs::

    gate (loss scaling) -> accumulate -> clip -> lr multipliers -> kernel family
      finite check,        window,        global   warmup x          native, single-tensor,
      skip decision,       in the         norm     trust ratio       multi-tensor or sparse
      1/scale folded       optimizer or   (device  (LARS)            kernels of the preset's
      into rescale_grad    at a Trainer   value)                     family

A preset (`LBSGD`, `LossScaledSGD`, `LAMB`) checks its arguments and chooses the pieces: a
kernel family, a `Warmup`, a `TrustRatio` or None. The shell only orchestrates; each job
has its piece:

- `plan`: what a call signature's update does (`Plan`, made once per signature);
- `state`: the per-parameter state layout (the family's, plus an fp32 accumulator);
- `window`: accumulation in the optimizer (`InOptimizerWindow`) or at a Trainer;
- `step`: the values handed around: the shell's `Pieces`, the Trainer's `Step`, `Reports`;
- `apply`: an Updater call through the gate, accumulated, clipped and run through its
  plans (functions of the optimizer's counters, the pieces, the step and the calls);
- `clip`: the global norm of the applied gradient (``max_grad_norm``);
- `progress` and `views`: counters, skipped-step accounting, checkpoint progress and what
  the properties report;
- `protocol`: the optimizer's side of the step protocol with a gluon Trainer (`binding`);
- `mx_lbsgd.loss_scaling`: the step gate, the scaler and the overflow reports.

The shell's methods and properties are one-line delegations to those.

After a skipped step ``last_overflow`` says which parameters overflowed, how, at which
micro-batch and on which rank; ``overflow_history`` keeps the last
``overflow_history_size`` reports. Finite steps pay nothing for it except, with a window at
a Trainer (batch_scale > 1), one device-side finite flag per micro-batch.

Sent to the servers of a dist kvstore (``update_on_kvstore=True``: pickled with protocol
0), the optimizer first refuses what the servers cannot do (`servers.refuse_server_updates`):
loss scaling, clipping, sparse gradients of dense weights, and a trust ratio of a tensor
that the kvstore splits across several servers.

Under a gluon Trainer, `binding` calls `begin_step` before the Updater runs (the shell never
infers a step from attribute writes); Module and bare Updaters call
`update_multi_precision` only, and the gate finds step boundaries itself.
"""
from __future__ import annotations

import os
from typing import Any, Counter, Deque, Dict, List, Optional, Tuple, Union

import mxnet as mx

from .. import _compat, _legacy
from .._checks import check_choice, check_int, check_real
from ..families.base import KernelFamily
from ..loss_scaling import gate as _scaling, graph as _graph_scale, overflow
from ..loss_scaling.scaler import DynamicLossScaler
from . import apply as _apply, clip as _clip_piece, progress as _progress
from . import batch_choice as _choice, lr_gain as _lr_gain, protocol as _protocol
from . import servers as _servers, state as _state, step as _step, views as _views
from .plan import Plan, SliceNorms
from .step_info import StepInfo, TrainerSide
from .trust_ratio import TrustRatio
from .warmup import Warmup


class PipelineOptimizer(mx.optimizer.Optimizer):
    """Base of mx_lbsgd's optimizers; see the module docstring. Subclasses set
    ``self._family``, ``self._warmup`` and ``self._trust`` in `_build_pieces`.

    A preset calls ``super().__init__`` with its checked arguments, sets its own
    hyperparameters, then calls ``self._build_pieces()``; unpickling calls
    `_build_pieces` again (the pieces are never pickled).

    Parameters
    ----------
    batch_scale : int >= 1 or 'auto'
        Micro-batches per update (keyword-only, as every parameter here); after
        construction the current window length (an int).
    fused : None or bool
        Kernel path (``$MX_LBSGD_FUSED`` when None).
    loss_scaler : DynamicLossScaler or None
    count_skipped_steps : bool
    scale_key : str
    multi_precision : bool
    overflow_history_size : int >= 0, default 32
    overflow_log_interval : float >= 0, default 30
    overflow_alert : {'warn', 'log'}, default 'warn'
        Where the falling-scale alert goes: ``warnings.warn(LossScaleFallingWarning)`` or a
        WARNING record on logger 'mx_lbsgd', never both (`mx_lbsgd.loss_scaling.overflow`).
        Skipped steps are INFO records on that logger either way.
    check_local_overflow : bool, default False
    max_grad_norm : None or float >= 0
    lr_scaling : None or {'linear', 'sqrt', 'adascale'}, default None
        How the lr grows with the batch (`mx_lbsgd.pipeline.lr_scaling`): with a rule,
        ``learning_rate`` and its scheduler are the ones tuned at the base batch (one
        micro-batch on one worker), each update's lr is multiplied by the rule's gain at
        S = batch_scale x workers (after warmup, which then rises to the gain, and before
        a trust ratio), and the scheduler sees ``scale_invariant_steps`` instead of
        ``num_update``. Needs a gluon Trainer (any engine).
    lr_scaling_smoothing : float in [0, 1), default 0.999
        Decay per base batch of AdaScale's estimates.
    batch_scale_bounds : None or (int, int)
        With ``batch_scale='auto'``: the window lengths it may choose, 1 <= lo <= hi
        (`mx_lbsgd.pipeline.batch_choice`: the most goodput from measured window times and
        the noise scale, changed at most 2x at a time at a window boundary, the same on
        every worker). Needs an ``lr_scaling`` rule and a gluon Trainer whose window is at
        its reduction (dense gradients).
    batch_scale_interval : int >= 1, default 16
        Applied updates between two choices of ``batch_scale='auto'``.
    **kwargs
        ``mx.optimizer.Optimizer``'s (``learning_rate``, ``wd``, ``rescale_grad``, ...).

    Raises
    ------
    ValueError
        An argument out of range (a negative ``learning_rate``, ``wd`` or
        ``max_grad_norm``, ``fused`` not None/True/False, ``overflow_alert`` not 'warn' or
        'log', ``lr_scaling`` not a rule, ...), or loss scaling, clipping or
        ``lr_scaling`` on a Module that updates on the kvstore.
        When the optimizer is sent to kvstore servers: see the module docstring.
    TypeError
        A number of the wrong type.

    Examples
    --------
    A preset is a few lines: plain SGD, with MXNet SGD's kernel family, no warmup and no
    trust ratio, run by a gluon Trainer:

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> from mx_lbsgd.families import SGDFamily
    >>> from mx_lbsgd.pipeline import PipelineOptimizer, Warmup
    >>> class PlainSGD(PipelineOptimizer):
    ...     def __init__(self, momentum=0.0, **kwargs):
    ...         super().__init__(batch_scale=1, fused=None, loss_scaler=None,
    ...                          count_skipped_steps=False, scale_key='default',
    ...                          multi_precision=False, **kwargs)
    ...         self.momentum = momentum
    ...         self._build_pieces()
    ...     def _build_pieces(self):
    ...         super()._build_pieces()
    ...         self._family = SGDFamily(self.momentum, lazy_update=True)
    ...         self._warmup = Warmup(None, 0, 1, 0)
    ...         self._trust = None
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), PlainSGD(learning_rate=0.1))
    >>> with autograd.record():
    ...     loss = net(nd.array([[1.0, 2.0]])).sum()
    >>> loss.backward()
    >>> trainer.step(1)
    >>> print(net.weight.data().asnumpy().round(4))
    [[0.9 0.8]]
    >>> trainer.optimizer.applied_updates
    1
    >>> PlainSGD(learning_rate=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: learning_rate must be in [0.0, inf); got -1.0
    """

    #: Whether num_update (what an lr_scheduler sees) counts applied updates (True) or
    #: micro-batches, as MXNet's LBSGD does (False).
    counts_applied_updates = False

    #: attributes that are rebuilt, never pickled
    _TRANSIENT = ('_pieces', '_this_step', '_reports', '_family', '_warmup', '_trust',
                  '_module_worker', '_window_length')

    #: AdaScale's r is raised to this power for the lr gain (1: SGD; LAMB: 0.5)
    _gain_power = 1.0

    _family: KernelFamily
    _warmup: Warmup
    _trust: Optional[TrustRatio]

    def __init__(self, *, batch_scale: Union[int, str], fused: Optional[bool],
                 loss_scaler: Optional[DynamicLossScaler], count_skipped_steps: bool,
                 scale_key: str, multi_precision: bool,
                 overflow_history_size: int = overflow.HISTORY_SIZE,
                 overflow_log_interval: float = overflow.LOG_INTERVAL,
                 overflow_alert: str = overflow.ALERT, check_local_overflow: bool = False,
                 max_grad_norm: Optional[float] = None, lr_scaling: Optional[str] = None,
                 lr_scaling_smoothing: float = 0.999,
                 batch_scale_bounds: Optional[Tuple[int, int]] = None,
                 batch_scale_interval: int = 16, **kwargs: Any) -> None:
        check_choice('fused', fused, (None, True, False))
        _lr_gain.check_args(lr_scaling, lr_scaling_smoothing)
        first_window, bounds = _choice.check_args(batch_scale, batch_scale_bounds,
                                                  batch_scale_interval, lr_scaling)
        _check_reports_and_clipping(overflow_alert, max_grad_norm, overflow_history_size,
                                    overflow_log_interval, check_local_overflow)
        _check_mxnet_arguments(kwargs)
        if _compat.creating_module_updates_on_kvstore():
            _refuse_module_kvstore_updates(type(self).__name__, lr_scaling, batch_scale,
                                           loss_scaler, max_grad_norm)
        super().__init__(multi_precision=multi_precision, **kwargs)
        self._set_window_length(first_window)
        self.batch_scale_bounds = bounds
        self.batch_scale_interval = int(batch_scale_interval)
        self.fused = _fused_from_env(fused)
        self.loss_scaler = loss_scaler
        self.count_skipped_steps = bool(count_skipped_steps)
        self.scale_key = str(scale_key)
        self.overflow_history_size = int(overflow_history_size)
        self.overflow_log_interval = float(overflow_log_interval)
        self.overflow_alert = overflow_alert
        self.check_local_overflow = bool(check_local_overflow)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        self.lr_scaling, self.lr_scaling_smoothing = lr_scaling, float(lr_scaling_smoothing)
        self._module_worker = _compat.creating_module_worker()
        # the Updater hands over every parameter of a dtype at once; kernels chunk by 60
        self.aggregate_num = 1 << 30
        if loss_scaler is not None:
            _graph_scale.serve(self.scale_key, loss_scaler)

    def _build_pieces(self) -> None:
        if 'batch_scale' in self.__dict__:           # unpickled: the window's length then
            self._set_window_length(self.__dict__.pop('batch_scale'))
        self._pieces = _step.build_pieces(self.__dict__, self._gain_power, self.fused,
                                          self._finite_check)
        self._this_step = _step.NO_TRAINER
        self._reports = _step.Reports(last_lr=self.__dict__.pop('_last_lr', None))
        self.__dict__.setdefault('_module_worker', None)
        self.__dict__.setdefault('check_local_overflow', False)    # pickled before it existed

    def _set_window_length(self, length: int) -> None:
        """The one writer of the fixed window length (``batch_scale='auto'``: the first)."""
        self._window_length = length

    @property
    def batch_scale(self) -> int:
        """Micro-batches per update, the window length: the constructor's, or with
        ``batch_scale='auto'`` the length its chooser took last (which owns it)."""
        return _views.window_length(self.__dict__.get('_pieces'), self._window_length)

    def set_learning_rate(self, lr: float) -> None:
        """As ``mx.optimizer.Optimizer.set_learning_rate`` (what ``Trainer.set_learning_rate``
        calls), after checking `lr` as the constructor does."""
        check_real('learning_rate', lr, 0.0)
        super().set_learning_rate(lr)

    # -- state (`state`) ----------------------------------------------------------------
    def _window_capacity(self) -> int:
        """The longest window: the accumulators exist in the states when it is > 1."""
        return _choice.capacity(self.batch_scale, self.__dict__.get('batch_scale_bounds'))

    def create_state(self, index: Any, weight: mx.nd.NDArray) -> Any:
        return _state.create_plain(self._family, weight, capacity=self._window_capacity(),
                                   sparse=_state.sparse_gradient(self.param_dict, index))

    def create_state_multi_precision(self, index: Any, weight: mx.nd.NDArray) -> Any:
        self._pieces.gate.created((weight.context, index))
        if _state.uses_master(weight, self.multi_precision):
            return _state.create_master(self._family, weight, self._window_capacity(),
                                        _state.sparse_gradient(self.param_dict, index))
        return _state.warn_float16(weight, self.create_state(index, weight))

    def split_state(self, weight: mx.nd.NDArray, state: Any) -> _state.StateParts:
        """(family state, master copy or None, accumulator or None) of a state in this
        optimizer's layout; states of MXNet's own optimizer fit it at batch_scale=1."""
        return _state.split_state(self._family, weight, state,
                                  batch_scale=self._window_capacity(),
                                  multi_precision=self.multi_precision,
                                  owner=type(self).__name__)

    # -- update -------------------------------------------------------------------------
    def _param_name(self, index: Any) -> Optional[str]:
        return _views.param_name(self.param_dict, self.idx2name, index)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if not isinstance(index, (list, tuple)):
            index, weight, grad, state = [index], [weight], [grad], [state]
        self._plan(index, weight, grad, state, check_shapes=True)    # validates first
        _apply.update(self, self._pieces, (index, weight, grad, state))

    def _finite_check(self, grads: Any, fused: Optional[bool]) -> bool:
        return _apply.finite_check(self, self._pieces, grads, fused)

    def _plan(self, index: List[Any], weight: List[mx.nd.NDArray], grad: List[mx.nd.NDArray],
              state: List[Any], check_shapes: bool = False) -> Plan:
        """The plan of this call signature (`plan.PlanCache`); `check_shapes` for a call
        from the Updater."""
        return self._pieces.plans.get(
            index, weight, grad, state, family=self._family, trust=self._trust,
            fused=self.fused, name=self._param_name, split=self.split_state,
            check_shapes=check_shapes, slices=self._this_step.slices_of(weight[0].dtype))

    # -- the step protocol with a gluon Trainer (`protocol`, driven by `binding`) --------
    @property
    def rescale_grad(self) -> float:
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value: float) -> None:
        self._rescale_grad = value
        # gluon.Trainer.step/update set rescale_grad before they reduce or update: the one
        # moment MXNet gives an optimizer to learn its Trainer. Binding is idempotent.
        trainer = _compat.trainer_assigning_rescale_grad(self)
        if trainer is not None:
            _protocol.trainer_found(trainer)

    def begin_step(self, gradients: Optional[List[mx.nd.NDArray]],
                   closes_window: Optional[bool] = None, trainer: Any = None,
                   local_flags: Optional[Dict[int, mx.nd.NDArray]] = None,
                   sum_sq: Optional[mx.nd.NDArray] = None,
                   slices: Optional[Dict[str, SliceNorms]] = None) -> None:
        """A Trainer step starts. `gradients`: every fresh gradient of the step, on every
        device (the loss-scale gate decides over them at once), or None when this optimizer
        does not want them (`wants_step_gradients`). `closes_window`: None when this
        optimizer accumulates itself; False when the Trainer summed this micro-batch
        locally (count it, apply nothing); True when the Trainer reduced the window's
        mean (apply it as one step). `trainer`: whose rank a report names. `local_flags`:
        {micro-batch (0: the step): device-side finite flag taken before the reduction}.

        With clipping, the norm is measured here when `gradients` are the ones the step
        applies (reduced, and the window's mean when the Trainer closes a window); with a
        window inside the optimizer the gate holds the step's calls and it is measured
        over the accumulators. `sum_sq`: the sum of squares of every rank's reduced
        gradients (`mx_lbsgd.ShardedTrainer`, whose `gradients` are this rank's shard):
        then the finite check and the clipping norm use it. `slices`: the pieces of tensors
        it split over ranks, by dtype (`pipeline.SliceNorms`)."""
        self._this_step = _protocol.begin_step(self, self._pieces, gradients, closes_window,
                                               trainer, local_flags, sum_sq, slices)

    def step_info(self, side: TrainerSide) -> StepInfo:
        """What a piece that watches the gradients of `side`'s Trainer is handed of this
        micro-batch (`pipeline.step_info.StepInfo`)."""
        return _protocol.step_info(self, side)

    def begin_micro_batch(self, side: TrainerSide) -> None:
        """A Trainer step begins, before its reduction reads the window (a window length
        chosen by ``batch_scale='auto'`` takes effect at a window boundary)."""
        if self._pieces.trainer_feed is not None:
            self._pieces.trainer_feed.window_begins(self.step_info(side))

    def observe_micro_batch(self, side: TrainerSide, window_at_trainer: bool) -> None:
        """A micro-batch's gradients, before the Trainer reduces (or sums) them."""
        if self._pieces.trainer_feed is not None:
            self._pieces.trainer_feed.micro_batch(side.trainer, self.step_info(side),
                                                  window_at_trainer)

    def observe_reduction(self, side: TrainerSide, closes_window: bool) -> None:
        """The Trainer reduced the gradients (`closes_window`: a window's mean)."""
        if self._pieces.trainer_feed is not None:
            self._pieces.trainer_feed.reduced(side.trainer, self.step_info(side),
                                              closes_window)

    def step_outside(self, applied: bool) -> None:
        """A `LossScaling` hook decided a step of its own (this optimizer has no
        loss_scaler): a skipped step never reaches the optimizer, so it is accounted here as
        the optimizer's own gate accounts one of its micro-batches (``last_step_skipped``;
        with ``count_skipped_steps`` it advances ``num_update``, so an ``lr_scheduler``)."""
        _protocol.step_outside(self, self._pieces, applied)

    def wants_local_flags(self, trainer: Any, window: bool) -> bool:
        """Whether the Trainer should keep a device-side finite flag of this worker's
        gradients before reducing them: per micro-batch of a window at the Trainer (to name
        the micro-batch), per step with ``check_local_overflow`` on a distributed job."""
        return _protocol.wants_local_flags(self, trainer, window)

    def wants_step_gradients(self) -> bool:
        """Whether `begin_step` needs the step's gradients (listing them costs a pass)."""
        return self.loss_scaler is not None or self._pieces.clip is not None

    def accumulates_at_trainer(self) -> bool:
        """Whether a Trainer should keep this optimizer's window at its reduction."""
        return self.batch_scale > 1

    def refuse_updates_on_kvstore(self) -> None:
        _protocol.refuse_updates_on_kvstore(type(self).__name__, self._pieces,
                                            self.loss_scaler)

    # -- reports: one-line delegations to their owners ----------------------------------
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped (an overflow with loss scaling)."""
        return self._pieces.ledger.last_step_skipped

    @property
    def last_overflow(self) -> Optional[overflow.OverflowReport]:
        """The `OverflowReport` of the last step if it was skipped, else None."""
        return self._pieces.overflow.last

    @property
    def overflow_history(self) -> Deque[overflow.OverflowReport]:
        """The last reports (a deque, oldest first)."""
        return self._pieces.overflow.history

    @property
    def overflow_tally(self) -> Counter[str]:
        """How many skipped steps each parameter overflowed in, as a Counter (by name)."""
        return self._pieces.overflow.tally

    @property
    def last_grad_norm(self) -> Optional[mx.nd.NDArray]:
        """The global L2 norm of the gradient the last update applied, before clipping.

        A (1,) float32 NDArray on the first device (reading its value waits for the step;
        keeping it does not). None without ``max_grad_norm`` or before the first update.
        NaN or inf when that step's gradients were not finite (the update was skipped)."""
        return _views.last_norm(self._reports, 'norm')

    @property
    def last_clip_coefficient(self) -> Optional[mx.nd.NDArray]:
        """``min(1, max_grad_norm / (last_grad_norm + 1e-6))``, the factor the last
        update's gradient was multiplied by (1: clipping was not active; NaN: the norm was
        not finite and the update skipped), a (1,) float32 NDArray; None as
        `last_grad_norm`."""
        return _views.last_norm(self._reports, 'coefficient')

    @property
    def learning_rate(self) -> float:
        """As MXNet's (``lr``, or the lr scheduler's rate, before per-parameter
        multipliers and warmup), with ``lr_scaling`` at ``scale_invariant_steps``, the step
        the scheduler sees (reading it never moves a scheduler past the run's progress);
        the update's lr is this times ``last_gain``."""
        return _apply.scheduled_lr(self, self._pieces.lr_gain)

    @property
    def scale_invariant_steps(self) -> Optional[float]:
        """With ``lr_scaling``: the sum of the gains of the applied updates ('adascale':
        AdaScale's r; 'linear'/'sqrt': S), in base-batch iterations: the step the lr
        scheduler sees. None without."""
        return _views.of_gain_state(self._pieces.lr_gain, 'progress')

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
        return self._reports.last_lr

    @property
    def last_gain(self) -> Optional[float]:
        """With ``lr_scaling``: the lr multiplier of the last applied update (1.0 before
        the first). None without."""
        return _views.of_gain_state(self._pieces.lr_gain, 'last_gain')

    @property
    def micro_batches(self) -> int:
        """Micro-batches counted so far, a skipped window not counted. It is the warmup
        position, without ``begin_epoch * updates_per_epoch``."""
        return _progress.micro_batches(self)

    @property
    def window_position(self) -> int:
        """Micro-batches of the open accumulation window (0 at a window boundary, where
        MXNet's own ``Trainer.save_states`` keeps every device's state)."""
        return _views.window_position(self, self._pieces.lr_gain)

    @property
    def applied_updates(self) -> int:
        """Updates that changed the weights, ``micro_batches // batch_scale`` (with
        ``batch_scale='auto'``: over the window lengths taken)."""
        return _views.applied_updates(self, self._pieces.lr_gain)

    @property
    def window_history(self) -> Optional[list]:
        """With ``batch_scale='auto'``: [(applied updates before it, window length)] of
        every length taken, in order. None without."""
        return _views.window_history(self._pieces.lr_gain)

    def lr_multiplier(self, position: Optional[int] = None) -> float:
        """The warmup learning-rate multiplier at micro-batch `position` (default: the last
        one counted, `micro_batches`); a trust ratio multiplies it per layer."""
        return self._warmup.multiplier(self.micro_batches if position is None else position)

    # -- checkpoint progress (`mx_lbsgd.checkpoint` reads and restores it) ----------------
    def progress(self) -> Dict[str, Any]:
        """What resuming bit for bit needs besides the per-parameter states: counters, the
        loss-scaler state and the ``lr_scaling`` state (plain Python values)."""
        return _views.progress(self, self._pieces)

    def load_progress(self, saved: Dict[str, Any]) -> None:
        """Resume `progress()` in place (objects that hold this optimizer's scaler keep
        seeing the live one)."""
        _views.load_progress(self, self._pieces, saved)

    def check_progress(self, saved: Dict[str, Any]) -> None:
        """ValueError (before anything loads) when `saved` cannot resume into this optimizer:
        with ``batch_scale='auto'``, a run of a fixed batch_scale under way, or window
        lengths outside this optimizer's ``batch_scale_bounds``."""
        _views.check_progress(self, self._pieces.lr_gain, saved)

    # -- pickling (Trainer.save_states, kvstore servers, copies) --------------------------
    def __getstate__(self) -> Dict[str, Any]:
        return _step.pickled(super().__getstate__(), self._TRANSIENT, self._pieces,
                             self._reports, self.idx2name, self.param_dict, self.batch_scale)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(_legacy.upgrade_optimizer_state(state))
        self._build_pieces()
        _progress.keep_live_scaler(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # kvstore.set_optimizer pickles with protocol 0 to send the optimizer to the
        # servers of a dist kvstore, which then update key by key.
        if protocol == 0:
            _servers.refuse_server_updates(self)
        return super().__reduce_ex__(protocol)

    def trust_ratio_applies(self, name: str) -> bool:
        """Whether the update of the parameter called `name` multiplies its learning rate
        by a per-tensor trust ratio (the shell: the `TrustRatio` piece's layers; `LAMB`,
        whose kernels compute the ratio: every layer its piece does not exclude)."""
        return self._trust is not None and self._trust.applies(name)


def _check_mxnet_arguments(kwargs: Dict[str, Any]) -> None:
    """learning_rate (None: the scheduler's or MXNet's default) and wd: finite, >= 0;
    rescale_grad and clip_gradient: real numbers."""
    if kwargs.get('learning_rate') is not None:
        check_real('learning_rate', kwargs['learning_rate'], 0.0)
    if 'wd' in kwargs:
        check_real('wd', kwargs['wd'], 0.0)
    for name in ('rescale_grad', 'clip_gradient'):
        if kwargs.get(name) is not None:
            check_real(name, kwargs[name])


def _check_reports_and_clipping(alert: Any, max_grad_norm: Any, history_size: Any,
                                log_interval: Any, check_local: Any) -> None:
    check_choice('overflow_alert', alert, overflow.ALERT_CHANNELS)
    if max_grad_norm is not None:
        check_real('max_grad_norm', max_grad_norm, 0.0)
    check_int('overflow_history_size', history_size, 0)
    check_real('overflow_log_interval', log_interval, 0.0, allow_inf=True)
    check_choice('check_local_overflow', check_local, (False, True))


def _refuse_module_kvstore_updates(owner: str, lr_scaling: Any, batch_scale: Any,
                                   loss_scaler: Any, max_grad_norm: Any) -> None:
    """Module creates the optimizer for a kvstore that updates the weights key by key,
    where no whole update is seen: refuse what needs one."""
    if lr_scaling is not None:
        _lr_gain.refuse_kvstore_updates(owner, lr_scaling, batch_scale == 'auto')
    if loss_scaler is not None:
        _scaling.refuse_kvstore_updates(owner)
    if max_grad_norm:
        _clip_piece.refuse_kvstore_updates(owner)


def _fused_from_env(fused: Optional[bool]) -> Optional[bool]:
    """`fused`, or $MX_LBSGD_FUSED ('0' or '1') when fused is None."""
    env = os.environ.get('MX_LBSGD_FUSED', '')
    if fused is not None or not env:
        return fused
    check_choice('MX_LBSGD_FUSED', env, ('0', '1'))
    return env == '1'
