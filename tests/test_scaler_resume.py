"""One scaler, always (issue 30): the user's DynamicLossScaler keeps driving the optimizer
after MXNet's ``Trainer.load_states`` / ``Updater.set_states`` and after
``mx_lbsgd.checkpoint.load_states``, and a run resumed with the README's recipes (loss
multiplied by the user's ``scaler.scale``) matches the uninterrupted run bit for bit, with
overflows before the save so that the scale is not its initial value."""
import hashlib
import pickle
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import checkpoint
from digits_mlp import mlp
from harness import digits

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

X, Y, _, _ = digits()
BATCH = 16
STEPS = 12
OVERFLOW = (1, 8)          # one overflow before the save, one after the resume


def make_scaler():
    # what a resumed process creates again, as the recipe does
    return mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=4)


def recipe(name, scaler):
    """(optimizer, params) of the README's recipes, with the user's `scaler`."""
    if name == 'lssgd':       # README "Loss-scaled optimizers"
        return 'lssgd', dict(learning_rate=0.1, momentum=0.9, multi_precision=True,
                             loss_scaler=scaler)
    if name == 'lbsgd-B2':    # LBSGD(loss_scaler=...) with a window at the Trainer
        return 'lbsgd', dict(learning_rate=0.1, momentum=0.9, multi_precision=True,
                             batch_scale=2, warmup_epochs=1, updates_per_epoch=4,
                             loss_scaler=scaler)
    assert name == 'lblamb-bert'   # README "LAMB: 'lblamb'", the BERT recipe (shortened)
    sched = mx_lbsgd.WarmupScheduler(base_lr=1e-2, warmup_steps=2, strategy='linear',
                                     decay='poly', power=1, max_update=20)
    return 'lblamb', dict(learning_rate=1e-2, wd=0.01, trust_exclude=True, batch_scale=2,
                          multi_precision=True, lr_scheduler=sched, loss_scaler=scaler)


def make_run(name, contexts=1):
    ctx = [mx.cpu(k) for k in range(contexts)]
    net = mlp(hidden=(32,), dtype='float16')
    net.collect_params().reset_ctx(ctx)
    scaler = make_scaler()
    opt, params = recipe(name, scaler)
    trainer = gluon.Trainer(net.collect_params(), opt, params, update_on_kvstore=False,
                            kvstore='device' if contexts > 1 else None)
    return net, scaler, trainer, ctx


def run(net, scaler, trainer, ctx, begin, end):
    """Steps begin..end-1 as the recipe writes them; per step the scaled loss (what the
    user's scaler multiplied) and the scale, read back."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    out = []
    for step in range(begin, end):
        x = np.asarray(X[step * BATCH:(step + 1) * BATCH], np.float16)
        y = Y[step * BATCH:(step + 1) * BATCH]
        xs = gluon.utils.split_and_load(x, ctx)
        ys = gluon.utils.split_and_load(y, ctx)
        losses = []
        with autograd.record():
            for xp, yp in zip(xs, ys):
                loss = loss_fn(net(xp).astype('float32'), yp) * scaler.scale
                if step in OVERFLOW:
                    loss = loss * float('inf')
                losses.append(loss)
        autograd.backward(losses)
        trainer.step(BATCH)
        out.append((np.concatenate([l.asnumpy() for l in losses]), scaler.scale))
        assert trainer.optimizer.loss_scaler is scaler
    return out


def weights(net):
    return [p.data(c).asnumpy() for p in net.collect_params().values() for c in p.list_ctx()]


def save(route, trainer, path):
    if route == 'mxnet':
        trainer.save_states(path)
    else:
        checkpoint.save_states(trainer, path)


def load(route, trainer, path):
    if route == 'mxnet':
        trainer.load_states(path)
    else:
        checkpoint.load_states(trainer, path)


@pytest.mark.parametrize('route', ['mxnet', 'checkpoint'])
@pytest.mark.parametrize('name, stop, contexts', [
    ('lssgd', 5, 1), ('lbsgd-B2', 5, 1), ('lblamb-bert', 5, 1),
    ('lssgd', 4, 2), ('lblamb-bert', 4, 2)])
def test_resumed_recipe_matches_uninterrupted_run(tmp_path, route, name, stop, contexts):
    if route == 'mxnet' and contexts > 1 and stop % 2:
        pytest.skip("MXNet's save_states keeps one device's states (window boundary only)")
    net_a, scaler_a, trainer_a, ctx = make_run(name, contexts)
    whole = run(net_a, scaler_a, trainer_a, ctx, 0, STEPS)

    net_b, scaler_b, trainer_b, ctx = make_run(name, contexts)
    first = run(net_b, scaler_b, trainer_b, ctx, 0, stop)
    assert scaler_b.scale != make_scaler().scale            # the overflow moved it
    path = str(tmp_path / 'run.states')
    save(route, trainer_b, path)
    net_b.save_parameters(str(tmp_path / 'run.params'))

    net_c, scaler_c, trainer_c, ctx = make_run(name, contexts)   # a new process's objects
    net_c.load_parameters(str(tmp_path / 'run.params'), ctx=ctx)
    load(route, trainer_c, path)
    assert trainer_c.optimizer.loss_scaler is scaler_c
    assert scaler_c.state_dict() == scaler_b.state_dict()
    rest = run(net_c, scaler_c, trainer_c, ctx, stop, STEPS)

    for (loss_a, scale_a), (loss_c, scale_c) in zip(whole, first + rest):
        np.testing.assert_array_equal(loss_a, loss_c)
        assert scale_a == scale_c
    for a, c in zip(weights(net_a), weights(net_c)):
        np.testing.assert_array_equal(a, c)
    assert scaler_c.state_dict() == scaler_a.state_dict()
    assert trainer_c.optimizer.num_update == trainer_a.optimizer.num_update


def _mlp32_trainer(opt, params):
    net = mlp(hidden=(16,))
    return net, gluon.Trainer(net.collect_params(), opt, params, kvstore=None)


def _one_step(net, trainer, scale, overflow=False):
    x, y = nd.array(X[:8]), nd.array(Y[:8])
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y) * scale
        if overflow:
            loss = loss * float('inf')
    loss.backward()
    trainer.step(8)


def test_updater_set_states_keeps_the_live_scaler():
    """A bare Updater (and Module's, kvstore's): set_states with an optimizer inside puts
    the file's scaler state into the live scaler, which the loaded optimizer then uses."""
    scaler = make_scaler()
    opt = mx.optimizer.create('lssgd', learning_rate=0.1, loss_scaler=scaler)
    updater = mx.optimizer.get_updater(opt)
    w, g = nd.ones((3,)), nd.array([1.0, np.inf, 0.0])
    updater(0, g, w)                                 # overflow: 1024 -> 512
    blob = updater.get_states(dump_optimizer=True)
    saved = scaler.state_dict()
    updater(0, nd.ones((3,)), w)                     # the live scaler moves on
    assert scaler.state_dict() != saved
    updater.set_states(blob)
    assert updater.optimizer is not opt and updater.optimizer.loss_scaler is scaler
    assert scaler.state_dict() == saved and scaler.scale == 512


