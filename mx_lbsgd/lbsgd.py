"""`LBSGD`: large-batch SGD with warmup, LARS, gradient accumulation and fp32 master weights."""
import sys
import uuid
import warnings

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _graph_scale, _kernels
from ._checks import check_choice, check_int, check_real
from ._step_gate import _StepGate
from .loss_scale import _as_scaler
from .schedules import WARMUP_STRATEGIES, warmup_multiplier

DEFAULT_LARS_EXCLUDE = ('bias', 'gamma', 'beta')


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

    With ``multi_precision=True`` and float16 weights, ``w`` above is an fp32 master copy
    (state ``(mom, weight_fp32)`` as in ``mx.optimizer.SGD``) cast back to the fp16 weight.

    LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
    https://arxiv.org/abs/1708.03888. Warmup: Goyal et al., "Accurate, Large Minibatch SGD"
    (2017), https://arxiv.org/abs/1706.02677.

    Differences from MXNet 1.9.1's ``mx.optimizer.LBSGD``: updates run on fused
    multi-tensor kernels (GPU) or the fastest per-tensor kernels (CPU); LARS norms stay on
    the device, include ``rescale_grad``, use the fp32 master weights, have a trust
    coefficient (``lars_eta``) and skip biases and BatchNorm parameters; accumulation is
    fp32, lives in the per-device optimizer state (multi-device Gluon training is right),
    keeps the first micro-batch and launches no ``lr=0`` kernel between updates; bad
    arguments raise instead of silently disabling warmup. ``lars`` with the clip range
    open matches ``mx.optimizer.LARS(momentum_correction=False)``. Compared with PyTorch's
    ``torch.optim.SGD``: MXNet's momentum form (lr inside the momentum buffer), weight decay
    added to the gradient, no dampening or Nesterov.

    Parameters (besides those of ``mx.optimizer.Optimizer``)
    ----------
    momentum : float in [0, 1)
    multi_precision : bool
        Keep fp32 master weights (and fp32 momentum) for float16 weights.
    warmup_strategy : {'linear', 'power2', 'sqrt', 'lars'}
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
        Kernel path: None picks fused multi-tensor kernels on GPU and per-tensor kernels on
        CPU (faster there, as measured); ``$MX_LBSGD_FUSED=0/1`` overrides None.
    loss_scaler : None, float or DynamicLossScaler
        None: no loss scaling. Otherwise the gradients carry ``loss_scaler.scale`` (scale the
        loss by it before ``backward()``): each step is checked for inf/NaN over all its
        gradients (one host read), skipped as a whole on overflow, and unscaled inside the
        update kernel (``rescale_grad / scale``); ``loss_scaler.update`` runs once per step.
        With ``batch_scale > 1`` every micro-batch is a loss-scaling step and is unscaled as
        it is accumulated, so the scale may change inside a window.
    count_skipped_steps : bool, default False
        Whether a skipped step advances ``num_update`` (what ``lr_scheduler`` sees). Warmup
        and accumulation counters never advance on a skipped step.
    scale_key : str, default 'default'
        Name under which ``loss_scaler`` serves :func:`mx_lbsgd.scale_gradient` ops (Module).
    """

    def __init__(self, momentum=0.0, multi_precision=False, warmup_strategy='linear',
                 warmup_epochs=5, batch_scale=1, updates_per_epoch=32, begin_epoch=0,
                 num_epochs=60, lars_eta=0.001, lars_eps=0.0, lars_min=0.0,
                 lars_max=float('inf'), lars_exclude=None, fused=None, loss_scaler=None,
                 count_skipped_steps=False, scale_key='default', **kwargs):
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
        check_real('lars_max', lars_max, 0.0)
        if lars_min > lars_max:
            raise ValueError('lars_min must be <= lars_max; got lars_min=%r, lars_max=%r'
                             % (lars_min, lars_max))
        if not (lars_exclude is None or callable(lars_exclude)
                or (isinstance(lars_exclude, (list, tuple))
                    and all(isinstance(s, str) for s in lars_exclude))):
            raise TypeError('lars_exclude must be None, a list of name suffixes or a '
                            'callable(name) -> bool; got %r' % (lars_exclude,))
        if fused not in (None, True, False):
            raise ValueError('fused=%r is not supported; expected one of (None, True, False)'
                             % (fused,))
        _kernels.use_fused(fused, mx.cpu())     # validates $MX_LBSGD_FUSED
        if loss_scaler is not None:
            loss_scaler = _as_scaler(loss_scaler)
            _refuse_kvstore_updates(type(self).__name__)
        self._gate = _StepGate(fused)
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
        # The Updater hands over every parameter of a dtype at once; kernels chunk by 60.
        self.aggregate_num = 1 << 30
        self._scratch = {}
        self._ledger = _Ledger(self)
        self._token = uuid.uuid4().hex     # shared by every unpickled copy of this optimizer
        self._adopted = set()
        self.loss_scaler = loss_scaler
        self.count_skipped_steps = bool(count_skipped_steps)
        self.scale_key = str(scale_key)
        if loss_scaler is not None:
            _graph_scale.serve(self.scale_key, loss_scaler)
        self.last_step_skipped = False
        self._skipped_updates = 0
        self._kvstore_refusal = None

    @property
    def rescale_grad(self):
        return self._rescale_grad

    @rescale_grad.setter
    def rescale_grad(self, value):
        # gluon.Trainer sets rescale_grad at the start of every step and update.
        if self.__dict__.get('_kvstore_refusal'):
            raise ValueError(self._kvstore_refusal)
        self._rescale_grad = value
        if '_gate' in self.__dict__:
            self._gate.new_step(self._fresh_grads())

    # -- state -------------------------------------------------------------------------
    def _uses_master(self, weight):
        return self.multi_precision and weight.dtype == np.float16

    def create_state(self, index, weight):
        if weight.dtype == np.float16 and self.batch_scale > 1:
            raise ValueError('batch_scale=%d with float16 weights needs multi_precision=True:'
                             ' the float32 accumulated gradient updates the float32 master '
                             'copy' % self.batch_scale)
        return self._make_state(weight, weight.dtype, master=None)

    def create_state_multi_precision(self, index, weight):
        self._gate.created((weight.context, index))
        if self._uses_master(weight):
            return self._make_state(weight, np.float32, master=weight.astype(np.float32))
        state = self.create_state(index, weight)
        if weight.dtype == np.float16:
            warnings.warn('Accumulating with float16 in optimizer can lead to poor accuracy '
                          'or slow convergence. Consider multi_precision=True.')
        return state

    def _make_state(self, weight, dtype, master):
        """MXNet SGD's layout (mom, or mom and weight_fp32), then an accumulator when
        batch_scale > 1, then the optimizer's `_Ledger` (see there)."""
        mom = (nd.zeros(weight.shape, weight.context, dtype=dtype)
               if self.momentum != 0.0 else None)
        parts = [mom] if master is None else [mom, master]
        if self.batch_scale > 1:
            acc_dtype = np.promote_types(weight.dtype, np.float32)
            parts.append(nd.zeros(weight.shape, weight.context, dtype=acc_dtype))
        return tuple(parts) + (self._ledger,)

    def _split_state(self, weight, state):
        """(momentum, master copy or None, accumulator or None, ledger or None).

        Also reads MXNet's SGD / LBSGD layout (a momentum, or (momentum, weight_fp32)),
        e.g. states saved by MXNet's built-in LBSGD."""
        ledger = None
        if isinstance(state, tuple) and state and isinstance(state[-1], _Ledger):
            ledger, state = state[-1], state[:-1]
        elif not isinstance(state, tuple):
            state = (state,)
        master = self._uses_master(weight)
        want = 1 + master + (self.batch_scale > 1)
        if len(state) != want or (state[0] is None) != (self.momentum == 0.0):
            raise ValueError(
                'optimizer state of shape %s does not fit %s(momentum=%g, multi_precision=%s, '
                'batch_scale=%d): it holds %d arrays (momentum %s), this optimizer needs %d. '
                'States written by MXNet\'s built-in LBSGD/SGD load with batch_scale=1 and the '
                'same momentum and multi_precision; otherwise start from fresh optimizer '
                'states (skip load_states / load_optimizer_states)'
                % (weight.shape, type(self).__name__, self.momentum, self.multi_precision,
                   self.batch_scale, len(state), 'absent' if state[0] is None else 'present',
                   want))
        return (state[0], state[1] if master else None,
                state[-1] if self.batch_scale > 1 else None, ledger)

    def _adopt(self, ledger):
        """Take over the counters and loss-scaler state carried by states that were saved
        without the optimizer (Module.save_optimizer_states) and loaded into this one."""
        old = ledger.opt
        current = next((k for k, v in self._all_index_update_counts.items()
                        if v is self._index_update_count), 0)
        self._all_index_update_counts = old._all_index_update_counts
        self._index_update_count = self._all_index_update_counts.setdefault(current, {})
        self.num_update = old.num_update
        self._skipped_updates = old._skipped_updates
        if self.loss_scaler is not None and old.loss_scaler is not None:
            # this step's gradients carry the scale served to scale_gradient ops when the
            # backward ran
            self._gate.scale_override = _graph_scale.served(self.scale_key,
                                                            self.loss_scaler).scale
            self.loss_scaler.load_state_dict(old.loss_scaler.state_dict())
            _graph_scale.serve(self.scale_key, self.loss_scaler)
        self._adopted.add(getattr(old, '_token', None))
        ledger.opt = self

    # -- update ------------------------------------------------------------------------
    def _name(self, index):
        if index in self.param_dict:
            return self.param_dict[index].name
        return self.idx2name.get(index, str(index))

    def _lars_applies(self, index):
        name = self._name(index)
        if callable(self.lars_exclude):
            return not self.lars_exclude(name)
        return not name.endswith(self.lars_exclude)

    def update(self, index, weight, grad, state):
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if not isinstance(index, (list, tuple)):
            index, weight, grad, state = [index], [weight], [grad], [state]
        for i, w, g in zip(index, weight, grad):
            if g.stype != 'default' or w.stype != 'default':
                raise TypeError("LBSGD supports only dense ('default') weights and gradients;"
                                " parameter %s has weight stype %r, gradient stype %r"
                                % (self._name(i), w.stype, g.stype))
        last = state[0][-1] if isinstance(state[0], tuple) and state[0] else None
        if isinstance(last, _Ledger) and last.opt is not self:
            # Trainer.load_states unpickles once per device: copies of the same optimizer
            # (or of one already adopted) carry nothing new
            if getattr(last.opt, '_token', None) in self._adopted | {self._token}:
                last.opt = self
            else:
                self._adopt(last)
        if self.loss_scaler is None:
            self._apply(index, weight, grad, state, unscale=1.0)
            return
        if self._updates_on_kvstore(index, weight):
            return
        runs = self._gate.submit([(w.context, i) for i, w in zip(index, weight)], grad,
                                 (index, weight, grad, state), self.loss_scaler)
        for call, apply_ in runs:
            self.last_step_skipped = not apply_
            if apply_:
                self._apply(*call, unscale=1.0 / self._gate.scale)
        if runs and self._gate.skip and self.count_skipped_steps and not self._gate.counted:
            self._gate.counted = True
            self._skipped_updates += 1
            self.num_update += 1

    def _fresh_grads(self):
        """All fresh gradients of a gluon Trainer's parameters, on every device."""
        grads = []
        if self.__dict__.get('loss_scaler') is None:
            return grads
        for param in self.__dict__.get('param_dict', {}).values():
            if param.grad_req == 'null' or param._data is None:
                continue
            grads += [g for d, g in zip(param.list_data(), param.list_grad()) if d._fresh_grad]
        return grads

    def _updates_on_kvstore(self, index, weight):
        """Detects a kvstore updating key by key (update_on_kvstore=True), where a step
        cannot be skipped as a whole; refuses it and skips every such update."""
        if self._kvstore_refusal is None:
            # a kvstore calls with one key: a str (Module) or an index whose weight is the
            # kvstore's own copy, not one of the parameter's arrays (Gluon)
            i, w = index[0], weight[0]
            param = self.param_dict.get(i)
            by_kvstore = isinstance(i, str) or (
                param is not None and param._data is not None
                and all(_handle(w) != _handle(d) for d in param.list_data()))
            if not by_kvstore:
                return False
            self._kvstore_refusal = _KVSTORE_REFUSAL % type(self).__name__
        raise ValueError(self._kvstore_refusal)

    def _update_count(self, index):
        super()._update_count(index)
        if self._skipped_updates:
            top = max(self._index_update_count[i] for i in index)
            self.num_update = max(self.num_update, top + self._skipped_updates)

    def _apply(self, index, weight, grad, state, unscale):
        self._update_count(index)
        B = self.batch_scale
        steps = [self._index_update_count[i] - self.begin_num_update for i in index]
        parts = [self._split_state(w, s) for w, s in zip(weight, state)]
        if B > 1:
            for first in (True, False):
                pick = [j for j, k in enumerate(steps) if (k % B == 1) == first]
                if pick:
                    _kernels.accumulate(accs=[parts[j][2] for j in pick],
                                        grads=[grad[j] for j in pick], first=first,
                                        scratch=self._scratch,
                                        factor=self.rescale_grad * unscale)
        due = [j for j, k in enumerate(steps) if k % B == 0]
        if not due:
            return
        lrs = self._get_lrs([index[j] for j in due])
        wds = self._get_wds([index[j] for j in due])
        lars = None
        if self.warmup_strategy == 'lars':
            lars = dict(apply=[self._lars_applies(index[j]) for j in due], eta=self.lars_eta,
                        eps=self.lars_eps, lars_min=self.lars_min, lars_max=self.lars_max)
        else:
            W = self.warmup_epochs * self.updates_per_epoch
            lrs = [lr * warmup_multiplier(self.init_updates + steps[j], W, B,
                                          self.warmup_strategy)
                   for lr, j in zip(lrs, due)]
        _kernels.sgd(weights=[weight[j] for j in due],
                     grads=[grad[j] if B == 1 else parts[j][2] for j in due],
                     moms=[parts[j][0] for j in due], masters=[parts[j][1] for j in due],
                     lrs=lrs, wds=wds, momentum=self.momentum,
                     # accumulated gradients are already rescaled and unscaled, micro-batch
                     # by micro-batch (rescale_grad and the loss scale may change in a window)
                     rescale_grad=self.rescale_grad * unscale if B == 1 else 1.0 / B,
                     clip_gradient=self.clip_gradient,
                     fused=self.fused, scratch=self._scratch, lars=lars)

    def __getstate__(self):
        state = super().__getstate__()
        # param_dict is not pickled; keep its names (LARS exclusions on kvstore servers)
        state['idx2name'] = dict(self.idx2name)
        state['idx2name'].update((i, p.name) for i, p in self.param_dict.items())
        state['_scratch'] = {}
        state['_gate'] = _StepGate(self.fused)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        # Module.load_optimizer_states unpickles the saved optimizer with the states: its
        # scaler serves scale_gradient until the next update adopts it (bit-identical resume)
        if self.loss_scaler is not None:
            _graph_scale.serve(self.scale_key, self.loss_scaler)

    def __reduce_ex__(self, protocol):
        # kvstore.set_optimizer pickles with protocol 0 to send the optimizer to the
        # servers of a dist kvstore, which then update key by key.
        if protocol == 0 and self.loss_scaler is not None:
            raise ValueError(_KVSTORE_REFUSAL % type(self).__name__)
        return super().__reduce_ex__(protocol)


