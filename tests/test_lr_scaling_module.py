"""``lr_scaling`` and ``batch_scale='auto'`` under Module (no Trainer): the Module's batch is
the base batch, and a Module run equals the same run under a gluon Trainer on one device bit
for bit (weights, gains, progress, estimates, window lengths); loss scaling and several
devices; host reads; checkpoints; updates on the kvstore refused."""
import warnings

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from test_batch_choice import _Clock

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

D, BATCH = 8, 16


def _batches(seed=1):
    rng = np.random.RandomState(seed)
    wstar = np.linspace(-1.0, 1.0, D).astype('f')
    while True:
        x = rng.normal(size=(BATCH, D)).astype('f')
        yield x, (x @ wstar + rng.normal(size=BATCH).astype('f')).reshape(BATCH, 1)


def _w0():
    return np.random.RandomState(0).normal(size=(1, D)).astype('f')


def _module(name, args, contexts=(mx.cpu(),), scaled=False):
    out = mx.sym.FullyConnected(mx.sym.Variable('data'), num_hidden=1, no_bias=True,
                                name='fc')
    if scaled:
        out = mx_lbsgd.scale_gradient(out)
    out = mx.sym.LinearRegressionOutput(out, name='lro')
    mod = mx.mod.Module(out, label_names=['lro_label'], context=list(contexts))
    mod.bind(data_shapes=[('data', (BATCH, D))], label_shapes=[('lro_label', (BATCH, 1))])
    mod.init_params(arg_params={'fc_weight': nd.array(_w0())})
    mod.init_optimizer(optimizer=name, optimizer_params=dict(args))
    return mod


def _module_step(mod, x, y):
    mod.forward_backward(mx.io.DataBatch([nd.array(x)], [nd.array(y)]))
    mod.update()


def _optimizer(mod):
    """The optimizer that updates `mod` (MXNet's load_optimizer_states replaces the
    Updater's, not ``mod._optimizer``)."""
    return mod._updater.optimizer


def _gluon(name, args):
    net = gluon.nn.Dense(1, use_bias=False, in_units=D)
    net.initialize()
    net.weight.set_data(nd.array(_w0()))
    return net, gluon.Trainer(net.collect_params(), name, dict(args))


def _gluon_step(net, trainer, x, y, scaler=None):
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
        if scaler is not None:
            loss = loss * scaler.scale
    loss.backward()
    trainer.step(BATCH)


def _args(name, rule, scale, **extra):
    args = dict(learning_rate=0.02, lr_scaling=rule, batch_scale=scale, **extra)
    if name == 'lbsgd':
        args.update(warmup_epochs=0, momentum=0.9)
    return args


def _outcome(weight, opt, gains):
    return (weight, gains, opt.scale_invariant_steps, opt._pieces.lr_gain.piece.state.as_dict(),
            opt.applied_updates, opt.window_history)


@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
@pytest.mark.parametrize('rule, scale', [('adascale', 1), ('sqrt', 2)] + [
    (rule, scale) for rule in ('adascale', 'linear') for scale in range(2, 9)])
def test_module_trains_as_a_gluon_trainer(name, rule, scale):
    """Module.update on one device against gluon.Trainer.step: the same weights, gains,
    progress and estimates after 48 micro-batches, bit for bit (the difference estimator
    at S = 1, the window's norms at S = 2..8: the window's mean is taken in the same
    arithmetic in the optimizer as at the Trainer, so odd windows agree too)."""
    mod = _module(name, _args(name, rule, scale))
    net, trainer = _gluon(name, _args(name, rule, scale))
    data = _batches()
    seen = ([], [])
    for _ in range(48):
        x, y = next(data)
        _module_step(mod, x, y)
        _gluon_step(net, trainer, x, y)
        seen[0].append(mod._optimizer.last_gain)
        seen[1].append(trainer.optimizer.last_gain)
    left = _outcome(mod.get_params()[0]['fc_weight'].asnumpy(), mod._optimizer, seen[0])
    right = _outcome(net.weight.data().asnumpy(), trainer.optimizer, seen[1])
    assert np.array_equal(left[0], right[0])
    assert left[1:] == right[1:]
    assert left[2] > 48 / scale or scale == 1
    if rule == 'adascale':
        assert left[3]['moments']['samples'] > 0
        assert 1.0 <= min(seen[0]) and (scale == 1 or max(seen[0]) > 1.0)