def test_a_copy_keeps_its_own_scaler():
    """Pickling or deep-copying an optimizer outside a loader makes an independent copy:
    the original keeps the user's scaler untouched."""
    import copy
    scaler = make_scaler()
    opt = mx.optimizer.create('lssgd', learning_rate=0.1, loss_scaler=scaler)
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert opt.loss_scaler is scaler and clone.loss_scaler is not scaler
        assert clone.loss_scaler.state_dict() == scaler.state_dict()
        clone.loss_scaler.update(True)
        assert scaler.scale == 2.0 ** 10


def test_mxnet_load_of_an_unscaled_optimizer_warns(tmp_path):
    net, trainer = _mlp32_trainer('lbsgd', dict(learning_rate=0.1))
    _one_step(net, trainer, 1.0)
    path = str(tmp_path / 'plain.states')
    trainer.save_states(path)
    scaler = make_scaler()
    net2, trainer2 = _mlp32_trainer('lssgd', dict(learning_rate=0.1, loss_scaler=scaler))
    with pytest.warns(RuntimeWarning, match='does not scale the loss'):
        trainer2.load_states(path)
    net3, trainer3 = _mlp32_trainer('lssgd', dict(learning_rate=0.1, loss_scaler=scaler))
    _one_step(net3, trainer3, scaler.scale)
    trainer3.save_states(path)
    with pytest.warns(RuntimeWarning, match='scales the loss'):
        trainer.load_states(path)


def test_module_checkpoint_restores_the_user_scaler(tmp_path):
    """Module: mx_lbsgd.checkpoint carries the scaler state (MXNet's
    save_optimizer_states has no optimizer in it) into the live scaler that the
    scale_gradient op reads."""
    from mx_lbsgd.loss_scaling import graph as _graph_scale

    def module(scaler):
        data = mx.sym.Variable('data')
        out = mx_lbsgd.scale_gradient(mx.sym.FullyConnected(data, num_hidden=10, name='fc'),
                                      key='resume-test')
        mod = mx.mod.Module(mx.sym.SoftmaxOutput(out, name='softmax'), context=mx.cpu())
        mod.bind([('data', (8, 64))], [('softmax_label', (8,))])
        mod.init_params(mx.init.Xavier())
        mod.init_optimizer(optimizer='lssgd', optimizer_params=dict(
            learning_rate=0.1, loss_scaler=scaler, scale_key='resume-test'))
        return mod

    scaler_b = make_scaler()
    mod_b = module(scaler_b)
    batch = mx.io.DataBatch([nd.array(X[:8])], [nd.array(Y[:8])])
    poisoned = mx.io.DataBatch([nd.array(np.full((8, 64), np.inf))], [nd.array(Y[:8])])
    for b in (poisoned, batch, batch):
        mod_b.forward_backward(b)
        mod_b.update()
    assert scaler_b.scale == 512 and scaler_b.num_good_steps == 2
    checkpoint.save_checkpoint(mod_b, str(tmp_path / 'm'), 1)
    scaler_c = make_scaler()
    mod_c = module(scaler_c)
    checkpoint.load_states(mod_c, str(tmp_path / 'm-0001.states'))
    assert mod_c._optimizer.loss_scaler is scaler_c
    assert scaler_c.state_dict() == scaler_b.state_dict()
    assert _graph_scale.served('resume-test') is scaler_c