class _Ledger:
    """One per optimizer, the last element of every state it creates. MXNet's Module saves
    the states without the optimizer; through this reference the pickled states carry the
    optimizer (its warmup/accumulation counters, num_update and loss-scaler state), which
    the optimizer that loads them adopts at its next update."""

    def __init__(self, opt):
        self.opt = opt


_KVSTORE_REFUSAL = (
    '%s with a loss_scaler cannot run with update_on_kvstore=True: the kvstore updates '
    'each parameter as soon as its gradient arrives, so an overflow step cannot be skipped '
    'as a whole. Use gluon.Trainer(..., update_on_kvstore=False), or for Module set the '
    'environment variable MXNET_UPDATE_ON_KVSTORE=0')


def _handle(array):
    return array.handle.value


def _refuse_kvstore_updates(name):
    """Refuse update_on_kvstore=True where the optimizer is created: in Module.init_optimizer
    (which decides it first) or in gluon.Trainer(update_on_kvstore=True). Later, inside the
    kvstore's updater callback, ctypes would swallow the exception."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return
        local = frame.f_locals
        owner = local.get('self')
        if (frame.f_code.co_name == 'init_optimizer' and isinstance(owner, mx.module.BaseModule)
                and 'update_on_kvstore' in local):
            if local['update_on_kvstore'] and local.get('kvstore') is not None:
                raise ValueError(_KVSTORE_REFUSAL % name)
            return
        if frame.f_code.co_name == '__init__' and isinstance(owner, mx.gluon.Trainer):
            if local.get('update_on_kvstore'):
                raise ValueError(_KVSTORE_REFUSAL % name)
            return
