"""The digits training loop behind ``mx-lbsgd train`` and ``benchmarks/study.py``.

:func:`train` fits ``mx_lbsgd._models.mlp`` to scikit-learn's bundled 8x8 digits (or
their one-pixel shifts, :func:`load_data`) with a Gluon Trainer and returns the per-epoch
and per-step history; :func:`write_outputs` turns that, and optionally the result of a
:func:`baseline_config` run, into ``metrics.csv``, ``steps.csv`` (``baseline-*.csv``),
``summary.json`` and ``training.png``. ``mx-lbsgd train`` runs ``DEMO_DEFAULTS`` and its
baseline; ``--single`` runs TrainConfig's own defaults alone.

Conventions: ``batch_size`` is the micro-batch of one forward/backward pass (per worker
with a dist kvstore); ``lbsgd`` and ``mxnet-lbsgd`` sum ``batch_scale`` micro-batches per
update, so an update sees ``batch_size * batch_scale`` samples and the warmup takes the
learning rate from ``lr`` to ``lr * batch_scale``. The loss is Gluon's per-sample loss,
backward of its sum, ``trainer.step(samples)``. Each epoch drops the last partial batch.
"""
import csv
import dataclasses
import functools
import json
import math
import os
import platform
import time
from typing import Optional, Tuple, Union

import numpy as np

OPTIMIZERS = ('lbsgd', 'lssgd', 'sgd', 'mxnet-lbsgd', 'lars')
WARMUP_OPTIMIZERS = ('lbsgd', 'mxnet-lbsgd')     # the ones with warmup and batch_scale
#: Learning rate used when none is given (measured on digits, batch 32, momentum 0.9).
DEFAULT_LR = {'lbsgd': 0.05, 'lssgd': 0.05, 'sgd': 0.05, 'mxnet-lbsgd': 0.05, 'lars': 2.0}
DEFAULT_LARS_LR = 2.0       # lbsgd with warmup_strategy='lars' (trust ratio eta = 0.001)
PLOT_FILES = ('training.png',)
#: What ``mx-lbsgd train`` changes in TrainConfig's defaults (the defaults of ``--single``)
#: for its main run: an effective batch of 32 x 8 = 256 by accumulation, linear warmup
#: over 5 epochs, float16 weights with fp32 master copies and dynamic loss scaling.
#: batch_scale and warmup_epochs apply to lbsgd / mxnet-lbsgd only.
DEMO_DEFAULTS = dict(batch_scale=8, epochs=30, warmup_epochs=5.0, dtype='float16',
                     growth_interval=20)


class ConfigError(ValueError):
    """A configuration the optimizers or the trainer refuse (one-line message)."""


@dataclasses.dataclass
class TrainConfig:
    """Everything one run depends on (see the module docstring for the conventions)."""
    optimizer: str = 'lbsgd'
    warmup_strategy: str = 'linear'
    warmup_epochs: float = 1.0
    batch_size: int = 32
    batch_scale: int = 1
    epochs: int = 15
    lr: Optional[float] = None                 # None: DEFAULT_LR / DEFAULT_LARS_LR
    momentum: float = 0.9
    wd: float = 1e-4
    dtype: str = 'float32'
    loss_scale: Union[str, float, None] = None  # None: 'dynamic' for float16, else 'none'
    growth_interval: int = 100
    kvstore: Optional[str] = None
    seed: int = 0
    hidden: Tuple[int, ...] = (64, 64)
    target: float = 0.95
    test_fraction: float = 0.25
    record_steps: bool = True                  # steps history (one host read per step)
    dataset: str = 'digits'                    # or 'digits-shifted' (see load_data)
    val_fraction: float = 0.0                  # of the non-test images: validation split
    lr_decay: Optional[str] = None             # None or 'cosine' (to 0 at the last step)
    warmup_from: Optional[float] = None        # sgd/lssgd/lars: linear warmup from this lr
    hybridize: bool = True                     # Gluon hybridize(static_alloc=True)

    def resolved_lr(self):
        if self.lr is not None:
            return float(self.lr)
        if self.optimizer == 'lbsgd' and self.warmup_strategy == 'lars':
            return DEFAULT_LARS_LR
        return DEFAULT_LR[self.optimizer]

    def resolved_loss_scale(self):
        """'none', 'dynamic' or a float."""
        if self.loss_scale is None:
            return 'dynamic' if self.dtype == 'float16' else 'none'
        return self.loss_scale


