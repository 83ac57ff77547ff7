"""A Gluon embedding model with row_sparse weights (``gluon.contrib.nn.SparseEmbedding``)
trained on a kvstore: in-process (the reference, kvstore 'local' with the global batch) or
as a worker of a ``dist_sync`` job started by `mx_lbsgd.launch`.

    python tests/sparse_dist_worker.py CONFIG_JSON OUT_DIR

CONFIG_JSON: {'optimizer': name, 'params': {...}, 'kvstore': 'local' | 'dist_sync' | ...,
'dense': bool (``Embedding(sparse_grad=True)`` instead: dense weights), 'api': 'gluon'
(default) or 'module' (``sym.Embedding(sparse_grad=True)``, dense weights)}. Step s uses 16
samples of rows 0..19 of a 50-row table; worker r of n trains on its 16/n of them. Writes
``rank<r>.npy``: the whole table after 6 steps; a ValueError exits 3 with one line.
"""
import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mx_lbsgd  # noqa: E402,F401  (registers 'lbsgd')

ROWS, BATCH, STEPS = 50, 16, 6


def table(emb):
    if emb._stype == 'row_sparse':
        return emb.row_sparse_data(nd.arange(ROWS)).asnumpy()
    return emb.data().asnumpy()


def train(cfg, kv, rank=0, num_workers=1):
    """The embedding table before and after training."""
    mx.random.seed(0)
    net = gluon.nn.Sequential()      # SparseEmbedding is not a HybridBlock
    net.add(gluon.nn.Embedding(ROWS, 4, sparse_grad=True) if cfg.get('dense')
            else gluon.contrib.nn.SparseEmbedding(ROWS, 4), gluon.nn.Dense(1, in_units=4))
    net.initialize(mx.init.Uniform(0.5))
    # rescale_grad fixed up front: dist_sync updates on the servers (step(1) keeps it)
    params = dict(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=1.0 / BATCH,
                  **cfg['params'])
    trainer = gluon.Trainer(net.collect_params(), cfg['optimizer'], params, kvstore=kv)
    emb = list(net.collect_params().values())[0]
    before = table(emb) if not cfg.get('dense') else None
    rng = np.random.RandomState(1)
    share = BATCH // num_workers
    for _ in range(STEPS):
        x = rng.randint(0, 20, BATCH)[rank * share:(rank + 1) * share]
        y = rng.uniform(-1, 1, BATCH)[rank * share:(rank + 1) * share]
        with autograd.record():
            loss = (net(nd.array(x)).reshape((-1,)) - nd.array(y)) ** 2
        loss.backward()
        trainer.step(1)
    return before, table(emb)


def train_module(cfg, kv, rank=0, num_workers=1):
    data = mx.sym.Variable('data')
    emb = mx.sym.Embedding(data, input_dim=ROWS, output_dim=4, sparse_grad=True, name='emb')
    out = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(emb, num_hidden=1, name='fc'),
                                        name='lro')
    share = BATCH // num_workers
    mod = mx.mod.Module(out, data_names=['data'], label_names=['lro_label'])
    mod.bind([('data', (share,))], [('lro_label', (share, 1))])
    mx.random.seed(0)
    mod.init_params(mx.init.Uniform(0.5))
    mod.init_optimizer(kvstore=kv, optimizer=cfg['optimizer'], optimizer_params=dict(
        learning_rate=0.1, rescale_grad=1.0 / BATCH, **cfg['params']))
    rng = np.random.RandomState(1)
    for _ in range(STEPS):
        x = rng.randint(0, 20, BATCH)[rank * share:(rank + 1) * share]
        y = rng.uniform(-1, 1, (BATCH, 1))[rank * share:(rank + 1) * share]
        mod.forward_backward(mx.io.DataBatch([nd.array(x)], [nd.array(y)]))
        mod.update()
    return None, mod.get_params()[0]['emb_weight'].asnumpy()


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    kv = mx.kv.create(cfg['kvstore'])
    run = train_module if cfg.get('api') == 'module' else train
    try:
        _, after = run(cfg, kv, kv.rank, kv.num_workers)
    except ValueError as err:
        print('rank %d ValueError: %s' % (kv.rank, err), flush=True)
        sys.exit(3)
    np.save(os.path.join(out, 'rank%d.npy' % kv.rank), after)
    print('rank %d done' % kv.rank, flush=True)


if __name__ == '__main__':
    main()
