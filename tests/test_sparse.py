"""Sparse gradients and storage fallback: MXNet 1.9.1's own SGD test grid with LBSGD in
place of SGD, row_sparse gradients against mx.optimizer.SGD and a numpy lazy reference."""
import io
import itertools
import json
import os
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.test_utils import compare_optimizer

import mx_lbsgd
import sparse_dist_worker
from mx_lbsgd.launch import launch
from reference import NumpySGD, lazy_sgd_rows
from reference import lars_factor

pytestmark = [pytest.mark.unit, pytest.mark.pipeline]

# MXNet 1.9.1 tests/python/unittest/test_optimizer.py::test_sgd, as data
OPTIONS = [[{}, {'momentum': 0.9}],
           [{}, {'clip_gradient': 0.4}, {'clip_gradient': 0.5}],
           [{}, {'rescale_grad': 0.14}, {'rescale_grad': 0.8}],
           [{}, {'wd': 0.03}, {'wd': 0.05}, {'wd': 0.07}],
           [{}, {'multi_precision': False}, {'multi_precision': True}]]


def _grid():
    cases = []
    for dtype in ('float16', 'float32', 'float64'):
        for parts in itertools.product(*OPTIONS):
            kwargs = {k: v for part in parts for k, v in part.items()}
            if dtype == 'float16' and not kwargs.get('multi_precision'):
                continue
            name = '-'.join('%s%s' % (k, v) for k, v in sorted(kwargs.items())) or 'default'
            cases.append(pytest.param(dtype, kwargs, 'default', id='%s-%s' % (dtype, name)))
            if dtype != 'float16':
                cases.append(pytest.param(dtype, kwargs, 'csr', id='%s-%s-csr' % (dtype, name)))
    return cases


GRID = _grid()


def test_grid_has_mxnet_1_9_1_size():
    assert len(GRID) == 936


@pytest.mark.parametrize('dtype, kwargs, stype', GRID)
def test_mxnet_sgd_grid(dtype, kwargs, stype):
    mx.random.seed(0)
    shape = (3, 4, 5) if stype == 'default' else (3, 4)
    compare_optimizer(NumpySGD(**kwargs), mx_lbsgd.LBSGD(**kwargs), shape, np.dtype(dtype),
                      w_stype=stype, g_stype=stype, rtol=1e-3 if dtype == 'float16' else 1e-4)


SPARSE_GRID = [pytest.param(lazy, kwargs, id='%s-%s' % ('lazy' if lazy else 'std', '-'.join(
    '%s%s' % kv for kv in sorted(kwargs.items())) or 'default'))
    for lazy in (True, False)
    for parts in itertools.product(*OPTIONS[:4])
    for kwargs in [{k: v for part in parts for k, v in part.items()}]
    if lazy or 'momentum' in kwargs]


@pytest.mark.parametrize('lazy, kwargs', SPARSE_GRID)
def test_row_sparse_weights_and_gradients_equal_mxnet_sgd(lazy, kwargs):
    """MXNet's test_sparse_sgd / test_std_sparse_sgd grids: lazy updates skip the rows the
    gradient lacks (our numpy reference, as MXNet's PySparseSGD), standard ones do not."""
    mx.random.seed(0)
    compare_optimizer(NumpySGD(lazy_rows=lazy, **kwargs),
                      mx_lbsgd.LBSGD(lazy_update=lazy, **kwargs), (3, 4, 5), np.float32,
                      w_stype='row_sparse', g_stype='row_sparse')


# -- row_sparse gradients on dense weights, several steps through the Updater --------------

def sparse_steps(steps=4, rows=10, cols=3, seed=0):
    rng = np.random.RandomState(seed)
    w = rng.uniform(-1, 1, (rows, cols))
    grads = []
    for _ in range(steps):
        present = sorted(rng.choice(rows, 3, replace=False))
        g = np.zeros((rows, cols))
        g[present] = rng.uniform(-1, 1, (3, cols))
        grads.append((g, present))
    return w, grads


def run_updater(opt, w, grads, dtype='float32'):
    updater = mx.optimizer.get_updater(opt)
    weight = nd.array(w, dtype=dtype)
    for g, _ in grads:
        updater(0, nd.array(g, dtype=dtype).tostype('row_sparse'), weight)
    return weight.asnumpy().astype(np.float64), updater


ARGS = dict(learning_rate=0.1, wd=0.01, rescale_grad=0.5)


