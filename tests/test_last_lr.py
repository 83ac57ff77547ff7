"""``optimizer.last_lr``: the learning rate the kernels used in the last update, for a
parameter without an ``lr_mult`` (the schedule's rate, the warmup and the ``lr_scaling``
gain; a LARS trust ratio not included), readable without a host sync.

The lr a kernel used is read back from the weights: with momentum and weight decay 0, a
zero weight and a gradient of -1, plain SGD's update leaves ``w = lr`` (in float32), and a
LARS layer ``lr * ratio``."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs

pytestmark = [pytest.mark.unit, pytest.mark.fallback]


def _applied_lr(opt, steps, shapes=((4,), (3,))):
    """Run `steps` micro-batches of gradient -1 on zero weights (reset before each); the
    lrs of the last update's tensors (read from the weights) and the host reads of
    ``last_lr`` itself."""
    updater = mx.optimizer.get_updater(opt)
    weights = [nd.zeros(s) for s in shapes]
    for _ in range(steps):
        for w in weights:
            w[:] = 0.0
        updater(list(range(len(shapes))), [-nd.ones(s) for s in shapes], weights)
    lrs = [w.asnumpy()[0] for w in weights]
    with count_host_syncs(include_waitall=False) as reads:
        last = opt.last_lr
    return lrs, last, len(reads)


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
@pytest.mark.parametrize('steps', [1, 3, 8])
def test_the_warmed_up_rate_is_the_kernels(fused, steps):
    opt = mx_lbsgd.LBSGD(learning_rate=0.37, warmup_strategy='power2', warmup_epochs=1,
                         updates_per_epoch=8, batch_scale=1, fused=fused,
                         lr_scheduler=mx.lr_scheduler.FactorScheduler(2, factor=0.7,
                                                                     base_lr=0.37))
    assert opt.last_lr is None
    lrs, last, reads = _applied_lr(opt, steps)
    assert reads == 0
    assert lrs == [np.float32(last)] * 2
    assert last < 0.37 or steps < 3            # the schedule moved it


def test_with_accumulation_and_warmup():
    opt = mx_lbsgd.LBSGD(learning_rate=0.1, warmup_strategy='linear', warmup_epochs=1,
                         updates_per_epoch=16, batch_scale=4)
    lrs, last, _ = _applied_lr(opt, 8)       # two windows of 4
    assert last == 0.1 * (1 + (4 - 1) * 8 / 16)
    assert lrs == [np.float32(last)] * 2


@pytest.mark.parametrize('rule', ['linear', 'sqrt', 'adascale'])
def test_with_lr_scaling_the_gain_is_in_it(rule):
    """A Dense layer without bias under loss = -sum(net(x)): each micro-batch's gradient
    is -sum(x) over its 8 rows, so the window's update moves the weight by lr times the
    mean of those (Trainer rescale 1/8). Before the last window the weight is set to 0;
    after it, the weight is what the kernel's lr made of that mean. Constant rows (no
    noise) for 'linear' and 'sqrt', random ones for 'adascale' (whose gain needs noise)."""
    rng = np.random.RandomState(0)
    net = gluon.nn.Dense(1, use_bias=False, in_units=4)
    net.initialize(mx.init.Zero())
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.05, batch_scale=4, warmup_epochs=0, lr_scaling=rule))
    opt = trainer.optimizer
    for step in range(24):
        if step == 20:
            net.weight.set_data(nd.zeros((1, 4)))
            window = []
        x = np.ones((8, 4), 'f') if rule != 'adascale' else rng.normal(size=(8, 4)).astype('f')
        with autograd.record():
            loss = -net(nd.array(x)).sum()
        loss.backward()
        trainer.step(8)
        if step >= 20:
            window.append(-x.sum(axis=0, dtype=np.float64) / 8)
    assert opt.last_gain > 1.0
    assert opt.last_lr == 0.05 * opt.last_gain
    moved = net.weight.data().asnumpy()[0].astype(np.float64)     # w = -lr * mean gradient
    if rule == 'adascale':
        np.testing.assert_allclose(moved, -opt.last_lr * np.mean(window, axis=0), rtol=1e-5)
    else:
        assert (moved == np.float32(opt.last_lr)).all()


def test_lars_is_not_in_it_an_excluded_layer_takes_it():
    opt = mx_lbsgd.LBSGD(learning_rate=0.2, lars=True, lars_eta=0.001, warmup_epochs=0,
                         param_idx2name={0: 'fc_weight', 1: 'fc_bias'})
    updater = mx.optimizer.get_updater(opt)
    weights = [nd.ones((4,)), nd.zeros((3,))]
    updater([0, 1], [-nd.ones((4,)), -nd.ones((3,))], weights)
    assert opt.last_lr == 0.2
    assert weights[1].asnumpy()[0] == np.float32(0.2)            # the bias: excluded
    ratio_lr = weights[0].asnumpy()[0] - 1.0                      # lr * trust ratio
    assert abs(ratio_lr - 0.2) > 0.01


def test_lamb_too():
    opt = mx.optimizer.create('lblamb', learning_rate=0.01, batch_scale=2,
                              lr_scheduler=mx.lr_scheduler.FactorScheduler(1, factor=0.5,
                                                                          base_lr=0.01))
    updater = mx.optimizer.get_updater(opt)
    for _ in range(4):
        updater(0, nd.ones((3,)), nd.ones((3,)))
    assert opt.last_lr is not None and opt.last_lr < 0.01
