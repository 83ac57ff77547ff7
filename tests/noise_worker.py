"""The gradient-noise-scale problem with an exact answer, for tests/test_noise_scale.py.

Per-example loss 1/2 |w - x_i|^2 with x_i ~ N(mu, sigma^2 I_d): the per-example gradient is
w - x_i, so tr(Sigma) = d sigma^2 and |G|^2 = |w - mu|^2, and B_simple = d sigma^2 / |w - mu|^2.
The learning rate is tiny, so w (and the truth) stays put.

    python tests/noise_worker.py CONFIG_JSON OUT_DIR      # a dist_sync or Horovod worker

Config: kvstore (None, 'device', 'dist_sync', 'horovod'), devices, batch (per device),
batch_scale, updates, seed, optimizer, lr_scaling (the optimizer's), sharded (Horovod:
mx_lbsgd.ShardedTrainer). Each worker writes rankR.json with the monitor's estimates, the
optimizer's gain and progress, and the truth (with AdaScale's exact r at the job's scale);
uneven (rank r's batch is batch + r * uneven). batch_scale 'auto' (with bounds and
interval): the worker runs `updates` applied updates and also writes the window length of
every update and its own host seconds per update.
"""
import json
import os
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd

D, SIGMA, G2 = 1024, 1.0, 32.0          # B_simple = 1024 / 32 = 32


def truth(base_batch=1.0, scale=1.0):
    sigma2 = D * SIGMA ** 2 / base_batch
    return dict(trace_sigma=D * SIGMA ** 2, gradient_sq=G2, b_simple=D * SIGMA ** 2 / G2,
                gain=(sigma2 + G2) / (sigma2 / scale + G2))


def run(cfg, rank=0, hvd=None, kvstore=None):
    ctxs = [mx.cpu(i) for i in range(cfg.get('devices', 1))]
    mu = np.zeros(D)
    w0 = np.full(D, np.sqrt(G2 / D))
    # a ShardedTrainer needs a parameter per rank: w in two halves (the same problem)
    halves = 2 if cfg.get('sharded') else 1
    params = [gluon.Parameter('w%d_weight' % h, shape=(D // halves,)) for h in range(halves)]
    for h, param in enumerate(params):
        param.initialize(ctx=ctxs)
        param.set_data(nd.array(np.split(w0, halves)[h]))
    args = dict(learning_rate=1e-9, batch_scale=cfg.get('batch_scale', 1))
    auto = args['batch_scale'] == 'auto'
    if auto:
        args.update(batch_scale_bounds=tuple(cfg['bounds']),
                    batch_scale_interval=cfg.get('interval', 4))
    if cfg.get('optimizer', 'lbsgd') == 'lbsgd':
        args['momentum'] = 0.0
    if cfg.get('lr_scaling'):
        args['lr_scaling'] = cfg['lr_scaling']
    if hvd is not None:
        make = mx_lbsgd.ShardedTrainer if cfg.get('sharded') else hvd.DistributedTrainer
        trainer = make(params, cfg.get('optimizer', 'lbsgd'), args)
    else:
        kvstore = kvstore or cfg.get('kvstore')
        trainer = gluon.Trainer(params, cfg.get('optimizer', 'lbsgd'), args, kvstore=kvstore,
                                update_on_kvstore=False if kvstore else None)
    monitor = None if auto else mx_lbsgd.GradientNoiseScale(
        trainer, interval=cfg.get('interval', 10), smoothing=cfg.get('smoothing', 0.99))
    rng = np.random.RandomState(cfg.get('seed', 0) + 1000 * rank)
    batch = cfg['batch'] + rank * cfg.get('uneven', 0)    # 'uneven': rank r takes r more
    # as the README: a dist_* kvstore's step takes the job's batch, Horovod's the worker's
    workers = kvstore.num_workers if 'dist' in getattr(kvstore, 'type', '') else 1
    size = workers
    if hvd is not None:
        import horovod.mxnet      # (hvd may be a namespace holding a DistributedTrainer only)
        size = horovod.mxnet.size()
    windows, seconds, last = [], [], time.perf_counter()
    micro_batches = 0
    while (len(windows) if auto else micro_batches) < cfg['updates'] * (
            1 if auto else args['batch_scale']):
        with autograd.record():
            losses = [0.5 * ((nd.concat(*[p.data(c) for p in params], dim=0)
                              - nd.array(rng.normal(mu, SIGMA, (batch, D)), ctx=c)) ** 2).sum()
                      for c in ctxs]
        autograd.backward(losses)
        trainer.step(batch * len(ctxs) * workers)
        micro_batches += 1
        if auto and trainer.optimizer.window_position == 0:
            windows.append(trainer.optimizer.batch_scale)     # the window just applied
            now = time.perf_counter()
            seconds.append(now - last)
            last = now
    mx.nd.waitall()     # a dist_sync worker must not exit with reductions in flight
    opt = trainer.optimizer
    if auto:
        chosen = opt._pieces.lr_gain.chooser.state
        return dict(windows=windows, seconds=seconds, history=opt.window_history,
                    timings=[(t.length, t.count, t.seconds) for t in chosen.timings],
                    gain=opt.last_gain, progress=opt.scale_invariant_steps,
                    noise_scale=opt._pieces.lr_gain.piece.state.moments.noise_scale,
                    truth=truth(batch * len(ctxs), size))
    monitor.flush()
    return dict(b_simple=monitor.b_simple, gradient_sq=monitor.gradient_sq,
                trace_sigma=monitor.trace_sigma, b_small=monitor.b_small, b_big=monitor.b_big,
                reads=len(monitor.history), gain=opt.last_gain,
                progress=opt.scale_invariant_steps, updates=cfg['updates'],
                truth=truth(batch * len(ctxs), args['batch_scale'] * size))


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    hvd = kv = None
    if cfg.get('kvstore') == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        rank = hvd.rank()
    else:
        kv = mx.kv.create(cfg['kvstore'])
        rank = kv.rank
    result = run(cfg, rank, hvd, kv)
    with open(os.path.join(out, 'rank%d.json' % rank), 'w') as f:
        json.dump(result, f)


if __name__ == '__main__':
    main()
