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
import mxnet as mx

from . import _compat
from .gluon import binding as _binding
from .pipeline import lr_scaling as _lr_scaling, noise_probe as _probe
from .pipeline.step_info import StepInfo

__all__ = ['GradientNoiseScale']

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
        self._probe = _probe.NormProbe(self._devices, small_every)
        self._pending: list[_probe.Observation] = []    # per update, until the next read
        self._moments = _lr_scaling.SmoothedMoments()
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
    def before_reduction(self, trainer: mx.gluon.Trainer, info: StepInfo) -> None:
        """One micro-batch's local gradients, device by device."""
        if _compat.trainer_updates_on_kvstore(trainer):
            self.close()
            raise ValueError('GradientNoiseScale: this Trainer updates on the kvstore '
                             '(update_on_kvstore=True), so the reduced gradient never reaches '
                             'the workers; use update_on_kvstore=False')
        self._probe.before_reduction(trainer, info, self._window_at_trainer())

    def after_reduction(self, trainer: mx.gluon.Trainer, info: StepInfo,
                        closes_window: bool) -> None:
        """The reduced gradient that the update applies."""
        if not self._checked:
            self._check_two_sizes(trainer)
        self._pending.append(self._probe.after_reduction(trainer, info, closes_window))
        self._updates += 1
        if self._updates % self.interval == 0:
            self.flush()

    def flush(self) -> None:
        """Read the pending norms now (one host read) and update the estimates."""
        if not self._pending:
            return
        values = iter(_probe.read([a for seen in self._pending for a in seen.arrays()]))
        start = self._updates - len(self._pending) + 1
        for u, seen in enumerate(self._pending):
            norms = seen.resolve([next(values) for _ in range(seen.value_count())])
            if not norms.small or not all(map(math.isfinite, norms.small + [norms.big])) \
                    or norms.b_big <= norms.b_small:
                continue
            self._estimate(start + u, sum(norms.small) / len(norms.small), norms.big,
                           norms.b_small, norms.b_big)
        self._pending = []

    # -- estimation ----------------------------------------------------------------------
    def _estimate(self, update: int, small_sq: float, big_sq: float, b_small: float,
                  b_big: float) -> None:
        g2, trace = _lr_scaling.noise_moments(small_sq, big_sq, b_small, b_big)
        self._moments.add(g2, trace, self.smoothing)
        self.gradient_sq, self.trace_sigma = self._moments.gradient_sq, self._moments.trace_sigma
        gradient_sq = self.gradient_sq or 0.0
        self.b_simple = (self.trace_sigma / gradient_sq  # type: ignore[operator]
                         if gradient_sq > 0 else None)
        self.b_small, self.b_big = b_small, b_big
        self.history.append(dict(update=update, b_small=b_small, b_big=b_big,
                                 small_sq=small_sq, big_sq=big_sq,
                                 gradient_sq=self.gradient_sq, trace_sigma=self.trace_sigma,
                                 b_simple=self.b_simple))

    # -- what the step knows ---------------------------------------------------------------
    def _window_at_trainer(self) -> bool:
        # the Trainer is alive: this runs from __init__ or while it steps
        opt = self._trainer().optimizer  # type: ignore[union-attr]
        # batch_scale='auto' whose bounds allow more than 1: its windows are at the
        # reduction (or refused there) from their first longer one
        longest = getattr(opt, '_window_capacity', lambda: 1)()
        return (opt.accumulates_at_trainer() or longest > 1) \
            and self._binding.window_at_reduction

    def _check_two_sizes(self, trainer: mx.gluon.Trainer) -> None:
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

