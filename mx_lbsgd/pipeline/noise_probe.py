"""The gradient norms a Trainer's step offers the noise-scale estimator, taken on the device.

At a Trainer's reduction (`binding`), per update::

    before the reduction (the first micro-batch of each group of k):
        small += [(sum of squares of device d's gradients, (1 / (b_small * scale))^2)]
    after it (the reduced gradient the update applies):
        big = (sum of squares, (mean / (batch * scale))^2)

with b_small = this worker's micro-batch over its devices, the loss scale the gradients
carry, and ``mean`` the engine's factor from a reduced sum to a mean over workers. For an
optimizer's gain, which every worker must compute alike, the small norms' mean is also
taken over the workers (`_compat.sum_over_workers`: one number per update). The
products of the sums and their factors are squared norms of mean per-example gradients,
the units of `lr_scaling.noise_moments`. Both `mx_lbsgd.GradientNoiseScale` (read every
few updates) and an optimizer's ``lr_scaling='adascale'`` (read once per update) use it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat, _kernels, _native
from . import binding as _binding

if TYPE_CHECKING:
    from .shell import PipelineOptimizer

#: A squared norm on the device ((1,) array) and the factor that turns it into units of the
#: mean per-example gradient.
Norm = Tuple[mx.nd.NDArray, float]


@dataclasses.dataclass(frozen=True)
class Norms:
    """An update's squared norms in per-example units, and its batch sizes."""

    small: List[float]
    big: float
    #: the reduced gradient's raw sum of squares (finite exactly when the gradient is)
    big_raw: float
    b_small: float
    b_big: float
    #: examples per micro-batch per worker, over its devices (the base batch)
    b_worker: float


@dataclasses.dataclass
class Observation:
    """One update's norms (device arrays, not read yet) and what turns them into `Norms`.

    ``big_scale / batch`` turns the reduced sum of squares' root into the mean per-example
    gradient. With ``job`` (the small norms reduced over the workers: one (2,) array, the
    sum over workers of their per-example small norms and of their batches) every worker
    resolves the same `Norms`, with the workers' mean batch."""

    small: List[Norm]
    big: Norm
    batch: float
    devices: int
    workers: int
    window: int
    job: Optional[mx.nd.NDArray] = None
    job_count: int = 0

    def arrays(self) -> List[mx.nd.NDArray]:
        first = [self.job] if self.job is not None else [a for a, _ in self.small]
        return first + [self.big[0]]

    def value_count(self) -> int:
        """How many host values `arrays()` hold."""
        return 3 if self.job is not None else len(self.small) + 1

    def resolve(self, raw: Sequence[float]) -> Norms:
        """`Norms` from the host values of `arrays()`."""
        if self.job is not None:
            batch = raw[1] / self.workers
            small = [raw[0] / (self.job_count * self.workers)]
        else:
            batch = self.batch
            small = [v * f for v, (_, f) in zip(raw, self.small)]
        big_raw = raw[self.value_count() - 1]
        return Norms(small=small, big=big_raw * (self.big[1] / batch) ** 2, big_raw=big_raw,
                     b_small=batch / self.devices, b_big=batch * self.workers * self.window,
                     b_worker=batch)


def read(arrays: Sequence[mx.nd.NDArray]) -> List[float]:
    """Host values of small 1-d arrays on any devices, in order, in one read."""
    if not arrays:
        return []
    host = [a.as_in_context(mx.cpu()) for a in arrays]
    return nd.concat(*host, dim=0).asnumpy().astype(np.float64).tolist()


