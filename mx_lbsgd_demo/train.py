"""The digits training loop behind ``mx-lbsgd train`` and ``mx-lbsgd study``.

:func:`train` fits :func:`mx_lbsgd_demo.models.mlp` to the digits
(:func:`mx_lbsgd_demo.data.load_data`) with a Gluon Trainer and returns the per-epoch and
per-step history and the summary numbers (:mod:`mx_lbsgd_demo.summary` writes them). The
loss is Gluon's per-sample loss, backward of its sum, ``trainer.step(samples)``. Each epoch
drops the last partial batch. Conventions: :mod:`mx_lbsgd_demo.config`.
"""
import dataclasses
import math
import os
import time
import warnings

import numpy as np

from .config import AUTO_BOUNDS, WARMUP_OPTIMIZERS, ConfigError, check, longest_window
from .data import load_data

__all__ = ['HOROVOD_INSTALL', 'NOISE_SCALE_INTERVAL', 'NOISE_SCALE_KEYS', 'OVERFLOW_KEYS',
           'build', 'overflow_fields', 'probe_underflow', 'train']

HOROVOD_INSTALL = 'bash scripts/install_horovod.sh'
#: Updates between the host reads of the gradient noise scale monitor (0: no monitor).
NOISE_SCALE_INTERVAL = 10
#: What each epoch row (and, as final_KEY, the result) keeps of the monitor.
NOISE_SCALE_KEYS = ('b_simple', 'gradient_sq', 'trace_sigma')
#: What a step row keeps of a skipped step's mx_lbsgd.OverflowReport (None when finite).
OVERFLOW_KEYS = ('overflow_parameters', 'overflow_micro_batch', 'overflow_rank',
                 'overflow_originated_here')


def _make_scaler(cfg):
    """The DynamicLossScaler the run uses, or None for no loss scaling."""
    import mx_lbsgd
    mode = cfg.resolved_loss_scale()
    if mode == 'none':
        return None
    if mode == 'dynamic':
        return mx_lbsgd.DynamicLossScaler(growth_interval=cfg.growth_interval)
    return mx_lbsgd.DynamicLossScaler.static(float(mode))


def _make_optimizer(cfg, scaler, updates_per_epoch, workers=1):
    """(optimizer, whether the optimizer itself applies `scaler`)."""
    import mxnet as mx
    import mx_lbsgd
    common = dict(learning_rate=cfg.resolved_lr(), momentum=cfg.momentum, wd=cfg.wd,
                  multi_precision=cfg.dtype == 'float16')
    clip = dict(max_grad_norm=cfg.max_grad_norm)       # ours; the hook clips for the others
    if cfg.lr_scaling is not None:                     # ours only (config.check)
        clip['lr_scaling'] = cfg.lr_scaling
    if cfg.batch_scale == 'auto':
        clip['batch_scale_bounds'] = tuple(cfg.batch_scale_bounds or AUTO_BOUNDS)
    sched = _scheduler(cfg, updates_per_epoch, workers)
    if sched is not None:
        common['lr_scheduler'] = sched
    warm = dict(warmup_strategy=cfg.warmup_strategy, warmup_epochs=cfg.warmup_epochs,
                batch_scale=cfg.batch_scale, updates_per_epoch=updates_per_epoch,
                num_epochs=cfg.epochs)
    name = cfg.optimizer
    if name == 'lbsgd':
        return mx_lbsgd.LBSGD(loss_scaler=scaler, **warm, **common, **clip), True
    if name == 'lssgd':
        scaler = scaler or mx_lbsgd.DynamicLossScaler(enabled=False)
        return mx_lbsgd.LossScaledSGD(loss_scaler=scaler, **common, **clip), True
    if name == 'sgd':
        return mx.optimizer.SGD(**common), False
    if name == 'mxnet-lbsgd':
        return mx_lbsgd.MXNET_LBSGD(**warm, **common), False
    if name == 'lblamb':
        lamb = dict(common, batch_scale=cfg.batch_scale, trust_exclude=True)
        lamb.pop('momentum')
        return mx_lbsgd.LAMB(loss_scaler=scaler, **lamb, **clip), True
    return mx.optimizer.LARS(eta=0.001, momentum_correction=False, **common), False


