"""Loss-scaled optimizers ('lssgd', LBSGD(loss_scaler=...)) against unscaled control runs."""
import pickle
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import DynamicLossScaler
from mx_lbsgd.counting import count_host_syncs

pytestmark = [pytest.mark.unit, pytest.mark.fallback, pytest.mark.pipeline]

CTX2 = [mx.cpu(0), mx.cpu(1)]


def make_params(n, dtypes, ctxs, seed=0):
    """n small parameters; dtypes cycles over the given dtypes (mixed fp16/fp32 groups)."""
    rng = np.random.RandomState(seed)
    params = []
    for i in range(n):
        p = gluon.Parameter('p%d' % i, shape=(2 + i % 4,), dtype=dtypes[i % len(dtypes)])
        p.initialize(ctx=ctxs)
        p.set_data(nd.array(rng.uniform(-1, 1, p.shape)))
        params.append(p)
    return params


def backward(params, ctxs, step, scale):
    """A loss whose gradient differs per parameter, device and step, times `scale`."""
    with autograd.record():
        losses = []
        for k, ctx in enumerate(ctxs):
            terms = [(p.data(ctx).astype('float32') * (1 + 0.1 * ((i + k + step) % 7))).square()
                     .sum() for i, p in enumerate(params)]
            losses.append(nd.add_n(*terms) * scale)
    autograd.backward(losses)


def weights(params):
    return [d.asnumpy().astype(np.float64) for p in params for d in p.list_data()]


def run(params, ctxs, optimizer, opt_params, steps, inject=(), kvstore='device'):
    """Trains for `steps`; `inject` maps step -> (param, device, value) written into one
    gradient after backward. An unscaled optimizer simply does not step there."""
    trainer = gluon.Trainer(params, optimizer, opt_params, kvstore=kvstore,
                            update_on_kvstore=False if kvstore else None)
    scaler = getattr(trainer.optimizer, 'loss_scaler', None)
    scales, skipped = [], []
    for step in range(steps):
        backward(params, ctxs, step, scaler.scale if scaler else 1.0)
        if step in inject:
            j, k, value = inject[step]
            params[j].list_grad()[k][:] = value
            if scaler is None:
                continue
        trainer.step(1)
        if scaler:
            scales.append(scaler.scale)
            skipped.append(trainer.optimizer.last_step_skipped)
    return trainer, scales, skipped


def expected_scales(init, growth_interval, overflow):
    """init * 2**k * 0.5**j along the steps (k growths, j backoffs)."""
    scale, good, out = init, 0, []
    for bad in overflow:
        if bad:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2, 0
        out.append(scale)
    return out


SGD = dict(learning_rate=0.05, momentum=0.9, wd=1e-3)


@pytest.mark.parametrize('n, dtypes, ctxs, kvstore, inject, fused', [
    pytest.param(6, ['float32'], CTX2[:1], None, {}, False, id='no-overflow'),
    pytest.param(6, ['float32'], CTX2[:1], None, {3: (2, 0, np.inf), 5: (0, 0, -np.inf)},
                 False, id='inf-and-minus-inf'),
    pytest.param(6, ['float32'], CTX2[:1], None, {2: (5, 0, np.nan)}, True, id='nan-fused'),
    pytest.param(230, ['float32'], CTX2[:1], None, {3: (225, 0, np.inf)}, True,
                 id='beyond-first-chunk-fused'),
    pytest.param(230, ['float32'], CTX2[:1], None, {3: (225, 0, np.inf)}, False,
                 id='beyond-first-chunk'),
    pytest.param(8, ['float32'], CTX2, None, {2: (6, 1, np.inf)}, False,
                 id='one-of-two-devices-unreduced'),
    pytest.param(8, ['float32'], CTX2, 'device', {2: (6, 1, np.inf), 4: (1, 0, np.nan)},
                 False, id='one-of-two-devices-allreduce'),
    pytest.param(9, ['float16', 'float32'], CTX2, None, {1: (7, 1, np.inf), 4: (4, 0, np.inf)},
                 False, id='mixed-dtypes-two-devices'),
])
def test_scaled_equals_control(n, dtypes, ctxs, kvstore, inject, fused):
    mp = 'float16' in dtypes
    control = make_params(n, dtypes, ctxs)
    scaled = make_params(n, dtypes, ctxs)
    run(control, ctxs, 'sgd', dict(SGD, multi_precision=mp), 7, inject, kvstore)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    trainer, scales, skipped = run(scaled, ctxs, 'lssgd',
                                   dict(SGD, multi_precision=mp, loss_scaler=scaler,
                                        fused=fused), 7, inject, kvstore)
    overflow = [s in inject for s in range(7)]
    assert skipped == overflow
    assert scales == expected_scales(2.0 ** 10, 2, overflow)
    assert scaler.total_skipped == len(inject) and scaler.total_steps == 7
    tol = 2e-3 if mp else 1e-6
    for a, b in zip(weights(control), weights(scaled)):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def _module_like_update(opt, steps, inject, dtypes=('float16', 'float32'), n=6, nd_=2):
    """Drives one Updater as Module does: indices i*num_device+k, no param_dict, one call per
    device (which the Updater splits by dtype), gradient arrays reused from step to step and
    identical on every device (the kvstore reduced them). `inject` maps step -> parameter."""
    rng = np.random.RandomState(3)
    updater = mx.optimizer.get_updater(opt)
    ws = [[nd.array(rng.uniform(-1, 1, (3,)), ctx=CTX2[k], dtype=dtypes[i % len(dtypes)])
           for k in range(nd_)] for i in range(n)]
    gs = [[nd.zeros((3,), ctx=CTX2[k], dtype=dtypes[i % 2]) for k in range(nd_)]
          for i in range(n)]
    history = []
    for step in range(steps):
        for i in range(n):
            value = np.inf if inject.get(step) == i else rng.uniform(-1, 1, (3,)) * 64
            for k in range(nd_):
                gs[i][k][:] = value
        for k in range(nd_):
            updater([i * nd_ + k for i in range(n)], [gs[i][k] for i in range(n)],
                    [ws[i][k] for i in range(n)])
        history.append([w.asnumpy().astype(np.float64) for row in ws for w in row])
    return history, updater


