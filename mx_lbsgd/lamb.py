"""`LAMB` ('lblamb'): MXNet's LAMB on the update pipeline, for large-batch transformer training."""
from __future__ import annotations

import math
from typing import Any, Callable, Literal, Optional, Sequence, Union

from ._checks import check_real
from .families import LAMBFamily
from .loss_scaling import DynamicLossScaler, as_scaler
from .pipeline import PipelineOptimizer, TrustRatio, Warmup
from .pipeline.batch_choice import check_args as check_batch_scale

#: `trust_exclude=True`: BERT practice leaves LayerNorm/BatchNorm and biases out of the ratio
BERT_TRUST_EXCLUDE = ('bias', 'gamma', 'beta')


class LAMB(PipelineOptimizer):
    """LAMB with accumulation, loss scaling and trust-ratio exclusions (registered as
    ``'lblamb'``; MXNet's own ``'lamb'`` stays MXNet's).

    You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
    (2019), https://arxiv.org/abs/1904.00962. Each applied update, per tensor::

        t = applied updates of this tensor (micro-batches // batch_scale)
        g = the window's mean gradient, rescale_grad and 1/loss_scale folded in
        mean = beta1 * mean + (1 - beta1) * clip(g, clip_gradient)
        var = beta2 * var + (1 - beta2) * clip(g, clip_gradient) ** 2
        m, v = mean / (1 - beta1 ** t), var / (1 - beta2 ** t)     # if bias_correction
        d = m / (sqrt(v) + epsilon) + wd * w
        r1 = clip(|w|, lower_bound, upper_bound)
        ratio = r1 / |d| if r1 > 0 and |d| > 0 and the layer is not excluded else 1
        w = w - lr * ratio * d              # w: the fp32 master copy with multi_precision

    At its defaults (``batch_scale=1``, ``trust_exclude=None``) the update equals
    ``mx.optimizer.LAMB``'s, and states move both ways between ``'lblamb'`` and ``'lamb'``:
    ``(mean, var)``, or ``(weight_fp32, (mean, var))``, with the fp32 accumulator appended
    when ``batch_scale > 1``.

    Differences from MXNet's ``mx.optimizer.LAMB``: ``batch_scale`` accumulates B
    micro-batches into one update (communicated once under a Trainer); ``t`` and
    ``num_update`` (what an ``lr_scheduler`` sees) count applied updates, so B
    micro-batches equal one LAMB step on their mean (``LBSGD`` counts micro-batches, as
    MXNet's LBSGD does); ``loss_scaler`` skips whole steps; ``trust_exclude`` leaves layers
    out of the trust ratio by name. For warmup and decay use an ``lr_scheduler`` such as
    ``mx_lbsgd.WarmupScheduler(..., decay='poly', power=1)``. Compared with NVIDIA apex's
    FusedLAMB (PyTorch has none in torch.optim): epsilon is added outside the square root
    of the corrected variance, and weight decay enters ``d`` before the trust ratio.

    Besides those of ``mx.optimizer.Optimizer`` (``learning_rate``, ``wd``,
    ``rescale_grad``, ``clip_gradient``, ``lr_scheduler``, ``param_idx2name``, ...):

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float in [0, 1), default 0.9 and 0.999
    epsilon : float > 0, default 1e-6
    lower_bound, upper_bound : None or float > 0
        Clip range of ``|w|`` in the trust ratio (MXNet's meaning: unset when None or <= 0).
    bias_correction : bool, default True
    multi_precision : bool
        Keep fp32 master weights (and fp32 moments) for float16 weights.
    batch_scale : int >= 1 or 'auto'
        Micro-batches per update; 'auto': chosen for goodput within ``batch_scale_bounds``
        (with an ``lr_scaling`` rule; see `mx_lbsgd.pipeline.PipelineOptimizer`).
    trust_exclude : None, True, sequence of str, or callable(name) -> bool
        Layers whose trust ratio is 1. None: none (as MXNet's LAMB). True: names ending in
        'bias', 'gamma' or 'beta' (BERT practice). Names come from ``param_dict`` (Gluon) or
        ``param_idx2name`` (Module).
    fused : None or bool
        None: on CPU the package's native LAMB operator (one call, two passes over memory)
        for float32 weights and float16 weights with master copies, when ``pip install``
        built it; otherwise MXNet's operators routed by tensor size. True / False force
        MXNet's multi-tensor / per-tensor LAMB operators (the GPU path is multi-tensor).
    loss_scaler, count_skipped_steps, scale_key : as in `LBSGD`.
    overflow_history_size, overflow_log_interval, overflow_alert, check_local_overflow
        As in `LBSGD`: overflow reports, and where the falling-scale alert goes
        (``overflow_alert='warn'``, the default: `LossScaleFallingWarning`; ``'log'``: a
        WARNING record on logger 'mx_lbsgd').
    max_grad_norm : None or float >= 0, default None
        Clip the applied gradient (the window's mean, unscaled, reduced over workers) to
        this global L2 norm over all parameters: ``g *= min(1, max_grad_norm / (norm +
        1e-6))`` before weight decay is added; the trust ratio sees the clipped gradient.
        The BERT recipe uses 1.0. None or 0: no clipping.
        ``last_grad_norm`` / ``last_clip_coefficient`` report the last update's norm and
        factor as NDArrays. See `mx_lbsgd.pipeline.clip` for how it differs from torch,
        apex and GluonNLP, and for non-finite norms.
    lr_scaling, lr_scaling_smoothing
        As in `LBSGD`, except that 'adascale' multiplies the lr by sqrt(r), the square root
        of AdaScale's gain (the progress still advances by r): AdaScale's derivation holds
        for SGD, whose step is linear in the gradient, while Adam-type steps are normalised
        by the second moment, so a batch S times larger, whose gradient variance is S
        times smaller, calls for about sqrt(S) times the lr in the noise-dominated regime
        (Malladi et al., "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms",
        NeurIPS 2022); AdaptDL's AdamScale takes the same power of r. fairscale's AdaScale
        is SGD-only.

    Raises
    ------
    ValueError
        An argument out of its range (``beta1`` or ``beta2`` outside [0, 1),
        ``epsilon <= 0``, ``lower_bound > upper_bound``, ``batch_scale < 1``, ...). Later,
        when a dist kvstore with several servers is to update the weights
        (``update_on_kvstore=True``) and splits a tensor with a trust ratio across them
        (``MXNET_KVSTORE_BIGARRAY_BOUND``): the servers would compute the ratio from
        slices (see `mx_lbsgd.pipeline.trust_ratio`).
    TypeError
        A number of the wrong type, or a ``trust_exclude`` that is not None, True, a list
        of str or a callable.

    Examples
    --------
    One LAMB step; at its defaults it is MXNet's ``'lamb'`` (whose states load into it):

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2, prefix='fc_')
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lblamb', {
    ...     'learning_rate': 0.01, 'trust_exclude': True, 'max_grad_norm': 1.0})
    >>> with autograd.record():
    ...     loss = net(nd.array([[1.0, 2.0]])).sum()
    >>> loss.backward()
    >>> trainer.step(1)
    >>> type(trainer.optimizer).__name__, trainer.optimizer.num_update
    ('LAMB', 1)
    >>> print(net.weight.data().asnumpy().round(4))     # w - lr * ratio * m / sqrt(v)
    [[0.99 0.99]]
    >>> print(trainer.optimizer.last_grad_norm.asnumpy().round(4))  # before clipping
    [2.4495]
    """

    counts_applied_updates = True
    #: lr_scaling='adascale': the lr gain is sqrt(r) (AdaptDL's AdamScale)
    _gain_power = 0.5

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-6, lower_bound: Optional[float] = None,
                 upper_bound: Optional[float] = None, bias_correction: bool = True,
                 multi_precision: bool = False, batch_scale: Union[int, str] = 1,
                 trust_exclude: Union[None, Literal[True], Sequence[str],
                                      Callable[[str], bool]] = None,
                 fused: Optional[bool] = None,
                 loss_scaler: Union[DynamicLossScaler, float, None] = None,
                 count_skipped_steps: bool = False, scale_key: str = 'default',
                 **kwargs: Any) -> None:
        check_real('beta1', beta1, 0.0, 1.0, open_max=True)
        check_real('beta2', beta2, 0.0, 1.0, open_max=True)
        check_real('epsilon', epsilon, 0.0, open_min=True)
        for name, bound in (('lower_bound', lower_bound), ('upper_bound', upper_bound)):
            if bound is not None:
                check_real(name, bound, allow_inf=name == 'upper_bound')
        if lower_bound and upper_bound and 0 < upper_bound < lower_bound:
            raise ValueError('lower_bound must be <= upper_bound; got lower_bound=%r, '
                             'upper_bound=%r' % (lower_bound, upper_bound))
        if not (trust_exclude is None or trust_exclude is True or callable(trust_exclude)
                or (isinstance(trust_exclude, (list, tuple))
                    and all(isinstance(s, str) for s in trust_exclude))):
            raise TypeError('trust_exclude must be None, True, a list of name suffixes or a '
                            'callable(name) -> bool; got %r' % (trust_exclude,))
        check_batch_scale(batch_scale, kwargs.get('batch_scale_bounds'),
                          kwargs.get('batch_scale_interval', 16), kwargs.get('lr_scaling'))
        super().__init__(learning_rate=learning_rate, batch_scale=batch_scale, fused=fused,
                         loss_scaler=None if loss_scaler is None else as_scaler(loss_scaler),
                         count_skipped_steps=count_skipped_steps, scale_key=scale_key,
                         multi_precision=multi_precision, **kwargs)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        self.bias_correction = bool(bias_correction)
        self.trust_exclude = (BERT_TRUST_EXCLUDE if trust_exclude is True
                              else trust_exclude if trust_exclude is None
                              or callable(trust_exclude) else tuple(trust_exclude))
        self._build_pieces()

    def _build_pieces(self) -> None:
        super()._build_pieces()
        upper = self.upper_bound
        self._family = LAMBFamily(self.beta1, self.beta2, self.epsilon, self.lower_bound,
                                  None if upper is not None and math.isinf(upper) else upper,
                                  self.bias_correction)
        self._warmup = Warmup(None, 0, 1, 0)
        self._trust = (None if not self.trust_exclude else
                       TrustRatio(1.0, 0.0, 0.0, math.inf, self.trust_exclude))

    def trust_ratio_applies(self, name: str) -> bool:
        """Every layer has LAMB's trust ratio (computed by the kernels) except those
        ``trust_exclude`` leaves out."""
        return self._trust is None or self._trust.applies(name)