@functools.lru_cache(maxsize=1)
def _raw_digits():
    from sklearn.datasets import load_digits as _load
    data = _load()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.float32)


def load_digits(seed=0, test_fraction=0.25):
    """(x_train, y_train, x_test, y_test): pixels / 16 as float32, labels as float32.

    The split is a permutation by `seed`; its first `test_fraction` is the test set."""
    x, y = _raw_digits()
    order = np.random.RandomState(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


DATASETS = ('digits', 'digits-shifted')
#: The 9 one-pixel shifts (dy, dx) of 'digits-shifted', the original first.
SHIFTS = tuple((dy, dx) for dy in (0, -1, 1) for dx in (0, -1, 1))


def _shifted(x, y):
    """x (n, 64) and y with every image also shifted by one pixel in each of the 8
    directions (zeros shifted in): 9 * n images, shift-major."""
    img = x.reshape(-1, 8, 8)
    out = []
    for dy, dx in SHIFTS:
        moved = np.zeros_like(img)
        ys, yd = (slice(max(dy, 0), 8 + min(dy, 0)), slice(max(-dy, 0), 8 + min(-dy, 0)))
        xs, xd = (slice(max(dx, 0), 8 + min(dx, 0)), slice(max(-dx, 0), 8 + min(-dx, 0)))
        moved[:, yd, xd] = img[:, ys, xs]
        out.append(moved.reshape(-1, 64))
    return np.concatenate(out), np.tile(y, len(SHIFTS))


def load_data(seed=0, test_fraction=0.25, val_fraction=0.0, dataset='digits'):
    """(x_train, y_train, x_val, y_val, x_test, y_test) of `dataset`.

    'digits': scikit-learn's 1,797 8x8 digits (load_digits; validation empty unless
    val_fraction > 0). 'digits-shifted': the same images split the same way by source
    image, then each split extended with the 8 one-pixel shifts of each of its images
    (9 times as many images; no source image is in two splits). The validation split is
    the first val_fraction of the non-test images."""
    if dataset not in DATASETS:
        raise ConfigError('dataset=%r is not supported; expected one of %r'
                          % (dataset, DATASETS))
    x, y, xt, yt = load_digits(seed, test_fraction)
    n_val = int(len(x) * val_fraction)
    xv, yv, x, y = x[:n_val], y[:n_val], x[n_val:], y[n_val:]
    if dataset == 'digits-shifted':
        (x, y), (xv, yv), (xt, yt) = _shifted(x, y), _shifted(xv, yv), _shifted(xt, yt)
    return x, y, xv, yv, xt, yt


def _make_scaler(cfg):
    """The DynamicLossScaler the run uses, or None for no loss scaling."""
    import mx_lbsgd
    mode = cfg.resolved_loss_scale()
    if mode == 'none':
        return None
    if mode == 'dynamic':
        return mx_lbsgd.DynamicLossScaler(growth_interval=cfg.growth_interval)
    return mx_lbsgd.DynamicLossScaler.static(float(mode))


def _make_optimizer(cfg, scaler, updates_per_epoch):
    """(optimizer, whether the optimizer itself applies `scaler`)."""
    import mxnet as mx
    import mx_lbsgd
    common = dict(learning_rate=cfg.resolved_lr(), momentum=cfg.momentum, wd=cfg.wd,
                  multi_precision=cfg.dtype == 'float16')
    sched = _scheduler(cfg, updates_per_epoch)
    if sched is not None:
        common['lr_scheduler'] = sched
    warm = dict(warmup_strategy=cfg.warmup_strategy, warmup_epochs=cfg.warmup_epochs,
                batch_scale=cfg.batch_scale, updates_per_epoch=updates_per_epoch,
                num_epochs=cfg.epochs)
    name = cfg.optimizer
    if name == 'lbsgd':
        return mx_lbsgd.LBSGD(loss_scaler=scaler, **warm, **common), True
    if name == 'lssgd':
        scaler = scaler or mx_lbsgd.DynamicLossScaler(enabled=False)
        return mx_lbsgd.LossScaledSGD(loss_scaler=scaler, **common), True
    if name == 'sgd':
        return mx.optimizer.SGD(**common), False
    if name == 'mxnet-lbsgd':
        return mx_lbsgd.MXNET_LBSGD(**warm, **common), False
    if name == 'lars':
        return mx.optimizer.LARS(eta=0.001, momentum_correction=False, **common), False
    raise ConfigError('optimizer=%r is not supported; expected one of %r'
                      % (name, OPTIMIZERS))


def _scheduler(cfg, steps_per_epoch):
    """The WarmupScheduler for cfg.lr_decay / cfg.warmup_from, or None. Its count is the
    optimizer's num_update: micro-batches for lbsgd (whose own warmup multiplies it),
    updates for the others (one per step, batch_scale being 1 there)."""
    import mx_lbsgd
    if cfg.lr_decay is None and cfg.warmup_from is None:
        return None
    warm = 0
    if cfg.warmup_from is not None:
        warm = int(round(cfg.warmup_epochs * steps_per_epoch))
    total = max(cfg.epochs * steps_per_epoch, warm + 1)
    return mx_lbsgd.WarmupScheduler(
        base_lr=cfg.resolved_lr(), warmup_steps=warm, strategy='linear',
        warmup_begin_lr=cfg.warmup_from if cfg.warmup_from is not None else 0.0,
        decay=cfg.lr_decay, max_update=total if cfg.lr_decay else None)


def _check(cfg):
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError('optimizer=%r is not supported; expected one of %r'
                          % (cfg.optimizer, OPTIMIZERS))
    if cfg.dtype not in ('float32', 'float16'):
        raise ConfigError("dtype=%r is not supported; expected 'float32' or 'float16'"
                          % (cfg.dtype,))
    if cfg.batch_scale != 1 and cfg.optimizer not in WARMUP_OPTIMIZERS:
        raise ConfigError('batch_scale=%d needs optimizer lbsgd or mxnet-lbsgd (got %s)'
                          % (cfg.batch_scale, cfg.optimizer))
    if cfg.warmup_from is not None and cfg.optimizer in WARMUP_OPTIMIZERS:
        raise ConfigError('warmup_from is for optimizers without a warmup of their own, '
                          'not %s' % cfg.optimizer)
    if cfg.lr_decay not in (None, 'cosine'):
        raise ConfigError("lr_decay=%r is not supported; expected None or 'cosine'"
                          % (cfg.lr_decay,))


HOROVOD_INSTALL = 'bash scripts/install_horovod.sh'


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
    _check(cfg)
    try:
        scaler = _make_scaler(cfg)
        opt, builtin = _make_optimizer(cfg, scaler, updates_per_epoch)
        if builtin:
            scaler = opt.loss_scaler if opt.loss_scaler is not None else None
            if scaler is not None and not scaler.enabled:
                scaler = None
        if kvstore == 'horovod':
            hvd = _horovod()
            hvd.broadcast_parameters(net.collect_params(), root_rank=0)
            trainer = hvd.DistributedTrainer(net.collect_params(), opt)
        else:
            trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=kvstore,
                                       update_on_kvstore=False if kvstore is not None else None)
        if kvstore not in (None, 'horovod') and 'dist' in kvstore.type:
            mx_lbsgd.init_kvstore(trainer, cfg.batch_size * kvstore.num_workers)
        hook = None
        if scaler is not None and not builtin:
            hook = mx_lbsgd.LossScaling(trainer, scaler, force=True)
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