@pytest.mark.parametrize('inject', [
    pytest.param({0: 1}, id='first-step-second-dtype-group'),
    pytest.param({2: 5}, id='later-step-second-dtype-group'),
    pytest.param({1: 0, 3: 3}, id='both-groups'),
])
def test_module_pattern_skips_all_groups(inject):
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100)
    opt = mx_lbsgd.LossScaledSGD(learning_rate=0.1, momentum=0.9, multi_precision=True,
                                 loss_scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)      # no "partly skipped" step
        history, updater = _module_like_update(opt, 5, inject)
    initial = _module_like_update(mx_lbsgd.LossScaledSGD(learning_rate=0.0, multi_precision=True),
                                  1, {0: 0})[0][0]
    for step in inject:
        before = history[step - 1] if step else [w.astype(np.float64) for w in initial]
        for a, b in zip(before, history[step]):
            np.testing.assert_array_equal(a, b)
    assert scaler.total_skipped == len(inject)
    applied = [s for s in range(5) if s not in inject]
    assert opt.num_update == len(applied)


def test_one_host_sync_per_step():
    params = make_params(12, ['float16', 'float32'], CTX2)
    trainer = gluon.Trainer(params, 'lssgd', dict(SGD, multi_precision=True), kvstore=None)
    for step in range(4):
        backward(params, CTX2, step, trainer.optimizer.loss_scaler.scale)
        with count_host_syncs(include_waitall=False) as calls:
            trainer.step(1)
        assert calls == [flag_read()], calls


@pytest.mark.parametrize('count, expected_num_update', [
    pytest.param(False, 4, id='skips-not-counted'),
    pytest.param(True, 6, id='skips-counted'),
])
def test_count_skipped_steps(count, expected_num_update):
    params = make_params(4, ['float32'], CTX2[:1])
    sched = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5)
    trainer, _, skipped = run(params, CTX2[:1], 'lssgd',
                              dict(SGD, lr_scheduler=sched, count_skipped_steps=count),
                              6, {1: (0, 0, np.inf), 2: (3, 0, np.nan)}, None)
    opt = trainer.optimizer
    assert skipped == [False, True, True, False, False, False]
    assert opt.num_update == expected_num_update
    assert opt.micro_batches == 4


def test_skip_leaves_weights_momentum_and_master_untouched():
    params = make_params(5, ['float16'], CTX2[:1])
    trainer, _, _ = run(params, CTX2[:1], 'lssgd', dict(SGD, multi_precision=True), 2)
    states = trainer._updaters[0].states
    snapshot = lambda: ([w for w in weights(params)]    # noqa: E731
                        + [a.asnumpy() for s in states.values() for a in s if isinstance(a, nd.NDArray)])
    before = snapshot()
    backward(params, CTX2[:1], 2, trainer.optimizer.loss_scaler.scale)
    params[4].list_grad()[0][:] = np.inf
    trainer.step(1)
    assert trainer.optimizer.last_step_skipped
    for a, b in zip(before, snapshot()):
        np.testing.assert_array_equal(a, b)


