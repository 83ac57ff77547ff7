"""One worker of tests/test_hook_distributed.py: the LossScaling hook over Horovod's
DistributedTrainer (cfg engine 'horovod') or a Trainer on a dist_sync kvstore ('dist_sync'),
unscale() and clip_global_norm() on this worker's shard; writes what the gradients held
after unscale(), the norms and the weights to OUT/rank<r>.npz."""
import json
import os
import sys
import weakref

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from harness import digits, mlp
from sparse_dist_worker import end_dist_worker


def main(cfg, out):
    """Train and save; a weakref to the kvstore of a dist job (for `end_dist_worker`)."""
    x_all, y_all, _, _ = digits()
    net = mlp(hidden=16)
    params = net.collect_params()
    sgd = dict(learning_rate=0.1, momentum=0.9)
    if cfg['engine'] == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        mx_lbsgd.distributed.broadcast_parameters(params, root_rank=0)
        trainer = hvd.DistributedTrainer(params, 'sgd', sgd)
        step_batch = cfg['batch'] // size        # Horovod's convention: this worker's batch
    else:
        kv = mx.kv.create('dist_sync')
        rank, size = kv.rank, kv.num_workers
        trainer = gluon.Trainer(params, 'sgd', sgd, kvstore=kv, update_on_kvstore=False)
        step_batch = cfg['batch']                # dist_sync: the batch of all workers
        mx_lbsgd.init_kvstore(trainer, step_batch)
    scaling = mx_lbsgd.LossScaling(trainer, cfg['scale'], force=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    record = {}
    per_rank = cfg['batch'] // size
    for step in range(cfg['steps']):
        lo = step * cfg['batch'] + rank * per_rank
        x, y = nd.array(x_all[lo:lo + per_rank]), nd.array(y_all[lo:lo + per_rank])
        with autograd.record():
            loss = scaling.scale_loss(loss_fn(net(x), y))
        loss.backward()
        scaling.unscale()
        for i, p in enumerate(params.values()):
            record['grad%d_%d' % (step, i)] = p.grad().asnumpy()
        if cfg['clip']:
            record['norm%d' % step] = scaling.clip_global_norm(cfg['clip']).asnumpy()
        assert scaling.step(step_batch)
    for i, p in enumerate(params.values()):
        record['weight%d' % i] = p.data().asnumpy()
    record['mean_factor'] = np.array(mx_lbsgd._compat.reduced_gradient_mean_factor(trainer))
    np.savez(os.path.join(out, 'rank%d.npz' % rank), **record)
    mx.nd.waitall()
    return weakref.ref(kv) if cfg['engine'] != 'horovod' else None


if __name__ == '__main__':
    KV_REF = main(json.loads(sys.argv[1]), sys.argv[2])
    if KV_REF is not None:      # once main's frame is gone: see end_dist_worker
        end_dist_worker(KV_REF)