def _lr_now(cfg, applied, steps_per_epoch, sched=None):
    """Scheduled learning rate after `applied` micro-batches (warmup for lbsgd-likes;
    for LARS the base lr, which each layer's trust ratio multiplies), times the
    lr_decay / warmup_from scheduler `sched` if any."""
    from mx_lbsgd.schedules import WARMUP_SHAPES, warmup_multiplier
    lr = sched(max(applied, 1)) if sched is not None else cfg.resolved_lr()
    if cfg.optimizer in WARMUP_OPTIMIZERS and cfg.warmup_strategy in WARMUP_SHAPES:
        return lr * warmup_multiplier(applied, cfg.warmup_epochs * steps_per_epoch,
                                      cfg.batch_scale, cfg.warmup_strategy)
    return lr


def train(cfg, on_start=None, on_step=None, on_epoch=None):
    """Run `cfg`; returns a result dict (config, history, summary numbers).

    Callbacks: on_start(dict(steps_per_epoch, epochs, rank, num_workers)) once the trainer
    is built, on_step(dict) after every step (only step and epoch unless
    cfg.record_steps), on_epoch(dict) after every epoch. ConfigError when the
    configuration is refused before training starts."""
    run = _Run(cfg)
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
    return _result(cfg, epochs, steps, time.perf_counter() - start, run)