def _scheduler(cfg, steps_per_epoch, workers=1):
    """The WarmupScheduler for cfg.lr_decay / cfg.warmup_from, or None. Its count is the
    optimizer's num_update: micro-batches for lbsgd (whose own warmup multiplies it),
    applied updates for lblamb, updates for the others (batch_scale being 1 there); with
    lr_scaling, the scale-invariant progress in base iterations (micro-batches x workers)."""
    import mx_lbsgd
    if cfg.lr_decay is None and cfg.warmup_from is None:
        return None
    warm = 0
    if cfg.warmup_from is not None:
        warm = int(round(cfg.warmup_epochs * steps_per_epoch))
    total = max(cfg.epochs * steps_per_epoch, warm + 1)
    if cfg.lr_scaling is not None:
        warm, total = warm * workers, total * workers
    elif cfg.optimizer == 'lblamb':
        warm, total = warm // cfg.batch_scale, max(total // cfg.batch_scale, 1)
    return mx_lbsgd.WarmupScheduler(
        base_lr=cfg.resolved_lr(), warmup_steps=warm, strategy='linear',
        warmup_begin_lr=cfg.warmup_from if cfg.warmup_from is not None else 0.0,
        decay=cfg.lr_decay, max_update=total if cfg.lr_decay else None)


def _horovod():
    """horovod.mxnet, initialised; ConfigError naming the install command if missing."""
    try:
        import horovod.mxnet as hvd
    except ImportError as err:
        raise ConfigError('kvstore=horovod needs horovod built with MXNet support (%s): %s'
                          % (err, HOROVOD_INSTALL)) from None
    hvd.init()
    return hvd


def build(cfg, net, updates_per_epoch, kvstore=None):
    """(trainer, LossScaling hook or None, scaler or None) for `cfg`; ConfigError on refusal.

    kvstore='horovod' gives horovod's DistributedTrainer (it averages over the workers, so
    `step` takes the per-worker batch there)."""
    import mxnet as mx
    import mx_lbsgd
    check(cfg)
    try:
        scaler = _make_scaler(cfg)
        workers = (_horovod().size() if kvstore == 'horovod' else kvstore.num_workers
                   if kvstore is not None and 'dist' in kvstore.type else 1)
        opt, builtin = _make_optimizer(cfg, scaler, updates_per_epoch, workers)
        if builtin:
            scaler = opt.loss_scaler if opt.loss_scaler is not None else None
            if scaler is not None and not scaler.enabled:
                scaler = None
        if kvstore == 'horovod':
            hvd = _horovod()
            mx_lbsgd.distributed.broadcast_parameters(net.collect_params(), root_rank=0)
            trainer = hvd.DistributedTrainer(net.collect_params(), opt)
        else:
            trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=kvstore,
                                       update_on_kvstore=False if kvstore is not None else None)
        if kvstore not in (None, 'horovod') and 'dist' in kvstore.type:
            mx_lbsgd.init_kvstore(trainer, cfg.batch_size * kvstore.num_workers)
        hook = None
        if (scaler is not None or cfg.max_grad_norm) and not builtin:
            hook = mx_lbsgd.LossScaling(
                trainer, scaler or mx_lbsgd.DynamicLossScaler(enabled=False), force=True,
                max_grad_norm=cfg.max_grad_norm)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from err
    return trainer, hook, scaler


def _zero_fraction(params):
    """Fraction of gradient entries that are exactly zero (one host read)."""
    import mxnet as mx
    grads = [p.grad() for p in params]
    zeros = mx.nd.add_n(*[(g == 0).astype('float32').sum() for g in grads])
    return float(zeros.asscalar()) / sum(g.size for g in grads)


