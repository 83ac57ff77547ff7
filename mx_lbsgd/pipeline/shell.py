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
- `apply`: a step's calls accumulated, clipped and run through their plans;
- `clip`: the global norm of the applied gradient (``max_grad_norm``);
- `progress`: counters, skipped-step accounting and checkpoint progress;
- `protocol`: the optimizer's side of the step protocol with a gluon Trainer (`binding`);
- `mx_lbsgd.loss_scaling`: the step gate, the scaler and the overflow reports.

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
import weakref
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import mxnet as mx

from .. import _compat, _legacy
from .._checks import check_choice, check_int, check_real
from ..families.base import KernelFamily
from ..loss_scaling import gate as _scaling, graph as _graph_scale, overflow
from ..loss_scaling.scaler import DynamicLossScaler
from . import clip as _clip_piece, progress as _progress, servers as _servers, state as _state
from . import batch_choice as _choice, lr_gain as _lr_gain
from .apply import Call, StepApplier
from .clip import GlobalNormClip, StepNorms
from .plan import Plan, PlanCache
from .protocol import StepProtocol
from .trust_ratio import TrustRatio
from .views import ClipViews, ProgressViews
from .warmup import Warmup
from .window import InOptimizerWindow


class PipelineOptimizer(StepApplier, overflow.OverflowViews, ProgressViews,
                        ClipViews, StepProtocol, mx.optimizer.Optimizer):
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
    _TRANSIENT = ('_scratch', '_plans', '_gate', '_ledger', '_family', '_warmup', '_trust',
                  '_accumulator', '_step_window', '_overflow', '_step_trainer', '_local_flags',
                  '_module_worker', '_clip', '_norms', '_trainer_norms', '_last_norms',
                  '_step_sum_sq', '_lr_gain')

    #: AdaScale's r is raised to this power for the lr gain (1: SGD; LAMB: 0.5)
    _gain_power = 1.0

    _family: KernelFamily
    _gate: _scaling.StepGate[Call]
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
        self.batch_scale, self.batch_scale_bounds = first_window, bounds
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
        self._scratch: Dict[Any, Any] = {}
        self._plans = PlanCache()
        self.__dict__.setdefault('max_grad_norm', None)    # pickled before it existed
        self._clip = GlobalNormClip(self.max_grad_norm) if self.max_grad_norm else None
        self._lr_gain = _lr_gain.build(self.__dict__, self._gain_power)
        self._norms: Optional[StepNorms] = None   # this step's, by context
        self._trainer_norms = False               # measured by begin_step (a Trainer)
        self._last_norms: Optional[StepNorms] = None
        self._step_sum_sq: Optional[mx.nd.NDArray] = None
        self._gate = _scaling.StepGate(self.fused, check=self._finite_check)
        self._ledger = _progress.SkipLedger(self.count_skipped_steps)
        # pickled as plain values
        self._ledger.skipped_updates = self.__dict__.pop('_skipped_updates', 0)
        self._ledger.last_step_skipped = bool(self.__dict__.pop('last_step_skipped', False))
        self._accumulator = InOptimizerWindow()
        self._step_window: Optional[bool] = None   # whether this step closes a Trainer window
        self._overflow = overflow.OverflowMonitor(
            getattr(self, 'overflow_history_size', overflow.HISTORY_SIZE),
            getattr(self, 'overflow_log_interval', overflow.LOG_INTERVAL),
            getattr(self, 'overflow_alert', overflow.ALERT))
        self._step_trainer: Optional[weakref.ref] = None   # the Trainer of this step (rank)
        #: {micro-batch (0: the step): device flag} before the reduction
        self._local_flags: Optional[Dict[int, mx.nd.NDArray]] = None
        self.__dict__.setdefault('_module_worker', None)
        self.__dict__.setdefault('check_local_overflow', False)    # pickled before it existed

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
        if weight.dtype == np.float16 and self._window_capacity() > 1:
            raise ValueError('windows of up to batch_scale=%d with float16 weights need '
                             'multi_precision=True: the float32 accumulated gradient updates '
                             'the float32 master copy' % self._window_capacity())
        return self._make_state(index, weight, weight.dtype, None)

    def create_state_multi_precision(self, index: Any, weight: mx.nd.NDArray) -> Any:
        self._gate.created((weight.context, index))
        if _state.uses_master(weight, self.multi_precision):
            return self._make_state(index, weight, np.float32, weight.astype(np.float32))
        made = self.create_state(index, weight)
        if weight.dtype == np.float16:
            warnings.warn('Accumulating with float16 in optimizer can lead to poor accuracy '
                          'or slow convergence. Consider multi_precision=True.')
        return made

    def _make_state(self, index: Any, weight: mx.nd.NDArray, dtype: Any,
                    master: Optional[mx.nd.NDArray]) -> Any:
        param = self.param_dict.get(index)
        sparse = param is not None and _compat.grad_stype(param) == 'row_sparse'
        return _state.make_state(self._family, weight, dtype, master, self._window_capacity(),
                                 sparse)

    def split_state(self, weight: mx.nd.NDArray, state: Any) -> _state.StateParts:
        """(family state, master copy or None, accumulator or None) of a state in this
        optimizer's layout; states of MXNet's own optimizer fit it at batch_scale=1."""
        return _state.split_state(self._family, weight, state,
                                  batch_scale=self._window_capacity(),
                                  multi_precision=self.multi_precision,
                                  owner=type(self).__name__)

    # -- update -------------------------------------------------------------------------
    def _name(self, index: Any) -> Optional[str]:
        if index in self.param_dict:
            return self.param_dict[index].name
        if not self.param_dict and not self.idx2name:
            return None
        return self.idx2name.get(index, str(index))

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if not isinstance(index, (list, tuple)):
            index, weight, grad, state = [index], [weight], [grad], [state]
        self._plan(index, weight, grad, state, check_shapes=True)    # validates first
        if self._step_window is False:
            self._count_micro_batch(index)      # summed at the Trainer; nothing to apply yet
            self._ledger.last_step_skipped = False
            return
        held = _lr_gain.held_by_gate(self._lr_gain, self)
        if self.loss_scaler is None and not held and (self._clip is None
                                                      or self._trainer_norms):
            self._apply_step([(index, weight, grad, state)], unscale=1.0)
            return
        if isinstance(index[0], str):     # Module's kvstore updater passes parameter names
            self.refuse_updates_on_kvstore()
        # without a loss scaler: the gate only holds the step's calls, so that clipping
        # measures the norm over all of them (a disabled scaler never skips)
        self._gated_update((index, weight, grad, state), self.loss_scaler or _HOLD_ONLY)

    def _gated_update(self, call: Call, scaler: DynamicLossScaler) -> None:
        """Run a call through the loss-scale gate: the step's calls run when it is decided,
        applied or skipped as a whole."""
        index, weight, grad, _ = call
        runs = self._gate.submit([(w.context, i) for i, w in zip(index, weight)], grad,
                                 call, scaler,
                                 1.0 if self.loss_scaler is None else self._gradient_scale())
        window = self.batch_scale if self._step_window else 1
        decision = self._gate.take_decision()
        if decision is not None:
            self._report(*decision)
        for held, apply_ in runs:
            self._ledger.last_step_skipped = not apply_
            if not apply_ and window > 1:
                _compat.count_on_device(self, held[1][0].context)
                _progress.rewind(self, held[0], window - 1)
        self._apply_step([held for held, apply_ in runs if apply_],
                         unscale=_scaling.unscale_factor(self._gate.loss_scale))
        if runs and self._gate.take_skip():
            self.num_update = self._ledger.skipped(
                self.num_update, 1 if self.counts_applied_updates else window)
        if self.loss_scaler is not None:
            _graph_scale.serve(self.scale_key, self.loss_scaler)

    def _finite_check(self, grads: Sequence[mx.nd.NDArray], fused: Optional[bool]) -> bool:
        """The gate's finite check. With clipping, when the gradients checked are the ones
        applied, the norm's sum-of-squares pass is the check (one pass, one host read)."""
        if self._step_sum_sq is not None:        # a sharded Trainer's, over every rank
            self._last_norms = self._norms or self._last_norms
            return _lr_gain.value_is_finite(self._lr_gain, self._step_sum_sq)
        # (an lr_scaling='adascale' update's norms come along in the same read)
        _lr_gain.module_check(self._lr_gain, self, grads,
                              self.rescale_grad / self._gate.loss_scale)
        if self._clip is None or not (self.batch_scale == 1 or self._step_window):
            return _lr_gain.all_finite(self._lr_gain, grads, fused)
        if not self._trainer_norms or self._norms is None:
            self._norms = self._clip.measure(grads, self.rescale_grad / self._gate.loss_scale)
        self._last_norms = self._norms
        return _lr_gain.norms_finite(self._lr_gain, self._norms)

    def _report(self, skipped: bool, grads: Sequence[mx.nd.NDArray],
                calls: List[Call]) -> None:
        """Keep the overflow report of a decided step (None for a finite one). Runs before
        the skipped window's counts are rewound, so the window position is this step's."""
        if not skipped:
            self._overflow.finite()
            return
        trainer = self._step_trainer() if self._step_trainer is not None else None
        self._overflow.report_skip(
            scaler=self.loss_scaler, scale=self._gate.loss_scale,
            named_grads=overflow.name_gradients(grads, calls, self._name, self.param_dict),
            optimizer=self, trainer=trainer, fallback_worker=self._module_worker,
            at_trainer=bool(self._step_window) and self.batch_scale > 1,
            local_flags=self._local_flags)

    def _gradient_scale(self) -> float:
        """The loss scale this step's gradients carry: Gluon scales the loss by the
        optimizer's scaler; a Module graph by the scaler its scale_gradient op was served
        when backward ran (another optimizer's, right after Module.load_optimizer_states).
        (Only with a loss_scaler.)"""
        return _graph_scale.gradient_scale(cast(DynamicLossScaler, self.loss_scaler),
                                           self.scale_key, gluon=bool(self.param_dict))

    def _plan(self, index: List[Any], weight: List[mx.nd.NDArray], grad: List[mx.nd.NDArray],
              state: List[Any], check_shapes: bool = False) -> Plan:
        """The plan of this call signature (`plan.PlanCache`); `check_shapes` for a call
        from the Updater."""
        return self._plans.get(index, weight, grad, state, family=self._family,
                               trust=self._trust, fused=self.fused, name=self._name,
                               split=self.split_state, check_shapes=check_shapes)

    # -- pickling (Trainer.save_states, kvstore servers, copies) --------------------------
    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        # param_dict is not pickled; keep its names (LARS exclusions on kvstore servers)
        state['idx2name'] = dict(self.idx2name)
        state['idx2name'].update((i, p.name) for i, p in self.param_dict.items())
        for transient in self._TRANSIENT:
            state.pop(transient, None)
        state['_skipped_updates'] = self._ledger.skipped_updates
        state['last_step_skipped'] = self._ledger.last_step_skipped
        return _lr_gain.pickled(self._lr_gain, state)

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


#: the gate's scaler when there is no loss scaler: it never checks, never skips
_HOLD_ONLY = DynamicLossScaler(enabled=False)


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
