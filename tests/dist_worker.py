"""Training used by the kvstore tests: run in-process (the reference, local/device kvstores)
or as a worker of a `dist_sync` job started by `mx_lbsgd.launch`.

    python tests/dist_worker.py CONFIG_JSON OUT_DIR

A config names the API ('gluon' or 'module'), kvstore, update_on_kvstore, optimizer and its
parameters, steps, the per-worker batch, contexts per worker and `inject` ({step: rank}: that
rank writes inf into one gradient after backward). Worker r of n trains on samples
[s*n*b + r*b, s*n*b + (r+1)*b) at step s, so n workers of batch b see what one process of
batch n*b sees. Each worker saves its weights, loss scales and skip flags.
"""
import copy
import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mx_lbsgd  # noqa: E402
from harness import digits, mlp  # noqa: E402

X, Y, _, _ = digits()


def _optimizer_params(cfg):
    params = dict(learning_rate=0.1, momentum=0.9, wd=1e-4, **copy.deepcopy(cfg['params']))
    if 'loss_scaler' in params:
        params['loss_scaler'] = mx_lbsgd.DynamicLossScaler(**params['loss_scaler'])
    return params


def _shard(step, rank, num_workers, batch):
    start = (step * num_workers + rank) * batch
    return X[start:start + batch], Y[start:start + batch]


def _gluon(cfg, kv, rank, num_workers, contexts):
    net = mlp()
    if len(contexts) > 1:
        net.collect_params().reset_ctx(contexts)
    trainer = gluon.Trainer(net.collect_params(), cfg['optimizer'], _optimizer_params(cfg),
                            kvstore=kv, update_on_kvstore=cfg.get('update_on_kvstore'))
    if kv is not None:
        mx_lbsgd.init_kvstore(trainer, cfg['batch'] * num_workers)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    record = []
    for step in range(cfg['steps']):
        x, y = _shard(step, rank, num_workers, cfg['batch'])
        opt = trainer._optimizer
        scale = opt.loss_scaler.scale if getattr(opt, 'loss_scaler', None) else 1.0
        xs = gluon.utils.split_and_load(nd.array(x), contexts)
        ys = gluon.utils.split_and_load(nd.array(y), contexts)
        with autograd.record():
            losses = [loss_fn(net(a), b) * scale for a, b in zip(xs, ys)]
        autograd.backward(losses)
        if cfg.get('inject', {}).get(str(step)) == rank:
            list(net.collect_params().values())[1].list_grad()[-1][:] = np.inf
        trainer.step(cfg['batch'] * num_workers)
        record.append(_scale_record(trainer._optimizer))
    weights = {p.name.split('_', 1)[1]: p.data(contexts[0]).asnumpy()
               for p in net.collect_params().values()}
    return weights, record


def _scale_record(opt):
    scaler = getattr(opt, 'loss_scaler', None)
    return (scaler.scale, bool(opt.last_step_skipped)) if scaler else (1.0, False)


def _module(cfg, kv, rank, num_workers, contexts):
    data = mx.sym.Variable('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name='fc1'), 'relu')
    out = mx.sym.FullyConnected(h, num_hidden=10, name='fc2')
    if cfg['optimizer'] == 'lssgd':
        out = mx_lbsgd.scale_gradient(out)
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(out, name='softmax'), context=contexts)
    batch = cfg['batch']
    mod.bind([('data', (batch, 64))], [('softmax_label', (batch,))])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore=kv, optimizer=cfg['optimizer'],
                       optimizer_params=_optimizer_params(cfg))
    record = []
    for step in range(cfg['steps']):
        x, y = _shard(step, rank, num_workers, batch)
        mod.forward_backward(mx.io.DataBatch([nd.array(x)], [nd.array(y)]))
        if cfg.get('inject', {}).get(str(step)) == rank:
            mod._exec_group.grad_arrays[0][-1][:] = np.inf
        mod.update()
        record.append(_scale_record(mod._optimizer))
    weights = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    return weights, record


def train(cfg, kv=None, rank=0, num_workers=1):
    """Weights (by name) and [(loss scale, skipped)] per step."""
    contexts = [mx.cpu(i) for i in range(cfg.get('contexts', 1))]
    run = _gluon if cfg['api'] == 'gluon' else _module
    return run(cfg, kv, rank, num_workers, contexts)


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    if cfg.get('module_update_on_kvstore') is not None:
        os.environ['MXNET_UPDATE_ON_KVSTORE'] = str(int(cfg['module_update_on_kvstore']))
    kv = mx.kv.create(cfg['kvstore'])
    weights, record = train(cfg, kv, kv.rank, kv.num_workers)
    np.savez(os.path.join(out, 'rank%d.npz' % kv.rank), record=np.array(record, dtype=float),
             **weights)
    print('rank %d done' % kv.rank)


if __name__ == '__main__':
    main()