@pytest.mark.parametrize('momentum', [0.0, 0.9])
@pytest.mark.parametrize('lazy', [True, False])
@pytest.mark.parametrize('dtype, mp', [('float32', False), ('float16', True)])
def test_row_sparse_gradients_equal_mxnet_sgd(momentum, lazy, dtype, mp):
    if dtype == 'float16' and lazy:
        pytest.skip("MXNet's SGD falls back to a dense update here: "
                    "test_fp16_mp_lazy_mxnet_result_is_lazy_update_false")
    w, grads = sparse_steps()
    args = dict(ARGS, momentum=momentum, lazy_update=lazy, multi_precision=mp)
    ours, _ = run_updater(mx_lbsgd.LBSGD(**args), w, grads, dtype)
    theirs, _ = run_updater(mx.optimizer.SGD(**args), w, grads, dtype)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_fp16_mp_lazy_mxnet_result_is_lazy_update_false(momentum):
    """MXNet's SGD has no sparse mp kernel: with fp16 weights, multi_precision and
    lazy_update=True it updates every row. Ours stays lazy there (rows only); the dense
    result MXNet gives is ours with lazy_update=False, and differs from our lazy one."""
    w, grads = sparse_steps()
    args = dict(ARGS, momentum=momentum, multi_precision=True)
    theirs, _ = run_updater(mx.optimizer.SGD(lazy_update=True, **args), w, grads, 'float16')
    dense, _ = run_updater(mx_lbsgd.LBSGD(lazy_update=False, **args), w, grads, 'float16')
    lazy, _ = run_updater(mx_lbsgd.LBSGD(lazy_update=True, **args), w, grads, 'float16')
    np.testing.assert_allclose(dense, theirs, rtol=1e-6, atol=1e-6)
    assert np.abs(lazy - theirs).max() > 1e-4


@pytest.mark.parametrize('dtype, mp', [('float32', False), ('float16', True)])
@pytest.mark.parametrize('B', [1, 2])
@pytest.mark.parametrize('strategy', ['linear', 'lars'])
def test_lazy_rows_only_against_numpy(dtype, mp, B, strategy):
    """Lazy: only the gradient's rows change (weight, momentum, decay, master rows); with
    batch_scale the window's rows are the union; LARS norms over the present rows."""
    w, grads = sparse_steps(steps=4)
    if dtype == 'float16':    # the reference starts from what fp16 holds
        w = w.astype(np.float16).astype(np.float64)
        grads = [(g.astype(np.float16).astype(np.float64), rows) for g, rows in grads]
    opt = mx_lbsgd.LBSGD(momentum=0.9, multi_precision=mp, batch_scale=B,
                         warmup_strategy=strategy, warmup_epochs=1, updates_per_epoch=4,
                         lars_eta=0.1, param_idx2name={0: 'emb_weight'}, **ARGS)
    got, updater = run_updater(opt, w, grads, dtype)
    ref_w, ref_m = w.copy(), np.zeros_like(w)
    for k in range(B, len(grads) + 1, B):
        window = grads[k - B:k]
        g = sum(x for x, _ in window) / B
        rows = sorted(set(r for _, rs in window for r in rs))
        lr = 0.1
        if strategy == 'lars':
            lr *= lars_factor(ref_w[rows], g[rows], 0.01, 0.1, 0.0, 0.5)
        else:
            lr *= mx_lbsgd.warmup_multiplier(k, 4, B, 'linear')
        ref_w, ref_m = lazy_sgd_rows(ref_w, ref_m, g, rows, lr, 0.01, 0.9, rescale=0.5)
    if mp:
        got = updater.states[0][1].asnumpy().astype(np.float64)
    np.testing.assert_allclose(got, ref_w, rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(len(w))) - set(r for _, rs in grads for r in rs))
    np.testing.assert_array_equal(got[untouched],
                                  w.astype(dtype).astype(np.float64)[untouched])


def test_every_sgd_keyword_is_accepted():
    params = dict(learning_rate=0.1, momentum=0.9, lazy_update=False, multi_precision=True,
                  wd=1e-4, rescale_grad=0.5, clip_gradient=1.0, param_idx2name={0: 'w'},
                  begin_num_update=3)
    mx.optimizer.create('sgd', **params)
    opt = mx.optimizer.create('lbsgd', **params)
    assert opt.lazy_update is False and opt.begin_num_update == 3


# -- Gluon and Module embedding models --------------------------------------------------------

def embedding_run(optimizer, params, steps=6, sparse=True, inject=None):
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Embedding(50, 4, sparse_grad=sparse), gluon.nn.Dense(1, in_units=4))
    net.initialize(mx.init.Uniform(0.5))
    trainer = gluon.Trainer(net.collect_params(), optimizer, params, kvstore=None)
    rng = np.random.RandomState(1)
    scaler = getattr(trainer.optimizer, 'loss_scaler', None)
    skipped = []
    for step in range(steps):
        x = nd.array(rng.randint(0, 50, (8,)))
        y = nd.array(rng.uniform(-1, 1, (8, 1)))
        with autograd.record():
            loss = ((net(x) - y) ** 2).mean() * (scaler.scale if scaler else 1.0)
        loss.backward()
        if inject == step:
            g = net[0].weight.grad()
            values = g.data.asnumpy()
            values[0, 0] = np.inf
            nd.sparse.row_sparse_array((values, g.indices.asnumpy()), shape=g.shape).copyto(g)
        trainer.step(1)
        skipped.append(bool(getattr(trainer.optimizer, 'last_step_skipped', False)))
    return [p.data().asnumpy() for p in net.collect_params().values()], skipped