# -- the LossScaling hook's scaler --------------------------------------------------------------
def _hook_run(scaling, net, trainer, begin, end):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    out = []
    for step in range(begin, end):
        x = nd.array(X[step * BATCH:(step + 1) * BATCH], dtype='float16')
        y = nd.array(Y[step * BATCH:(step + 1) * BATCH])
        with autograd.record():
            loss = scaling.scale_loss(loss_fn(net(x).astype('float32'), y))
            if step in OVERFLOW:
                loss = loss * float('inf')
        loss.backward()
        scaling.step(BATCH)
        out.append((loss.asnumpy(), scaling.scaler.scale))
    return out


def _hook_setup():
    net = mlp(hidden=(32,), dtype='float16')
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(
        learning_rate=0.1, momentum=0.9, multi_precision=True), update_on_kvstore=False)
    scaler = make_scaler()
    return net, trainer, scaler, mx_lbsgd.LossScaling(trainer, scaler)


def test_hook_scaler_resumes_through_a_checkpoint(tmp_path):
    net_a, trainer_a, scaler_a, scaling_a = _hook_setup()
    whole = _hook_run(scaling_a, net_a, trainer_a, 0, STEPS)
    net_b, trainer_b, scaler_b, scaling_b = _hook_setup()
    first = _hook_run(scaling_b, net_b, trainer_b, 0, 5)
    path = str(tmp_path / 'hook.states')
    checkpoint.save_states(trainer_b, path)
    net_b.save_parameters(str(tmp_path / 'hook.params'))
    net_c, trainer_c, scaler_c, scaling_c = _hook_setup()
    net_c.load_parameters(str(tmp_path / 'hook.params'))
    checkpoint.load_states(trainer_c, path)
    assert scaling_c.scaler is scaler_c and scaler_c.state_dict() == scaler_b.state_dict()
    rest = _hook_run(scaling_c, net_c, trainer_c, 5, STEPS)
    for (loss_a, scale_a), (loss_c, scale_c) in zip(whole, first + rest):
        np.testing.assert_array_equal(loss_a, loss_c)
        assert scale_a == scale_c
    for a, c in zip(weights(net_a), weights(net_c)):
        np.testing.assert_array_equal(a, c)

    net_d = mlp(hidden=(32,), dtype='float16')      # no hook attached: said, not dropped
    trainer_d = gluon.Trainer(net_d.collect_params(), 'sgd', dict(
        learning_rate=0.1, momentum=0.9, multi_precision=True), update_on_kvstore=False)
    with pytest.warns(RuntimeWarning, match='LossScaling hook'):
        checkpoint.load_states(trainer_d, path)


def _rewrite(path, edit):
    """Re-write an mx_lbsgd states file after `edit(content)`, with a valid checksum."""
    with open(path, 'rb') as f:
        blob = f.read()
    head = len(checkpoint.MX_LBSGD_MAGIC) + 32
    content = pickle.loads(blob[head:])
    edit(content)
    payload = pickle.dumps(content)
    with open(path, 'wb') as f:
        f.write(blob[:len(checkpoint.MX_LBSGD_MAGIC)] + hashlib.sha256(payload).digest()
                + payload)


@pytest.mark.parametrize('bad', [{'scale': 'x'}, {'scale': float('inf')}, None])
def test_malformed_scaler_state_is_refused_before_any_change(tmp_path, bad):
    scaler = make_scaler()
    net, trainer = _mlp32_trainer('lssgd', dict(learning_rate=0.1, loss_scaler=scaler))
    _one_step(net, trainer, scaler.scale, overflow=True)
    path = str(tmp_path / 'bad.states')
    checkpoint.save_states(trainer, path)

    def edit(content):
        state = content['progress']['loss_scaler']
        if bad is None:
            del state['state']['total_steps']
        else:
            state['state'].update(bad)
    _rewrite(path, edit)
    live = make_scaler()
    net2, trainer2 = _mlp32_trainer('lssgd', dict(learning_rate=0.1, loss_scaler=live))
    before = live.state_dict()
    with pytest.raises(ValueError, match='loss scaler state'):
        checkpoint.load_states(trainer2, path)
    assert live.state_dict() == before
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert trainer2._updaters[0].states == {}
