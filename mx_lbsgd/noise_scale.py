"""`GradientNoiseScale`: how large a batch pays off, measured while a Trainer trains.

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018),
https://arxiv.org/abs/1812.06162. The simple noise scale ``B_simple = tr(Sigma) / |G|^2``
predicts the critical batch size; it is estimated from the squared norms of the mean
gradient at two batch sizes, B_small < B_big (their Appendix A.1)::

    |G|^2     ~ (B_big * |g_big|^2 - B_small * |g_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)
    B_simple  = ema(tr(Sigma)) / ema(|G|^2)          # each term smoothed on its own

The Trainer already holds both gradients. g_small: one device's gradient of one
micro-batch, before the window sums it and before any reduction (B_small = the
micro-batch on one device). g_big: the gradient the update applies, after the window and
the reduction over devices and workers (kvstore ``device``/``dist_sync``, Horovod);
B_big = B_small * devices * workers * batch_scale. The batch sizes come from the step's
batch argument as the docs' recipes pass it on each engine (see `GradientNoiseScale`'s
Notes), the mean over workers from how the engine reduces
(`_compat.reduced_gradient_mean_factor`: the kvstore's servers and Horovod on CPU sum,
Horovod with NCCL >= 2.10 averages). Every norm is a sum of squares on the
device; the host reads them once every `interval` updates. The monitor only reads
gradients, so training is bit for bit the same with and without it.

Unlike GPT-NeoX's and k-diffusion's PyTorch monitors, which compute extra gradients or
gather per-worker norms, this one uses only gradients the step computes anyway and adds
no communication: each worker estimates from its own small gradients and the shared big
one.
"""
from __future__ import annotations

import math
import weakref
from typing import List, Sequence, Tuple

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _compat, _kernels, _native
from .pipeline import binding as _binding

__all__ = ['GradientNoiseScale']

#: A squared norm on the device ((1,) array) and the factor that turns it into units of the
#: mean per-example gradient.
_Norm = Tuple['mx.nd.NDArray', float]
#: Per update: (the small gradients' norms, the big gradient's norm, B_small, B_big).
_Pending = Tuple[List[_Norm], _Norm, float, float]


