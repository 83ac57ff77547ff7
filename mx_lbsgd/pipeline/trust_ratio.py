"""The trust-ratio piece (LARS): a per-layer learning-rate multiplier computed on the device.

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
https://arxiv.org/abs/1708.03888::

    ratio = clip(eta * |w| / (|rescale_grad * g| + wd * |w| + eps), lars_min, lars_max)
    ratio = 1 where |w| == 0 or |g| == 0, or where the layer is excluded by name

It multiplies whatever the other multipliers (warmup) give: the rates reach the kernels as
a float32 vector on the device, so the ratio costs no host sync (except for a layer with a
row_sparse gradient, whose sparse kernel takes lr as a float).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

from mxnet import nd

from .. import _kernels

DEFAULT_LARS_EXCLUDE = ('bias', 'gamma', 'beta')

#: layers left out of the ratio: name suffixes, or a predicate on the name
Exclude = Union[Tuple[str, ...], Callable[[str], bool]]


class TrustRatio:
    """The LARS trust ratio of each layer, as a learning-rate multiplier (see the module
    docstring). `LBSGD` makes one with ``lars=True``; `LAMB` one with ``eta=1`` for its
    ``trust_exclude`` names (its kernels compute the ratio itself).

    Parameters
    ----------
    eta : float > 0
        Trust coefficient.
    eps : float >= 0
        Added to the denominator.
    lars_min, lars_max : float
        Clip range of the ratio.
    exclude : tuple of str, or callable(name) -> bool
        Layers left at ratio 1: name suffixes, or a predicate on the name.

    Examples
    --------
    >>> import math
    >>> from mxnet import nd
    >>> from mx_lbsgd.pipeline import DEFAULT_LARS_EXCLUDE, TrustRatio
    >>> trust = TrustRatio(0.001, 0.0, 0.0, math.inf, DEFAULT_LARS_EXCLUDE)
    >>> trust.applies('fc_weight'), trust.applies('fc_bias')
    (True, False)

    The rates of two layers on the device: ``0.1 * 0.001 * |w| / |g|`` = ``0.1 * 0.001 *
    5 / 0.5`` for the first, the second kept (an excluded bias):

    >>> rates = trust.lr_vector(
    ...     weights=[nd.array([3.0, 4.0]), nd.array([1.0])],
    ...     grads=[nd.array([0.3, 0.4]), nd.array([1.0])], lrs=[0.1, 0.1], wds=[0.0, 0.0],
    ...     keep_lr=[False, True], rescale_grad=1.0)
    >>> print(rates.asnumpy().round(6))
    [0.001 0.1  ]
    """

    def __init__(self, eta: float, eps: float, lars_min: float, lars_max: float,
                 exclude: Exclude) -> None:
        self.eta = eta
        self.eps = eps
        self.lars_min = lars_min
        self.lars_max = lars_max
        self.exclude = exclude

    def applies(self, name: Optional[str]) -> bool:
        """Whether the layer called `name` gets a trust ratio (None: no names known).

        Raises ValueError when `name` is None and some layers are to be excluded (the
        optimizer was given no parameter names)."""
        if name is None:
            if self.exclude:
                raise ValueError(
                    "LARS needs parameter names to leave %r out of it, and this optimizer "
                    "has none (horovod's DistributedOptimizer keeps the names Module gives "
                    'it to itself). Create it with param_idx2name={index: name}, e.g. '
                    'dict(enumerate(n for n in sym.list_arguments() if n not in data_names '
                    '+ label_names)), or pass lars_exclude=() to apply LARS to every layer'
                    % (self.exclude,))
            return True
        if callable(self.exclude):
            return not self.exclude(name)
        return not name.endswith(self.exclude)

    def lr_vector(self, *, weights: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
                  lrs: Sequence[float], wds: Sequence[float], keep_lr: Sequence[bool],
                  rescale_grad: float,
                  grad_coefficient: Optional[nd.NDArray] = None) -> nd.NDArray:
        """lrs times the ratios, a float32 vector on the device (see the module docstring);
        with `grad_coefficient` (a global-norm clip) the ratio sees the clipped gradient."""
        return _kernels.lars_lrs(weights=weights, grads=grads, lrs=lrs, wds=wds,
                                 keep_lr=keep_lr, eta=self.eta, eps=self.eps,
                                 rescale_grad=rescale_grad, lars_min=self.lars_min,
                                 lars_max=self.lars_max, grad_coefficient=grad_coefficient)

    def sparse_factor(self, *, weight: nd.NDArray, grad: nd.NDArray, wd: float,
                      rescale_grad: float) -> float:
        """The ratio of one layer with a row_sparse gradient, over the rows present."""
        return _kernels.sparse_lars_factor(weight=weight, grad=grad, wd=wd, eta=self.eta,
                                           eps=self.eps, rescale_grad=rescale_grad,
                                           lars_min=self.lars_min, lars_max=self.lars_max)
