"""Real training runs with 'lbsgd' through Gluon's Trainer and Module.fit."""
import logging

import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd  # noqa: F401
from harness import accuracy, digits, mlp

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

X, Y, XT, YT = digits()
LOSS = mx.gluon.loss.SoftmaxCrossEntropyLoss()


def batches(batch, epochs, seed=0):
    rng = np.random.RandomState(seed)
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for i in range(0, len(X) - batch + 1, batch):
            idx = order[i:i + batch]
            yield X[idx], Y[idx]


def train_steps(net, trainer, data, ctxs=(mx.cpu(),)):
    losses = []
    for xb, yb in data:
        xs = mx.gluon.utils.split_and_load(mx.nd.array(xb), list(ctxs))
        ys = mx.gluon.utils.split_and_load(mx.nd.array(yb), list(ctxs))
        with mx.autograd.record():
            ls = [LOSS(net(x), y) for x, y in zip(xs, ys)]
        mx.autograd.backward(ls)
        trainer.step(len(xb))
        losses.append(sum(l.sum().asscalar() for l in ls) / len(xb))
    return losses


TRAINER_CASES = [
    pytest.param(dict(warmup_strategy='linear', batch_scale=4, learning_rate=0.02), 0.93,
                 id='linear-B4'),
    pytest.param(dict(warmup_strategy='sqrt', batch_scale=1, learning_rate=0.05), 0.95,
                 id='sqrt-B1'),
    pytest.param(dict(warmup_strategy='lars', lars_eta=0.001, learning_rate=1.0), 0.93,
                 id='lars'),
]


@pytest.mark.parametrize('B, lr', [pytest.param(1, 0.005, id='B1'),
                                   pytest.param(4, 0.015, id='B4')])
def test_gluon_trainer_learns_digits_with_lblamb(B, lr):
    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lblamb',
                               dict(learning_rate=lr, wd=1e-4, batch_scale=B,
                                    trust_exclude=True))
    losses = train_steps(net, trainer, batches(16, 6))
    per_epoch = np.array(losses).reshape(6, -1).mean(axis=1)
    assert per_epoch[-1] < 0.3 * per_epoch[0]
    assert accuracy(net, XT, YT) > 0.93
    assert trainer.optimizer.num_update == len(losses) // B


@pytest.mark.parametrize('params, threshold', TRAINER_CASES)
def test_gluon_trainer_learns_digits(params, threshold):
    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd',
                               dict(momentum=0.9, wd=1e-4, warmup_epochs=1,
                                    updates_per_epoch=len(X) // 16, **params))
    assert isinstance(trainer._optimizer, mx_lbsgd.LBSGD)
    losses = train_steps(net, trainer, batches(16, 6))
    per_epoch = np.array(losses).reshape(6, -1).mean(axis=1)
    assert per_epoch[-1] < 0.3 * per_epoch[0]
    assert accuracy(net, XT, YT) > threshold


def _digits_module():
    """(Module of a 64-unit MLP, shuffled training iterator, test iterator), seeded."""
    np.random.seed(0)       # NDArrayIter shuffles with numpy's global generator
    mx.random.seed(0)
    data = mx.sym.Variable('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name='fc1'), 'relu')
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=10, name='fc2'),
                               name='softmax')
    train = mx.io.NDArrayIter(X, Y, batch_size=32, shuffle=True,
                              label_name='softmax_label')
    test = mx.io.NDArrayIter(XT, YT, batch_size=32, label_name='softmax_label')
    return mx.mod.Module(out, context=mx.cpu()), train, test


