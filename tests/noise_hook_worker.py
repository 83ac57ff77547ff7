"""tests/noise_worker.py's problem under the `LossScaling` hook, on a dist_sync worker or a
Horovod rank, each stepping as the README's recipe for its engine does (the hook's
``step(batch)`` takes the job's batch on a dist kvstore, the worker's under Horovod)::

    python -m mx_lbsgd.launch -n 2 -- python tests/noise_hook_worker.py CONFIG_JSON OUT_DIR
    horovodrun --gloo -np 2 -H localhost:2 python tests/noise_hook_worker.py CONFIG_JSON OUT

Config: kvstore ('dist_sync' or 'horovod'), batch, updates, scale (a static loss scale),
unscale (call the hook's unscale() before its step, as before clipping). Each worker writes
rankR.json with the monitor's estimates and the truth.
"""
import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from noise_worker import D, G2, SIGMA, truth


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    param = gluon.Parameter('w_weight', shape=(D,))
    param.initialize(ctx=mx.cpu())
    param.set_data(nd.full((D,), np.sqrt(G2 / D)))
    args = dict(learning_rate=1e-9, momentum=0.0)
    if cfg['kvstore'] == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        rank, workers = hvd.rank(), hvd.size()
        trainer = hvd.DistributedTrainer([param], 'lbsgd', args)
        step_batch = cfg['batch']
    else:
        kv = mx.kv.create(cfg['kvstore'])
        rank, workers = kv.rank, kv.num_workers
        trainer = gluon.Trainer([param], 'lbsgd', args, kvstore=kv, update_on_kvstore=False)
        step_batch = cfg['batch'] * workers
        mx_lbsgd.init_kvstore(trainer, step_batch)
    scaling = mx_lbsgd.LossScaling(trainer, float(cfg['scale']), force=True)
    monitor = mx_lbsgd.GradientNoiseScale(trainer, interval=10, smoothing=0.99)
    rng = np.random.RandomState(1000 * rank)
    for _ in range(cfg['updates']):
        x = nd.array(rng.normal(0.0, SIGMA, (cfg['batch'], D)))
        with autograd.record():
            loss = scaling.scale_loss(0.5 * ((param.data() - x) ** 2).sum())
        loss.backward()
        if cfg.get('unscale'):
            scaling.unscale()
        assert scaling.step(step_batch)
    mx.nd.waitall()     # a dist_sync worker must not exit with reductions in flight
    monitor.flush()
    result = dict(b_simple=monitor.b_simple, gradient_sq=monitor.gradient_sq,
                  trace_sigma=monitor.trace_sigma, b_small=monitor.b_small,
                  b_big=monitor.b_big, reads=len(monitor.history), workers=workers,
                  truth=truth())
    with open(os.path.join(out, 'rank%d.json' % rank), 'w') as f:
        json.dump(result, f)


if __name__ == '__main__':
    main()
