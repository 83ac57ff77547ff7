"""`LBSGD`: large-batch SGD with warmup, LARS, gradient accumulation and fp32 master weights."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence, Union

from ._checks import check_bool, check_choice, check_float32, check_int, check_real
from ._legacy import Ledger as _Ledger  # noqa: F401  (mx_lbsgd 0.1 files pickle this name)
from .families import SGDFamily
from .loss_scaling import DynamicLossScaler, as_scaler
from .pipeline import DEFAULT_LARS_EXCLUDE, PipelineOptimizer, TrustRatio, Warmup
from .pipeline.batch_choice import check_args as check_batch_scale
from .schedules import WARMUP_SHAPES, WARMUP_STRATEGIES

#: MXNet LBSGD's ``updates_per_epoch`` default, used when none is given
_MXNET_UPDATES_PER_EPOCH = 32


def _updates_per_epoch(value: Optional[int], warmup_strategy: str, warmup_epochs: float,
                       batch_scale: int) -> int:
    """`value` checked, or MXNet's default; a warning when that default decides the length
    of a warmup (one that changes the learning rate: a shape, epochs > 0, batch_scale > 1)."""
    if value is not None:
        return check_int('updates_per_epoch', value, 1)
    if warmup_strategy in WARMUP_SHAPES and warmup_epochs > 0 and batch_scale > 1:
        warnings.warn(
            'LBSGD: warmup_strategy=%r rises over warmup_epochs * updates_per_epoch '
            "micro-batches, and updates_per_epoch was not given, so MXNet's default of %d "
            'applies: the warmup takes %g micro-batches (warmup_epochs=%g) whatever the '
            'length of your epochs. Pass updates_per_epoch=<micro-batches per epoch>, e.g. '
            'len(train_data)' % (warmup_strategy, _MXNET_UPDATES_PER_EPOCH,
                                 warmup_epochs * _MXNET_UPDATES_PER_EPOCH, warmup_epochs),
            UserWarning, stacklevel=4)
    return _MXNET_UPDATES_PER_EPOCH


class LBSGD(PipelineOptimizer):
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
        if warmup_strategy == 'lars':
            mult = 1                                                 # MXNet's meaning
        if lars and layer not excluded:
            mult *= clip(lars_eta * |w| / (|r * g| + wd * |w| + lars_eps),
                         lars_min, lars_max)            # 1 where |w| == 0 or |g| == 0
        g = clip(r * g, clip_gradient)
        if not nesterov:                                 # MXNet's SGD (sgd_mom_update)
            mom = momentum * mom - lr * mult * (g + wd * w)
            w = w + mom
        else:                                            # MXNet's NAG (nag_mom_update)
            m = momentum * mom
            w_new = w - m + (momentum + 1) * (m - lr * mult * (g + wd * w))
            mom = m - lr * mult * (g + wd * w_new)       # MXNet's order: the new weight
            w = w_new

    Under a gluon ``Trainer`` (kvstore updates on the workers, or no kvstore, or horovod's
    ``DistributedTrainer``) the window is kept at the Trainer's reduction instead: the
    gradients of a window are summed per device in the same float32 buffer and reduced
    once, on the micro-batch that updates the weights; the result is the same.

    With ``multi_precision=True`` and float16 weights, ``w`` above is an fp32 master copy
    (state ``(mom, weight_fp32)`` as in ``mx.optimizer.SGD``) cast back to the fp16 weight.
    States are laid out exactly as ``mx.optimizer.SGD``'s (``mom``, ``(mom, weight_fp32)``
    or None), with the float32 accumulator appended when ``batch_scale > 1``: at
    ``batch_scale=1`` they load into ``SGD`` (and MXNet's ``LBSGD``) and back. With
    ``nesterov=True`` they are ``mx.optimizer.NAG``'s (the momentum always dense), and at
    ``batch_scale=1`` without warmup or LARS the weights are ``'nag'``'s bit for bit.

    It is a preset of the update pipeline (`mx_lbsgd.pipeline`): the SGD kernel family, a
    warmup, and a trust ratio when ``lars``.

    LARS: You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
    https://arxiv.org/abs/1708.03888. Warmup: Goyal et al., "Accurate, Large Minibatch SGD"
    (2017), https://arxiv.org/abs/1706.02677.

    Differences from MXNet 1.9.1's ``mx.optimizer.LBSGD``: updates run on per-tensor
    kernels for big tensors and fused multi-tensor kernels for small ones; LARS norms stay
    on the device, include ``rescale_grad``, use the fp32 master weights, have a trust
    coefficient (``lars_eta``), skip biases and BatchNorm parameters and combine with a
    warmup (``lars=True``); accumulation is fp32, lives in the per-device optimizer state,
    keeps the first micro-batch, launches no ``lr=0`` kernel between updates and
    communicates once per update under a Trainer; bad arguments raise instead of silently
    disabling warmup. ``lars`` with the clip range open matches
    ``mx.optimizer.LARS(momentum_correction=False)``. Compared with PyTorch's
    ``torch.optim.SGD``: MXNet's momentum form (lr inside the momentum buffer), weight decay
    added to the gradient, no dampening. Nesterov momentum (``nesterov=True``) is MXNet
    NAG's rule, Sutskever et al., "On the importance of initialization and momentum in deep
    learning" (ICML 2013): the same step as torch's ``nesterov=True`` for a constant lr
    and no weight decay, but with lr inside the buffer (a changing lr applies at once)
    and the momentum's weight-decay term taken at the new weight, as MXNet's kernel does;
    it combines with warmup, LARS (the trust ratio scales lr in both terms), the window,
    fp16 master copies and clipping.

    Besides those of ``mx.optimizer.Optimizer`` (``learning_rate``, ``wd``,
    ``rescale_grad``, ``clip_gradient``, ``lr_scheduler``, ``param_idx2name``, ...):

    Parameters
    ----------
    momentum : float in [0, 1)
    nesterov : bool, default False
        Nesterov momentum with MXNet NAG's update rule (``'nag'``, ``nag_mom_update``);
        no effect without momentum (NAG then runs ``sgd_update``, as this does).
    multi_precision : bool
        Keep fp32 master weights (and fp32 momentum) for float16 weights.
    warmup_strategy : one of `mx_lbsgd.WARMUP_STRATEGIES` ('linear', 'power2', 'sqrt', 'lars')
        'lars' is MXNet's spelling of LARS without a warmup (multiplier 1, ``lars=True``).
    warmup_epochs : float >= 0
    batch_scale : int >= 1 or 'auto'
        Micro-batches per update; also the final learning-rate multiplier of the warmup
        (without ``lr_scaling``). 'auto': the window length that gives the most goodput,
        chosen within ``batch_scale_bounds=(lo, hi)`` every ``batch_scale_interval``
        updates (default 16) from measured window times and the noise scale; it needs an
        ``lr_scaling`` rule (`mx_lbsgd.pipeline.batch_choice`).
    updates_per_epoch : None or int >= 1
        Micro-batches per epoch (warmup length W = warmup_epochs * updates_per_epoch).
        None: MXNet's default of 32, with a UserWarning when that decides a warmup's
        length (a warmup shape, ``warmup_epochs > 0`` and ``batch_scale > 1``).
    begin_epoch : int >= 0
        Epoch the run starts from: the warmup position starts at begin_epoch * updates_per_epoch.
    num_epochs : int >= 1
        Accepted for compatibility with MXNet's LBSGD, which does not use it either.
    lars : None or bool
        Multiply the warmup by the LARS trust ratio per layer. None: only with
        ``warmup_strategy='lars'``.
    lars_eta : float > 0, default 0.001
        Trust coefficient (the LARS paper's and ``mx.optimizer.LARS``'s default).
    lars_eps : float >= 0, default 0
        Added to the denominator (zero norms already fall back to a factor of 1).
    lars_min, lars_max : float, default 0 and inf
        Clip range of the trust ratio; open by default, like the paper and MXNet's LARS.
        ``lars_eta``, ``lars_eps`` and ``lars_min`` are 0 or of a normal float32 magnitude
        (MXNet's operators take them as floats and refuse the others).
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
    overflow_history_size, overflow_log_interval, check_local_overflow, overflow_alert
        With a ``loss_scaler``: how many `mx_lbsgd.OverflowReport` objects
        ``overflow_history`` keeps (default 32), the least seconds between two log records
        of skipped steps (default 30.0), whether a distributed worker checks its own
        gradients before the reduction when ``batch_scale`` is 1 (default False; one
        device-side check per step) so that ``last_overflow.originated_here`` is known,
        and where the falling-scale alert goes (``'warn'``, the default:
        `mx_lbsgd.LossScaleFallingWarning` through ``warnings``; ``'log'``: a WARNING
        record on logger 'mx_lbsgd'; never both).
    max_grad_norm : None or float >= 0, default None
        Clip the applied gradient (the window's mean, unscaled, reduced over workers) to
        this global L2 norm over all parameters: ``g *= min(1, max_grad_norm / (norm +
        1e-6))`` before weight decay is added; the LARS ratio sees the clipped gradient.
        None or 0: no clipping.
        ``last_grad_norm`` / ``last_clip_coefficient`` report the last update's norm and
        factor as NDArrays. See `mx_lbsgd.pipeline.clip` for how it differs from torch,
        apex and GluonNLP, and for non-finite norms.
    lazy_update : bool, default True
        As in ``mx.optimizer.SGD``: with a row_sparse gradient only its rows change
        (weight, momentum, weight decay, fp32 master rows); False updates every row.
        Tensors with non-default storage (row_sparse gradients, csr or row_sparse weights)
        run one by one through MXNet's sparse-aware kernels, as SGD runs them. With
        ``batch_scale > 1`` a row_sparse gradient accumulates over the union of its rows
        (in a row_sparse buffer for gluon Parameters with ``grad_stype='row_sparse'``).
        LARS norms of such a layer cover the rows present and are read back once.
    lr_scaling : None or {'linear', 'sqrt', 'adascale'}, default None
        How the lr grows with the batch (`mx_lbsgd.pipeline.lr_scaling`). With a rule,
        ``learning_rate`` and ``lr_scheduler`` are the ones tuned at one micro-batch on one
        worker; each update multiplies the lr by the rule's gain at S = batch_scale x
        workers (the warmup, if any, rises to that gain instead of ``batch_scale``; LARS's
        ratio multiplies after it), and the scheduler sees ``scale_invariant_steps`` (the
        sum of the gains: AdaScale's r, or S). ``last_gain`` is the last update's gain.
        'adascale' (Johnson et al., ICML 2020) measures the gradient's variance on the
        step's own gradients: a sum-of-squares pass per micro-batch and one over the
        reduced gradient, one number reduced over the workers, and one host read per
        update (shared with a loss scaler's flag read). Needs a gluon Trainer (any engine;
        'adascale' with ``batch_scale > 1`` needs the window at the Trainer).
    lr_scaling_smoothing : float in [0, 1), default 0.999
        Decay per base batch of AdaScale's moving averages.

    Raises
    ------
    ValueError
        An argument out of its range (``momentum`` outside [0, 1), an unknown
        ``warmup_strategy``, ``batch_scale < 1``, ``lars_min > lars_max``, a negative
        ``max_grad_norm``, NaN, ...), ``lars`` not None or a bool, or ``lars=False`` with
        ``warmup_strategy='lars'``. Later, ``create_state`` raises it for float16 weights
        with ``batch_scale > 1`` and no ``multi_precision``; and when the optimizer is sent
        to several servers of a dist kvstore (``update_on_kvstore=True``) with ``lars`` and
        a tensor LARS applies to that MXNet splits across them (at least
        ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements): each server would compute the trust
        ratio from its slice.
    TypeError
        A number of the wrong type (``batch_scale=2.0``, ``momentum='0.9'``), a
        ``nesterov`` that is not a bool, or a ``lars_exclude`` that is not None, a list of
        str or a callable.

    Examples
    --------
    Two micro-batches per update, with a linear warmup over 4 micro-batches (one epoch of
    ``updates_per_epoch=4``) up to ``batch_scale`` times the learning rate:

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2, prefix='fc_')
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {
    ...     'learning_rate': 0.1, 'momentum': 0.9, 'batch_scale': 2,
    ...     'warmup_strategy': 'linear', 'warmup_epochs': 1, 'updates_per_epoch': 4})
    >>> x = nd.array([[1.0, 2.0]])
    >>> for _ in range(2):                  # one window: the weights change once
    ...     with autograd.record():
    ...         loss = net(x).sum()
    ...     loss.backward()
    ...     trainer.step(1)
    >>> opt = trainer.optimizer
    >>> type(opt).__name__, opt.micro_batches, opt.applied_updates, opt.lr_multiplier()
    ('LBSGD', 2, 1, 1.5)
    >>> print(net.weight.data().asnumpy().round(4))    # w - 0.1 * 1.5 * mean gradient
    [[0.85 0.7 ]]

    Bad arguments raise at construction:

    >>> mx_lbsgd.LBSGD(warmup_strategy='cosine')
    Traceback (most recent call last):
    ...
    ValueError: warmup_strategy='cosine' is not supported; expected one of ('linear', ...)
    """

    def __init__(self, momentum: float = 0.0, multi_precision: bool = False,
                 warmup_strategy: str = 'linear', warmup_epochs: float = 5,
                 batch_scale: Union[int, str] = 1, updates_per_epoch: Optional[int] = None,
                 begin_epoch: int = 0,
                 num_epochs: int = 60, lars: Optional[bool] = None, lars_eta: float = 0.001,
                 lars_eps: float = 0.0, lars_min: float = 0.0, lars_max: float = float('inf'),
                 lars_exclude: Union[None, Sequence[str], Callable[[str], bool]] = None,
                 fused: Optional[bool] = None,
                 loss_scaler: Union[DynamicLossScaler, float, None] = None,
                 count_skipped_steps: bool = False, scale_key: str = 'default',
                 lazy_update: bool = True, nesterov: bool = False, **kwargs: Any) -> None:
        check_real('momentum', momentum, 0.0, 1.0, open_max=True)
        check_bool('nesterov', nesterov)
        check_choice('warmup_strategy', warmup_strategy, WARMUP_STRATEGIES)
        check_real('warmup_epochs', warmup_epochs, 0.0)
        first, bounds = check_batch_scale(batch_scale, kwargs.get('batch_scale_bounds'),
                                          kwargs.get('batch_scale_interval', 16),
                                          kwargs.get('lr_scaling'))
        per_epoch = _updates_per_epoch(updates_per_epoch, warmup_strategy, warmup_epochs,
                                       first if bounds is None else bounds[1])
        check_int('begin_epoch', begin_epoch, 0)
        check_int('num_epochs', num_epochs, 1)
        if lars is not None and not isinstance(lars, bool):    # (1 == True)
            raise ValueError('lars=%r is not supported; expected one of (None, True, False)'
                             % (lars,))
        if lars is False and warmup_strategy == 'lars':
            raise ValueError("lars=False contradicts warmup_strategy='lars' (LARS without a "
                             "warmup); use lars=True with a warmup shape %r, or leave lars "
                             'unset' % (tuple(WARMUP_SHAPES),))
        for name, value in (('lars_eta', check_real('lars_eta', lars_eta, 0.0, open_min=True)),
                            ('lars_eps', check_real('lars_eps', lars_eps, 0.0)),
                            ('lars_min', check_real('lars_min', lars_min, 0.0))):
            check_float32(name, value)
        check_real('lars_max', lars_max, 0.0, allow_inf=True)
        if lars_min > lars_max:
            raise ValueError('lars_min must be <= lars_max; got lars_min=%r, lars_max=%r'
                             % (lars_min, lars_max))
        if not (lars_exclude is None or callable(lars_exclude)
                or (isinstance(lars_exclude, (list, tuple))
                    and all(isinstance(s, str) for s in lars_exclude))):
            raise TypeError('lars_exclude must be None, a list of name suffixes or a '
                            'callable(name) -> bool; got %r' % (lars_exclude,))
        super().__init__(batch_scale=batch_scale, fused=fused,
                         loss_scaler=None if loss_scaler is None else as_scaler(loss_scaler),
                         count_skipped_steps=count_skipped_steps, scale_key=scale_key,
                         multi_precision=multi_precision, **kwargs)
        self.momentum = float(momentum)
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = warmup_epochs
        self.updates_per_epoch = per_epoch
        self.begin_epoch = int(begin_epoch)
        self.init_updates = self.begin_epoch * self.updates_per_epoch
        self.num_epochs = int(num_epochs)
        self.lars = warmup_strategy == 'lars' if lars is None else lars
        self.lars_eta = float(lars_eta)
        self.lars_eps = float(lars_eps)
        self.lars_min = float(lars_min)
        self.lars_max = float(lars_max)
        self.lars_exclude = (DEFAULT_LARS_EXCLUDE if lars_exclude is None
                             else lars_exclude if callable(lars_exclude)
                             else tuple(lars_exclude))
        self.lazy_update = bool(lazy_update)
        self.nesterov = nesterov
        self._build_pieces()

    def _build_pieces(self) -> None:
        super()._build_pieces()
        self._family = SGDFamily(self.momentum, self.lazy_update, self.nesterov)
        self._warmup = Warmup(self.warmup_strategy if self.warmup_strategy in WARMUP_SHAPES
                              else None, self.warmup_epochs * self.updates_per_epoch,
                              self.batch_scale, self.init_updates)
        self._trust = (TrustRatio(self.lars_eta, self.lars_eps, self.lars_min, self.lars_max,
                                  self.lars_exclude) if self.lars else None)
