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
from typing import List, Optional, Sequence, Tuple, cast

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat, _kernels, _native
from .step_info import StepInfo

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
    #: the difference estimator's (the last two updates' gradients)
    biased: bool = False
    #: the mean over workers of the values that rode along (`NormProbe.after_reduction`)
    extra: Tuple[float, ...] = ()


@dataclasses.dataclass
class Observation:
    """One update's norms (device arrays, not read yet) and what turns them into `Norms`.

    ``big_scale / batch`` turns the reduced sum of squares' root into the mean per-example
    gradient. With ``job`` (the small norms reduced over the workers: one array, the sum
    over workers of their per-example small norms, of their batches and of the ``extra``
    values) every worker resolves the same `Norms`, with the workers' mean batch. With
    ``difference`` (one gradient per update): ``small`` holds the last update's and this
    update's squared norms and ``big`` that of their sum, all per example."""

    small: List[Norm]
    big: Norm
    batch: float
    devices: int
    workers: int
    window: int
    job: Optional[mx.nd.NDArray] = None
    job_count: int = 0
    extra: Tuple[float, ...] = ()
    difference: bool = False

    def arrays(self) -> List[mx.nd.NDArray]:
        first = [self.job] if self.job is not None else [a for a, _ in self.small]
        return first + [self.big[0]]

    def value_count(self) -> int:
        """How many host values `arrays()` hold."""
        if self.job is not None:
            return 3 + len(self.extra)
        return len(self.small) + 1

    def resolve(self, raw: Sequence[float]) -> Norms:
        """`Norms` from the host values of `arrays()`."""
        extra = self.extra
        if self.difference:
            previous, current, both = raw
            return Norms(small=[previous, current], big=both / 4.0, big_raw=current,
                         b_small=self.batch, b_big=2.0 * self.batch, b_worker=self.batch,
                         biased=True, extra=extra)
        if self.job is not None:
            batch = raw[1] / self.workers
            small = [raw[0] / (self.job_count * self.workers)]
            extra = tuple(v / self.workers for v in raw[2:2 + len(extra)])
        else:
            batch = self.batch
            small = [v * f for v, (_, f) in zip(raw, self.small)]
        big_raw = raw[self.value_count() - 1]
        return Norms(small=small, big=big_raw * (self.big[1] / batch) ** 2, big_raw=big_raw,
                     b_small=batch / self.devices, b_big=batch * self.workers * self.window,
                     b_worker=batch, extra=extra)


def read(arrays: Sequence[mx.nd.NDArray]) -> List[float]:
    """Host values of small 1-d arrays on any devices, in order, in one read."""
    if not arrays:
        return []
    host = [a.as_in_context(mx.cpu()) for a in arrays]
    return nd.concat(*host, dim=0).asnumpy().astype(np.float64).tolist()


class PreviousGradient:
    """The last update's gradient, for AdaptDL's difference estimator when an update has a
    single gradient (one worker, one device, a window of 1)::

        previous = f_prev * g_prev                  # float32 copy, per-example units
        small = [|previous|^2, |f * g|^2]           # two base batches of b examples
        big = |previous + f * g|^2 / 4              # their mean: 2 b examples
        previous = f * g

    with f = 1 / (b x loss scale). Costs a float32 copy of the gradients and four passes
    over them per update (`_kernels.accumulate` twice, two sums of squares)."""

    def __init__(self) -> None:
        self.buffers: Optional[List[mx.nd.NDArray]] = None
        #: |previous|^2, a (1,) array
        self.square: Optional[mx.nd.NDArray] = None
        # a checkpoint's (square, buffers), put on the gradients' device at the next pair
        self._restored: Optional[Tuple[float, Sequence[mx.nd.NDArray]]] = None
        self._scratch: dict = {}

    def pair(self, grads: Sequence[mx.nd.NDArray], factor: float
             ) -> Optional[Tuple[List[Norm], Norm]]:
        """(small, big) norms of the last update's and this one's gradients (factors 1:
        already per example), None for the first; then keeps this one."""
        if self._restored is not None:
            square, host = self._restored
            self._restored = None
            if len(host) == len(grads) and all(h.shape == g.shape for h, g in zip(host, grads)):
                self.buffers = [h.as_in_context(g.context).astype('float32', copy=True)
                                for h, g in zip(host, grads)]
                self.square = nd.array([square], ctx=grads[0].context, dtype='float32')
        current = sum_squares(grads) * (factor * factor)
        result = None
        buffers = self.buffers
        if buffers is not None and len(buffers) == len(grads) and all(
                b.shape == g.shape and b.context == g.context for b, g in zip(buffers, grads)):
            _kernels.accumulate(accs=buffers, grads=grads, first=False, rescale_grad=factor,
                                scratch=self._scratch)
            result = ([(cast(mx.nd.NDArray, self.square), 1.0), (current, 1.0)],
                      (sum_squares(buffers), 1.0))
        else:
            buffers = self.buffers = [nd.zeros(g.shape, ctx=g.context, dtype='float32')
                                      for g in grads]
        _kernels.accumulate(accs=buffers, grads=grads, first=True, rescale_grad=factor,
                            scratch=self._scratch)
        self.square = current
        return result

    def forget(self) -> None:
        self.buffers = self.square = None
        self._restored = None

    def saved(self) -> Optional[Tuple[float, List[mx.nd.NDArray]]]:
        """(|previous|^2, copies of the buffers on the CPU) for a checkpoint (one host
        read), None before the first update."""
        if self._restored is not None:
            return self._restored[0], list(self._restored[1])
        if self.buffers is None or self.square is None:
            return None
        return float(self.square.asnumpy()[0]), [b.copyto(mx.cpu()) for b in self.buffers]

    def restore(self, square: float, buffers: Sequence[mx.nd.NDArray]) -> None:
        """Resume `saved` (on the gradients' device, at the next update)."""
        self.buffers = self.square = None
        self._restored = (float(square), list(buffers))