class _Run:
    """Data, model, trainer and counters of one training run."""

    def __init__(self, cfg):
        import mxnet as mx
        from mx_lbsgd._models import mlp
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
        if self.steps_per_epoch < cfg.batch_scale or self.steps_per_epoch < 1:
            raise ConfigError('batch_size * batch_scale = %d is larger than the %d training '
                              'samples%s' % (cfg.batch_size * cfg.batch_scale, len(self.shard),
                                             ' of this worker' if self.workers > 1 else ''))
        self.net = mlp(tuple(cfg.hidden), dtype=cfg.dtype, seed=cfg.seed)
        if cfg.hybridize:
            self.net.hybridize(static_alloc=True)
        self.trainer, self.hook, self.scaler = build(cfg, self.net, self.steps_per_epoch, kv)
        self.sched = _scheduler(cfg, self.steps_per_epoch)
        self.params = [p for p in self.net.collect_params().values() if p.grad_req != 'null']
        self.loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        self.rng = np.random.RandomState(cfg.seed + 1)
        probe = self.shard[:cfg.batch_size]
        self.probe = mx.nd.array(self.x[probe]), mx.nd.array(self.y[probe])
        self.applied = self.skipped = self.step_count = 0

    @property
    def scale(self):
        return self.scaler.scale if self.scaler is not None else 1.0

    def lr(self):
        return _lr_now(self.cfg, self.applied, self.steps_per_epoch, self.sched)

    def step(self, xb, yb):
        """One forward/backward/update: (per-sample losses, logits, skipped, zero fraction)."""
        import mxnet as mx
        cfg, scale = self.cfg, self.scale
        with mx.autograd.record():
            out = self.net(xb).astype('float32')
            loss = self.loss_fn(out, yb)
            scaled = loss * scale if scale != 1.0 else loss
        scaled.backward()
        zero = _zero_fraction(self.params) if cfg.record_steps else None
        before = self.scaler.total_skipped if self.scaler is not None else 0
        if self.hook is not None:
            if cfg.optimizer == 'lars':
                self.hook.unscale()   # MXNet's LARS squares the (fp16) gradients as given
            self.hook.step(self.step_batch)
        else:
            self.trainer.step(self.step_batch)
        skipped = self.scaler.total_skipped - before if self.scaler is not None else 0
        self.skipped += skipped
        self.applied += 0 if skipped else 1
        if skipped and cfg.optimizer == 'lbsgd' and cfg.batch_scale > 1:
            # a skipped window: LBSGD uncounts its earlier micro-batches too
            self.applied = max(self.applied - (cfg.batch_scale - 1), 0)
        self.step_count += 1
        return loss, out, skipped, zero

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
            loss, out, skipped, zero = self.step(xb, yb)
            loss_sum += loss.sum()
            correct += (out.argmax(axis=1) == yb).sum()
            row = dict(step=self.step_count, epoch=epoch)
            if cfg.record_steps:
                row.update(loss=float(loss.mean().asscalar()), lr=self.lr(), loss_scale=scale,
                           skipped=int(skipped), zero_grad_fraction=zero)
                steps.append(row)
            if on_step is not None:
                on_step(row)
        seen = self.steps_per_epoch * bs
        row = dict(epoch=epoch, train_loss=float(loss_sum.asscalar()) / seen,
                   train_acc=float(correct.asscalar()) / seen,
                   test_acc=_accuracy(self.net, self.xt, self.yt), lr=self.lr(),
                   loss_scale=self.scale, skipped_steps=self.skipped - skipped_before)
        if len(self.yv):
            row['val_acc'] = _accuracy(self.net, self.xv, self.yv)
        if cfg.dtype == 'float16':
            row['underflow_fraction'] = probe_underflow(self.net, self.loss_fn, *self.probe,
                                                        scale=self.scale)
        return row