def probe_underflow(net, loss_fn, xb, yb, scale):
    """Fraction of the gradient entries that are non-zero when the loss is scaled by the
    largest power of two <= 2**24 that keeps them finite, but zero at loss scale `scale`.

    Runs its own backward passes (the gradients are overwritten; call it between steps)."""
    import mxnet as mx
    params = [p for p in net.collect_params().values() if p.grad_req != 'null']

    def grads(s):
        with mx.autograd.record():
            loss = loss_fn(net(xb).astype('float32'), yb) * s
        loss.backward()
        return [p.grad().asnumpy() for p in params]

    at_scale = grads(scale)
    ref_scale = 2.0 ** 24
    while True:
        ref = grads(ref_scale)
        if all(np.isfinite(g).all() for g in ref) or ref_scale <= 1.0:
            break
        ref_scale /= 2.0
    if ref_scale <= scale:
        return 0.0
    nonzero = sum(int((r != 0).sum()) for r in ref)
    lost = sum(int(((a == 0) & (r != 0)).sum()) for a, r in zip(at_scale, ref))
    return lost / nonzero if nonzero else 0.0


def overflow_fields(report):
    """The OVERFLOW_KEYS of a step row from an mx_lbsgd.OverflowReport (or None: all None).
    overflow_parameters is 'name:kind:count' per parameter, most elements first, ';'-joined."""
    if report is None:
        return dict.fromkeys(OVERFLOW_KEYS)
    return dict(overflow_parameters=';'.join('%s:%s:%d' % (n, k, report.counts[n])
                                             for n, k in report.parameters.items()),
                overflow_micro_batch=report.micro_batch, overflow_rank=report.rank,
                overflow_originated_here=report.originated_here)


def _shard(n, kvstore):
    """Indices of this worker's shard of n samples: equal-sized, contiguous, by rank."""
    if kvstore == 'horovod':
        hvd = _horovod()
        rank, workers = hvd.rank(), hvd.size()
    elif kvstore is None or not hasattr(kvstore, 'num_workers'):
        return np.arange(n), 0, 1
    else:
        rank, workers = kvstore.rank, kvstore.num_workers
    size = n // workers
    return np.arange(rank * size, (rank + 1) * size), rank, workers


def _accuracy(net, x, y):
    import mxnet as mx
    pred = net(mx.nd.array(x)).astype('float32').argmax(axis=1).asnumpy()
    return float(np.mean(pred == y))


def train(cfg, on_start=None, on_step=None, on_epoch=None,
          noise_scale_interval=NOISE_SCALE_INTERVAL):
    """Run `cfg`; returns a result dict (config, history, summary numbers).

    Callbacks: on_start(dict(steps_per_epoch, epochs, rank, num_workers)) once the trainer
    is built, on_step(dict) after every step (only step and epoch unless
    cfg.record_steps), on_epoch(dict) after every epoch. ConfigError when the
    configuration is refused before training starts.

    noise_scale_interval: updates between the host reads of an
    mx_lbsgd.GradientNoiseScale monitor (0: none). It watches the runs that have two batch
    sizes (an mx_lbsgd optimizer with batch_scale > 1 or several workers), only reads the
    gradients, and gives each epoch row b_simple, gradient_sq and trace_sigma (None
    where not measured)."""
    if not isinstance(noise_scale_interval, int) or isinstance(noise_scale_interval, bool) \
            or noise_scale_interval < 0:
        raise ConfigError('noise_scale_interval must be an int >= 0; got %r'
                          % (noise_scale_interval,))
    run = _Run(cfg, noise_scale_interval)
    if on_start is not None:
        on_start(dict(steps_per_epoch=run.steps_per_epoch, epochs=cfg.epochs,
                      rank=run.rank, num_workers=run.workers))
    epochs, steps = [], []
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        row = run.epoch(epoch, steps, on_step)
        row['seconds'] = time.perf_counter() - start
        epochs.append(row)
        if on_epoch is not None:
            on_epoch(row)
    wall = time.perf_counter() - start
    if run.noise is not None:
        run.noise.close()
    return _result(cfg, epochs, steps, wall, run)


def _noise_monitor(trainer, optimizer, interval):
    """(GradientNoiseScale or None, why there is none or None). build() has created a dist
    kvstore already, so the monitor knows the number of workers when it is attached."""
    import mx_lbsgd
    if interval == 0:
        return None, 'off (noise_scale_interval 0)'
    try:
        return mx_lbsgd.GradientNoiseScale(trainer, interval=interval), None
    except TypeError:
        return None, "%s is not one of mx_lbsgd's optimizers (lbsgd, lssgd, lblamb)" \
            % optimizer
    except ValueError:
        return None, 'one batch size (batch_scale 1, one device, one worker)'


