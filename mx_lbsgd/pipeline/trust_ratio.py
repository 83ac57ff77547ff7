"""The trust-ratio piece (LARS): a per-layer learning-rate multiplier computed on the device.

You, Gitman & Ginsburg, "Large Batch Training of Convolutional Networks" (2017),
https://arxiv.org/abs/1708.03888::

    ratio = clip(eta * |w| / (|rescale_grad * g| + wd * |w| + eps), lars_min, lars_max)
    ratio = 1 where |w| == 0 or |g| == 0, or where the layer is excluded by name

It multiplies whatever the other multipliers (warmup) give, and costs no host sync (except
for a layer with a row_sparse gradient, whose sparse kernel takes lr as a float): the
kernels get it as a `KernelTrust`. The native CPU kernel computes the norms and the update
in one call, a group of tensors at a time, so the update reads weights and gradients the
norms' pass has just brought into the cache, and sums ``|w|^2`` of the weights it writes for
the next step, which uses those sums while MXNet's engine version of a weight shows that
nothing else wrote it; MXNet's operators get the rates as a float32
vector on the device (``multi_sum_sq``, ``multi_lars``, then ``preloaded_multi_sgd_*``).

A ratio needs the whole tensor. MXNet 1.9.1's dist kvstore splits every array of at least
``MXNET_KVSTORE_BIGARRAY_BOUND`` elements across its servers (``KVStoreDist``, which reads
the variable on the worker when it is created: ``EncodeDefaultKey`` sends an array with
``size >= bound`` in one slice to each server), so an optimizer that updates on several
servers would compute the ratio of such a tensor from a slice: `refuse_split_ratios`
refuses that before the optimizer is sent to the servers.
"""
from __future__ import annotations

import os
from typing import Callable, List, Mapping, Optional, Tuple, Union

from mxnet import nd

from .. import _kernels
from ..families.base import KernelTrust

DEFAULT_LARS_EXCLUDE = ('bias', 'gamma', 'beta')

