"""`LossScaledSGD` ('lssgd'): SGD with dynamic loss scaling built into the optimizer."""
from __future__ import annotations

from typing import Any, Optional, Union

from .lbsgd import LBSGD
from .loss_scaling import DynamicLossScaler, as_scaler


class LossScaledSGD(LBSGD):
    """SGD with momentum, weight decay and fp32 master weights, for loss-scaled gradients
    (registered as ``'lssgd'``). Each step::

        scale = loss_scaler.scale               # the scale the loss was multiplied by
        finite = all gradients of the step (every device, every dtype) are finite
        loss_scaler.update(not finite)          # once per step: grow, back off, count
        if not finite:
            return                              # nothing changes, num_update included
        mom = momentum * mom - lr * (clip(rescale_grad / scale * g, clip_gradient) + wd * w)
        w = w + mom                             # w: the fp32 master copy with multi_precision

    The overflow check runs on the device and reads one flag back per step; the unscaling
    is folded into the update kernel's ``rescale_grad`` (the fp32 kernels unscale fp16
    gradients in fp32). Scale the loss by ``optimizer.loss_scaler.scale`` before
    ``backward()`` (Gluon), or put :func:`mx_lbsgd.scale_gradient` in the symbol (Module).

    Loss scaling: Micikevicius et al., "Mixed Precision Training" (2018),
    https://arxiv.org/abs/1710.03740. Compared with MXNet's ``contrib.amp``: the scaler is
    configurable (:class:`DynamicLossScaler`), pickled with the optimizer (so
    ``Trainer.save_states`` keeps it), works with Module, checks every device's gradients
    and mixed fp16/fp32 parameters, and skips a step as a whole. Compared with PyTorch's
    ``GradScaler``: the scaler lives in the optimizer, so ``trainer.step`` does everything.
    It is the :class:`LBSGD` preset without warmup, LARS or accumulation (use
    ``LBSGD(loss_scaler=...)`` for those); the update equals ``mx.optimizer.SGD`` when no step
    overflows.

    Besides those of ``mx.optimizer.Optimizer`` (``learning_rate``, ``wd``,
    ``rescale_grad``, ``clip_gradient``, ``lr_scheduler``, ``param_idx2name``, ...):

    Parameters
    ----------
    momentum : float in [0, 1)
    multi_precision : bool
    loss_scaler : DynamicLossScaler, float (static scale) or None (the defaults: 2**16,
        growth 2 every 2000 finite steps, backoff 0.5)
    count_skipped_steps : bool, default False
        Whether skipped steps advance ``num_update`` (and so ``lr_scheduler``).
    scale_key : str, default 'default'
        Name under which ``loss_scaler`` serves :func:`mx_lbsgd.scale_gradient` ops.
    fused : None or bool
        Kernel path, as in :class:`LBSGD`.
    overflow_history_size, overflow_log_interval, overflow_alert, check_local_overflow
        Overflow reports, as in :class:`LBSGD`: ``overflow_alert='warn'`` (the default)
        warns with `mx_lbsgd.LossScaleFallingWarning` when the scale keeps falling,
        ``'log'`` writes a WARNING record on logger 'mx_lbsgd' instead.
    max_grad_norm : None or float >= 0
        Global-norm clipping of the unscaled gradient, as in :class:`LBSGD`; its
        sum-of-squares pass is also the step's overflow check.
    lr_scaling, lr_scaling_smoothing
        As in :class:`LBSGD`; S is the number of workers ('lssgd' has no window). With
        'adascale' the loss scaler's flag read also brings AdaScale's norms.

    Raises
    ------
    ValueError
        ``batch_scale``, ``warmup_strategy`` or ``warmup_epochs`` given (use
        :class:`LBSGD` with ``loss_scaler=...`` for them), or an argument out of range as
        in :class:`LBSGD`.
    TypeError
        ``loss_scaler`` not a DynamicLossScaler, a number or None, or a number of the
        wrong type.

    Examples
    --------
    A step whose gradients hold an inf is skipped as a whole and the scale backs off; the
    next finite step is applied, unscaled inside the update:

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2, prefix='fc_')
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lssgd', {
    ...     'learning_rate': 0.1, 'loss_scaler': mx_lbsgd.DynamicLossScaler(init_scale=1024)})
    >>> opt = trainer.optimizer
    >>> def train_step(x):
    ...     with autograd.record():
    ...         loss = net(nd.array(x)).sum() * opt.loss_scaler.scale   # scale the loss
    ...     loss.backward()
    ...     trainer.step(1)
    >>> train_step([[1.0, float('inf')]])
    >>> opt.last_step_skipped, opt.loss_scaler.scale
    (True, 512.0)
    >>> print(opt.last_overflow)
    step 1 skipped (loss scale 1024 -> 512): fc_weight inf (1).
    >>> train_step([[1.0, 2.0]])
    >>> opt.last_step_skipped, opt.last_overflow
    (False, None)
    >>> print(net.weight.data().asnumpy().round(4))     # w - 0.1 * gradient
    [[0.9 0.8]]
    """

    def __init__(self, momentum: float = 0.0, multi_precision: bool = False,
                 loss_scaler: Union[DynamicLossScaler, float, None] = None,
                 count_skipped_steps: bool = False, scale_key: str = 'default',
                 fused: Optional[bool] = None, **kwargs: Any) -> None:
        for fixed in ('batch_scale', 'warmup_strategy', 'warmup_epochs'):
            if fixed in kwargs:
                raise ValueError(
                    "'lssgd' takes no %s: it is SGD with loss scaling. For accumulation or "
                    "warmup use 'lbsgd' with loss_scaler=... (mx_lbsgd.LBSGD)" % fixed)
        super().__init__(momentum=momentum, multi_precision=multi_precision,
                         warmup_strategy='linear', warmup_epochs=0, batch_scale=1,
                         loss_scaler=as_scaler(loss_scaler), fused=fused,
                         count_skipped_steps=count_skipped_steps, scale_key=scale_key,
                         **kwargs)
