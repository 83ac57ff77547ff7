"""numpy-mode Gluon (npx.set_np(), mx.np arrays): the same weights as legacy mode."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon

import mx_lbsgd
from mx_lbsgd import checkpoint
from harness import digits

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

X, Y, _, _ = digits()
CTX2 = [mx.cpu(0), mx.cpu(1)]

CONFIGS = [
    pytest.param('lbsgd', dict(warmup_strategy=s, batch_scale=b, momentum=0.9,
                               warmup_epochs=1, updates_per_epoch=4), None,
                 id='lbsgd-%s-B%d' % (s, b))
    for s, b in [('linear', 1), ('linear', 2), ('power2', 2), ('sqrt', 1), ('lars', 2)]
] + [
    pytest.param('lssgd', dict(momentum=0.9, loss_scaler=mx_lbsgd.DynamicLossScaler(
        init_scale=2.0 ** 6, growth_interval=2)), None, id='lssgd'),
    pytest.param('lbsgd', dict(momentum=0.9, batch_scale=2, loss_scaler=mx_lbsgd.
                               DynamicLossScaler(init_scale=2.0 ** 6)), None,
                 id='lbsgd-scaled-B2'),
    pytest.param('sgd', dict(momentum=0.9), 'hook', id='sgd-hook'),
]


def train(numpy_mode, name, params, hook, ctxs, tmp_path=None, steps=6):
    import copy
    params = copy.deepcopy(params)
    if numpy_mode:
        mx.npx.set_np()
    try:
        array = mx.np.array if numpy_mode else mx.nd.array
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        with net.name_scope():
            net.add(gluon.nn.Dense(16, activation='relu', in_units=64),
                    gluon.nn.Dense(10, in_units=16))
        net.initialize(mx.init.Xavier(), ctx=ctxs)
        rng = np.random.RandomState(0)     # the same start in both modes
        for p in net.collect_params().values():
            p.set_data(array(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))
        trainer = gluon.Trainer(net.collect_params(), name, dict(learning_rate=0.1, **params),
                                kvstore='device' if len(ctxs) > 1 else None,
                                update_on_kvstore=False if len(ctxs) > 1 else None)
        mx_lbsgd.init_kvstore(trainer, 32)
        scaling = mx_lbsgd.LossScaling(trainer, 2.0 ** 5, force=True) if hook else None
        scaler = getattr(trainer.optimizer, 'loss_scaler', None) or (
            scaling and scaling.scaler)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        for step in range(steps):
            xs = gluon.utils.split_and_load(array(X[step * 32:(step + 1) * 32]), ctxs)
            ys = gluon.utils.split_and_load(array(Y[step * 32:(step + 1) * 32]), ctxs)
            with autograd.record():
                losses = [loss_fn(net(x), y) * (scaler.scale if scaler else 1.0)
                          for x, y in zip(xs, ys)]
            autograd.backward(losses)
            if scaling:
                scaling.step(32)
            else:
                trainer.step(32)
            if tmp_path is not None and step == steps // 2:
                checkpoint.save_states(trainer, str(tmp_path / 's.states'))
                checkpoint.load_states(trainer, str(tmp_path / 's.states'))
        return [p.data(ctxs[-1]).asnumpy() for p in net.collect_params().values()]
    finally:
        if numpy_mode:
            mx.npx.reset_np()


@pytest.mark.parametrize('name, params, hook', CONFIGS)
@pytest.mark.parametrize('ctxs', [pytest.param(CTX2[:1], id='1dev'),
                                  pytest.param(CTX2, id='2dev')])
def test_numpy_mode_equals_legacy(name, params, hook, ctxs, tmp_path):
    legacy = train(False, name, params, hook, ctxs)
    numpy_ = train(True, name, params, hook, ctxs, tmp_path)
    for a, b in zip(legacy, numpy_):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(a).sum() > 0 for a in legacy)