#: MXNet 1.9.1's default of ``MXNET_KVSTORE_BIGARRAY_BOUND`` (``src/kvstore/kvstore_dist.h``)
BIGARRAY_BOUND = 1000 * 1000
#: tensors a refusal names (the largest first), then "and N more"
NAMED_TENSORS = 5

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

    The rates of two layers on the device, as the kernels compute them with the update:
    ``0.1 * 0.001 * |w| / |g|`` = ``0.1 * 0.001 * 5 / 0.5`` for the first, the second kept
    (an excluded bias):

    >>> kernel = trust.for_kernel([not trust.applies('fc_weight'), not trust.applies('fc_bias')])
    >>> rates = kernel.rates(
    ...     weights=[nd.array([3.0, 4.0]), nd.array([1.0])],
    ...     grads=[nd.array([0.3, 0.4]), nd.array([1.0])], lrs=[0.1, 0.1], wds=[0.0, 0.0],
    ...     rescale_grad=1.0, grad_norm=None)
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

    def for_kernel(self, keep_lr: List[bool]) -> KernelTrust:
        """The ratio for a family's kernels to compute with the update, on tensors whose
        `keep_lr` flags are given (the native kernel fuses it into its pass)."""
        return KernelTrust(self.eta, self.eps, self.lars_min, self.lars_max, keep_lr)

    def sparse_factor(self, *, weight: nd.NDArray, grad: nd.NDArray, wd: float,
                      rescale_grad: float) -> float:
        """The ratio of one layer with a row_sparse gradient, over the rows present."""
        return _kernels.sparse_lars_factor(weight=weight, grad=grad, wd=wd, eta=self.eta,
                                           eps=self.eps, rescale_grad=rescale_grad,
                                           lars_min=self.lars_min, lars_max=self.lars_max)


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable as MXNet's ``dmlc::GetEnv`` reads it (unset or empty: the
    default; a value it could not parse fails ``mx.kv.create`` already: the default)."""
    try:
        return int(environ.get(name, '').strip() or default)
    except ValueError:
        return default


def split_tensors(sizes: Mapping[str, int], environ: Optional[Mapping[str, str]] = None
                  ) -> Tuple[int, int, List[Tuple[str, int]]]:
    """(servers, bound, [(name, elements)]): the number of kvstore servers of this dist job
    (``DMLC_NUM_SERVER``, which ps-lite reads; 1 outside a job), the element count from
    which MXNet 1.9.1's dist kvstore splits an array across them (``MXNET_KVSTORE_BIGARRAY_
    BOUND`` as this worker's kvstore read it, default 1,000,000; MXNet reads it as an
    unsigned size, so a negative value splits nothing), and the tensors of `sizes` that it
    splits (none with one server), the largest first.

    >>> from mx_lbsgd.pipeline.trust_ratio import split_tensors
    >>> env = {'DMLC_NUM_SERVER': '2', 'MXNET_KVSTORE_BIGARRAY_BOUND': '1000'}
    >>> split_tensors({'fc_weight': 4096, 'fc_bias': 64, 'out_weight': 1000}, env)
    (2, 1000, [('fc_weight', 4096), ('out_weight', 1000)])
    >>> split_tensors({'fc_weight': 4096}, {})
    (1, 1000000, [])
    """
    env = os.environ if environ is None else environ
    servers = _env_int(env, 'DMLC_NUM_SERVER', 1)
    bound = _env_int(env, 'MXNET_KVSTORE_BIGARRAY_BOUND', BIGARRAY_BOUND)
    if servers < 2 or bound < 0:
        return servers, bound, []
    split = sorted(((n, int(s)) for n, s in sizes.items() if s >= bound),
                   key=lambda item: (-item[1], item[0]))
    return servers, bound, split


def refuse_split_ratios(owner: str, sizes: Mapping[str, int],
                        has_ratio: Callable[[str], bool],
                        environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise ValueError when an optimizer about to update on the servers of a dist kvstore
    (`owner`: its class name) has a per-tensor trust ratio (``has_ratio(name)``) on a tensor
    the kvstore splits across several servers (`split_tensors` of `sizes`, {name: number of
    elements}): each server would compute the ratio from its own slice. The message names
    the tensors (the largest `NAMED_TENSORS`), the servers, the bound and the three ways
    out.

    Examples
    --------
    >>> from mx_lbsgd.pipeline.trust_ratio import refuse_split_ratios
    >>> env = {'DMLC_NUM_SERVER': '2', 'MXNET_KVSTORE_BIGARRAY_BOUND': '1000'}
    >>> sizes = {'fc_weight': 4096, 'fc_bias': 1024, 'out_weight': 640}
    >>> refuse_split_ratios('LBSGD', sizes, lambda name: not name.endswith('bias'), env)
    Traceback (most recent call last):
    ...
    ValueError: LBSGD cannot update on the 2 servers of this dist kvstore: MXNet splits ...
    >>> refuse_split_ratios('LBSGD', sizes, lambda name: name == 'fc_bias', {})   # 1 server
    """
    servers, bound, split = split_tensors(sizes, environ)
    split = [(name, size) for name, size in split if has_ratio(name)]
    if not split:
        return
    named = ', '.join('%r (%d elements)' % item for item in split[:NAMED_TENSORS])
    if len(split) > NAMED_TENSORS:
        named += ' and %d more' % (len(split) - NAMED_TENSORS)
    raise ValueError(
        '%s cannot update on the %d servers of this dist kvstore: MXNet splits every array of '
        'at least MXNET_KVSTORE_BIGARRAY_BOUND=%d elements across the servers, so each '
        'server would compute the per-tensor trust ratio of %s from its own slice only (a '
        'silently wrong update). Use one server (DMLC_NUM_SERVER=1: mx-lbsgd launch -s 1), '
        'or MXNET_KVSTORE_BIGARRAY_BOUND=%d or more (above the largest tensor) set for '
        'every process of the job, or update on the workers: gluon.Trainer(..., '
        'update_on_kvstore=False) or mx_lbsgd.ShardedTrainer (Module: '
        'MXNET_UPDATE_ON_KVSTORE=0)' % (owner, servers, bound, named, split[0][1] + 1))