class GradientNoiseScale:
    """Estimates the gradient noise scale of a gluon Trainer that runs an mx_lbsgd
    optimizer (``'lbsgd'``, ``'lssgd'``, ``'lblamb'``).

    Parameters
    ----------
    trainer : gluon.Trainer (or Horovod's DistributedTrainer)
    interval : int >= 1, default 10
        Updates between host reads; the estimates change only then.
    smoothing : float in [0, 1), default 0.95
        Decay of the exponential moving averages of ``|G|^2`` and ``tr(Sigma)``
        (bias-corrected, as Adam's moments).
    small_every : None or int >= 1
        Observe the small gradient on every k-th micro-batch (the first of each group of
        k). None: once per accumulation window (k = batch_scale), which keeps the cost of
        a micro-batch under 1% on the digits demo; 1: every micro-batch (less noise).

    Attributes
    ----------
    b_simple : float or None
        The smoothed estimate, None until there is one (or while the smoothed ``|G|^2`` is
        not positive).
    gradient_sq, trace_sigma : float or None
        The smoothed ``|G|^2`` and ``tr(Sigma)``, in units of the mean per-example
        gradient.
    b_small, b_big : float or None
        The two batch sizes (examples per gradient), known after the first step.
    history : list of dict
        One entry per update read: ``update``, ``b_small``, ``b_big``, ``small_sq``,
        ``big_sq`` (the raw squared norms), ``gradient_sq``, ``trace_sigma``, ``b_simple``
        (smoothed, after this update). Updates whose gradients were not finite (skipped by
        a loss scaler) are left out.

    Notes
    -----
    Batch sizes: a gradient does not say how many examples it sums, so the monitor reads
    them from the batch passed to ``trainer.step(batch)`` (or to the `LossScaling` hook's
    ``step``), taken as the batch that makes the update apply the mean gradient of the
    examples that entered it, the convention of the docs' recipes:

    - one device, or several with a ``local``/``device`` kvstore: the worker's batch,
      over all its devices;
    - a ``dist_sync`` (any ``dist_*``) kvstore: the job's,
      ``trainer.step(batch_per_worker * kv.num_workers)``;
    - Horovod's ``DistributedTrainer``: the worker's, ``trainer.step(batch_per_worker)``.

    So this worker's batch is the step's divided by the kvstore's ``num_workers`` on a
    ``dist_*`` kvstore (where the servers sum, and MXNet's Module normalises the same way),
    and the step's otherwise (Horovod's trainer folds its mean over workers into the
    Trainer's scale). ``B_small`` is that over the devices. A ``dist_sync`` loop that
    passes the per-worker batch trains with ``num_workers`` times the mean gradient, and
    the monitor would take B_small and B_big ``num_workers`` times too small.

    Raises
    ------
    ValueError
        A bad `interval`, `smoothing` or `small_every`; a Trainer with
        ``update_on_kvstore=True``; or only one batch size to compare (one device, one
        worker and no accumulation window at the Trainer).
    TypeError
        The Trainer's optimizer is not one of mx_lbsgd's.

    Examples
    --------
    One device: the two batch sizes are a micro-batch (4 examples) and the window of
    ``batch_scale=2`` micro-batches (8):

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> import mx_lbsgd
    >>> mx.random.seed(0)
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {
    ...     'learning_rate': 0.1, 'batch_scale': 2, 'warmup_epochs': 0})
    >>> gns = mx_lbsgd.GradientNoiseScale(trainer, interval=2)
    >>> for _ in range(8):                      # 8 micro-batches: 4 updates
    ...     x = nd.random.normal(shape=(4, 2))
    ...     with autograd.record():
    ...         loss = ((net(x) - 10) ** 2).sum()
    ...     loss.backward()
    ...     trainer.step(4)
    >>> gns.b_small, gns.b_big, [h['update'] for h in gns.history]
    (4.0, 8.0, [1, 2, 3, 4])
    >>> gns.b_simple is not None       # tr(Sigma) / |G|^2, smoothed
    True
    >>> gns.close()
    """

    def __init__(self, trainer: mx.gluon.Trainer, interval: int = 10, smoothing: float = 0.95,
                 small_every: int | None = None) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError('interval must be an int >= 1; got %r' % (interval,))
        if small_every is not None and (not isinstance(small_every, int) or
                                        isinstance(small_every, bool) or small_every < 1):
            raise ValueError('small_every must be None or an int >= 1; got %r'
                             % (small_every,))
        if not (isinstance(smoothing, (int, float)) and 0.0 <= smoothing < 1.0):
            raise ValueError('smoothing must be a float in [0, 1); got %r' % (smoothing,))
        opt = trainer.optimizer
        if not hasattr(opt, 'begin_step'):
            raise TypeError("GradientNoiseScale needs a Trainer running one of mx_lbsgd's "
                            "optimizers ('lbsgd', 'lssgd', 'lblamb'); this one runs %s"
                            % type(opt).__name__)
        if _compat.trainer_kvstore_requested_updates(trainer):
            raise ValueError('GradientNoiseScale cannot watch a Trainer with '
                             'update_on_kvstore=True: the reduced gradient never reaches the '
                             'workers. Use gluon.Trainer(..., update_on_kvstore=False)')
        self.interval, self.smoothing = interval, float(smoothing)
        self.small_every = small_every
        self.b_simple: float | None = None
        self.gradient_sq: float | None = None
        self.trace_sigma: float | None = None
        self.b_small: float | None = None
        self.b_big: float | None = None
        self.history: list[dict[str, float | None]] = []
        # weak: the Trainer's binding holds this monitor, and must not keep the Trainer
        # (and its kvstore, whose destructor ends a dist_sync worker cleanly) alive
        self._trainer = weakref.ref(trainer)
        self._devices = len(_compat.trainer_params(trainer)[0].list_ctx())
        self._pending: list[_Pending] = []   # per update: ([small sums], big sum, B_small, B_big)
        self._small: list[_Norm] = []        # this update's small sums so far
        self._ema: list[float] = [0.0, 0.0, 0]   # |G|^2, tr(Sigma), samples
        self._updates = 0
        self._checked = False
        self._binding = _binding.bind(trainer)
        self._binding.observers.append(self)
        if self._devices == 1 and not self._window_at_trainer() \
                and _compat.trainer_worker_count(trainer, default=None) == 1:
            raise self._one_batch_size()

    def close(self) -> None:
        """Stop observing (the estimates stay)."""
        if self in self._binding.observers:
            self._binding.observers.remove(self)

    # -- observations (called by the Trainer binding) -----------------------------------
    def before_reduction(self, trainer: mx.gluon.Trainer, opt: mx.optimizer.Optimizer) -> None:
        """One micro-batch's local gradients, device by device."""
        if _compat.trainer_updates_on_kvstore(trainer):
            self.close()
            raise ValueError('GradientNoiseScale: this Trainer updates on the kvstore '
                             '(update_on_kvstore=True), so the reduced gradient never reaches '
                             'the workers; use update_on_kvstore=False')
        every = self.small_every or (opt.batch_scale if self._window_at_trainer() else 1)
        if opt.window_position % every:
            return
        b_small = self._worker_batch(trainer, opt) / self._devices
        factor = 1.0 / (b_small * self._loss_scale(trainer, opt))
        for grads in _gradients_by_device(trainer):
            self._small.append((_sum_squares(grads), factor ** 2))

    def after_reduction(self, trainer: mx.gluon.Trainer, opt: mx.optimizer.Optimizer,
                        closes_window: bool) -> None:
        """The reduced gradient that the update applies."""
        if not self._checked:
            self._check_two_sizes(trainer, opt)
        workers = _compat.trainer_worker_count(trainer, default=1)
        batch = self._worker_batch(trainer, opt)
        window = opt.batch_scale if closes_window else 1
        b_small = batch / self._devices
        b_big = batch * workers * window
        # a sharded Trainer's ranks hold the reduced gradients they own: its sum over them
        reduced = getattr(trainer, 'reduced_sum_of_squares', None)
        big = reduced() if reduced is not None else _sum_squares(_gradients_by_device(trainer)[0])
        # the reduced gradient times `mean` is the mean over workers of each worker's
        # gradient (its sum over `batch` examples; a window's mean of such sums)
        mean = _compat.reduced_gradient_mean_factor(trainer)
        factor = mean / (batch * self._loss_scale(trainer, opt))
        self._pending.append((self._small, (big, factor ** 2), b_small, b_big))
        self._small = []
        self._updates += 1
        if self._updates % self.interval == 0:
            self.flush()

    def flush(self) -> None:
        """Read the pending norms now (one host read) and update the estimates."""
        if not self._pending:
            return
        arrays = [a.as_in_context(mx.cpu()) for small, big, _, _ in self._pending
                  for a, _ in small + [big]]
        values = iter(nd.concat(*arrays, dim=0).asnumpy().tolist())
        start = self._updates - len(self._pending) + 1
        for u, (small, (_, big_factor), b_small, b_big) in enumerate(self._pending):
            sums = [next(values) * f for _, f in small]
            big_sq = next(values) * big_factor
            if not sums or not all(map(math.isfinite, sums + [big_sq])) or b_big <= b_small:
                continue
            self._estimate(start + u, sum(sums) / len(sums), big_sq, b_small, b_big)
        self._pending = []

    # -- estimation ----------------------------------------------------------------------
    def _estimate(self, update: int, small_sq: float, big_sq: float, b_small: float,
                  b_big: float) -> None:
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        ema = self._ema
        ema[0] = self.smoothing * ema[0] + (1 - self.smoothing) * g2
        ema[1] = self.smoothing * ema[1] + (1 - self.smoothing) * trace
        ema[2] += 1
        correction = 1 - self.smoothing ** ema[2]
        self.gradient_sq, self.trace_sigma = ema[0] / correction, ema[1] / correction
        self.b_simple = self.trace_sigma / self.gradient_sq if self.gradient_sq > 0 else None
        self.b_small, self.b_big = b_small, b_big
        self.history.append(dict(update=update, b_small=b_small, b_big=b_big,
                                 small_sq=small_sq, big_sq=big_sq,
                                 gradient_sq=self.gradient_sq, trace_sigma=self.trace_sigma,
                                 b_simple=self.b_simple))

    # -- what the step knows ---------------------------------------------------------------
    def _window_at_trainer(self) -> bool:
        # the Trainer is alive: this runs from __init__ or while it steps
        opt = self._trainer().optimizer  # type: ignore[union-attr]
        return opt.accumulates_at_trainer() and self._binding.window_at_reduction

    @staticmethod
    def _worker_batch(trainer: mx.gluon.Trainer, opt: mx.optimizer.Optimizer) -> float:
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

    @staticmethod
    def _loss_scale(trainer: mx.gluon.Trainer, opt: mx.optimizer.Optimizer) -> float:
        """The scale the observed gradients carry: the optimizer's loss scaler's, or the
        `LossScaling` hook's (1 when the hook is inactive)."""
        hook = _binding.loss_scaling_of(trainer)
        if hook is not None:
            return float(hook.scale)
        scaler = getattr(opt, 'loss_scaler', None)
        return 1.0 if scaler is None else float(scaler.scale)

    def _check_two_sizes(self, trainer: mx.gluon.Trainer, opt: mx.optimizer.Optimizer) -> None:
        self._checked = True
        if self._devices == 1 and _compat.trainer_worker_count(trainer, default=1) == 1 \
                and not self._window_at_trainer():
            raise self._one_batch_size()

    def _one_batch_size(self) -> ValueError:
        self.close()
        return ValueError(
            'GradientNoiseScale needs gradients at two batch sizes, and this Trainer has one '
            'device, one worker and no accumulation window at the Trainer: use batch_scale > 1 '
            '(with a Trainer that reduces once per update: no update_on_kvstore, dense '
            'gradients), more than one device, or more than one worker (dist_sync, Horovod)')


def _gradients_by_device(trainer: mx.gluon.Trainer) -> list[list[mx.nd.NDArray]]:
    """[[gradients of device 0], [of device 1], ...] of the trainable parameters."""
    params = [p for p in _compat.trainer_params(trainer) if p.grad_req != 'null']
    return [list(grads) for grads in zip(*[p.list_grad() for p in params])]


def _sum_squares(arrays: Sequence[mx.nd.NDArray]) -> mx.nd.NDArray:
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