class NormProbe:
    """Takes the norms of one update at a Trainer's reduction (see the module docstring).

    Parameters
    ----------
    devices : int
        The Trainer's devices per worker.
    small_every : None or int >= 1
        Take the small norms on every k-th micro-batch (the first of each group of k); None:
        once per window at the Trainer (k = batch_scale), else every micro-batch.
    """

    def __init__(self, devices: int, small_every: Optional[int] = None) -> None:
        self.devices = devices
        self.small_every = small_every
        #: this update's small norms so far
        self.small: List[Norm] = []

    def before_reduction(self, trainer: mx.gluon.Trainer, opt: PipelineOptimizer,
                         window_at_trainer: bool) -> None:
        """One micro-batch's local gradients, device by device."""
        every = self.small_every or (opt.batch_scale if window_at_trainer else 1)
        if opt.window_position % every:
            return
        b_small = worker_batch(trainer, opt) / self.devices
        factor = 1.0 / (b_small * loss_scale(trainer, opt))
        for grads in gradients_by_device(trainer):
            self.small.append((sum_squares(grads), factor ** 2))

    def after_reduction(self, trainer: mx.gluon.Trainer, opt: PipelineOptimizer,
                        closes_window: bool, across_workers: bool = False) -> Observation:
        """The reduced gradient that the update applies; returns the update's norms. With
        `across_workers`, the small norms are the mean over every worker's (one more
        reduction, of two numbers: with the workers' batches), so that every worker
        resolves the same norms."""
        workers = _compat.trainer_worker_count(trainer, default=1)
        batch = worker_batch(trainer, opt)
        window = opt.batch_scale if closes_window else 1
        # a sharded Trainer's ranks hold the reduced gradients they own: its sum over them
        reduced = getattr(trainer, 'reduced_sum_of_squares', None)
        big = reduced() if reduced is not None else sum_squares(gradients_by_device(trainer)[0])
        # the reduced gradient times `mean` is the mean over workers of each worker's
        # gradient (its sum over `batch` examples; a window's mean of such sums)
        mean = _compat.reduced_gradient_mean_factor(trainer)
        seen = Observation(small=self.small, big=(big, mean / loss_scale(trainer, opt)),
                           batch=batch, devices=self.devices, workers=workers, window=window)
        self.small = []
        if across_workers and workers > 1 and seen.small:
            local = nd.add_n(*[a * f for a, f in seen.small]) if len(seen.small) > 1 else \
                seen.small[0][0] * seen.small[0][1]
            seen.job = nd.concat(local, nd.full((1,), batch, ctx=local.context), dim=0)
            seen.job_count = len(seen.small)
            _compat.sum_over_workers(trainer, seen.job)
        return seen

def worker_batch(trainer: mx.gluon.Trainer, opt: PipelineOptimizer) -> float:
    """Examples per step on this worker (over its devices), from the step's batch
    argument read the way the docs' recipe for each engine passes it:

    - one device, several devices (``local``/``device`` kvstore), Horovod: the step's
      batch is this worker's (``trainer.step(batch_per_worker)``);
    - ``dist_*`` kvstores: the step's batch is the job's
      (``trainer.step(batch_per_worker * kv.num_workers)``, as Module's
      ``rescale_grad`` is: the servers sum, so only then does the update apply the
      mean gradient), and this worker's share is that over ``num_workers``.

    The step's batch: Trainer.step(batch_size) sets rescale_grad to scale / batch_size
    (Horovod's trainer folds its mean over workers into that scale: the quotient is
    still the argument). Under a `LossScaling` hook, whose Trainer.update sets
    rescale_grad only after the reduction (with 1/scale folded in): the batch of the
    hook's last step (NaN before its first, and the update is left out of the
    estimates)."""
    hook = _binding.loss_scaling_of(trainer)
    if hook is not None:
        step_batch = float(hook.batch_size or math.nan)
    else:
        step_batch = _compat.trainer_scale(trainer) / opt.rescale_grad
    kind = _compat.trainer_kvstore_type(trainer)
    if kind and kind.startswith('dist'):
        return step_batch / _compat.trainer_worker_count(trainer, default=math.nan)
    return step_batch


def loss_scale(trainer: mx.gluon.Trainer, opt: Any) -> float:
    """The scale the observed gradients carry: the optimizer's loss scaler's, or the
    `LossScaling` hook's (1 when the hook is inactive)."""
    hook = _binding.loss_scaling_of(trainer)
    if hook is not None:
        return float(hook.scale)
    scaler = getattr(opt, 'loss_scaler', None)
    return 1.0 if scaler is None else float(scaler.scale)


def gradients_by_device(trainer: mx.gluon.Trainer) -> List[List[mx.nd.NDArray]]:
    """[[gradients of device 0], [of device 1], ...] of the trainable parameters."""
    params = [p for p in _compat.trainer_params(trainer) if p.grad_req != 'null']
    return [list(grads) for grads in zip(*[p.list_grad() for p in params])]


def sum_squares(arrays: Sequence[mx.nd.NDArray]) -> mx.nd.NDArray:
    """A (1,) float32 array on the arrays' device: the sum of their squares (the native
    operator in one call on CPU; else MXNet's multi_sum_sq per dtype)."""
    arrays = [a.data if a.stype != 'default' else a for a in arrays]   # sparse: the values
    ops = _native.ops()
    dtypes = sorted({np.dtype(a.dtype).name for a in arrays})
    if ops is not None and arrays[0].context.device_type == 'cpu' \
            and set(dtypes) <= {'float32', 'float16'}:
        return ops.sum_sq(*arrays, num_arrays=len(arrays), total=1)
    parts = [_kernels.sum_squares([a for a in arrays if np.dtype(a.dtype).name == d]).sum()
             for d in dtypes]
    return nd.add_n(*parts) if len(parts) > 1 else parts[0]