def _result(cfg, epochs, steps, wall, run):
    accs = [r['test_acc'] for r in epochs]
    best = int(np.nanargmax(accs)) if not all(math.isnan(a) for a in accs) else 0
    reach = next((r['epoch'] for r in epochs if r['test_acc'] >= cfg.target), None)
    config = dataclasses.asdict(cfg)
    config.update(lr=cfg.resolved_lr(), loss_scale=cfg.resolved_loss_scale(),
                  hidden=list(cfg.hidden))
    out = dict(config=config, epochs=epochs, steps=steps,
               final_test_acc=accs[-1], best_test_acc=accs[best], best_epoch=best + 1,
               target_acc=cfg.target, epochs_to_target=reach, wall_time_s=wall,
               skipped_steps=run.skipped, total_steps=run.step_count,
               steps_per_epoch=run.steps_per_epoch,
               effective_batch=cfg.batch_size * cfg.batch_scale * run.workers,
               final_loss_scale=epochs[-1]['loss_scale'], test_samples=len(run.yt),
               rank=run.rank, num_workers=run.workers)
    # the headline numbers under the names the summary documents
    out.update(effective_batch_size=out['effective_batch'], batch_size=cfg.batch_size,
               batch_scale=cfg.batch_scale, dtype=cfg.dtype, optimizer=cfg.optimizer,
               warmup_strategy=(cfg.warmup_strategy if cfg.optimizer in WARMUP_OPTIMIZERS
                                else 'linear' if cfg.warmup_from is not None else None),
               loss_scale=out['final_loss_scale'], test_accuracy=accs[-1],
               train_samples=len(run.shard), updates=_updates(cfg, run))
    if epochs and 'val_acc' in epochs[-1]:
        out['final_val_acc'] = epochs[-1]['val_acc']
    if epochs and 'underflow_fraction' in epochs[-1]:
        out['final_underflow_fraction'] = epochs[-1]['underflow_fraction']
    return out


def _updates(cfg, run):
    """Weight updates applied (micro-batches / batch_scale for the accumulating ones)."""
    per = cfg.batch_scale if cfg.optimizer in WARMUP_OPTIMIZERS else 1
    return run.step_count // per - run.skipped


def versions():
    """Versions of what the run depends on."""
    import matplotlib
    import mxnet as mx
    import sklearn
    import mx_lbsgd
    return dict(python=platform.python_version(), mxnet=mx.__version__,
                numpy=np.__version__, scikit_learn=sklearn.__version__,
                matplotlib=matplotlib.__version__, mx_lbsgd=mx_lbsgd.__version__,
                platform=platform.platform())


EPOCH_FIELDS = ('epoch', 'train_loss', 'train_acc', 'val_acc', 'test_acc', 'lr',
                'loss_scale', 'skipped_steps', 'seconds', 'underflow_fraction')
STEP_FIELDS = ('step', 'epoch', 'loss', 'lr', 'loss_scale', 'skipped', 'zero_grad_fraction')
#: What summary.json's ``baseline`` keeps of the baseline's result.
BASELINE_KEYS = ('optimizer', 'batch_size', 'batch_scale', 'effective_batch_size', 'dtype',
                 'warmup_strategy', 'loss_scale', 'skipped_steps', 'test_accuracy',
                 'final_test_acc', 'best_test_acc', 'best_epoch', 'epochs_to_target',
                 'wall_time_s', 'total_steps', 'updates', 'steps_per_epoch')


