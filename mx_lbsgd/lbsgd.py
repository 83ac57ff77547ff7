"""`LBSGD`: large-batch SGD with warmup, LARS, gradient accumulation and fp32 master weights."""
import os
import warnings

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _compat, _graph_scale, _kernels, _scaling
from ._checks import check_choice, check_int, check_real
from .loss_scale import _as_scaler
from .schedules import WARMUP_STRATEGIES, warmup_multiplier

DEFAULT_LARS_EXCLUDE = ('bias', 'gamma', 'beta')

#: Called as hook(trainer, optimizer) at the start of every gluon Trainer step (from the
#: ``rescale_grad`` setter). The Gluon glue registers its accumulation window here, so that
#: this module does not import the layer above it.
_TRAINER_STEP_HOOKS = []


class LBSGD(mx.optimizer.Optimizer):
    """Large-batch SGD with momentum and weight decay (registered as ``'lbsgd'``).

    Each call counts one micro-batch per parameter and device. With ``batch_scale=B``
    the gradients of B micro-batches are summed in a float32 buffer and applied once::

        k = micro-batches seen by this parameter on this device      # 1, 2, 3, ...
        r = rescale_grad / loss_scale           # of this micro-batch (loss_scale 1 if none)
        if B > 1:
            acc = r * grad if k % B == 1 else acc + r * grad         # no weight touched
            if k % B != 0:
                return
            g, r = acc / B, 1.0
        else:
            g = grad
        n = begin_epoch * updates_per_epoch + k
        W = warmup_epochs * updates_per_epoch
        mult = warmup_multiplier(n, W, B, warmup_strategy)          # linear, power2, sqrt
        if warmup_strategy == 'lars' and layer not excluded:
            mult = clip(lars_eta * |w| / (|r * g| + wd * |w| + lars_eps),
                        lars_min, lars_max)            # 1 where |w| == 0 or |g| == 0
        mom = momentum * mom - lr * mult * (clip(r * g, clip_gradient) + wd * w)
        w = w + mom

    Under a gluon ``Trainer`` (kvstore updates on the workers, or no kvstore, or horovod's
    ``DistributedTrainer``) the window is kept at the Trainer's reduction instead: the
    gradients of a window are summed per device in the same float32 buffer and reduced
    once, on the micro-batch that updates the weights; the result is the same.

    With ``multi_precision=True`` and float16 weights, ``w`` above is an fp32 master copy
    (state ``(mom, weight_fp32)`` as in ``mx.optimizer.SGD``) cast back to the fp16 weight.
    States are laid out exactly as ``mx.optimizer.SGD``'s (``mom``, ``(mom, weight_fp32)``
    or None), with the float32 accumulator appended when ``batch_scale > 1``: at
    ``batch_scale=1`` they load into ``SGD`` (and MXNet's ``LBSGD``) and back.

    LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
    https://arxiv.org/abs/1708.03888. Warmup: Goyal et al., "Accurate, Large Minibatch SGD"
    (2017), https://arxiv.org/abs/1706.02677.

    Differences from MXNet 1.9.1's ``mx.optimizer.LBSGD``: updates run on per-tensor
    kernels for big tensors and fused multi-tensor kernels for small ones; LARS norms stay
    on the device, include ``rescale_grad``, use the fp32 master weights, have a trust
    coefficient (``lars_eta``) and skip biases and BatchNorm parameters; accumulation is
    fp32, lives in the per-device optimizer state, keeps the first micro-batch, launches no
    ``lr=0`` kernel between updates and communicates once per update under a Trainer;
    bad arguments raise instead of silently disabling warmup. ``lars`` with the clip range
    open matches ``mx.optimizer.LARS(momentum_correction=False)``. Compared with PyTorch's
    ``torch.optim.SGD``: MXNet's momentum form (lr inside the momentum buffer), weight decay
    added to the gradient, no dampening or Nesterov.

    Parameters (besides those of ``mx.optimizer.Optimizer``)
    ----------
    momentum : float in [0, 1)
    multi_precision : bool
        Keep fp32 master weights (and fp32 momentum) for float16 weights.
    warmup_strategy : one of `mx_lbsgd.WARMUP_STRATEGIES` ('linear', 'power2', 'sqrt', 'lars')
    warmup_epochs : float >= 0
    batch_scale : int >= 1
        Micro-batches per update; also the final learning-rate multiplier of the warmup.
    updates_per_epoch : int >= 1
        Micro-batches per epoch (warmup length W = warmup_epochs * updates_per_epoch).
    begin_epoch : int >= 0
        Epoch the run starts from: the warmup position starts at begin_epoch * updates_per_epoch.
    num_epochs : int >= 1
        Accepted for compatibility with MXNet's LBSGD, which does not use it either.
    lars_eta : float > 0, default 0.001
        Trust coefficient (the LARS paper's and ``mx.optimizer.LARS``'s default).
    lars_eps : float >= 0, default 0
        Added to the denominator (zero norms already fall back to a factor of 1).
    lars_min, lars_max : float, default 0 and inf
        Clip range of the trust ratio; open by default, like the paper and MXNet's LARS.
    lars_exclude : None, sequence of str, or callable(name) -> bool
        Layers LARS leaves at factor 1. Default: names ending in 'bias', 'gamma' or 'beta'.
        A sequence gives name suffixes; names come from ``param_dict`` (Gluon) or
        ``param_idx2name`` (Module). Use a module-level function to keep it picklable.
    fused : None or bool
        Kernel path: None runs per-tensor kernels for big tensors and fused multi-tensor
        kernels for small ones (see ``_kernels.route``); True/False force one path.
        ``$MX_LBSGD_FUSED=0/1`` overrides None.
    loss_scaler : None, float or DynamicLossScaler
        None: no loss scaling. Otherwise the gradients carry ``loss_scaler.scale`` (scale the
        loss by it before ``backward()``): each step is checked for inf/NaN over all its
        gradients (one host read), skipped as a whole on overflow, and unscaled inside the
        update kernel (``rescale_grad / scale``); ``loss_scaler.update`` runs once per step.
        Under a Trainer with ``batch_scale > 1`` a step is a whole window (an overflow in
        any micro-batch skips the window on every worker); elsewhere every micro-batch is
        a loss-scaling step, unscaled as it is accumulated.
    count_skipped_steps : bool, default False
        Whether a skipped step advances ``num_update`` (what ``lr_scheduler`` sees). Warmup
        and accumulation counters never advance on a skipped step.
    scale_key : str, default 'default'
        Name under which ``loss_scaler`` serves :func:`mx_lbsgd.scale_gradient` ops (Module).
    lazy_update : bool, default True
        As in ``mx.optimizer.SGD``: with a row_sparse gradient only its rows change
        (weight, momentum, weight decay, fp32 master rows); False updates every row.
        Tensors with non-default storage (row_sparse gradients, csr or row_sparse weights)
        run one by one through MXNet's sparse-aware kernels, as SGD runs them. With
        ``batch_scale > 1`` a row_sparse gradient accumulates over the union of its rows
        (in a row_sparse buffer for gluon Parameters with ``grad_stype='row_sparse'``).
        LARS norms of such a layer cover the rows present and are read back once.
    """

    def __init__(self, momentum=0.0, multi_precision=False, warmup_strategy='linear',
                 warmup_epochs=5, batch_scale=1, updates_per_epoch=32, begin_epoch=0,
                 num_epochs=60, lars_eta=0.001, lars_eps=0.0, lars_min=0.0,
                 lars_max=float('inf'), lars_exclude=None, fused=None, loss_scaler=None,
                 count_skipped_steps=False, scale_key='default', lazy_update=True, **kwargs):
        check_real('momentum', momentum, 0.0, 1.0, open_max=True)
        check_choice('warmup_strategy', warmup_strategy, WARMUP_STRATEGIES)
        check_real('warmup_epochs', warmup_epochs, 0.0)
        check_int('batch_scale', batch_scale, 1)
        check_int('updates_per_epoch', updates_per_epoch, 1)
        check_int('begin_epoch', begin_epoch, 0)
        check_int('num_epochs', num_epochs, 1)
        check_real('lars_eta', lars_eta, 0.0, open_min=True)
        check_real('lars_eps', lars_eps, 0.0)
        check_real('lars_min', lars_min, 0.0)
        check_real('lars_max', lars_max, 0.0, allow_inf=True)
        if lars_min > lars_max:
            raise ValueError('lars_min must be <= lars_max; got lars_min=%r, lars_max=%r'
                             % (lars_min, lars_max))
        if not (lars_exclude is None or callable(lars_exclude)
                or (isinstance(lars_exclude, (list, tuple))
                    and all(isinstance(s, str) for s in lars_exclude))):
            raise TypeError('lars_exclude must be None, a list of name suffixes or a '
                            'callable(name) -> bool; got %r' % (lars_exclude,))
        check_choice('fused', fused, (None, True, False))
        _check_real_kwargs(kwargs)
        fused = _fused_from_env(fused)
        if loss_scaler is not None:
            loss_scaler = _as_scaler(loss_scaler)
            if _compat.creating_module_updates_on_kvstore():
                raise ValueError(_scaling.KVSTORE_REFUSAL % type(self).__name__)
        self._gate = _scaling._StepGate(fused)
        super().__init__(multi_precision=multi_precision, **kwargs)
        self.momentum = float(momentum)
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = warmup_epochs
        self.batch_scale = int(batch_scale)
        self.updates_per_epoch = int(updates_per_epoch)
        self.begin_epoch = int(begin_epoch)
        self.init_updates = self.begin_epoch * self.updates_per_epoch
        self.num_epochs = int(num_epochs)
        self.lars_eta = float(lars_eta)
        self.lars_eps = float(lars_eps)
        self.lars_min = float(lars_min)
        self.lars_max = float(lars_max)
        self.lars_exclude = (DEFAULT_LARS_EXCLUDE if lars_exclude is None
                             else lars_exclude if callable(lars_exclude)
                             else tuple(lars_exclude))
        self.fused = fused
        self.lazy_update = bool(lazy_update)
        # The Updater hands over every parameter of a dtype at once; kernels chunk by 60.
        self.aggregate_num = 1 << 30
        self._scratch = {}
        self._plans = {}
        self.loss_scaler = loss_scaler
        self.count_skipped_steps = bool(count_skipped_steps)
        self.scale_key = str(scale_key)
        if loss_scaler is not None:
            _graph_scale.serve(self.scale_key, loss_scaler)
        self.last_step_skipped = False
        self._skipped_updates = 0
        self._kvstore_refusal = None
        # accumulation at a Trainer's reduction: None (this optimizer accumulates),
        # 'partial' (a micro-batch summed locally, not reduced) or 'final' (the window's
        # mean, reduced once); set by the Trainer glue each step
        self.window_phase = None
        self.window_position = 0

    @property
    def rescale_grad(self):
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value):
        # gluon.Trainer.step/update set rescale_grad first thing: the firm start of a step
        if self.__dict__.get('_kvstore_refusal'):
            raise ValueError(self._kvstore_refusal)
        self._rescale_grad = value
        if '_gate' not in self.__dict__ or 'param_dict' not in self.__dict__:
            return
        trainer = _compat.trainer_of(self.param_dict)
        if trainer is None or not _compat.trainer_is_built(trainer):
            return
        if id(trainer) != self.__dict__.get('_checked_trainer'):
            _refuse_dist_sparse_gradients(trainer, type(self).__name__)
            self._checked_trainer = id(trainer)
        if self.loss_scaler is not None:
            self._refuse_kvstore_updates(trainer)
            self._gate.new_step(_compat.fresh_gradients(self.param_dict))
        for hook in _TRAINER_STEP_HOOKS:
            hook(trainer, self)

    def _refuse_kvstore_updates(self, trainer):
        if _compat.trainer_kvstore_requested_updates(trainer) is not True:
            _compat.init_trainer_kvstore(trainer)
            if not _compat.trainer_updates_on_kvstore(trainer):
                return
        self._kvstore_refusal = _scaling.KVSTORE_REFUSAL % type(self).__name__
        raise ValueError(self._kvstore_refusal)

    # -- state -------------------------------------------------------------------------
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
        """MXNet SGD's layout (mom, or (mom, weight_fp32); the momentum takes the weight's
        storage type when lazy_update, as SGD's does), then an accumulator when
        batch_scale > 1 (row_sparse for a gluon Parameter with a row_sparse gradient)."""
        stype = weight.stype if self.lazy_update else 'default'
        mom = (nd.zeros(weight.shape, weight.context, dtype=dtype, stype=stype)
               if self.momentum != 0.0 else None)
        parts = [mom] if master is None else [mom, master]
        if self.batch_scale > 1:
            acc_dtype = np.promote_types(weight.dtype, np.float32)
            param = self.param_dict.get(index)
            acc_stype = 'row_sparse' if param is not None and \
                _compat.grad_stype(param) == 'row_sparse' else 'default'
            parts.append(nd.zeros(weight.shape, weight.context, dtype=acc_dtype,
                                  stype=acc_stype))
        return parts[0] if len(parts) == 1 else tuple(parts)

    def split_state(self, weight, state):
        """(momentum or None, master copy or None, accumulator or None) of a state in this
        optimizer's layout; states of MXNet's SGD/LBSGD fit it at batch_scale=1."""
        master = self._uses_master(weight)
        parts = state if isinstance(state, tuple) else (state,)
        want = 1 + master + (self.batch_scale > 1)
        if parts and isinstance(parts[-1], _Ledger):
            raise ValueError(
                'these optimizer states were written by mx_lbsgd 0.1 (each state ends with '
                'its optimizer); load the file with mx_lbsgd.checkpoint.load_states(target, '
                'path), which converts it to MXNet\'s SGD layout and keeps the counters')
        if len(parts) != want or (parts[0] is None) != (self.momentum == 0.0):
            raise ValueError(
                'optimizer state of shape %s does not fit %s(momentum=%g, multi_precision=%s, '
                'batch_scale=%d): it holds %d arrays (momentum %s), this optimizer needs %d. '
                'States written by MXNet\'s built-in LBSGD/SGD load with batch_scale=1 and the '
                'same momentum and multi_precision; otherwise start from fresh optimizer '
                'states (skip load_states / load_optimizer_states)'
                % (weight.shape, type(self).__name__, self.momentum, self.multi_precision,
                   self.batch_scale, len(parts), 'absent' if parts[0] is None else 'present',
                   want))
        return (parts[0], parts[1] if master else None,
                parts[-1] if self.batch_scale > 1 else None)

    # -- progress (counters and loss scale), for checkpoints -----------------------------
    def progress(self):
        """Counters and loss-scaler state: what resuming bit for bit needs besides the
        per-parameter states (plain Python values)."""
        return {'index_update_counts': {k: dict(v) for k, v in
                                        self._all_index_update_counts.items()},
                'num_update': self.num_update, 'skipped_updates': self._skipped_updates,
                'window_position': self.window_position,
                'loss_scaler': (None if self.loss_scaler is None
                                else self.loss_scaler.state_dict())}

    def load_progress(self, progress):
        """Resume the counters and loss-scale state of `progress()` (in place: objects that
        hold this optimizer's scaler keep seeing the live one)."""
        counts = {int(k): {i: int(n) for i, n in v.items()}
                  for k, v in progress['index_update_counts'].items()}
        if self.loss_scaler is not None and progress.get('loss_scaler') is not None:
            self.loss_scaler.load_state_dict(progress['loss_scaler'])
        current = next((k for k, v in self._all_index_update_counts.items()
                        if v is self._index_update_count), 0)
        self._all_index_update_counts = counts or {0: {}}
        self._index_update_count = self._all_index_update_counts.setdefault(current, {})
        self.num_update = int(progress['num_update'])
        self._skipped_updates = int(progress['skipped_updates'])
        self.window_position = int(progress.get('window_position', 0))

    # -- public progress -----------------------------------------------------------------
    @property
    def micro_batches(self):
        """Micro-batches counted so far (a skipped window is not counted): the warmup
        position, without ``begin_epoch * updates_per_epoch``."""
        counts = self._index_update_count.values()
        return max(counts, default=self.begin_num_update) - self.begin_num_update

    @property
    def applied_updates(self):
        """Updates that changed the weights: ``micro_batches // batch_scale``."""
        return self.micro_batches // self.batch_scale

    def lr_multiplier(self, position=None):
        """The warmup learning-rate multiplier at micro-batch `position` (default: the last
        one counted, `micro_batches`); LARS's per-layer trust ratio multiplies it."""
        position = self.micro_batches if position is None else position
        if self.warmup_strategy == 'lars':
            return 1.0
        return warmup_multiplier(self.init_updates + position,
                                 self.warmup_epochs * self.updates_per_epoch,
                                 self.batch_scale, self.warmup_strategy)

    # -- update ------------------------------------------------------------------------
    def _name(self, index):
        if index in self.param_dict:
            return self.param_dict[index].name
        return self.idx2name.get(index, str(index))

    def _lars_applies(self, index):
        if not self.param_dict and not self.idx2name and self.lars_exclude:
            raise ValueError(
                "warmup_strategy='lars' needs parameter names to leave %r out of LARS, and "
                'this optimizer has none (horovod\'s DistributedOptimizer keeps the names '
                'Module gives it to itself). Create it with param_idx2name={index: name}, '
                'e.g. dict(enumerate(n for n in sym.list_arguments() if n not in '
                'data_names + label_names)), or pass lars_exclude=() to apply LARS to every '
                'layer' % (self.lars_exclude,))
        name = self._name(index)
        if callable(self.lars_exclude):
            return not self.lars_exclude(name)
        return not name.endswith(self.lars_exclude)

    def update(self, index, weight, grad, state):
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if not isinstance(index, (list, tuple)):
            index, weight, grad, state = [index], [weight], [grad], [state]
        self._plan(index, weight, grad, state)    # validates states and names first
        if self.window_phase == 'partial':
            self._update_count(index)      # summed at the Trainer; nothing to apply yet
            self.last_step_skipped = False
            return
        if self.loss_scaler is None:
            self._apply(index, weight, grad, state, unscale=1.0)
            return
        if isinstance(index[0], str):     # Module's kvstore updater passes parameter names
            self._kvstore_refusal = _scaling.KVSTORE_REFUSAL % type(self).__name__
            raise ValueError(self._kvstore_refusal)
        runs = self._gate.submit([(w.context, i) for i, w in zip(index, weight)], grad,
                                 (index, weight, grad, state), self.loss_scaler,
                                 self._gradient_scale())
        for call, apply_ in runs:
            self.last_step_skipped = not apply_
            if apply_:
                self._apply(*call, unscale=_scaling.unscale_factor(self._gate.scale))
            elif self.window_phase == 'final':
                self._rewind_window(call[0])
        if runs and self._gate.skip and not self._gate.counted:
            self._gate.counted = True
            self._count_skipped_step()
        _graph_scale.serve(self.scale_key, self.loss_scaler)

    def _gradient_scale(self):
        """The scale this step's gradients carry: Gluon scales the loss by the optimizer's
        scaler; a Module graph by the scaler its scale_gradient op was served when backward
        ran (another optimizer's, right after Module.load_optimizer_states)."""
        if self.param_dict:
            return self.loss_scaler.scale
        return _graph_scale.served(self.scale_key, self.loss_scaler).scale

    def _count_skipped_step(self):
        window = self.batch_scale if self.window_phase == 'final' else 1
        if self.window_phase == 'final':
            self.num_update -= window - 1    # its micro-batches were counted as they came
        if self.count_skipped_steps:
            self._skipped_updates += window
            self.num_update += window

    def _rewind_window(self, index):
        for i in index:
            self._index_update_count[i] -= self.batch_scale - 1

    def _update_count(self, index):
        super()._update_count(index)
        if self._skipped_updates:
            top = max(self._index_update_count[i] for i in index)
            self.num_update = max(self.num_update, top + self._skipped_updates)

    def _plan(self, index, weight, grad, state):
        """Per call signature, computed once: the state parts, the kernel routes (tensors
        with non-default storage go one by one through MXNet's sparse-aware kernels) and the
        LARS exclusions (states are re-split when the Updater's state objects change)."""
        key = (weight[0].context, tuple(index))
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan['state'], state)):
            return plan
        parts = [self.split_state(w, s) for w, s in zip(weight, state)]
        sparse = [j for j, (w, g) in enumerate(zip(weight, grad))
                  if w.stype != 'default' or g.stype != 'default']
        dense = [j for j in range(len(weight)) if j not in sparse]
        groups = {}
        for j in dense:
            groups.setdefault((weight[j].dtype, parts[j][1] is None), []).append(j)
        routes = []
        for members in groups.values():
            single, multi = _kernels.route([weight[j].size for j in members],
                                           weight[0].context.device_type, self.fused,
                                           weight[members[0]].dtype)
            routes += [(_kernels._single_tensor_sgd, [members[p] for p in single]),
                       (_kernels._multi_tensor_sgd, [members[p] for p in multi])]
        lars = self.warmup_strategy == 'lars'
        plan = {'state': list(state), 'moms': [p[0] for p in parts],
                'masters': [p[1] for p in parts], 'accs': [p[2] for p in parts],
                'routes': [(fn, pos) for fn, pos in routes if pos], 'sparse': sparse,
                'dense': dense,
                'keep_lr': [not self._lars_applies(i) for i in index] if lars else None}
        self._plans[key] = plan
        return plan

    def _apply(self, index, weight, grad, state, unscale):
        self._update_count(index)
        B = self.batch_scale
        plan = self._plan(index, weight, grad, state)
        edge = self.window_phase is not None
        if B > 1 and not edge:
            steps = [self._index_update_count[i] - self.begin_num_update for i in index]
            for j in plan['sparse']:
                _kernels.accumulate_sparse(acc=plan['accs'][j], grad=grad[j],
                                           first=steps[j] % B == 1,
                                           factor=self.rescale_grad * unscale)
            sparse = plan['sparse']
            for first in (True, False):
                pick = [j for j in plan['dense'] if (steps[j] % B == 1) == first]
                if pick:
                    _kernels.accumulate(accs=[plan['accs'][j] for j in pick],
                                        grads=[grad[j] for j in pick], first=first,
                                        factor=self.rescale_grad * unscale,
                                        scratch=self._scratch)
            if any(k % B for k in steps):
                if not all(k % B for k in steps):
                    raise RuntimeError('parameters of one call are at different positions '
                                       'of the accumulation window: %s' % (steps,))
                if _compat.on_kvstore_server():
                    # the server reuses the gradient buffer it passed once the weight it
                    # holds is ready, which this call did not write: without the wait, 1
                    # job in 3 to 5 (SparseEmbedding, batch_scale=2) read a reused buffer
                    for acc in plan['accs']:
                        acc.wait_to_read()
                return
            grad = [acc.tostype('row_sparse')      # lazy over the window's rows (a dense
                    if j in sparse and grad[j].stype == 'row_sparse'   # buffer when there
                    and acc.stype == 'default' else acc         # is no param_dict)
                    for j, acc in enumerate(plan['accs'])]
            rescale = 1.0 / B     # already rescaled and unscaled, micro-batch by micro-batch
        else:
            rescale = self.rescale_grad * unscale   # at a Trainer: the window's mean
        lrs = self._get_lrs(index)
        wds = self._get_wds(index)
        lars = plan['keep_lr'] is not None and not all(plan['keep_lr'])
        if plan['keep_lr'] is None:
            W = self.warmup_epochs * self.updates_per_epoch
            mults = {}      # parameters of a call mostly share one position
            for i in index:
                k = self._index_update_count[i]
                if k not in mults:
                    mults[k] = warmup_multiplier(self.init_updates + k - self.begin_num_update,
                                                 W, B, self.warmup_strategy)
            lrs = [lr * mults[self._index_update_count[i]] for lr, i in zip(lrs, index)]
        for kernel, pos in plan['routes']:
            pick = lambda seq: [seq[j] for j in pos]   # noqa: E731
            weights, grads, masters = pick(weight), pick(grad), pick(plan['masters'])
            lr_vector = None
            if lars:
                lr_vector = _kernels.lars_lrs(
                    weights=[m if m is not None else w for w, m in zip(weights, masters)],
                    grads=grads, lrs=pick(lrs), wds=pick(wds), keep_lr=pick(plan['keep_lr']),
                    eta=self.lars_eta, eps=self.lars_eps, rescale_grad=rescale,
                    lars_min=self.lars_min, lars_max=self.lars_max)
            kernel(weights=weights, grads=grads, moms=pick(plan['moms']), masters=masters,
                   lrs=pick(lrs), wds=pick(wds), lr_vector=lr_vector,
                   momentum=self.momentum, rescale_grad=rescale,
                   clip_gradient=self.clip_gradient, scratch=self._scratch)
        if plan['sparse']:
            self._apply_sparse(plan, weight, grad, lrs, wds, rescale, lars)

    def _apply_sparse(self, plan, weight, grad, lrs, wds, rescale, lars):
        pos = plan['sparse']
        lrs = [lrs[j] for j in pos]
        if lars:
            for n, j in enumerate(pos):
                if not plan['keep_lr'][j] and grad[j].stype == 'row_sparse':
                    norm_weight = plan['masters'][j] if plan['masters'][j] is not None \
                        else weight[j]
                    lrs[n] *= _kernels.sparse_lars_factor(
                        weight=norm_weight, grad=grad[j], wd=wds[j], eta=self.lars_eta,
                        eps=self.lars_eps, rescale_grad=rescale, lars_min=self.lars_min,
                        lars_max=self.lars_max)
        _kernels._sparse_sgd(weights=[weight[j] for j in pos], grads=[grad[j] for j in pos],
                             moms=[plan['moms'][j] for j in pos],
                             masters=[plan['masters'][j] for j in pos], lrs=lrs,
                             wds=[wds[j] for j in pos], momentum=self.momentum,
                             rescale_grad=rescale, clip_gradient=self.clip_gradient,
                             lazy_update=self.lazy_update)

    def __getstate__(self):
        state = super().__getstate__()
        # param_dict is not pickled; keep its names (LARS exclusions on kvstore servers)
        state['idx2name'] = dict(self.idx2name)
        state['idx2name'].update((i, p.name) for i, p in self.param_dict.items())
        for transient in ('_scratch', '_plans', '_gate', '_checked_trainer'):
            state.pop(transient, None)
        state['window_phase'] = None     # set afresh by the Trainer glue at every step
        return state

    def __setstate__(self, state):
        # attributes that optimizers pickled by mx_lbsgd 0.1 lack
        state = dict({'window_position': 0, 'lazy_update': True, '_kvstore_refusal': None},
                     **state)
        state['window_phase'] = None
        super().__setstate__(state)
        self._scratch, self._plans = {}, {}
        self._gate = _scaling._StepGate(self.fused)

    def __reduce_ex__(self, protocol):
        # kvstore.set_optimizer pickles with protocol 0 to send the optimizer to the
        # servers of a dist kvstore, which then update key by key.
        if protocol == 0 and self.loss_scaler is not None:
            raise ValueError(_scaling.KVSTORE_REFUSAL % type(self).__name__)
        if protocol == 0:
            kind, names = _compat.module_sparse_gradients_on_dist_kvstore()
            _refuse_sparse_gradients_on_servers(names, kind, type(self).__name__)
        return super().__reduce_ex__(protocol)