def test_lbsgd_accumulation_with_loss_scaling_matches_unscaled():
    """batch_scale=4 with a scale that changes inside the window (an overflow micro-step
    and a growth) equals LBSGD without scaling fed the unscaled micro-batches."""
    rng = np.random.RandomState(0)
    shapes = [(4, 3), (3,), (5,)]
    w0 = [rng.uniform(-1, 1, s) for s in shapes]
    grads = [[rng.uniform(-1, 1, s) for s in shapes] for _ in range(11)]
    overflow = {3, 8}
    common = dict(learning_rate=0.1, momentum=0.9, wd=1e-3, warmup_epochs=1,
                  updates_per_epoch=8, batch_scale=4, multi_precision=True)
    plain = mx_lbsgd.LBSGD(**common)
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    scaled = mx_lbsgd.LBSGD(loss_scaler=scaler, **common)
    results = []
    for opt, use_scale in ((plain, False), (scaled, True)):
        updater = mx.optimizer.get_updater(opt)
        ws = [nd.array(w, dtype='float16') for w in w0]
        for step, gs in enumerate(grads):
            if not use_scale and step in overflow:
                continue
            s = scaler.scale if use_scale else 1.0
            g_nd = [nd.array(g * s, dtype='float16') for g in gs]
            if use_scale and step in overflow:
                g_nd[1][:] = np.inf
            updater(list(range(len(ws))), g_nd, ws)
        results.append([w.asnumpy() for w in ws])
    assert scaler.total_skipped == 2
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3)
    assert any(np.abs(b - w).max() > 0.01 for b, w in zip(results[1], w0))   # it trained


def test_state_round_trip_through_trainer_save_states(tmp_path):
    """Save mid growth window, load into a fresh trainer, continue: same weights and scale
    as an uninterrupted run."""
    scaler_kw = dict(init_scale=2.0 ** 8, growth_interval=3)
    inject = {1: (0, 0, np.inf)}

    def fresh():
        params = make_params(5, ['float16', 'float32'], CTX2[:1])
        trainer = gluon.Trainer(params, 'lssgd', dict(
            SGD, multi_precision=True, loss_scaler=DynamicLossScaler(**scaler_kw)), kvstore=None)
        return params, trainer

    def steps(params, trainer, begin, end):
        for step in range(begin, end):
            backward(params, CTX2[:1], step, trainer.optimizer.loss_scaler.scale)
            if step in inject:
                params[0].list_grad()[0][:] = np.inf
            trainer.step(1)

    params_a, trainer_a = fresh()
    steps(params_a, trainer_a, 0, 8)
    params_b, trainer_b = fresh()
    steps(params_b, trainer_b, 0, 4)
    assert trainer_b.optimizer.loss_scaler.num_good_steps == 2     # inside the window
    path = str(tmp_path / 'trainer.states')
    trainer_b.save_states(path)
    params_c, trainer_c = fresh()
    for pc, pb in zip(params_c, params_b):
        pc.set_data(pb.data())
    trainer_c.load_states(path)
    assert trainer_c.optimizer.loss_scaler.state_dict() == \
        trainer_b.optimizer.loss_scaler.state_dict()
    steps(params_c, trainer_c, 4, 8)
    for a, c in zip(weights(params_a), weights(params_c)):
        np.testing.assert_array_equal(a, c)
    assert trainer_c.optimizer.loss_scaler.state_dict() == \
        trainer_a.optimizer.loss_scaler.state_dict()


def test_pickle_keeps_scaler_and_refuses_kvstore_protocol():
    opt = mx_lbsgd.LossScaledSGD(loss_scaler=DynamicLossScaler(init_scale=32.0))
    opt.loss_scaler.update(False)
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    with pytest.raises(ValueError, match='update_on_kvstore'):
        pickle.dumps(opt, 0)
    pickle.dumps(mx_lbsgd.LBSGD(), 0)       # no loss scaler: servers may update