@pytest.mark.parametrize('scale, clip', [(1, dict(max_grad_norm=0.5)),
                                         (4, dict(max_grad_norm=0.5)),
                                         (2, dict(clip_gradient=0.1))])
def test_module_with_clipping_trains_as_a_gluon_trainer(scale, clip):
    """'adascale' with global-norm or per-element clipping: the Module run's weights and
    progress equal the gluon Trainer run's bit for bit."""
    args = _args('lbsgd', 'adascale', scale, **clip)
    mod = _module('lbsgd', args)
    net, trainer = _gluon('lbsgd', args)
    data = _batches()
    for _ in range(40):
        x, y = next(data)
        _module_step(mod, x, y)
        _gluon_step(net, trainer, x, y)
    assert np.array_equal(mod.get_params()[0]['fc_weight'].asnumpy(),
                          net.weight.data().asnumpy())
    assert mod._optimizer.scale_invariant_steps == trainer.optimizer.scale_invariant_steps
    assert mod._optimizer.scale_invariant_steps > 40 / scale or scale == 1


@pytest.mark.parametrize('scaled', [False, True])
def test_module_auto_takes_the_gluon_trainers_windows(scaled):
    """batch_scale='auto' with the same virtual clock (and a loss scaler, whose finite
    check comes before the step): the Module takes the gluon Trainer's window lengths at
    the same updates, times the same windows, and ends with the same weights."""
    def args():
        extra = dict(loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=4.0)) if scaled \
            else {}
        return dict(learning_rate=0.02, warmup_epochs=0, lr_scaling='adascale',
                    batch_scale='auto', batch_scale_bounds=(1, 8), batch_scale_interval=2,
                    **extra)
    mod = _module('lbsgd', args(), scaled=scaled)
    net, trainer = _gluon('lbsgd', args())
    clocks = (_Clock(0.01, 0.3), _Clock(0.01, 0.3))
    mod._optimizer._pieces.lr_gain._clock = clocks[0]
    trainer.optimizer._pieces.lr_gain._clock = clocks[1]
    data = _batches()
    for _ in range(160):
        x, y = next(data)
        clocks[0].step(mod._optimizer, lambda: _module_step(mod, x, y))
        clocks[1].step(trainer.optimizer,
                       lambda: _gluon_step(net, trainer, x, y, trainer.optimizer.loss_scaler))
    history = mod._optimizer.window_history
    assert len(history) > 2 and history == trainer.optimizer.window_history
    timed = [[(t.length, t.count, t.seconds) for t in o._pieces.lr_gain.chooser.state.timings]
             for o in (mod._optimizer, trainer.optimizer)]
    assert timed[0] == timed[1]
    assert np.array_equal(mod.get_params()[0]['fc_weight'].asnumpy(),
                          net.weight.data().asnumpy())


@pytest.mark.parametrize('scale', [1, 2])
def test_module_with_a_loss_scaler_on_two_devices(monkeypatch, scale):
    """A loss-scaled Module graph on two devices (updated by the Updater, not the kvstore)
    estimates as one device does: the Updater's gradients are reduced over the devices,
    and the Module's batch is the base batch."""
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    gains = []
    for contexts in ((mx.cpu(0),), (mx.cpu(0), mx.cpu(1))):
        mod = _module('lbsgd', _args('lbsgd', 'adascale', scale,
                                     loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=8.0)),
                      contexts, scaled=True)
        data = _batches()
        for _ in range(40):
            _module_step(mod, *next(data))
        opt = mod._optimizer
        gains.append((opt.scale_invariant_steps, opt._pieces.lr_gain.piece.state.moments.noise_scale))
        assert opt.loss_scaler.total_skipped == 0
    np.testing.assert_allclose(gains[0], gains[1], rtol=1e-4)
    assert gains[0][1] > 0


@pytest.mark.parametrize('scaled, scale, extra', [(False, 1, 0), (False, 4, 0), (True, 1, 0),
                                                  (True, 4, 1)])
def test_module_host_reads(scaled, scale, extra):
    """'adascale' on a Module reads once per update: with a loss scaler at S = 1 its norms
    come along with the flag; with a window in the optimizer the flag is read per
    micro-batch and the window's norms once more per update (`extra`)."""
    counts = {}
    for rule in (None, 'adascale'):
        args = _args('lbsgd', rule, scale)
        if scaled:
            args['loss_scaler'] = mx_lbsgd.DynamicLossScaler(init_scale=4.0)
        mod = _module('lbsgd', args, scaled=scaled)
        data = _batches()
        for _ in range(2 * scale):
            _module_step(mod, *next(data))
        with count_host_syncs(include_waitall=False) as calls:
            for _ in range(5 * scale):
                _module_step(mod, *next(data))
        counts[rule] = len(calls)
    assert counts['adascale'] == max(counts[None], 5) + 5 * extra


