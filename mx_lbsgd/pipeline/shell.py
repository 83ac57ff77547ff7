"""The optimizer shell: MXNet's `Optimizer` interface over one update pipeline.

Every call of the Updater runs::

    gate (loss scaling) -> accumulate -> lr multipliers -> kernel family
      finite check,        window,        warmup x          single-tensor, multi-tensor
      skip decision,       in the         trust ratio       or sparse kernels of the
      1/scale folded       optimizer or   (LARS)            preset's family (`_sgd`)
      into rescale_grad    at a Trainer

A preset (`LBSGD`, `LossScaledSGD`) checks its arguments and chooses the pieces: a kernel
family, a `Warmup`, a `TrustRatio` or None. The shell keeps MXNet's bookkeeping (lr, wd,
multipliers, update counts), the state layout (the family's, with an fp32 accumulator
appended when ``batch_scale > 1``), checkpoint progress and pickling.

Overflow reports (`mx_lbsgd.overflow`): after a skipped step ``last_overflow`` says which
parameters overflowed, how, at which micro-batch and on which rank; ``overflow_history``
keeps the last ``overflow_history_size`` reports. Finite steps pay nothing for it except,
with a window at a Trainer (batch_scale > 1), one device-side finite flag per micro-batch.

Step protocol: under a gluon Trainer, `_binding` calls `begin_step` before the Updater runs
(the shell never infers a step from attribute writes); Module and bare Updaters call
`update_multi_precision` only, and the gate finds step boundaries itself.
"""
import os
import warnings
import weakref

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat, _kernels, _legacy
from .._checks import check_choice, check_int, check_real
from ..loss_scaling import gate as _scaling, graph as _graph_scale, overflow
from ..loss_scaling.scaler import DynamicLossScaler
from . import binding as _binding
from .window import InOptimizerWindow