def test_registered_and_arguments():
    opt = mx.optimizer.create('lssgd', loss_scaler=128.0)
    assert isinstance(opt, mx_lbsgd.LossScaledSGD)
    assert opt.loss_scaler.scale == 128.0 and not opt.loss_scaler.dynamic
    assert mx.optimizer.create('lssgd').loss_scaler.scale == 2.0 ** 16
    with pytest.raises(TypeError, match='loss_scaler'):
        mx_lbsgd.LossScaledSGD(loss_scaler='big')
    with pytest.raises(ValueError, match='momentum'):
        mx_lbsgd.LossScaledSGD(momentum=1.5)


@pytest.mark.parametrize('uok', [pytest.param(True, id='explicit'),
                                 pytest.param(None, id='automatic')])
def test_trainer_update_on_kvstore_refused_before_any_change(uok):
    params = make_params(3, ['float32'], CTX2)
    trainer = gluon.Trainer(params, 'lssgd', SGD, kvstore='device', update_on_kvstore=uok)
    before = weights(params)
    backward(params, CTX2, 0, trainer.optimizer.loss_scaler.scale)
    with pytest.raises(ValueError, match='update_on_kvstore=False'):
        trainer.step(1)
    with pytest.raises(ValueError, match='update_on_kvstore=False'):
        trainer.step(1)
    for a, b in zip(before, weights(params)):
        np.testing.assert_array_equal(a, b)


def test_hook_refuses_loss_scaled_optimizer():
    params = make_params(3, ['float32'], CTX2[:1])
    trainer = gluon.Trainer(params, 'lssgd', SGD, kvstore=None)
    with pytest.raises(ValueError, match='already scales the loss'):
        mx_lbsgd.LossScaling(trainer)


def test_hook_one_host_sync_per_step():
    params = make_params(12, ['float16', 'float32'], CTX2)
    trainer = gluon.Trainer(params, 'sgd', dict(SGD, multi_precision=True), kvstore='device',
                            update_on_kvstore=False)
    scaling = mx_lbsgd.LossScaling(trainer, DynamicLossScaler(init_scale=256.0))
    for step in range(3):
        backward(params, CTX2, step, scaling.scale)
        with count_host_syncs(include_waitall=False) as calls:
            assert scaling.step(1)
        assert calls == [flag_read()], calls


def _subset_steps(optimizer):
    """Three steps of two layers, the second without layer b (ignore_stale_grad)."""
    a = gluon.nn.Dense(2, in_units=2, use_bias=False, prefix='a_')
    b = gluon.nn.Dense(2, in_units=2, use_bias=False, prefix='b_')
    a.initialize(mx.init.One())
    b.initialize(mx.init.One())
    params = a.collect_params()
    params.update(b.collect_params())
    trainer = gluon.Trainer(params, optimizer, {'learning_rate': 1.0}, kvstore=None)
    history = []
    for use_b, g in ((True, 1.0), (False, 1.0), (True, 10.0)):
        scaler = getattr(trainer.optimizer, 'loss_scaler', None)
        with autograd.record():
            out = a(nd.ones((1, 2)) * g).sum()
            if use_b:
                out = out + b(nd.ones((1, 2)) * g).sum()
            loss = out * (scaler.scale if scaler else 1.0)
        loss.backward()
        trainer.step(1, ignore_stale_grad=True)
        history.append((a.weight.data().asnumpy(), b.weight.data().asnumpy()))
    return history


def test_step_with_a_subset_of_parameters_applies_at_once():
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        scaled = _subset_steps('lssgd')
    for (a1, b1), (a2, b2) in zip(_subset_steps('sgd'), scaled):
        np.testing.assert_array_equal(a1, a2)
        np.testing.assert_array_equal(b1, b2)


def test_hook_with_accumulation_and_a_changing_scale():
    """LossScaling over LBSGD(batch_scale=2): each micro-batch is unscaled by its own scale."""
    results = []
    for growth_interval in (1000, 1):
        w = gluon.Parameter('w', shape=(1,), init=mx.init.Zero())
        w.initialize()
        trainer = gluon.Trainer([w], 'lbsgd', dict(learning_rate=1.0, batch_scale=2,
                                                    warmup_epochs=0), kvstore=None)
        scaling = mx_lbsgd.LossScaling(trainer, DynamicLossScaler(
            init_scale=4.0, growth_interval=growth_interval), force=True)
        for _ in range(2):
            with autograd.record():
                loss = scaling.scale_loss(w.data() * 1.0)
            loss.backward()
            scaling.step(1)
        results.append(w.data().asscalar())
    assert results[0] == results[1] != 0.0


# -- warmup and accumulation positions do not advance on a skipped step -------------------
from reference import LBSGDReference  # noqa: E402
from harness import flag_read  # noqa: E402