def _refuse_dist_sparse_gradients(trainer, name):
    """Gluon: checked at the first step of each Trainer, before its kvstore exists."""
    kind = _compat.trainer_kvstore_type(trainer)
    if kind and kind.startswith('dist'):
        _refuse_sparse_gradients_on_servers(
            _compat.dense_weights_with_sparse_gradients(trainer), kind, name)


def _refuse_sparse_gradients_on_servers(names, kind, name):
    """Dense weights with row_sparse gradients on a dist kvstore: MXNet 1.9.1 pushes the
    sparse gradients into keys initialized dense, and the server aborts ("copying size
    mismatch"; with mx.optimizer.SGD too). Refuse before anything is sent."""
    if names:
        raise ValueError(
            '%s: parameter(s) %s have dense weights and row_sparse gradients '
            "(Embedding(sparse_grad=True)), which MXNet 1.9.1's %r kvstore cannot reduce (its "
            'server aborts, with mx.optimizer.SGD too). Use gluon.contrib.nn.SparseEmbedding '
            "(row_sparse weights, updated on the servers), sparse_grad=False, or a 'local' or "
            "'device' kvstore" % (name, ', '.join(map(repr, names)), kind))


class _Ledger:
    """The last element of every state written by mx_lbsgd 0.1 (a reference to the
    optimizer). Kept so that such files unpickle; `checkpoint.load_states` converts them."""

    def __init__(self, opt=None):
        self.opt = opt


def _fused_from_env(fused):
    """`fused`, or $MX_LBSGD_FUSED ('0' or '1') when fused is None."""
    env = os.environ.get('MX_LBSGD_FUSED', '')
    if fused is not None or not env:
        return fused
    check_choice('MX_LBSGD_FUSED', env, ('0', '1'))
    return env == '1'


def _check_real_kwargs(kwargs):
    """NaN or infinite values of the base Optimizer's real-valued arguments."""
    for name in ('learning_rate', 'wd', 'rescale_grad', 'clip_gradient'):
        value = kwargs.get(name)
        if value is not None:
            check_real(name, value)