class NormProbe:
    """Takes the norms of one update at a Trainer's reduction (see the module docstring).

    Parameters
    ----------
    devices : int
        The Trainer's devices per worker.
    small_every : None or int >= 1
        Take the small norms on every k-th micro-batch (the first of each group of k); None:
        once per window at the Trainer (k = batch_scale), else every micro-batch.
    difference : bool
        When an update has a single gradient (one worker, one device, a window of 1), take
        the difference estimator's norms (`PreviousGradient`); otherwise such an update
        gives no estimate.
    """

    def __init__(self, devices: int, small_every: Optional[int] = None,
                 difference: bool = False) -> None:
        self.devices = devices
        self.small_every = small_every
        #: this update's small norms so far
        self.small: List[Norm] = []
        self.previous = PreviousGradient() if difference else None
        self._dense: Optional[bool] = None

    def before_reduction(self, trainer: mx.gluon.Trainer, info: StepInfo,
                         window_at_trainer: bool) -> None:
        """One micro-batch's local gradients, device by device."""
        every = self.small_every or (info.batch_scale if window_at_trainer else 1)
        if info.window_position() % every or self._single(trainer, info):
            return
        b_small = info.worker_batch() / self.devices
        factor = 1.0 / (b_small * info.loss_scale())
        for grads in gradients_by_device(trainer):
            self.small.append((sum_squares(grads), factor ** 2))

    def after_reduction(self, trainer: mx.gluon.Trainer, info: StepInfo,
                        closes_window: bool, across_workers: bool = False,
                        extra: Sequence[float] = ()) -> Observation:
        """The reduced gradient that the update applies; returns the update's norms. With
        `across_workers`, the small norms are the mean over every worker's (one more
        reduction, of a few numbers: with the workers' batches and the host values
        `extra`, whose mean over the workers `Norms.extra` gives), so that every worker
        resolves the same norms."""
        workers = _compat.trainer_worker_count(trainer, default=1)
        batch = info.worker_batch()
        window = info.batch_scale if closes_window else 1
        # the reduced gradient times `mean` is the mean over workers of each worker's
        # gradient (its sum over `batch` examples; a window's mean of such sums)
        mean = _compat.reduced_gradient_mean_factor(trainer)
        if self._single(trainer, info):
            return self._difference(trainer, info, batch, mean, extra)
        if self.previous is not None:
            self.previous.forget()          # a gradient from before a longer window is stale
        # a sharded Trainer's ranks hold the reduced gradients they own: its sum over them
        reduced = getattr(trainer, 'reduced_sum_of_squares', None)
        big = reduced() if reduced is not None else sum_squares(gradients_by_device(trainer)[0])
        seen = Observation(small=self.small, big=(big, mean / info.loss_scale()),
                           batch=batch, devices=self.devices, workers=workers, window=window,
                           extra=tuple(extra))
        self.small = []
        if across_workers and workers > 1 and seen.small:
            local = nd.add_n(*[a * f for a, f in seen.small]) if len(seen.small) > 1 else \
                seen.small[0][0] * seen.small[0][1]
            values = np.array([batch] + [float(v) for v in extra], dtype=np.float32)
            seen.job = nd.concat(local, nd.array(values, ctx=local.context), dim=0)
            seen.job_count = len(seen.small)
            _compat.sum_over_workers(trainer, seen.job)
        return seen

    def _single(self, trainer: mx.gluon.Trainer, info: StepInfo) -> bool:
        """Whether the difference estimator takes this update: one gradient per update
        (one worker, one device, windows of 1, dense)."""
        if self.previous is None or self.devices != 1 or info.batch_scale != 1 \
                or _compat.trainer_worker_count(trainer, default=2) != 1:
            return False
        if self._dense is None:
            self._dense = not _compat.has_sparse_gradients(trainer)
        return self._dense

    def _difference(self, trainer: mx.gluon.Trainer, info: StepInfo, batch: float,
                    mean: float, extra: Sequence[float]) -> Observation:
        """One worker, one device, a window of 1: the difference estimator's norms (an
        observation without small norms, which gives no estimate, on the first update)."""
        self.small = []
        grads = gradients_by_device(trainer)[0]
        factor = mean / (batch * info.loss_scale())
        pair = cast(PreviousGradient, self.previous).pair(grads, factor)
        if pair is None:
            return Observation(small=[], big=(sum_squares(grads), mean / info.loss_scale()),
                               batch=batch, devices=1, workers=1, window=1,
                               extra=tuple(extra))
        small, big = pair
        return Observation(small=small, big=big, batch=batch, devices=1, workers=1, window=1,
                           extra=tuple(extra), difference=True)

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
        return _native.call(ops.sum_sq, arrays, nd.empty((1,), ctx=arrays[0].context),
                            num_arrays=len(arrays), total=1)
    parts = [_kernels.sum_squares([a for a in arrays if np.dtype(a.dtype).name == d]).sum()
             for d in dtypes]
    return nd.add_n(*parts) if len(parts) > 1 else parts[0]