@pytest.mark.parametrize('lazy', [True, False])
@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_gluon_sparse_embedding_equals_mxnet_sgd(lazy, momentum):
    params = dict(learning_rate=0.5, momentum=momentum, wd=1e-3, lazy_update=lazy)
    ours, _ = embedding_run('lbsgd', params)
    theirs, _ = embedding_run('sgd', params)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_gluon_sparse_embedding_accumulates_over_the_union_of_rows():
    ours, _ = embedding_run('lbsgd', dict(learning_rate=0.5, momentum=0.9, batch_scale=2,
                                          warmup_epochs=0), steps=6)
    dense, _ = embedding_run('lbsgd', dict(learning_rate=0.5, momentum=0.9, batch_scale=2,
                                           warmup_epochs=0, lazy_update=False), steps=6,
                             sparse=False)
    rows_never_seen = np.all(ours[0] == embedding_run('sgd', dict(learning_rate=0.0),
                                                      steps=1)[0][0], axis=1)
    assert rows_never_seen.any()              # lazy: rows no micro-batch touched stay put
    assert not np.allclose(ours[0], dense[0])  # (the dense update decays them)


def test_loss_scaling_inf_in_a_sparse_row_skips_the_step():
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=8.0)
    weights, skipped = embedding_run('lssgd', dict(learning_rate=0.5, loss_scaler=scaler),
                                     steps=4, inject=2)
    assert skipped == [False, False, True, False]
    assert scaler.total_skipped == 1
    assert all(np.isfinite(w).all() for w in weights)


def test_module_sparse_embedding_equals_mxnet_sgd():
    def run(name):
        data = mx.sym.Variable('data')
        emb = mx.sym.Embedding(data, input_dim=50, output_dim=4, sparse_grad=True, name='emb')
        out = mx.sym.FullyConnected(mx.sym.sum(emb, axis=1), num_hidden=1, name='fc')
        sym = mx.sym.LinearRegressionOutput(out, name='lro')
        mod = mx.mod.Module(sym, label_names=['lro_label'])
        mod.bind([('data', (8, 3))], [('lro_label', (8, 1))])
        mx.random.seed(0)
        mod.init_params(mx.init.Uniform(0.5))
        mod.init_optimizer(kvstore=None, optimizer=name, optimizer_params=dict(
            learning_rate=0.1, momentum=0.9))
        rng = np.random.RandomState(2)
        for _ in range(5):
            mod.forward_backward(mx.io.DataBatch([nd.array(rng.randint(0, 50, (8, 3)))],
                                                 [nd.array(rng.uniform(-1, 1, (8, 1)))]))
            mod.update()
        return {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    ours, theirs = run('lbsgd'), run('sgd')
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-7)


def embedding_two_devices(optimizer, params, kvstore, steps=4):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    mx.random.seed(0)
    emb = gluon.nn.Embedding(30, 4, sparse_grad=True)
    emb.initialize(mx.init.Uniform(0.5), ctx=ctxs)
    trainer = gluon.Trainer(emb.collect_params(), optimizer, params, kvstore=kvstore,
                            update_on_kvstore=False)
    rng = np.random.RandomState(3)
    for _ in range(steps):
        xs = [nd.array(rng.randint(0, 30, (4,)), ctx=c) for c in ctxs]
        with autograd.record():
            losses = [(emb(x) ** 2).sum() for x in xs]
        autograd.backward(losses)
        trainer.step(8)
    return emb.weight.data(ctxs[0]).asnumpy(), emb.weight.data(ctxs[1]).asnumpy()


@pytest.mark.parametrize('kvstore', ['local', 'device'])
@pytest.mark.parametrize('B', [1, 2])
def test_sparse_embedding_on_two_devices_equals_mxnet_sgd(kvstore, B):
    """Gluon with row_sparse gradients reduced by a local/device kvstore (push, then pull).
    At batch_scale=1 the same as SGD; with B=2 the same as SGD on the summed window."""
    params = dict(learning_rate=0.2, momentum=0.9, wd=1e-3)
    ours = embedding_two_devices('lbsgd', dict(params, batch_scale=B, warmup_epochs=0),
                                 kvstore)
    np.testing.assert_array_equal(ours[0], ours[1])         # the devices agree
    if B == 1:
        theirs = embedding_two_devices('sgd', params, kvstore)
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6, atol=1e-7)