def baseline_config(cfg):
    """The baseline of the default run: `cfg`'s data, model, epochs and seed, trained the
    plain way: mx SGD with momentum, one micro-batch per update (cfg.batch_size), float32,
    no loss scaling, no warmup, the default lr."""
    return dataclasses.replace(
        cfg, optimizer='sgd', warmup_strategy='linear', batch_scale=1, lr=None,
        dtype='float32', loss_scale=None, kvstore=None, warmup_from=None, lr_decay=None)


def _write_csv(path, fields, rows):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ('' if row.get(k) is None else row.get(k)) for k in fields})


def _write_history(result, out_dir, prefix, paths):
    fields = [f for f in EPOCH_FIELDS if f in result['epochs'][0]]
    path = os.path.join(out_dir, prefix + 'metrics.csv')
    _write_csv(path, fields, result['epochs'])
    paths.append(path)
    if result['steps']:
        path = os.path.join(out_dir, prefix + 'steps.csv')
        _write_csv(path, STEP_FIELDS, result['steps'])
        paths.append(path)


def write_outputs(result, out_dir, argv=None, baseline=None):
    """Write metrics.csv, steps.csv (if recorded), summary.json and training.png into
    out_dir (created), and baseline-metrics.csv / baseline-steps.csv when `baseline` (the
    baseline run's result) is given; returns the list of paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    _write_history(result, out_dir, '', paths)
    if baseline is not None:
        _write_history(baseline, out_dir, 'baseline-', paths)
    for name in PLOT_FILES:
        path = os.path.join(out_dir, name)
        plot_training(result, path, baseline)
        paths.append(path)
    summary = {k: v for k, v in result.items() if k not in ('epochs', 'steps')}
    what = ('test accuracy per epoch, learning rate per step, loss scale per step '
            '(skipped steps: red x), train loss per epoch')
    summary.update(args=summary.pop('config'), argv=argv, versions=versions(),
                   plots={'training.png': 'one figure, 2x2 subplots: ' + what
                          + (' (main run and baseline)' if baseline else '')},
                   files=[os.path.basename(p) for p in paths] + ['summary.json'])
    if baseline is not None:
        summary['baseline'] = dict({k: baseline[k] for k in BASELINE_KEYS},
                                   args=baseline['config'])
    path = os.path.join(out_dir, 'summary.json')
    with open(path, 'w') as f:
        json.dump(summary, f, indent=1, default=_jsonable)
    paths.append(path)
    return paths


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError('not JSON serializable: %r' % (value,))


def describe(result):
    """One line: optimizer, dtype, batch (micro x scale), warmup, loss scaling."""
    cfg = result['config']
    text = '%s %s, batch %d' % (cfg['optimizer'], cfg['dtype'], cfg['batch_size'])
    if cfg['batch_scale'] > 1:
        text += ' x %d = %d' % (cfg['batch_scale'], result['effective_batch_size'])
    if result.get('warmup_strategy') == 'lars':
        text += ', LARS'
    elif result.get('warmup_strategy') and (cfg['batch_scale'] > 1
                                            or cfg.get('warmup_from') is not None):
        text += ', %s warmup %g ep' % (result['warmup_strategy'], cfg['warmup_epochs'])
    if cfg['loss_scale'] != 'none':
        text += ', loss scale %s' % cfg['loss_scale']
    return text + ', lr %g' % cfg['lr']


def _per_epoch(result):
    """x of each step in epochs (step k of an epoch of n ends at epoch - 1 + k / n)."""
    n = result['steps_per_epoch']
    return [r['step'] / n for r in result['steps']]


def plot_training(result, path, baseline=None):
    """One PNG with four panels: test accuracy, learning rate, loss scale, train loss;
    with `baseline`, both runs in the accuracy, learning rate and loss panels."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    runs = [(result, 'main: ' + describe(result), 'C0')]
    if baseline is not None:
        runs.append((baseline, 'baseline: ' + describe(baseline), 'C1'))
    cfg = result['config']
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    for res, label, color in runs:
        e = [r['epoch'] for r in res['epochs']]
        ax.plot(e, [r['test_acc'] for r in res['epochs']], 'o-', ms=3, color=color,
                label='%s (%.3f)' % (label.split(':')[0], res['final_test_acc']))
    if baseline is None:
        ax.plot(e, [r['train_acc'] for r in result['epochs']], '--', color='C2',
                label='train')
    ax.axhline(cfg['target'], color='gray', ls=':', label='target %.2f' % cfg['target'])
    low = min(min(r['test_acc'] for r in res['epochs']) for res, _, _ in runs)
    ax.set(title='test accuracy per epoch', xlabel='epoch', ylim=(max(0, min(low, 0.8)), 1.0))
    ax.legend(loc='lower right', fontsize=8)
    ax = axes[0, 1]
    for res, label, color in runs:
        if res['steps']:
            ax.plot(_per_epoch(res), [r['lr'] for r in res['steps']], color=color,
                    label=label.split(':')[0])
        else:
            ax.plot([r['epoch'] for r in res['epochs']], [r['lr'] for r in res['epochs']],
                    'o-', color=color, label=label.split(':')[0])
    if result['batch_scale'] > 1 and cfg['warmup_strategy'] != 'lars' and cfg['warmup_epochs']:
        ax.axvline(cfg['warmup_epochs'], color='gray', ls=':', label='end of warmup')
    ax.set(title='learning rate per update (scheduled)', xlabel='epoch', ylim=(0, None))
    ax.legend(loc='lower right', fontsize=8)
    ax = axes[1, 0]
    st = result['steps']
    if st:
        x = _per_epoch(result)
        ax.plot(x, [r['loss_scale'] for r in st], color='C0', label='loss scale (main)')
        bad = [(xi, r['loss_scale']) for xi, r in zip(x, st) if r['skipped']]
        if bad:
            ax.plot(*zip(*bad), 'rx', ms=8, label='skipped step (%d)' % len(bad))
    else:
        ax.plot([r['epoch'] for r in result['epochs']],
                [r['loss_scale'] for r in result['epochs']], 'o-', label='loss scale (main)')
    ax.set_yscale('log', base=2)
    title = 'loss scale (%s)' % cfg['loss_scale']
    if 'final_underflow_fraction' in result:
        title += ', fp16 gradient underflow %.2f%%' % (100 * result['final_underflow_fraction'])
    ax.set(title=title, xlabel='epoch')
    ax.legend(loc='best', fontsize=8)
    ax = axes[1, 1]
    for res, label, color in runs:
        ax.plot([r['epoch'] for r in res['epochs']], [r['train_loss'] for r in res['epochs']],
                'o-', ms=3, color=color, label=label.split(':')[0])
    ax.set_yscale('log')
    ax.set(title='train loss per epoch', xlabel='epoch')
    ax.legend(loc='upper right', fontsize=8)
    lines = ['%s: test acc %.3f' % (label, res['final_test_acc']) for res, label, _ in runs]
    fig.suptitle('\n'.join(lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _run_one(cfg):
    """train(cfg) without the per-step history (picklable worker for run_many)."""
    result = train(cfg)
    result['steps'] = []
    return result


def _exit_with_parent(parent):
    """Pool worker initializer: exit once the parent is gone (a SIGTERM to `mx-lbsgd study`
    would otherwise leave its workers training on, reparented, for as long as the run)."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def run_many(configs, jobs=1, on_result=None):
    """Results of train(cfg) for each config, in order. jobs > 1 runs them in that many
    spawned processes with OMP_NUM_THREADS=1 (MXNet's OpenMP threads spin and crawl when
    the cores are oversubscribed). on_result(index, result) is called as each finishes."""
    configs = list(configs)
    results = [None] * len(configs)
    if jobs <= 1:
        for i, cfg in enumerate(configs):
            results[i] = _run_one(cfg)
            if on_result is not None:
                on_result(i, results[i])
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    saved = os.environ.get('OMP_NUM_THREADS')
    os.environ['OMP_NUM_THREADS'] = '1'
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context('spawn'),
                                 initializer=_exit_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_run_one, cfg): i for i, cfg in enumerate(configs)}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if on_result is not None:
                    on_result(i, results[i])
    finally:
        if saved is None:
            del os.environ['OMP_NUM_THREADS']
        else:
            os.environ['OMP_NUM_THREADS'] = saved
    return results
