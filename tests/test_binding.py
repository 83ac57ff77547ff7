"""The step protocol (`_binding`): which Trainer is bound and what survives a reload."""
import pickle

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd

pytestmark = pytest.mark.unit

CTX2 = [mx.cpu(0), mx.cpu(1)]


def _net(ctxs, seed=0):
    rng = np.random.RandomState(seed)
    params = [gluon.Parameter('p%d_weight' % i, shape=(3 + i,)) for i in range(3)]
    for p in params:
        p.initialize(ctx=ctxs)
        p.set_data(nd.array(rng.uniform(-1, 1, p.shape)))
    return params


def _backward(params, ctxs, step, scale=1.0, bad=False):
    rng = np.random.RandomState(100 + step)
    targets = [rng.uniform(-1, 1, p.shape) for p in params]
    with autograd.record():
        losses = [nd.add_n(*[((p.data(c) - nd.array(t, ctx=c)) ** 2).sum()
                             for p, t in zip(params, targets)]) * scale for c in ctxs]
    autograd.backward(losses)
    if bad:
        params[0].list_grad()[-1][:] = np.inf


def _args(B, scaler=True):
    return dict(learning_rate=0.1, momentum=0.9, batch_scale=B, warmup_epochs=1,
                updates_per_epoch=4, loss_scaler=mx_lbsgd.DynamicLossScaler(
                    init_scale=8.0, growth_interval=2) if scaler else None)


def _train(B, steps, second_trainer, ctxs=CTX2, inject=(2,)):
    params = _net(ctxs)
    trainer = gluon.Trainer(params, 'lbsgd', _args(B), kvstore='device',
                            update_on_kvstore=False)
    if second_trainer:   # created later over the same parameters: Parameter._trainer
        gluon.Trainer(params, 'sgd', dict(learning_rate=0.1), kvstore='device',
                      update_on_kvstore=False)
    record = []
    for step in range(steps):
        _backward(params, ctxs, step, trainer.optimizer.loss_scaler.scale, step in inject)
        trainer.step(5)
        record.append((trainer.optimizer.last_step_skipped, trainer.optimizer.num_update))
    return [p.data(ctxs[0]).asnumpy() for p in params], record


@pytest.mark.parametrize('B', [pytest.param(1, id='B1'), pytest.param(2, id='B2')])
def test_the_stepping_trainer_is_bound_not_the_last_one_created(B):
    alone, record_alone = _train(B, 6, second_trainer=False)
    shared, record_shared = _train(B, 6, second_trainer=True)
    assert record_shared == record_alone
    assert any(skipped for skipped, _ in record_alone)
    for a, b in zip(alone, shared):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('split', [pytest.param(False, id='step'),
                                   pytest.param(True, id='allreduce-then-update')])
def test_mxnet_save_states_inside_a_window_resumes(tmp_path, split):
    """MXNet's own Trainer.save_states/load_states (one device) in the middle of a window:
    the window position comes back with the counters."""
    def run(steps, trainer=None, params=None, start=0):
        params = params or _net([mx.cpu()])
        trainer = trainer or gluon.Trainer(params, 'lbsgd', _args(4, scaler=False),
                                           kvstore=None)
        for step in range(start, steps):
            _backward(params, [mx.cpu()], step)
            if split:
                trainer.allreduce_grads()
                trainer.update(5)
            else:
                trainer.step(5)
        return params, trainer

    whole, _ = run(10)
    params, trainer = run(6)
    assert trainer.optimizer.window_position == 2
    path = str(tmp_path / 'mxnet.states')
    trainer.save_states(path)
    saved = [p.data().copy() for p in params]
    params2 = _net([mx.cpu()])
    for p, w in zip(params2, saved):
        p.set_data(w)
    trainer2 = gluon.Trainer(params2, 'lbsgd', _args(4, scaler=False), kvstore=None)
    trainer2.load_states(path)
    resumed, _ = run(10, trainer2, params2, start=6)
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy())


def test_last_step_skipped_survives_pickling():
    params = _net([mx.cpu()])
    trainer = gluon.Trainer(params, 'lssgd', dict(learning_rate=0.1, loss_scaler=8.0),
                            kvstore=None)
    _backward(params, [mx.cpu()], 0, 8.0, bad=True)
    trainer.step(5)
    assert trainer.optimizer.last_step_skipped
    assert pickle.loads(pickle.dumps(trainer.optimizer)).last_step_skipped


def test_a_custom_kvstore_counts_its_workers_before_the_first_step():
    """A kvstore of the public KVStoreBase interface (not MXNet's KVStore) passed to a
    Trainer: its type and worker count are known before Trainer.step creates it."""
    from mx_lbsgd import _compat

    class ThreeWorkers(mx.kvstore.KVStoreBase):
        type = 'dist_sync'
        num_workers = 3
        rank = 0

    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', kvstore=ThreeWorkers(),
                               update_on_kvstore=False)
    assert _compat.trainer_kvstore_type(trainer) == 'dist_sync'
    assert _compat.trainer_worker_count(trainer, 2) == 3
