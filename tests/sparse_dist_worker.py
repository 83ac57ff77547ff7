"""A Gluon embedding model with row_sparse weights (``gluon.contrib.nn.SparseEmbedding``)
trained on a kvstore: in-process (the reference, kvstore 'local' with the global batch) or
as a worker of a ``dist_sync`` job started by `mx_lbsgd.launch`.

    python tests/sparse_dist_worker.py CONFIG_JSON OUT_DIR

CONFIG_JSON: {'optimizer': name, 'params': {...}, 'kvstore': 'local' | 'dist_sync' | ...,
'dense': bool (``Embedding(sparse_grad=True)`` instead: dense weights), 'api': 'gluon'
(default) or 'module' (``sym.Embedding(sparse_grad=True)``, dense weights)}. Step s uses 16
samples of rows 0..19 of a 50-row table; worker r of n trains on its 16/n of them. Writes
``rank<r>.npy``: the whole table after 6 steps; a ValueError exits 3 with one line.

A dist worker ends with `end_dist_worker` (no kvstore operation in flight, the kvstore
freed while MXNet is fully alive: see there), and prints its Python stacks on SIGUSR1.
"""
import faulthandler
import gc
import json
import os
import signal
import sys
import weakref

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


def end_dist_worker(kv_ref):
    """End a dist worker's part of the job in an order that does not depend on how the
    interpreter exits. `kv_ref`: a weakref to the kvstore, called once the function that
    trained has returned (its frame, and any snapshot of its locals, gone: mx_lbsgd reads
    its callers' ``f_locals`` while it checks an optimizer, and in Python 3.11 that
    snapshot keeps ``kv`` alive after a ``del kv`` in the same function); it is freed here.

    1. ``mx.nd.waitall()``: the last step's dense pushpulls can still be in flight when
       the table's pull returns (ps-lite's log shows their answers arriving after the
       script ended). At interpreter exit MXNet's atexit hook (``_notify_shutdown``) puts
       the engine in its shutdown phase, where an operation that has not started is never
       run (``ThreadedEngine::ExecuteOprBlock``); a push dropped there leaves the servers'
       synchronous round open, and every process of the job then waits forever (a worker
       that exits right after ``kv.push`` does that every time). After the wait nothing is
       left for the shutdown to drop.
    2. ``gc.collect()``: the kvstore is held by a reference cycle (a Gluon
       Trainer and its Parameters point at each other), so without this it is freed only by
       the garbage collection of interpreter finalization, after that shutdown hook, if at
       all. Its destructor is the job's exit protocol (``~KVStoreDist``: a barrier of the
       workers, rank 0 stops the servers, ``ps::Finalize``'s barrier of every node); here it
       runs at once, with the engine and the interpreter alive."""
    mx.nd.waitall()
    gc.collect()
    if kv_ref() is not None:
        raise RuntimeError('the kvstore is still referenced; it would be freed (and ps-lite '
                           'finalized) only at interpreter exit: %r'
                           % [type(r).__name__ for r in gc.get_referrers(kv_ref())])


def main():
    """Train and save; a weakref to the kvstore of a dist job (for `end_dist_worker`)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1`: the stacks
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    kv = mx.kv.create(cfg['kvstore'])
    rank = kv.rank
    run = train_module if cfg.get('api') == 'module' else train
    try:
        _, after = run(cfg, kv, rank, kv.num_workers)
    except ValueError as err:
        print('rank %d ValueError: %s' % (rank, err), flush=True)
        sys.exit(3)
    np.save(os.path.join(out, 'rank%d.npy' % rank), after)
    print('rank %d done' % rank, flush=True)
    return weakref.ref(kv) if 'dist' in kv.type else None


if __name__ == '__main__':
    KV_REF = main()
    if KV_REF is not None:
        end_dist_worker(KV_REF)