class _Run:
    """Data, model, trainer and counters of one training run."""

    def __init__(self, cfg, noise_scale_interval=0):
        import mxnet as mx
        import mx_lbsgd
        from .models import mlp
        check(cfg)
        self.cfg = cfg
        self.x, self.y, self.xv, self.yv, self.xt, self.yt = load_data(
            cfg.seed, cfg.test_fraction, cfg.val_fraction, cfg.dataset)
        if cfg.kvstore and 'dist' in cfg.kvstore and 'DMLC_ROLE' not in os.environ:
            raise ConfigError('kvstore=%r needs a parameter-server job: run it under '
                              '"mx-lbsgd launch -n WORKERS -- ..."' % cfg.kvstore)
        kv = (cfg.kvstore if cfg.kvstore == 'horovod'
              else mx.kv.create(cfg.kvstore) if cfg.kvstore else None)
        self.shard, self.rank, self.workers = _shard(len(self.x), kv)
        # horovod's DistributedTrainer averages over the workers itself
        self.step_batch = cfg.batch_size * (1 if kv == 'horovod' else self.workers)
        self.steps_per_epoch = len(self.shard) // cfg.batch_size
        if self.steps_per_epoch < longest_window(cfg) or self.steps_per_epoch < 1:
            raise ConfigError('batch_size * batch_scale = %d is larger than the %d training '
                              'samples%s' % (cfg.batch_size * longest_window(cfg),
                                             len(self.shard),
                                             ' of this worker' if self.workers > 1 else ''))
        self.net = mlp(tuple(cfg.hidden), dtype=cfg.dtype, seed=cfg.seed)
        if cfg.hybridize:
            self.net.hybridize(static_alloc=True)
        self.trainer, self.hook, self.scaler = build(cfg, self.net, self.steps_per_epoch, kv)
        self.opt = self.trainer.optimizer
        self.ours = isinstance(self.opt, mx_lbsgd.LBSGD)      # LossScaledSGD is one too
        self.params = [p for p in self.net.collect_params().values() if p.grad_req != 'null']
        self.loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        self.rng = np.random.RandomState(cfg.seed + 1)
        probe = self.shard[:cfg.batch_size]
        self.probe = mx.nd.array(self.x[probe]), mx.nd.array(self.y[probe])
        self.skipped = self.step_count = 0
        self.noise, self.noise_missing = _noise_monitor(self.trainer, cfg.optimizer,
                                                        noise_scale_interval)
        self.noise_interval = noise_scale_interval if self.noise is not None else None
        # who keeps the OverflowReports: the LossScaling hook, or the loss-scaled optimizer
        self.reports = self.hook if self.hook is not None else (
            self.opt if self.scaler is not None else None)
        self.scale_warnings = []

    def top_offenders(self):
        """[[parameter, skipped steps it overflowed in]], most first (at most 3), or None
        without loss scaling."""
        if self.reports is None:
            return None
        return [[name, n] for name, n in self.reports.overflow_tally.most_common(3)]

    def _update(self):
        """trainer.step (or the hook's), keeping each mx_lbsgd.LossScaleFallingWarning in
        scale_warnings (the library logs it too); other warnings are shown as usual."""
        import mx_lbsgd
        if self.reports is None:
            return self._apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always', mx_lbsgd.LossScaleFallingWarning)
            self._apply()
        for w in caught:
            if isinstance(w.message, mx_lbsgd.LossScaleFallingWarning):
                self.scale_warnings.append(dict(step=self.step_count + 1, message=str(w.message),
                                                offenders=[list(o) for o in w.message.offenders]))
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    def _apply(self):
        if self.hook is not None:
            if self.cfg.optimizer == 'lars':
                self.hook.unscale()   # MXNet's LARS squares the (fp16) gradients as given
            self.hook.step(self.step_batch)
        else:
            self.trainer.step(self.step_batch)

    def grad_norm(self):
        """The global norm of the last applied update's gradient, before clipping (None
        without clipping, or before the first update; inf/NaN when it was skipped)."""
        if not self.cfg.max_grad_norm:
            return None
        norm = (self.hook if self.hook is not None else self.opt).last_grad_norm
        return None if norm is None else float(norm.asscalar())

    @property
    def scale(self):
        return self.scaler.scale if self.scaler is not None else 1.0

    def applied_micro_batches(self):
        """Micro-batches the optimizer has counted (a skipped step or window is not):
        LBSGD's warmup position; MXNet's num_update for the others."""
        return self.opt.micro_batches if self.ours else self.opt.num_update

    def applied_updates(self):
        """Weight updates applied (micro-batches / batch_scale for the accumulating ones)."""
        if self.ours:
            return self.opt.applied_updates
        return self.opt.num_update // (self.cfg.batch_scale
                                       if self.cfg.optimizer in WARMUP_OPTIMIZERS else 1)

    def lr(self):
        """The scheduled learning rate after the micro-batches applied so far: the lr
        scheduler's (or the base lr) times the warmup multiplier; for LARS the base lr,
        which each layer's trust ratio multiplies."""
        import mx_lbsgd
        applied = self.applied_micro_batches()
        cfg = self.cfg
        if cfg.lr_scaling is not None:         # an mx_lbsgd optimizer (config.check)
            return self._scaled_lr(applied)
        sched = self.opt.lr_scheduler
        count = self.opt.num_update if self.cfg.optimizer == 'lblamb' else applied
        lr = sched(max(count, 1)) if sched is not None else self.cfg.resolved_lr()
        if self.ours:
            return lr * self.opt.lr_multiplier()
        if cfg.optimizer == 'mxnet-lbsgd' and cfg.warmup_strategy != 'lars':
            return lr * mx_lbsgd.warmup_multiplier(
                applied, cfg.warmup_epochs * self.steps_per_epoch, cfg.batch_scale,
                cfg.warmup_strategy)
        return lr

    def _scaled_lr(self, applied):
        """With lr_scaling: the scheduler's rate at the scale-invariant progress times the
        last update's gain (lbsgd's warmup rising to that gain)."""
        import mx_lbsgd
        from mx_lbsgd import schedules
        cfg, opt = self.cfg, self.opt
        gain = opt.last_gain
        if cfg.optimizer == 'lbsgd' and cfg.warmup_strategy in schedules.WARMUP_SHAPES \
                and cfg.warmup_epochs:
            gain = mx_lbsgd.warmup_multiplier(
                applied, cfg.warmup_epochs * self.steps_per_epoch, gain, cfg.warmup_strategy)
        return opt.learning_rate * gain

    def scaling_fields(self):
        """With lr_scaling: the last gain, the window length and the progress."""
        if self.cfg.lr_scaling is None:
            return {}
        return dict(gain=self.opt.last_gain, window=self.opt.batch_scale,
                    progress=self.opt.scale_invariant_steps)

    def step(self, xb, yb):
        """One forward/backward/update: (per-sample losses, logits, skipped, zero fraction,
        the OverflowReport of a skipped step or None)."""
        import mxnet as mx
        cfg, scale = self.cfg, self.scale
        with mx.autograd.record():
            out = self.net(xb).astype('float32')
            loss = self.loss_fn(out, yb)
            scaled = loss * scale if scale != 1.0 else loss
        scaled.backward()
        zero = _zero_fraction(self.params) if cfg.record_steps else None
        before = self.scaler.total_skipped if self.scaler is not None else 0
        self._update()
        skipped = self.scaler.total_skipped - before if self.scaler is not None else 0
        self.skipped += skipped
        self.step_count += 1
        report = self.reports.last_overflow if skipped and cfg.record_steps else None
        return loss, out, skipped, zero, report

    def epoch(self, epoch, steps, on_step):
        """Train one epoch; appends to `steps` if recording; returns the epoch's row."""
        import mxnet as mx
        cfg, bs = self.cfg, self.cfg.batch_size
        order = self.rng.permutation(self.shard)
        loss_sum, correct = mx.nd.zeros((1,)), mx.nd.zeros((1,))
        skipped_before = self.skipped
        for i in range(self.steps_per_epoch):
            idx = order[i * bs:(i + 1) * bs]
            xb, yb = mx.nd.array(self.x[idx]), mx.nd.array(self.y[idx])
            scale = self.scale
            loss, out, skipped, zero, report = self.step(xb, yb)
            loss_sum += loss.sum()
            correct += (out.argmax(axis=1) == yb).sum()
            row = dict(step=self.step_count, epoch=epoch)
            if cfg.record_steps:
                row.update(loss=float(loss.mean().asscalar()), lr=self.lr(), loss_scale=scale,
                           skipped=int(skipped), zero_grad_fraction=zero,
                           grad_norm=self.grad_norm(), **overflow_fields(report))
                row.update(self.scaling_fields())
                steps.append(row)
            if on_step is not None:
                on_step(row)
        seen = self.steps_per_epoch * bs
        row = dict(epoch=epoch, train_loss=float(loss_sum.asscalar()) / seen,
                   train_acc=float(correct.asscalar()) / seen,
                   test_acc=_accuracy(self.net, self.xt, self.yt), lr=self.lr(),
                   loss_scale=self.scale, skipped_steps=self.skipped - skipped_before,
                   **self.scaling_fields())
        if len(self.yv):
            row['val_acc'] = _accuracy(self.net, self.xv, self.yv)
        if self.noise is not None:
            self.noise.flush()      # per-epoch numbers that do not depend on the interval
        row.update({k: getattr(self.noise, k, None) for k in NOISE_SCALE_KEYS})
        if cfg.dtype == 'float16':
            row['underflow_fraction'] = probe_underflow(self.net, self.loss_fn, *self.probe,
                                                        scale=self.scale)
        return row