class PipelineOptimizer(overflow.OverflowViews, mx.optimizer.Optimizer):
    """Base of mx_lbsgd's optimizers; see the module docstring. Subclasses set
    ``self._family``, ``self._warmup`` and ``self._trust`` in `_build_pieces`."""

    #: what num_update (so an lr_scheduler) counts: micro-batches, as MXNet's LBSGD does
    #: (False), or applied updates (True)
    counts_applied_updates = False

    #: attributes that are rebuilt, never pickled
    _TRANSIENT = ('_scratch', '_plans', '_gate', '_ledger', '_family', '_warmup', '_trust',
                  '_accumulator', '_step_window', '_overflow', '_step_trainer', '_local_flags',
                  '_module_worker')

    def __init__(self, *, batch_scale, fused, loss_scaler, count_skipped_steps, scale_key,
                 multi_precision, overflow_history_size=overflow.HISTORY_SIZE,
                 overflow_log_interval=overflow.LOG_INTERVAL, check_local_overflow=False,
                 **kwargs):
        check_choice('fused', fused, (None, True, False))
        check_int('overflow_history_size', overflow_history_size, 0)
        check_real('overflow_log_interval', overflow_log_interval, 0.0, allow_inf=True)
        check_choice('check_local_overflow', check_local_overflow, (False, True))
        _check_lr_wd(kwargs)
        for name in ('rescale_grad', 'clip_gradient'):
            if kwargs.get(name) is not None:
                check_real(name, kwargs[name])
        if loss_scaler is not None and _compat.creating_module_updates_on_kvstore():
            _scaling.refuse_kvstore_updates(type(self).__name__)
        super().__init__(multi_precision=multi_precision, **kwargs)
        self.batch_scale = int(batch_scale)
        self.fused = _fused_from_env(fused)
        self.loss_scaler = loss_scaler
        self.count_skipped_steps = bool(count_skipped_steps)
        self.scale_key = str(scale_key)
        self.overflow_history_size = int(overflow_history_size)
        self.overflow_log_interval = float(overflow_log_interval)
        self.check_local_overflow = bool(check_local_overflow)
        self._module_worker = _compat.creating_module_worker()
        # the Updater hands over every parameter of a dtype at once; kernels chunk by 60
        self.aggregate_num = 1 << 30
        if loss_scaler is not None:
            _graph_scale.serve(self.scale_key, loss_scaler)

    def _build_pieces(self):
        self._scratch, self._plans = {}, {}
        self._gate = _scaling.StepGate(self.fused)
        self._ledger = _scaling.SkipLedger(self.count_skipped_steps)
        # pickled as plain values
        self._ledger.skipped_updates = self.__dict__.pop('_skipped_updates', 0)
        self._ledger.last_step_skipped = bool(self.__dict__.pop('last_step_skipped', False))
        self._accumulator = InOptimizerWindow(self.batch_scale)
        self._step_window = None   # None, or whether this step closes a Trainer's window
        self._overflow = overflow.OverflowMonitor(
            getattr(self, 'overflow_history_size', overflow.HISTORY_SIZE),
            getattr(self, 'overflow_log_interval', overflow.LOG_INTERVAL))
        self._step_trainer = None  # weakref to the Trainer of this step (its rank)
        self._local_flags = None   # {micro-batch (0: the step): device flag} before reduction
        self.__dict__.setdefault('_module_worker', None)
        self.__dict__.setdefault('check_local_overflow', False)    # pickled before it existed

    def set_learning_rate(self, lr):
        """As ``mx.optimizer.Optimizer.set_learning_rate`` (what ``Trainer.set_learning_rate``
        calls), after checking `lr` as the constructor does."""
        check_real('learning_rate', lr, 0.0)
        super().set_learning_rate(lr)

    @property
    def last_step_skipped(self):
        """Whether the last step was skipped (an overflow with loss scaling)."""
        return self._ledger.last_step_skipped

    # -- the step protocol (called by `_binding`) ---------------------------------------
    @property
    def rescale_grad(self):
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value):
        self._rescale_grad = value
        # gluon.Trainer.step/update set rescale_grad before they reduce or update: the one
        # moment MXNet gives an optimizer to learn its Trainer. Binding is idempotent.
        trainer = _compat.trainer_assigning_rescale_grad(self)
        if trainer is not None:
            _binding.bind(trainer)

    def begin_step(self, gradients, closes_window=None, trainer=None, local_flags=None):
        """A Trainer step starts. `gradients`: every fresh gradient of the step, on every
        device (the loss-scale gate decides over them at once). `closes_window`: None when
        this optimizer accumulates itself; False when the Trainer summed this micro-batch
        locally (count it, apply nothing); True when the Trainer reduced the window's
        mean (apply it as one step). `trainer`: whose rank a report names. `local_flags`:
        {micro-batch (0: the step): device-side finite flag taken before the reduction}."""
        self._step_window = closes_window
        self._step_trainer = None if trainer is None else weakref.ref(trainer)
        self._local_flags = local_flags
        if self.loss_scaler is not None:
            self._gate.new_step(gradients)

    def step_outside(self, applied):
        """A `LossScaling` hook decided a step of its own (this optimizer has no
        loss_scaler): a skipped step never reaches the optimizer, so it is accounted here as
        the optimizer's own gate accounts one of its micro-batches (``last_step_skipped``;
        with ``count_skipped_steps`` it advances ``num_update``, so an ``lr_scheduler``)."""
        self._ledger.last_step_skipped = not applied
        if not applied:
            self.num_update = self._ledger.skipped(self.num_update, 1)

    def wants_local_flags(self, trainer, window):
        """Whether the Trainer should keep a device-side finite flag of this worker's
        gradients before reducing them: per micro-batch of a window at the Trainer (to name
        the micro-batch), per step with ``check_local_overflow`` on a distributed job."""
        if self.loss_scaler is None or not self.loss_scaler.enabled:
            return False
        return window or (self.check_local_overflow
                          and _compat.trainer_worker_count(trainer, 2) > 1)

    def wants_step_gradients(self):
        """Whether `begin_step` needs the step's gradients (listing them costs a pass)."""
        return self.loss_scaler is not None

    def accumulates_at_trainer(self):
        """Whether a Trainer should keep this optimizer's window at its reduction."""
        return self.batch_scale > 1

    def refuse_updates_on_kvstore(self):
        if self.loss_scaler is not None:
            _scaling.refuse_kvstore_updates(type(self).__name__)

    # -- state ------------------------------------------------------------------------
    def _uses_master(self, weight):
        return self.multi_precision and weight.dtype == np.float16

    def create_state(self, index, weight):
        if weight.dtype == np.float16 and self.batch_scale > 1:
            raise ValueError('batch_scale=%d with float16 weights needs multi_precision=True:'
                             ' the float32 accumulated gradient updates the float32 master '
                             'copy' % self.batch_scale)
        return self._make_state(index, weight, weight.dtype, master=None)

    def create_state_multi_precision(self, index, weight):
        self._gate.created((weight.context, index))
        if self._uses_master(weight):
            return self._make_state(index, weight, np.float32,
                                    master=weight.astype(np.float32))
        state = self.create_state(index, weight)
        if weight.dtype == np.float16:
            warnings.warn('Accumulating with float16 in optimizer can lead to poor accuracy '
                          'or slow convergence. Consider multi_precision=True.')
        return state

    def _make_state(self, index, weight, dtype, master):
        """The family's layout, then an accumulator when batch_scale > 1 (row_sparse for a
        gluon Parameter with a row_sparse gradient)."""
        base = self._family.make_state(weight, dtype, master)
        if self.batch_scale == 1:
            return base
        param = self.param_dict.get(index)
        acc = nd.zeros(weight.shape, weight.context,
                       dtype=np.promote_types(weight.dtype, np.float32),
                       stype='row_sparse' if param is not None
                       and _compat.grad_stype(param) == 'row_sparse' else 'default')
        return (base if isinstance(base, tuple) else (base,)) + (acc,)

    def split_state(self, weight, state):
        """(family state, master copy or None, accumulator or None) of a state in this
        optimizer's layout; states of MXNet's own optimizer fit it at batch_scale=1."""
        master = self._uses_master(weight)
        parts = state if isinstance(state, tuple) else (state,)
        if parts and isinstance(parts[-1], _legacy.Ledger):
            raise ValueError(_legacy.LEDGER_IN_STATE)
        acc = None
        if self.batch_scale > 1 and len(parts) >= 2:
            acc, parts = parts[-1], parts[:-1]
        split = None
        if acc is not None or self.batch_scale == 1:
            split = self._family.split(parts[0] if len(parts) == 1 else parts, master)
        if split is None:
            raise ValueError(
                'optimizer state of shape %s does not fit %s(%s, multi_precision=%s, '
                'batch_scale=%d): it holds %d arrays. States written by MXNet\'s %s load '
                'with batch_scale=1 and the same settings; otherwise start from fresh '
                'optimizer states (skip load_states / load_optimizer_states)'
                % (weight.shape, type(self).__name__, self._family.describe(),
                   self.multi_precision, self.batch_scale,
                   len(state) if isinstance(state, tuple) else 1, self._family.name))
        return split[0], split[1], acc

    # -- progress, for checkpoints (`checkpoint` reads and restores it) -----------------
    def progress(self):
        """What resuming bit for bit needs besides the per-parameter states: counters and
        the loss-scaler state (plain Python values)."""
        counts, _ = _compat.update_counts(self)
        return {'index_update_counts': {k: dict(v) for k, v in counts.items()},
                'num_update': self.num_update, 'skipped_updates': self._ledger.skipped_updates,
                'loss_scaler': (None if self.loss_scaler is None
                                else self.loss_scaler.state_dict())}

    def load_progress(self, progress):
        """Resume `progress()` in place (objects that hold this optimizer's scaler keep
        seeing the live one)."""
        if self.loss_scaler is not None and progress.get('loss_scaler') is not None:
            self.loss_scaler.load_state_dict(progress['loss_scaler'])
        _compat.set_update_counts(self, progress['index_update_counts'])
        self.num_update = int(progress['num_update'])
        self._ledger.skipped_updates = int(progress.get('skipped_updates', 0))

    @property
    def micro_batches(self):
        """Micro-batches counted so far (a skipped window is not counted): the warmup
        position, without ``begin_epoch * updates_per_epoch``."""
        _, counts = _compat.update_counts(self)
        return max(counts.values(), default=self.begin_num_update) - self.begin_num_update

    @property
    def window_position(self):
        """Micro-batches of the open accumulation window (0 at a window boundary, where
        MXNet's own ``Trainer.save_states`` keeps every device's state)."""
        return self.micro_batches % self.batch_scale

    @property
    def applied_updates(self):
        """Updates that changed the weights: ``micro_batches // batch_scale``."""
        return self.micro_batches // self.batch_scale

    def lr_multiplier(self, position=None):
        """The warmup learning-rate multiplier at micro-batch `position` (default: the last
        one counted, `micro_batches`); a trust ratio multiplies it per layer."""
        return self._warmup.multiplier(self.micro_batches if position is None else position)

    # -- update -----------------------------------------------------------------------
    def _name(self, index):
        if index in self.param_dict:
            return self.param_dict[index].name
        if not self.param_dict and not self.idx2name:
            return None
        return self.idx2name.get(index, str(index))

    def update(self, index, weight, grad, state):
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if not isinstance(index, (list, tuple)):
            index, weight, grad, state = [index], [weight], [grad], [state]
        self._plan(index, weight, grad, state)    # validates states and names first
        if self._step_window is False:
            self._update_count(index)      # summed at the Trainer; nothing to apply yet
            self._ledger.last_step_skipped = False
            return
        if self.loss_scaler is None:
            self._apply(index, weight, grad, state, unscale=1.0)
            return
        if isinstance(index[0], str):     # Module's kvstore updater passes parameter names
            _scaling.refuse_kvstore_updates(type(self).__name__)
        runs = self._gate.submit([(w.context, i) for i, w in zip(index, weight)], grad,
                                 (index, weight, grad, state), self.loss_scaler,
                                 self._gradient_scale())
        window = self.batch_scale if self._step_window else 1
        decision = self._gate.take_decision()
        if decision is not None:
            self._report(*decision)
        for call, apply_ in runs:
            self._ledger.last_step_skipped = not apply_
            if apply_:
                self._apply(*call, unscale=_scaling.unscale_factor(self._gate.scale))
            elif window > 1:
                _, counts = _compat.update_counts(self)
                for i in call[0]:
                    counts[i] -= window - 1
        if runs and self._gate.take_skip():
            self.num_update = self._ledger.skipped(
                self.num_update, 1 if self.counts_applied_updates else window)
        _graph_scale.serve(self.scale_key, self.loss_scaler)

    def _report(self, skipped, grads, calls):
        """Keep the overflow report of a decided step (None for a finite one). Runs before
        the skipped window's counts are rewound, so the window position is this step's."""
        if not skipped:
            self._overflow.finite()
            return
        at_trainer = bool(self._step_window) and self.batch_scale > 1
        micro_batch = (self.window_position + 1
                       if self.batch_scale > 1 and not at_trainer else None)
        rank, workers = self._worker()
        self._overflow.skipped(
            scaler=self.loss_scaler, scale=self._gate.scale,
            named_grads=self._named_gradients(grads, calls), micro_batch=micro_batch,
            local_flags=self._local_flags, rank=rank, num_workers=workers,
            window=self.batch_scale if at_trainer else 0)

    def _named_gradients(self, grads, calls):
        """[(parameter name, gradient)] for the checked gradients: Gluon names from
        param_dict, Module's from idx2name (param_idx2name), else the index."""
        names = {}
        for index, _, call_grads, _ in calls:
            for i, g in zip(index, call_grads):
                names[_compat.buffer_id(g)] = self._name(i) or str(i)
        for param in self.param_dict.values():
            try:
                copies = param.list_grad()
            except (RuntimeError, mx.MXNetError):      # grad_req='null', not initialized
                continue
            for g in copies:
                names[_compat.buffer_id(_compat.legacy(g))] = param.name
        return [(names.get(_compat.buffer_id(g), '#%d' % k), g) for k, g in enumerate(grads)]

    def _worker(self):
        """(rank or None, number of workers) of this step's reduction."""
        trainer = self._step_trainer() if self._step_trainer is not None else None
        if trainer is not None:
            return _compat.trainer_rank(trainer), _compat.trainer_worker_count(trainer, 1)
        return self._module_worker or _compat.horovod_worker() or (None, 1)

    def _gradient_scale(self):
        """The scale this step's gradients carry: Gluon scales the loss by the optimizer's
        scaler; a Module graph by the scaler its scale_gradient op was served when backward
        ran (another optimizer's, right after Module.load_optimizer_states)."""
        if self.param_dict:
            return self.loss_scaler.scale
        return _graph_scale.served(self.scale_key, self.loss_scaler).scale

    def _update_count(self, index):
        super()._update_count(index)
        _, counts = _compat.update_counts(self)
        top = max(counts[i] for i in index)
        if self.counts_applied_updates:
            first = self.begin_num_update
            self.num_update = (first + (top - first) // self.batch_scale
                               + self._ledger.skipped_updates)
        else:
            self.num_update = self._ledger.counted(self.num_update, top)

    def _plan(self, index, weight, grad, state):
        """Per call signature, computed once: the state parts, the kernel routes (tensors
        with non-default storage go one by one through the family's sparse kernel) and the
        trust-ratio exclusions (states are re-split when the Updater's state objects
        change)."""
        key = (weight[0].context, tuple(index))
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan['state'], state)):
            return plan
        parts = [self.split_state(w, s) for w, s in zip(weight, state)]
        sparse = [j for j, (w, g) in enumerate(zip(weight, grad))
                  if w.stype != 'default' or g.stype != 'default']
        if sparse and not self._family.supports_sparse:
            raise ValueError(self._family.sparse_refusal(
                [self._name(index[j]) or index[j] for j in sparse]))
        dense = [j for j in range(len(weight)) if j not in sparse]
        groups = {}
        for j in dense:
            groups.setdefault((weight[j].dtype, parts[j][1] is None), []).append(j)
        family = self._family
        routes = []
        device_type = weight[0].context.device_type
        for (dtype, no_master), members in groups.items():
            native = (None if self.fused is not None
                      else family.native_kernel(device_type, dtype, not no_master))
            if native is not None:      # the family's compiled kernel takes the whole group
                routes.append((native, members))
                continue
            single, multi = _kernels.route([weight[j].size for j in members], device_type,
                                           self.fused, dtype)
            routes += [(family.single_tensor, [members[p] for p in single]),
                       (family.multi_tensor, [members[p] for p in multi])]
        keep = (None if self._trust is None
                else [not self._trust.applies(self._name(i)) for i in index])
        masters = [p[1] for p in parts]
        plan = {'state': list(state), 'states': [p[0] for p in parts], 'masters': masters,
                'accs': [p[2] for p in parts], 'sparse': sparse, 'keep_lr': keep,
                # the trust ratio as the shell's lr vector (LARS), unless every layer is
                # excluded or the family's kernels hold the ratio (LAMB)
                'lars': (keep is not None and not all(keep)
                         and not self._family.trust_in_kernel),
                'routes': [(fn, pos, _route_constants(pos, parts, masters, keep))
                           for fn, pos in routes if pos]}
        self._plans[key] = plan
        return plan

    def _apply(self, index, weight, grad, state, unscale):
        self._update_count(index)
        plan = self._plan(index, weight, grad, state)
        _, counts = _compat.update_counts(self)
        positions = [counts[i] - self.begin_num_update for i in index]
        rescale = self.rescale_grad * unscale
        if self.batch_scale > 1 and self._step_window is None:
            window = self._accumulator.add(accs=plan['accs'], grads=grad, positions=positions,
                                           factor=rescale, sparse=plan['sparse'],
                                           scratch=self._scratch)
            if window is None:
                return
            grad, rescale = window
        lrs = self._warmup.scale_lrs(self._get_lrs(index), positions)
        wds = self._get_wds(index)
        steps = [k // self.batch_scale for k in positions]     # this update's number t
        for kernel, pos, const in plan['routes']:
            pick = lambda seq: [seq[j] for j in pos]   # noqa: E731
            weights, grads = pick(weight), pick(grad)
            lr_vector = None
            if plan['lars']:
                lr_vector = self._trust.lr_vector(
                    weights=[m if m is not None else w
                             for w, m in zip(weights, const['masters'])],
                    grads=grads, lrs=pick(lrs), wds=pick(wds), keep_lr=const['keep_lr'],
                    rescale_grad=rescale)
            self._family.run(kernel, weights=weights, grads=grads, states=const['states'],
                             masters=const['masters'], lrs=pick(lrs), wds=pick(wds),
                             lr_vector=lr_vector, rescale_grad=rescale,
                             clip_gradient=self.clip_gradient, scratch=self._scratch,
                             steps=pick(steps), ratio_applies=const['ratio_applies'])
        if plan['sparse']:
            self._apply_sparse(plan, weight, grad, lrs, wds, rescale,
                               self._trust if plan['lars'] else None)

    def _apply_sparse(self, plan, weight, grad, lrs, wds, rescale, trust):
        pos = plan['sparse']
        lrs = [lrs[j] for j in pos]
        if trust is not None:
            for n, j in enumerate(pos):
                if not plan['keep_lr'][j] and grad[j].stype == 'row_sparse':
                    master = plan['masters'][j]
                    lrs[n] *= trust.sparse_factor(
                        weight=master if master is not None else weight[j], grad=grad[j],
                        wd=wds[j], rescale_grad=rescale)
        self._family.run_sparse(weights=[weight[j] for j in pos],
                                grads=[grad[j] for j in pos],
                                states=[plan['states'][j] for j in pos],
                                masters=[plan['masters'][j] for j in pos], lrs=lrs,
                                wds=[wds[j] for j in pos], rescale_grad=rescale,
                                clip_gradient=self.clip_gradient)

    # -- pickling (Trainer.save_states, kvstore servers, copies) ------------------------
    def __getstate__(self):
        state = super().__getstate__()
        # param_dict is not pickled; keep its names (LARS exclusions on kvstore servers)
        state['idx2name'] = dict(self.idx2name)
        state['idx2name'].update((i, p.name) for i, p in self.param_dict.items())
        for transient in self._TRANSIENT:
            state.pop(transient, None)
        state['_skipped_updates'] = self._ledger.skipped_updates
        state['last_step_skipped'] = self._ledger.last_step_skipped
        return state

    def __setstate__(self, state):
        super().__setstate__(_legacy.upgrade_optimizer_state(state))
        self._build_pieces()
        self._keep_live_scaler()

    def _keep_live_scaler(self):
        """One scaler, always: when MXNet's ``Updater.set_states`` (``Trainer.load_states``,
        ``Module.load_optimizer_states``) unpickles this optimizer to replace a live one, the
        file's scaler state goes into the live optimizer's scaler object, which this
        optimizer then uses (as PyTorch's ``GradScaler.load_state_dict`` restores into the
        live scaler): code that scales the loss by ``scaler.scale`` keeps working. A plain
        copy (pickle, ``copy.deepcopy``) keeps its own scaler."""
        live = _compat.optimizer_replaced_by_unpickling()
        if live is None or live is self:
            return
        loaded, held = self.loss_scaler, getattr(live, 'loss_scaler', None)
        if loaded is not None and isinstance(held, DynamicLossScaler):
            if held is not loaded:
                held.load_state_dict(loaded.state_dict())
                self.loss_scaler = held
        elif loaded is not None:
            warnings.warn('the optimizer loaded from the states file scales the loss (loss '
                          'scale %g) and replaces a %s that did not: multiply the loss by '
                          'trainer.optimizer.loss_scaler.scale from now on'
                          % (loaded.scale, type(live).__name__), RuntimeWarning)
        elif held is not None:
            warnings.warn('the optimizer loaded from the states file does not scale the loss '
                          'and replaces one whose loss_scaler (scale %g) did: stop '
                          'multiplying the loss by that scale' % getattr(held, 'scale', 1.0),
                          RuntimeWarning)

    def __reduce_ex__(self, protocol):
        # kvstore.set_optimizer pickles with protocol 0 to send the optimizer to the
        # servers of a dist kvstore, which then update key by key.
        if protocol == 0 and self.loss_scaler is not None:
            _scaling.refuse_kvstore_updates(type(self).__name__)
        if protocol == 0:
            kind, names = _compat.module_sparse_gradients_on_dist_kvstore()
            _binding.refuse_sparse_gradients_on_servers(names, kind, type(self).__name__)
        return super().__reduce_ex__(protocol)


def _route_constants(pos, parts, masters, keep):
    """What a kernel route's call takes that stays the same from step to step."""
    return {'states': [parts[j][0] for j in pos], 'masters': [masters[j] for j in pos],
            'keep_lr': None if keep is None else [keep[j] for j in pos],
            'ratio_applies': None if keep is None else [not keep[j] for j in pos]}


def _check_lr_wd(kwargs):
    """learning_rate (None: the scheduler's or MXNet's default) and wd: finite, >= 0."""
    if kwargs.get('learning_rate') is not None:
        check_real('learning_rate', kwargs['learning_rate'], 0.0)
    if 'wd' in kwargs:
        check_real('wd', kwargs['wd'], 0.0)


def _fused_from_env(fused):
    """`fused`, or $MX_LBSGD_FUSED ('0' or '1') when fused is None."""
    env = os.environ.get('MX_LBSGD_FUSED', '')
    if fused is not None or not env:
        return fused
    check_choice('MX_LBSGD_FUSED', env, ('0', '1'))
    return env == '1'