@pytest.mark.parametrize('strategy', ['linear', 'lars'])
def test_module_fit_learns_digits(strategy):
    mod, train, test = _digits_module()
    lr = 2.0 if strategy == 'lars' else 0.05
    mod.fit(train, num_epoch=8, optimizer='lbsgd', initializer=mx.init.Xavier(),
            optimizer_params=dict(learning_rate=lr, momentum=0.9, wd=1e-4,
                                  warmup_strategy=strategy, batch_scale=2, lars_eta=0.001,
                                  updates_per_epoch=len(X) // 32, warmup_epochs=1))
    assert isinstance(mod._optimizer, mx_lbsgd.LBSGD)
    assert mod._optimizer.idx2name      # Module's names reach the LARS exclusion
    # measured over numpy seeds 0-5: linear 0.958-0.971, lars 0.938-0.956
    assert dict(mod.score(test, 'acc'))['accuracy'] > (0.92 if strategy == 'lars' else 0.95)


@pytest.mark.parametrize('B', [1, 2])
def test_module_fit_learns_digits_with_lblamb(B):
    """Module's names reach the trust-ratio exclusions; num_update counts applied updates."""
    mod, train, test = _digits_module()
    mod.fit(train, num_epoch=8, optimizer='lblamb', initializer=mx.init.Xavier(),
            optimizer_params=dict(learning_rate=0.005 * B, wd=1e-4, batch_scale=B,
                                  trust_exclude=True))
    opt = mod._optimizer
    assert isinstance(opt, mx_lbsgd.LAMB) and opt.idx2name
    train.reset()
    micro_batches = 8 * sum(1 for _ in train)
    assert opt.micro_batches == micro_batches
    assert opt.num_update == opt.applied_updates == micro_batches // B
    assert dict(mod.score(test, 'acc'))['accuracy'] > 0.93


@pytest.mark.parametrize('strategy', ['linear', 'lars'])
def test_two_contexts_equal_one_with_accumulation(strategy):
    """Accumulators live in each device's updater state, so two devices give the same
    weights as one (MXNet's LBSGD shared them by index and mixed devices)."""
    kwargs = dict(learning_rate=0.1, momentum=0.9, batch_scale=4, warmup_strategy=strategy,
                  warmup_epochs=1, updates_per_epoch=8, lars_eta=0.02)
    results = []
    for ctxs in ([mx.cpu(0)], [mx.cpu(0), mx.cpu(1)]):
        net = mlp()
        net.collect_params().reset_ctx(ctxs)
        trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', kwargs, kvstore='device',
                                   update_on_kvstore=False)
        train_steps(net, trainer, batches(32, 1), ctxs)
        results.append([p.data(ctxs[-1]).asnumpy() for p in net.collect_params().values()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('strategy', ['linear', 'lars'])
def test_trainer_save_load_states_resumes_bit_identically(tmp_path, strategy):
    kwargs = dict(learning_rate=0.1, momentum=0.9, batch_scale=4, warmup_strategy=strategy,
                  warmup_epochs=1, updates_per_epoch=20, lars_eta=0.02)
    data = list(batches(32, 1))[:30]

    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', kwargs)
    train_steps(net, trainer, data)
    straight = [p.data().asnumpy() for p in net.collect_params().values()]

    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', kwargs)
    train_steps(net, trainer, data[:14])         # stops inside an accumulation window
    net.save_parameters(str(tmp_path / 'net.params'))
    trainer.save_states(str(tmp_path / 'trainer.states'))

    net = mlp(seed=1)
    net.load_parameters(str(tmp_path / 'net.params'))
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', kwargs)
    trainer.load_states(str(tmp_path / 'trainer.states'))
    train_steps(net, trainer, data[14:])
    resumed = [p.data().asnumpy() for p in net.collect_params().values()]
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


def test_fp16_master_copy_state_round_trip():
    """Updater states (momentum, weight_fp32, accumulator) survive get/set_states."""
    opt_args = dict(momentum=0.9, multi_precision=True, batch_scale=2, learning_rate=0.1)
    rng = np.random.RandomState(0)
    grads = [rng.uniform(-1, 1, (5, 3)).astype(np.float16) for _ in range(9)]

    def run(grads, updater, w):
        for g in grads:
            updater(0, mx.nd.array(g, dtype='float16'), w)

    w = mx.nd.ones((5, 3), dtype='float16')
    updater = mx.optimizer.get_updater(mx_lbsgd.LBSGD(**opt_args))
    run(grads, updater, w)

    w2 = mx.nd.ones((5, 3), dtype='float16')
    first = mx.optimizer.get_updater(mx_lbsgd.LBSGD(**opt_args))
    run(grads[:5], first, w2)
    blob = first.get_states(dump_optimizer=True)
    second = mx.optimizer.get_updater(mx_lbsgd.LBSGD(**opt_args))
    second.set_states(blob)
    run(grads[5:], second, w2)
    np.testing.assert_array_equal(w.asnumpy(), w2.asnumpy())
    np.testing.assert_array_equal(updater.states[0][1].asnumpy(),
                                  second.states[0][1].asnumpy())
