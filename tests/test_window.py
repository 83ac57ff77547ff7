"""Accumulation at a gluon Trainer's reduction: the unchanged loop (trainer.step every
micro-batch) communicates once per update and gives the reference's weights."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from reference import LBSGDReference

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

CTX2 = [mx.cpu(0), mx.cpu(1)]
ARGS = dict(learning_rate=0.1, momentum=0.9, wd=1e-3, warmup_epochs=1, updates_per_epoch=6)


def run(ctxs, strategy, B, steps, dtype='float32', kvstore='device', inject=None,
        scaler=None, lars=None):
    rng = np.random.RandomState(0)
    params = [gluon.Parameter('l%d_%s' % (i, 'bias' if i % 2 else 'weight'),
                              shape=(3 + i,), dtype=dtype) for i in range(4)]
    start = [rng.uniform(-1, 1, p.shape) for p in params]
    for p, w in zip(params, start):
        p.initialize(ctx=ctxs)
        p.set_data(nd.array(w).astype(dtype))
    trainer = gluon.Trainer(params, 'lbsgd', dict(
        ARGS, warmup_strategy=strategy, batch_scale=B, multi_precision=dtype == 'float16',
        loss_scaler=scaler, lars=lars), kvstore=kvstore, update_on_kvstore=False if kvstore else None)
    mx_lbsgd.init_kvstore(trainer, 8)
    pushes = []
    kv = trainer._kvstore
    if kv is not None:
        original = kv.pushpull
        kv.pushpull = lambda key, *a, **k: (pushes.append(key), original(key, *a, **k))[1]
    grads = []
    for step in range(steps):
        per_dev = [[rng.uniform(-1, 1, p.shape) for p in params] for _ in ctxs]
        scale = scaler.scale if scaler else 1.0
        with autograd.record():
            losses = [nd.add_n(*[(p.data(c).astype('float32') * nd.array(g, ctx=c)).sum()
                                 for p, g in zip(params, gs)]) * scale
                      for c, gs in zip(ctxs, per_dev)]
        autograd.backward(losses)
        if inject and step in inject:
            params[0].list_grad()[-1][:] = np.inf
        grads.append([sum(gs[i] for gs in per_dev) for i in range(len(params))])
        trainer.step(8)
    return params, start, grads, pushes, trainer


STRATEGIES = [pytest.param(s, None, id=s) for s in mx_lbsgd.WARMUP_STRATEGIES] + [
    pytest.param(s, True, id='lars+' + s) for s in mx_lbsgd.schedules.WARMUP_SHAPES]


@pytest.mark.parametrize('strategy, lars', STRATEGIES)
@pytest.mark.parametrize('ctxs, kvstore', [pytest.param(CTX2[:1], None, id='1dev'),
                                           pytest.param(CTX2, 'device', id='2dev-device')])
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_window_equals_reference_and_reduces_once(strategy, lars, ctxs, kvstore, dtype):
    B, steps = 4, 12
    params, start, grads, pushes, trainer = run(ctxs, strategy, B, steps, dtype, kvstore,
                                                lars=lars)
    names = [p.name for p in params]
    ref = LBSGDReference([w.astype(dtype) for w in start], names, lr=0.1, wd=1e-3,
                         momentum=0.9, strategy=strategy, B=B, warmup_epochs=1,
                         updates_per_epoch=6, rescale=1 / 8., lars=lars)
    for g in grads:
        ref.step(g)
    tol = 2e-2 if dtype == 'float16' else 2e-5
    for p, w in zip(params, ref.w):
        for d in p.list_data():
            np.testing.assert_allclose(d.asnumpy().astype(np.float64), w, rtol=tol,
                                       atol=tol)
    if kvstore:
        assert len(pushes) == len(params) * steps // B      # once per parameter and update
    assert trainer.optimizer.num_update == steps


def test_overflow_in_a_window_skips_the_window_on_every_device():
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 4, growth_interval=100)
    params, start, grads, pushes, trainer = run(CTX2, 'linear', 4, 8, inject={1},
                                                scaler=scaler)
    assert scaler.total_steps == 2 and scaler.total_skipped == 1
    names = [p.name for p in params]
    ref = LBSGDReference(start, names, lr=0.1, wd=1e-3, momentum=0.9, strategy='linear',
                         B=4, warmup_epochs=1, updates_per_epoch=6, rescale=1 / 8.)
    for g in grads[4:]:                         # the first window is dropped whole
        ref.step(g)
    for p, w in zip(params, ref.w):
        for d in p.list_data():
            np.testing.assert_allclose(d.asnumpy(), w, rtol=2e-5, atol=2e-5)
    assert len(pushes) == 2 * len(params)