@pytest.mark.parametrize('at', [24, 25, 26])
@pytest.mark.parametrize('batch_scale', [1, 4, 'auto'])
def test_module_resume_is_bit_for_bit(tmp_path, at, batch_scale):
    """Save with mx_lbsgd.checkpoint after `at` micro-batches (inside a window, or at its
    end), load into a fresh Module, train to 64: weights, progress, estimates and window
    lengths equal the uninterrupted run's. (Module's own save_optimizer_states keeps no
    optimizer, so neither these nor MXNet's counters.)"""
    args = _args('lbsgd', 'adascale', batch_scale)
    if batch_scale == 'auto':     # lengths 1, 2, 4 before the save, 8 after it
        args.update(batch_scale_bounds=(1, 8), batch_scale_interval=4)

    def fresh():
        mod = _module('lbsgd', args)
        clock = _Clock(0.01, 1.0)
        mod._optimizer._pieces.lr_gain._clock = clock
        return mod, clock

    def train(mod, clock, data, count):
        for _ in range(count):
            x, y = next(data)
            clock.step(_optimizer(mod), lambda: _module_step(mod, x, y))

    def outcome(mod):
        opt = _optimizer(mod)
        return (mod.get_params()[0]['fc_weight'].asnumpy(), opt.scale_invariant_steps,
                opt.last_gain, opt._pieces.lr_gain.piece.state.as_dict(), opt.window_history,
                opt.batch_scale)

    mod, clock = fresh()
    train(mod, clock, _batches(), 64)
    whole = outcome(mod)
    assert batch_scale != 'auto' or [n for _, n in whole[4]] == [1, 2, 4, 8]
    mod, clock = fresh()
    data = _batches()
    train(mod, clock, data, at)
    path = str(tmp_path / 'states')
    mx_lbsgd.checkpoint.save_states(mod, path)
    weights, now = mod.get_params()[0]['fc_weight'].copy(), clock.now
    mod, clock = fresh()
    clock.now = now
    mod.set_params({'fc_weight': weights}, {})
    mx_lbsgd.checkpoint.load_states(mod, path)
    _optimizer(mod)._pieces.lr_gain._clock = clock
    train(mod, clock, data, 64 - at)
    resumed = outcome(mod)
    assert np.array_equal(whole[0], resumed[0])
    assert whole[1:] == resumed[1:]


def test_module_updating_on_the_kvstore_is_refused():
    """Two devices with a local kvstore that updates: refused when the optimizer is
    created, naming lr_scaling and the switch."""
    with pytest.raises(ValueError, match="lr_scaling='adascale'.*MXNET_UPDATE_ON_KVSTORE=0"):
        _module('lbsgd', _args('lbsgd', 'adascale', 2), (mx.cpu(0), mx.cpu(1)))


@pytest.mark.parametrize('scaled', [False, True], ids=['unscaled', 'loss-scaled'])
@pytest.mark.parametrize('scale', [1, 4])
def test_an_optimizer_moved_to_a_module_on_another_device_keeps_estimating(scale, scaled):
    """The estimates follow the Module's first device: after the optimizer moves on to a
    Module bound to another device, its updates keep adding samples (at most the switch's
    first update is not measured), and none waits for the old device's keys."""
    extra = dict(loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=8.0)) if scaled else {}
    first = _module('lbsgd', _args('lbsgd', 'adascale', scale, **extra), (mx.cpu(0),),
                    scaled=scaled)
    data = _batches()
    for _ in range(8 * scale):
        _module_step(first, *next(data))
    opt = first._optimizer
    moments = opt._pieces.lr_gain.piece.state.moments
    samples = moments.samples
    assert samples > 0
    second = _module('lbsgd', {}, (mx.cpu(1),), scaled=scaled)
    second.init_optimizer(optimizer=opt, force_init=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)    # (a held update warns: ran late)
        for _ in range(8 * scale):
            _module_step(second, *next(data))
    assert second._optimizer is opt
    assert opt._pieces.lr_gain.piece.state.moments.samples >= samples + 6