# -- dist_sync: row_sparse weights (SparseEmbedding) update on the servers -----------------

SPARSE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             'sparse_dist_worker.py')
DIST_SPARSE = [
    pytest.param('sgd', {}, id='mxnet-sgd'),
    pytest.param('lbsgd', {}, id='lbsgd'),
    pytest.param('lbsgd', dict(lazy_update=False), id='lbsgd-standard'),
    pytest.param('lbsgd', dict(warmup_strategy='power2', batch_scale=2, warmup_epochs=1,
                               updates_per_epoch=2), id='lbsgd-power2-B2'),
    pytest.param('lbsgd', dict(warmup_strategy='lars', lars_eta=0.1), id='lbsgd-lars'),
]


def run_sparse_job(cfg, tmp_path):
    out = io.StringIO()
    code = launch([sys.executable, SPARSE_WORKER, json.dumps(cfg), str(tmp_path)], 2, 1,
                  timeout=60, stream=out, env={'PYTHONPATH': os.pathsep.join(filter(None, [
                      os.path.dirname(os.path.dirname(SPARSE_WORKER)),
                      os.environ.get('PYTHONPATH')]))})
    return code, out.getvalue()


@pytest.mark.multiprocess
@pytest.mark.parametrize('optimizer, params', DIST_SPARSE)
def test_sparse_embedding_dist_sync_equals_one_process(tmp_path, optimizer, params):
    """2 workers + 1 server, SparseEmbedding: the optimizer runs on the server (MXNet's
    Trainer requires it for row_sparse weights); the table equals one process with the
    global batch, only looked-up rows move when lazy, and lbsgd at B=1 equals SGD."""
    cfg = dict(optimizer=optimizer, params=params, kvstore='dist_sync')
    code, log = run_sparse_job(cfg, tmp_path)
    assert code == 0, log
    ranks = [np.load(str(tmp_path / ('rank%d.npy' % r))) for r in range(2)]
    np.testing.assert_array_equal(ranks[0], ranks[1])
    before, ref = sparse_dist_worker.train(dict(cfg, kvstore='local'), 'local')
    np.testing.assert_allclose(ranks[0], ref, rtol=1e-5, atol=1e-6)
    moved = np.abs(ranks[0] - before).sum(axis=1) > 0
    if params.get('lazy_update', True):
        assert moved[:20].all() and not moved[20:].any()
    else:
        assert moved.all()                        # weight decay reaches every row
    if optimizer == 'lbsgd' and params in ({}, dict(lazy_update=False)):
        _, theirs = sparse_dist_worker.train(dict(cfg, optimizer='sgd', kvstore='local'),
                                             'local')
        np.testing.assert_allclose(ranks[0], theirs, rtol=1e-6, atol=1e-7)


def test_dense_weights_with_sparse_gradients_on_dist_kvstore_are_refused():
    """Embedding(sparse_grad=True) on dist_sync aborts MXNet's server (SGD too): refused at
    the first step, before the kvstore exists, naming what to use."""
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Embedding(10, 4, sparse_grad=True), gluon.nn.Dense(1, in_units=4))
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(learning_rate=0.1),
                            kvstore='dist_sync')
    with autograd.record():
        loss = net(nd.array([1, 2])).sum()
    loss.backward()
    before = [p.data().asnumpy() for p in net.collect_params().values()]
    with pytest.raises(ValueError, match=r"embedding\d+_weight.*'dist_sync'.*SparseEmbedding"):
        trainer.step(2)
    assert trainer._kvstore is None and not trainer._kv_initialized
    for b, p in zip(before, net.collect_params().values()):
        np.testing.assert_array_equal(b, p.data().asnumpy())


@pytest.mark.multiprocess
@pytest.mark.parametrize('api', ['gluon', 'module'])
def test_dense_weights_with_sparse_gradients_refused_in_a_dist_job(tmp_path, api):
    """The same refusal in a real 2-worker job, for Gluon and for Module (raised while
    init_optimizer sends the optimizer to the servers); MXNet's own SGD aborts the server
    there instead (kept as a check that the refusal is still needed)."""
    cfg = dict(optimizer='lbsgd', params={}, kvstore='dist_sync', dense=True, api=api)
    code, log = run_sparse_job(cfg, tmp_path)
    assert code == 3, log
    assert "'dist_sync' kvstore cannot reduce" in log and 'SparseEmbedding' in log
    assert 'emb' in log.split('parameter(s)')[1].split('have')[0]
    code, log = run_sparse_job(dict(cfg, optimizer='sgd'), tmp_path)
    assert code != 0 and 'copying size mismatch' in log, log