WARM = dict(learning_rate=0.1, momentum=0.9, wd=1e-3, warmup_strategy='linear',
            warmup_epochs=1, updates_per_epoch=16)


@pytest.mark.parametrize('B, count', [
    pytest.param(1, False, id='B1'),
    pytest.param(1, True, id='B1-count-skipped'),
    pytest.param(2, False, id='B2'),
    pytest.param(3, True, id='B3-count-skipped'),
])
def test_module_path_warmup_skips_overflow_steps(B, count):
    """Through mx.optimizer.get_updater (Module's path, no Trainer): every micro-batch is a
    loss-scaling step; the weights are the reference's fed only the finite micro-batches,
    unscaled by the scale each one carried."""
    rng = np.random.RandomState(7)
    shapes, names = [(4, 3), (3,), (5,)], ['fc_weight', 'fc_bias', 'out_weight']
    w0 = [rng.uniform(-1, 1, s) for s in shapes]
    steps, overflow = 14, {2, 5, 6, 11}
    grads = [[rng.uniform(-1, 1, s) for s in shapes] for _ in range(steps)]
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)   # scale moves every step
    opt = mx_lbsgd.LBSGD(batch_scale=B, rescale_grad=0.5, loss_scaler=scaler,
                         count_skipped_steps=count, scale_key='warmup-module-%d' % B, **WARM)
    updater = mx.optimizer.get_updater(opt)
    ws = [nd.array(w) for w in w0]
    scales = []
    for step, gs in enumerate(grads):
        scales.append(scaler.scale)
        g_nd = [nd.array(g * scaler.scale) for g in gs]
        if step in overflow:
            g_nd[step % 3][:] = np.inf if step % 2 else np.nan
        updater(list(range(len(ws))), g_nd, ws)
    assert len(set(scales)) > 2                 # the unscaling really varied
    ref = LBSGDReference(w0, names, lr=0.1, wd=1e-3, momentum=0.9, strategy='linear', B=B,
                         warmup_epochs=1, updates_per_epoch=16, rescale=0.5)
    for step, gs in enumerate(grads):
        if step not in overflow:
            ref.step(gs)
    for w, r in zip(ws, ref.w):
        np.testing.assert_allclose(w.asnumpy(), r, rtol=1e-5, atol=1e-6)
    applied = steps - len(overflow)
    assert scaler.total_skipped == len(overflow) and scaler.total_steps == steps
    assert opt.micro_batches == applied     # the warmup position
    assert opt.num_update == (steps if count else applied)


def _trainer_run(B, count, steps, inject, ctxs, kvstore, init_scale=16.0):
    """gluon Trainer over LBSGD(loss_scaler, batch_scale=B), trainer.step every micro-batch.
    `inject`: micro-batches whose gradient on the last device is set to inf. Returns the
    start weights, the summed (unscaled) gradients per micro-batch, params, trainer, scaler."""
    rng = np.random.RandomState(0)
    params = [gluon.Parameter('l%d_%s' % (i, 'bias' if i % 2 else 'weight'), shape=(3 + i,))
              for i in range(4)]
    start = [rng.uniform(-1, 1, p.shape) for p in params]
    for p, w in zip(params, start):
        p.initialize(ctx=ctxs)
        p.set_data(nd.array(w))
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1)
    trainer = gluon.Trainer(params, 'lbsgd', dict(
        WARM, batch_scale=B, loss_scaler=scaler, count_skipped_steps=count),
        kvstore=kvstore, update_on_kvstore=False if kvstore else None)
    grads, scales = [], []
    for step in range(steps):
        per_dev = [[rng.uniform(-1, 1, p.shape) for p in params] for _ in ctxs]
        scale = scaler.scale
        scales.append(scale)
        with autograd.record():
            losses = [nd.add_n(*[(p.data(c) * nd.array(g, ctx=c)).sum()
                                 for p, g in zip(params, gs)]) * scale
                      for c, gs in zip(ctxs, per_dev)]
        autograd.backward(losses)
        if step in inject:
            params[step % 4].list_grad()[-1][:] = np.inf
        grads.append([sum(gs[i] for gs in per_dev) for i in range(len(params))])
        trainer.step(4)
    return start, grads, params, trainer, scaler, scales


