"""The kernel-family interface, and the helpers its families share.

A kernel family is an optimizer's update rule with its state layout, on several kernel
paths that take one keyword-only signature (as torch's ``optim/sgd.py`` kernels do):

- ``native``: the package's compiled operator, every tensor of a group in one call (CPU,
  float32 weights or float16 with float32 master copies, when the library is built);
- ``single_tensor``: MXNet's operators one tensor at a time;
- ``multi_tensor``: MXNet's multi-tensor operators (the GPU path);
- ``run_sparse``: tensors with non-default storage, one by one (families that have it:
  `SparseKernelFamily`).

The optimizer shell (`mx_lbsgd.pipeline`) picks the path per group of tensors and calls
`KernelFamily.run`; accumulation, warmup, the trust ratio and the loss-scale gate do not
depend on the family. Adding a family means writing a class that satisfies `KernelFamily`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
from mxnet import nd

from .. import _kernels, _native

#: A kernel of a family: keyword-only arguments, lists of arrays per tensor; runs
#: asynchronously on MXNet's engine and returns nothing.
Kernel = Callable[..., None]
#: A family's per-parameter state (arrays, tuples of arrays, or None), MXNet's layout.
FamilyState = Any
#: Per-tensor lists a kernel takes: arrays, optional arrays (master copies, momenta), floats.
Arrays = List[nd.NDArray]
Masters = List[Optional[nd.NDArray]]
Floats = List[float]
#: Given this rank's partial sums of squares of two per-tensor quantities (two float32 device
#: vectors, one entry per tensor of a kernel call), the whole tensors' sums over every rank
#: (the pieces of tensors split over ranks); asynchronous, no host read.
SliceSums = Callable[[nd.NDArray, nd.NDArray], Tuple[nd.NDArray, nd.NDArray]]


@dataclasses.dataclass
class GradNorm:
    """The global L2 norm of the gradients an update applies, on one device, for clipping::

        norm = factor * sqrt(sum_sq)            # float32, on the device
        coefficient = min(1, max_norm / (norm + eps))

    `sum_sq` is the (1,) float32 sum of squares of the gradients as passed; `factor` the
    scalar that makes them the applied gradient (rescale_grad, 1 / loss scale). The
    coefficient multiplies rescale_grad in the kernels; it is NaN when the norm is not
    finite, and the native kernels then write nothing.

    Parameters
    ----------
    sum_sq : NDArray
        (1,) float32, on the device.
    factor : float
    max_norm : float
    eps : float

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd.families import GradNorm
    >>> grad_norm = GradNorm(nd.array([25.0]), factor=0.5, max_norm=1.0, eps=1e-6)
    >>> print(grad_norm.norm().asnumpy(), grad_norm.coefficient().asnumpy().round(4))
    [2.5] [0.4]
    >>> grad_norm.native_attrs()['norm_factor']
    0.5
    """

    sum_sq: nd.NDArray
    factor: float
    max_norm: float
    eps: float
    _cache: Dict[str, nd.NDArray] = dataclasses.field(default_factory=dict, repr=False)

    def norm(self) -> nd.NDArray:
        """The norm, a (1,) float32 device array (computed once, no host sync)."""
        if 'norm' not in self._cache:
            self._cache['norm'] = nd.sqrt(self.sum_sq) * self.factor
        return self._cache['norm']

    def coefficient(self) -> nd.NDArray:
        """min(1, max_norm / (norm + eps)), a (1,) float32 device array; NaN when the norm
        is not finite (``+ 0 * norm``: an infinite norm would give 0)."""
        if 'coefficient' not in self._cache:
            norm = self.norm()
            self._cache['coefficient'] = \
                nd.minimum(self.max_norm / (norm + self.eps), 1.0) + norm * 0.0
        return self._cache['coefficient']

    def native_attrs(self) -> Dict[str, Union[int, float]]:
        """The attributes of the native update operators that take `sum_sq` as an input."""
        return dict(has_norm=1, max_grad_norm=self.max_norm, norm_factor=self.factor,
                    norm_eps=self.eps)


@dataclasses.dataclass(frozen=True)
class KernelTrust:
    """A LARS trust ratio for a family's kernels to compute with the update (the
    ``TrustRatio`` piece of `mx_lbsgd.pipeline` makes one per group of tensors)::

        ratio = clip(eta * |w| / (|c * rescale_grad * g| + wd * |w| + eps), lars_min, lars_max)
        lr' = lr * ratio, or lr where |w| == 0, |g| == 0 or keep_lr

    with ``w`` the master copy when there is one and ``c`` the clip coefficient
    (`GradNorm`). The native kernel computes it in its own pass, a group of tensors at a
    time (`native_attrs`), with each ``|w|^2`` summed by the update that wrote the weight
    while nothing else wrote it since (MXNet's engine version of the array); MXNet's paths
    as a device vector first (`rates`).

    Examples
    --------
    >>> import math
    >>> from mxnet import nd
    >>> from mx_lbsgd.families import KernelTrust
    >>> trust = KernelTrust(eta=0.001, eps=0.0, lars_min=0.0, lars_max=math.inf,
    ...                     keep_lr=[False, True])
    >>> rates = trust.rates(weights=[nd.array([3.0, 4.0]), nd.array([1.0])],
    ...                     grads=[nd.array([0.3, 0.4]), nd.array([1.0])], lrs=[0.1, 0.1],
    ...                     wds=[0.0, 0.0], rescale_grad=1.0, grad_norm=None)
    >>> print(rates.asnumpy().round(6))           # 0.1 * 0.001 * 5 / 0.5, and a kept lr
    [0.001 0.1  ]
    >>> trust.native_attrs()['applies']
    '1.0,0.0'
    """

    eta: float
    eps: float
    lars_min: float
    lars_max: float
    keep_lr: List[bool]
    #: (|w|^2, |g|^2) per tensor, float32 device vectors, when the norms come from elsewhere
    #: (the pieces of a tensor split over ranks: the whole tensor's); MXNet's paths only
    sums: Optional[Tuple[nd.NDArray, nd.NDArray]] = None

    def rates(self, *, weights: Arrays, grads: Arrays, lrs: Floats, wds: Floats,
              rescale_grad: float, grad_norm: Optional[GradNorm]) -> nd.NDArray:
        """``lr'`` of every tensor, a float32 vector on the device (no host sync)."""
        return _kernels.lars_lrs(
            weights=weights, grads=grads, lrs=lrs, wds=wds, keep_lr=self.keep_lr,
            eta=self.eta, eps=self.eps, rescale_grad=rescale_grad, lars_min=self.lars_min,
            lars_max=self.lars_max, sums=self.sums,
            grad_coefficient=None if grad_norm is None else grad_norm.coefficient())

    def native_attrs(self) -> Dict[str, Union[int, float, str]]:
        """The attributes of ``mx_lbsgd_sgd_update`` that make it compute the rates with
        `_kernels.lars_lrs`'s arithmetic (the same bits while the call's tensors form one
        group of the operator; over several groups the sums of squares are split across
        the threads differently, so they can differ in the last bits). Made once: a plan
        keeps its routes' `KernelTrust` while it lives."""
        return self._attrs

    @functools.cached_property
    def _attrs(self) -> Dict[str, Union[int, float, str]]:
        return dict(lars=1, eta=self.eta, eps=self.eps, lars_min=self.lars_min,
                    lars_max=min(self.lars_max, _FLOAT32_MAX),
                    lars_direct=int(_kernels.lars_direct(self.lars_min, self.lars_max,
                                                         self.keep_lr)),
                    applies=_native.attribute_list([0.0 if k else 1.0 for k in self.keep_lr]))


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class KernelFamily(Protocol):
    """What the optimizer shell needs of a kernel family.

    A `typing.Protocol`: a family satisfies it by having these attributes and methods
    (`FamilyBase` gives ``native_kernel`` and ``sparse_refusal``); it need not inherit
    from it. ``single_tensor`` and ``multi_tensor`` (and ``native``, see `FamilyBase`) are
    the family's kernels, usually ``staticmethod`` s.

    Examples
    --------
    The two families of the package satisfy it:

    >>> from mx_lbsgd.families import KernelFamily, LAMBFamily, SGDFamily
    >>> needed = set(KernelFamily.__annotations__) | {
    ...     n for n in vars(KernelFamily) if not n.startswith('_')}
    >>> sorted(needed)
    ['describe', 'make_state', 'multi_tensor', 'name', 'native_kernel', 'run',
     'single_tensor', 'sparse_refusal', 'split', 'supports_sparse', 'trust_in_kernel']
    >>> families = [SGDFamily(0.9, lazy_update=True),
    ...             LAMBFamily(0.9, 0.999, 1e-6, None, None, bias_correction=True)]
    >>> [all(hasattr(f, n) for n in needed) for f in families]
    [True, True]
    """

    name: str                  # MXNet's optimizer of the same rule, for messages
    supports_sparse: bool      # whether `run_sparse` exists (a `SparseKernelFamily`)
    trust_in_kernel: bool      # True: the kernels compute the trust ratio (LAMB)
    single_tensor: Kernel
    multi_tensor: Kernel

    def make_state(self, weight: nd.NDArray, dtype: Any,
                   master: Optional[nd.NDArray]) -> FamilyState:
        """A new state for `weight` in `dtype`, holding `master` (the fp32 copy) if any."""

    def split(self, base: FamilyState,
              with_master: bool) -> Optional[Tuple[FamilyState, Optional[nd.NDArray]]]:
        """(the kernels' state, master copy or None), or None when `base` does not fit."""

    def describe(self) -> str:
        """The hyperparameters that decide the layout, for error messages."""

    def native_kernel(self, device_type: str, dtype: Any,
                      with_master: bool) -> Optional[Kernel]:
        """The compiled kernel for such a group, or None (MXNet's operators run)."""

    def sparse_refusal(self, names: Sequence[str]) -> str:
        """The error message for parameters with sparse gradients (families without)."""

    def run(self, kernel: Kernel, *, weights: List[nd.NDArray], grads: List[nd.NDArray],
            states: List[FamilyState], masters: List[Optional[nd.NDArray]], lrs: List[float],
            wds: List[float], trust: Optional[KernelTrust], rescale_grad: float,
            clip_gradient: Optional[float], scratch: dict, steps: List[int],
            ratio_applies: Optional[List[bool]], grad_norm: Optional[GradNorm],
            sums: Optional[SliceSums] = None) -> None:
        """Run `kernel` (one of this family's) on a group of tensors; with `grad_norm`, on
        the gradients times its coefficient (global-norm clipping). With `sums` the tensors
        are pieces of tensors split over ranks, `kernel` is ``single_tensor``, and the
        family calls `sums` exactly once, with the partial sums of squares of the two
        quantities of its per-layer ratio, to get the whole tensors' (every rank calls
        it alike: it is one collective)."""


class SparseKernelFamily(KernelFamily, Protocol):
    """A kernel family with ``supports_sparse`` True: it also updates tensors with
    non-default storage.

    Examples
    --------
    >>> from mx_lbsgd.families import LAMBFamily, SGDFamily
    >>> SGDFamily.supports_sparse, hasattr(SGDFamily, 'run_sparse')
    (True, True)
    >>> LAMBFamily.supports_sparse, hasattr(LAMBFamily, 'run_sparse')
    (False, False)
    """

    def run_sparse(self, *, weights: List[nd.NDArray], grads: List[nd.NDArray],
                   states: List[FamilyState], masters: List[Optional[nd.NDArray]],
                   lrs: List[float], wds: List[float], rescale_grad: float,
                   clip_gradient: Optional[float]) -> None:
        """Update tensors with non-default storage one by one (the shell has already
        multiplied their gradients by a clip coefficient)."""


class FamilyBase:
    """What the families share: the native-kernel choice and the sparse refusal.

    A subclass sets ``name``, ``supports_sparse``, ``trust_in_kernel`` and its kernels
    (``native``, ``single_tensor``, ``multi_tensor``) as class attributes.

    Examples
    --------
    >>> import numpy as np
    >>> from mx_lbsgd.families import FamilyBase
    >>> class MyFamily(FamilyBase):
    ...     name = 'MySGD'
    >>> family = MyFamily()
    >>> family.native_kernel('cpu', np.float32, with_master=False) is None   # no native
    True
    >>> family.sparse_refusal(['emb_weight'])
    "MySGD has no sparse update: parameter(s) 'emb_weight' have row_sparse gradients or ..."
    """

    name = ''
    supports_sparse = False
    trust_in_kernel = False
    #: the family's compiled kernel (set by the subclass), used when `native_kernel` allows
    native: Optional[Kernel] = None

    def native_kernel(self, device_type: str, dtype: Any,
                      with_master: bool) -> Optional[Kernel]:
        """The family's `native` kernel for float32 weights, or float16 with fp32 master
        copies, on CPU when the native library is built; None otherwise."""
        name = np.dtype(dtype).name
        supported = name == 'float32' and not with_master or name == 'float16' and with_master
        if device_type != 'cpu' or not supported or _native.ops() is None:
            return None
        return type(self).native

    def sparse_refusal(self, names: Sequence[str]) -> str:
        return ('%s has no sparse update: parameter(s) %s have row_sparse gradients or '
                'non-default storage' % (self.name, ', '.join(map(repr, names))))


def update_kwargs(rescale_grad: float, clip_gradient: Optional[float],
                  **hyper: Union[float, bool]) -> dict:
    """Keyword arguments of MXNet's update operators: `rescale_grad`, `clip_gradient` only
    when it is set (MXNet's default, -1, means no clipping), and `hyper`."""
    kwargs = dict(hyper, rescale_grad=rescale_grad)
    if clip_gradient:
        kwargs['clip_gradient'] = clip_gradient
    return kwargs


def native_clip(clip_gradient: Optional[float]) -> float:
    """`clip_gradient` as the native operators take it (-1: no clipping)."""
    return clip_gradient if clip_gradient else -1.0


def cast_down(weights: Sequence[nd.NDArray], masters: Sequence[nd.NDArray]) -> None:
    """Write each fp32 master copy into its fp16 weight."""
    for w, w32 in zip(weights, masters):
        nd.Cast(w32, dtype=w.dtype, out=w)
