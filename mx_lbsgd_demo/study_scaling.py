"""Scale rules: a schedule tuned at the base batch, run unchanged at larger batches.

    python -m mx_lbsgd_bench.bench_lr_scaling [--epochs 12]      (runs these)

After Johnson et al., "AdaScale SGD" (ICML 2020): the learning rate and its schedule are
tuned for the base batch b = 32 on one worker (lr 0.05, momentum 0.9, wd 1e-4, the lr
divided by 10 at 50% and 75% of T base iterations, T = --epochs epochs at b). At scale S
(batch S b: `batch_scale` = S micro-batches of b) each rule runs with the same schedule,
no warmup, until its scale-invariant progress (`scale_invariant_steps`, what the scheduler
sees) reaches T:

  adascale  lr x r per update, progress += r (AdaScale's gain from the noise estimates)
  linear    lr x S per update, progress += S (T / S updates: the same epochs)

and the final test accuracy, updates, examples and the last gain go into the table next
to the base run's. Data: 'digits-shifted' (no download); model: the (64, 64) MLP.
"""
import math
import time

__all__ = ['RULES', 'run_scale_rule']

RULES = ('adascale', 'linear')
BASE_BATCH = 32
BASE_LR = 0.05


def _schedule(total):
    import mxnet as mx
    return mx.lr_scheduler.MultiFactorScheduler(
        step=[int(total * 0.5), int(total * 0.75)], factor=0.1, base_lr=BASE_LR)


def run_scale_rule(spec):
    """Train one run of the experiment. spec: rule (None: the base run), scale, epochs,
    seed, dataset. Returns dict(rule, scale, test_acc, updates, examples, progress,
    last_gain, gains [(update, gain)], curve [(progress, test_acc)], wall_time_s)."""
    import mxnet as mx
    import numpy as np
    import mx_lbsgd
    from .data import load_data
    from .models import mlp
    start = time.perf_counter()
    x, y, _, _, xt, yt = load_data(0, 0.25, 0.0, spec['dataset'])
    total = spec['epochs'] * (len(x) // BASE_BATCH)
    scale = spec['scale'] if spec['rule'] else 1
    net = mlp((64, 64), seed=spec['seed'])
    net.hybridize(static_alloc=True)
    trainer = mx.gluon.Trainer(net.collect_params(), mx_lbsgd.LBSGD(
        learning_rate=BASE_LR, momentum=0.9, wd=1e-4, batch_scale=scale, warmup_epochs=0,
        lr_scheduler=_schedule(total), lr_scaling=spec['rule'] or 'linear'))
    opt = trainer.optimizer
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    x_all, y_all, x_test = mx.nd.array(x), mx.nd.array(y), mx.nd.array(xt)
    rng = np.random.RandomState(spec['seed'] + 1)
    order, pos = rng.permutation(len(x)), 0

    def accuracy():
        return float(np.mean(net(x_test).argmax(axis=1).asnumpy() == yt))

    out = dict(rule=spec['rule'], scale=scale, gains=[], curve=[])
    updates, next_read = 0, 0.0
    while opt.scale_invariant_steps < total:
        for _ in range(scale):
            if pos + BASE_BATCH > len(order):
                order, pos = rng.permutation(len(x)), 0
            idx = mx.nd.array(order[pos:pos + BASE_BATCH], dtype='int64')
            pos += BASE_BATCH
            with mx.autograd.record():
                loss = loss_fn(net(x_all.take(idx)), y_all.take(idx))
            loss.backward()
            trainer.step(BASE_BATCH)
        updates += 1
        if updates % 10 == 0:
            out['gains'].append((updates, opt.last_gain))
        if opt.scale_invariant_steps >= next_read:
            next_read += total / 20
            out['curve'].append((opt.scale_invariant_steps, accuracy()))
    acc = accuracy()
    out['curve'].append((opt.scale_invariant_steps, acc))
    out.update(test_acc=acc, updates=updates, examples=updates * scale * BASE_BATCH,
               progress=opt.scale_invariant_steps, last_gain=opt.last_gain,
               diverged=not math.isfinite(float(loss.mean().asscalar())),
               wall_time_s=time.perf_counter() - start)
    return out