def _result(cfg, epochs, steps, wall, run):
    """The result dict: the summary.json keys (see mx_lbsgd_demo.summary) plus the history."""
    accs = [r['test_acc'] for r in epochs]
    best = int(np.nanargmax(accs)) if not all(math.isnan(a) for a in accs) else 0
    reach = next((r['epoch'] for r in epochs if r['test_acc'] >= cfg.target), None)
    config = dataclasses.asdict(cfg)
    config.update(lr=cfg.resolved_lr(), loss_scale=cfg.resolved_loss_scale(),
                  hidden=list(cfg.hidden))
    if cfg.batch_scale == 'auto':
        config['batch_scale_bounds'] = list(cfg.batch_scale_bounds or AUTO_BOUNDS)
    window = run.opt.batch_scale if cfg.batch_scale == 'auto' else cfg.batch_scale
    scaling = run.scaling_fields()
    out = dict(
        config=config, epochs=epochs, steps=steps, optimizer=cfg.optimizer,
        dtype=cfg.dtype, batch_size=cfg.batch_size, batch_scale=cfg.batch_scale,
        effective_batch_size=cfg.batch_size * window * run.workers,
        lr_scaling=cfg.lr_scaling, final_gain=scaling.get('gain'),
        progress=scaling.get('progress'), final_batch_scale=window,
        batch_history=(None if cfg.batch_scale != 'auto' else [
            dict(update=u, batch_scale=b, batch=cfg.batch_size * b * run.workers)
            for u, b in run.opt.window_history]),
        warmup_strategy=(cfg.warmup_strategy if cfg.optimizer in WARMUP_OPTIMIZERS
                         else 'linear' if cfg.warmup_from is not None else None),
        final_test_acc=accs[-1], best_test_acc=accs[best], best_epoch=best + 1,
        target_acc=cfg.target, epochs_to_target=reach, wall_time_s=wall,
        skipped_steps=run.skipped, total_steps=run.step_count, updates=run.applied_updates(),
        steps_per_epoch=run.steps_per_epoch, final_loss_scale=epochs[-1]['loss_scale'],
        train_samples=len(run.shard), test_samples=len(run.yt), rank=run.rank,
        num_workers=run.workers, noise_scale_interval=run.noise_interval,
        noise_scale_not_measured=run.noise_missing,
        noise_scale_updates=len(run.noise.history) if run.noise is not None else 0,
        overflow_top_offenders=run.top_offenders(), loss_scale_warnings=run.scale_warnings,
        **{'final_' + k: epochs[-1][k] for k in NOISE_SCALE_KEYS})
    if epochs and 'val_acc' in epochs[-1]:
        out['final_val_acc'] = epochs[-1]['val_acc']
    if epochs and 'underflow_fraction' in epochs[-1]:
        out['final_underflow_fraction'] = epochs[-1]['underflow_fraction']
    return out
