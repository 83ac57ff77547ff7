"""Real loss-scaled training: Module.fit with 'lssgd', and float16 training on digits."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from digits_mlp import mlp
from harness import digits

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

X, Y, XT, YT = digits()


def symbol(scaled):
    data = mx.sym.Variable('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=32, name='fc1'), 'relu')
    out = mx.sym.FullyConnected(h, num_hidden=10, name='fc2')
    if scaled:
        out = mx_lbsgd.scale_gradient(out)
    return mx.sym.SoftmaxOutput(out, name='softmax')


def fit(optimizer, params, contexts=(mx.cpu(),), epochs=3, monitor=None):
    np.random.seed(0)
    mx.random.seed(0)
    train = mx.io.NDArrayIter(X, Y, batch_size=64, shuffle=True, label_name='softmax_label')
    mod = mx.mod.Module(symbol(optimizer == 'lssgd'), context=list(contexts))
    mod.fit(train, num_epoch=epochs, optimizer=optimizer, initializer=mx.init.Xavier(),
            optimizer_params=dict(learning_rate=0.1, momentum=0.9, wd=1e-4, **params),
            batch_end_callback=monitor)
    return mod


def test_module_fit_lssgd_equals_sgd_and_scale_is_dynamic():
    """The graph multiplies the gradient by the current scale and the optimizer divides it
    out: with power-of-two scales and no overflow, the weights equal plain SGD's."""
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 6, growth_interval=10)
    seen = []
    mod = fit('lssgd', dict(loss_scaler=scaler),
              monitor=lambda p: seen.append(p.locals['self']._optimizer.loss_scaler.scale))
    reference = fit('sgd', {})
    steps = 3 * -(-len(X) // 64)          # NDArrayIter pads the last batch
    assert scaler.total_steps == steps and scaler.total_skipped == 0
    assert seen[-1] == 2.0 ** 6 * 2 ** (steps // 10) == scaler.scale   # it grew in the graph
    for name, value in reference.get_params()[0].items():
        np.testing.assert_allclose(mod.get_params()[0][name].asnumpy(), value.asnumpy(),
                                   rtol=1e-5, atol=1e-6)


def test_module_update_on_kvstore_refused_and_env_switch(monkeypatch):
    contexts = (mx.cpu(0), mx.cpu(1))
    with pytest.raises(ValueError, match='MXNET_UPDATE_ON_KVSTORE=0'):
        fit('lssgd', {}, contexts, epochs=1)
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    mod = fit('lssgd', dict(loss_scaler=2.0 ** 8), contexts, epochs=1)
    assert mod._optimizer.loss_scaler.total_steps == -(-len(X) // 64)


def test_gradient_op_without_optimizer_fails_clearly(capfd):
    sym = mx_lbsgd.scale_gradient(mx.sym.Variable('x'), key='nobody')
    exe = sym.simple_bind(mx.cpu(), x=(2,))
    exe.forward(is_train=True, x=nd.ones((2,)))
    exe.backward(nd.ones((2,)))
    with pytest.raises(mx.base.MXNetError):
        exe.grad_dict['x'].asnumpy()
    out = capfd.readouterr()
    assert "scale_gradient(key='nobody'): no loss-scaled optimizer serves" in out.out + out.err


def train_fp16(loss_scaler, epochs=40, batch=256):
    """fp16 weights and activations (fp32 only inside the matrix products), mean loss."""
    net = mlp((64, 64), dtype='float16')
    params = dict(learning_rate=0.3, momentum=0.9, multi_precision=True)
    if loss_scaler is not None:
        params['loss_scaler'] = loss_scaler
    trainer = gluon.Trainer(net.collect_params(), 'lssgd' if loss_scaler else 'sgd', params,
                            kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for i in range(0, len(X) - batch + 1, batch):
            pick = order[i:i + batch]
            scale = loss_scaler.scale if loss_scaler else 1.0
            with autograd.record():
                loss = loss_fn(net(nd.array(X[pick], dtype='float16')).astype('float32'),
                               nd.array(Y[pick])).mean() * scale
            loss.backward()
            trainer.step(1)
    pred = net(nd.array(XT, dtype='float16')).astype('float32').argmax(axis=1).asnumpy()
    return net, float(np.mean(pred == YT))


def underflow_fraction(net16, scale):
    """Fraction of the gradient entries that are non-zero in float32 but zero in float16,
    at the trained float16 weights, for a loss multiplied by `scale`."""
    net32 = mlp((64, 64), dtype='float32')
    for p16, p32 in zip(net16.collect_params().values(), net32.collect_params().values()):
        p32.set_data(p16.data().astype('float32'))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    grads = []
    for net, dtype, s in ((net32, 'float32', 1.0), (net16, 'float16', scale)):
        with autograd.record():
            loss = loss_fn(net(nd.array(X[:256], dtype=dtype)).astype('float32'),
                           nd.array(Y[:256])).mean() * s
        loss.backward()
        grads.append(np.concatenate([p.grad().asnumpy().ravel()
                                     for p in net.collect_params().values()]))
    nonzero = grads[0] != 0
    return float(np.mean(grads[1][nonzero] == 0))


def test_fp16_training_underflows_without_scaling_and_learns_with_it():
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=50)
    net_scaled, acc_scaled = train_fp16(scaler)
    net_plain, acc_plain = train_fp16(None)
    lost_plain = underflow_fraction(net_plain, 1.0)
    lost_scaled = underflow_fraction(net_scaled, scaler.scale)
    print('fp16 digits: accuracy scaled %.4f, unscaled %.4f; gradient entries lost to '
          'underflow: unscaled %.3f, scaled (x%g) %.4f' % (acc_scaled, acc_plain, lost_plain,
                                                         scaler.scale, lost_scaled))
    # measured: unscaled 0.12 of the entries underflow, scaled < 0.01; accuracy 0.971
    assert lost_plain > 0.05
    assert lost_scaled < 0.2 * lost_plain
    assert scaler.scale > 2.0 ** 16            # the scale grew during training
    assert acc_scaled > 0.93


@pytest.mark.parametrize('batch_scale', [1, 2])
def test_module_on_two_devices_keeps_their_windows_together(monkeypatch, batch_scale):
    """A loss-scaled Module on two devices: the gate holds the first device's calls until
    the second one's arrive, and each call counts its micro-batch on its own device, so
    both devices close their windows together and hold the one-device run's weights."""
    from test_lr_scaling_module import _batches, _module, _module_step
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    weights = []
    for contexts in ((mx.cpu(0),), (mx.cpu(0), mx.cpu(1))):
        mod = _module('lbsgd', dict(learning_rate=0.05, momentum=0.9, warmup_epochs=0,
                                    batch_scale=batch_scale,
                                    loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=8.0)),
                      contexts, scaled=True)
        data = _batches()
        for _ in range(6):
            _module_step(mod, *next(data))
        weights.append([w.asnumpy() for w in mod._exec_group.param_arrays[0]])
    assert np.array_equal(weights[1][0], weights[1][1])
    np.testing.assert_allclose(weights[1][0], weights[0][0], rtol=1e-6, atol=1e-6)