@pytest.mark.parametrize('B, count, inject, dropped', [
    # B=1: each micro-batch is a step
    pytest.param(1, False, {1, 4, 5}, {1, 4, 5}, id='B1'),
    pytest.param(1, True, {1, 4, 5}, {1, 4, 5}, id='B1-count-skipped'),
    # B=2: an overflow in either micro-batch drops its whole window
    pytest.param(2, False, {3, 6}, {2, 3, 6, 7}, id='B2-last-then-first-micro-batch'),
    pytest.param(2, True, {0, 9}, {0, 1, 8, 9}, id='B2-count-skipped'),
    pytest.param(2, False, {2, 3, 4}, {2, 3, 4, 5}, id='B2-two-windows-in-a-row'),
    pytest.param(3, False, {4}, {3, 4, 5}, id='B3-middle-micro-batch'),
])
@pytest.mark.parametrize('ctxs, kvstore', [pytest.param(CTX2[:1], None, id='1dev'),
                                           pytest.param(CTX2, 'device', id='2dev')])
def test_trainer_warmup_continues_from_the_last_applied_window(B, count, inject, dropped,
                                                               ctxs, kvstore):
    steps = 12
    start, grads, params, trainer, scaler, scales = _trainer_run(B, count, steps, inject,
                                                                 ctxs, kvstore)
    opt = trainer.optimizer
    windows = steps // B
    assert scaler.total_steps == windows
    assert scaler.total_skipped == len(dropped) // B
    assert len(set(scales)) > 1                 # windows carried different scales
    ref = LBSGDReference(start, [p.name for p in params], lr=0.1, wd=1e-3, momentum=0.9,
                         strategy='linear', B=B, warmup_epochs=1, updates_per_epoch=16,
                         rescale=1 / 4.)
    for step, g in enumerate(grads):
        if step not in dropped:                 # the reference never sees a dropped window
            ref.step(g)
    for p, w in zip(params, ref.w):
        for d in p.list_data():
            np.testing.assert_allclose(d.asnumpy(), w, rtol=2e-5, atol=2e-5)
    applied = steps - len(dropped)
    assert opt.micro_batches == applied
    assert opt.num_update == (steps if count else applied)


# -- unpickling has no global side effects --------------------------------------------------
def _registry():
    from mx_lbsgd.loss_scaling import graph as _graph_scale
    return dict(_graph_scale._SCALERS)


def _assert_same_registry(before):
    from mx_lbsgd.loss_scaling import graph as _graph_scale
    assert set(_graph_scale._SCALERS) == set(before)
    for key, scaler in before.items():
        assert _graph_scale._SCALERS[key] is scaler, key


@pytest.mark.parametrize('make', [
    pytest.param(lambda key: mx_lbsgd.LossScaledSGD(
        momentum=0.9, loss_scaler=DynamicLossScaler(init_scale=32.0), scale_key=key),
        id='lssgd'),
    pytest.param(lambda key: mx.optimizer.create('lssgd', loss_scaler=DynamicLossScaler(
        init_scale=32.0), scale_key=key), id='lssgd-registry'),
    pytest.param(lambda key: mx_lbsgd.LBSGD(batch_scale=2, loss_scaler=8.0, scale_key=key),
                 id='lbsgd-scaled'),
])
@pytest.mark.parametrize('how', ['pickle', 'deepcopy', 'copy'])
def test_copies_do_not_change_the_served_scalers(make, how):
    """The scale_gradient registry serves the live optimizer's scaler; a copy of the
    optimizer (pickle round trip, deepcopy) must not take the key over."""
    import copy as copy_module
    key = 'side-effects-%s' % how
    opt = make(key)
    opt.loss_scaler.update(True)              # the copy's scaler state differs from a fresh one
    live = DynamicLossScaler(init_scale=4.0)   # e.g. a newer optimizer took the key since
    from mx_lbsgd.loss_scaling import graph as _graph_scale
    _graph_scale.serve(key, live)
    before = _registry()
    if how == 'pickle':
        clone = pickle.loads(pickle.dumps(opt))
    elif how == 'deepcopy':
        clone = copy_module.deepcopy(opt)
    else:
        clone = copy_module.copy(opt)
    _assert_same_registry(before)
    assert _graph_scale.served(key) is live
    assert clone.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    if how != 'copy':
        assert clone.loss_scaler is not opt.loss_scaler


@pytest.mark.parametrize('name', ['batch_scale', 'warmup_strategy', 'warmup_epochs'])
def test_lbsgd_only_arguments_are_refused_with_the_alternative(name):
    with pytest.raises(ValueError, match="'lssgd' takes no %s.*'lbsgd' with loss_scaler" % name):
        mx.optimizer.create('lssgd', **{name: 2 if name != 'warmup_strategy' else 'linear'})
