"""The LossScaling hook on plain gluon Trainers (any optimizer)."""
import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd
from harness import digits, mlp

pytestmark = [pytest.mark.unit, pytest.mark.fallback, pytest.mark.pipeline]

X, Y, _, _ = digits()
LOSS = mx.gluon.loss.SoftmaxCrossEntropyLoss()
PATHS = [pytest.param(True, id='fused'), pytest.param(False, id='pertensor')]


def weights(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def run(steps, scaling_kwargs=None, optimizer='sgd', inject=(), clip=None, ctxs=None,
        grad_req='write', micro=1, **trainer_kwargs):
    """Train `steps` updates; inject[k] = (param index, value) poisons update k's gradient."""
    ctxs = ctxs or [mx.cpu()]
    net = mlp()
    net.collect_params().reset_ctx(ctxs)
    net.collect_params().setattr('grad_req', grad_req)
    trainer = mx.gluon.Trainer(net.collect_params(), optimizer,
                               dict(learning_rate=0.05, momentum=0.9), **trainer_kwargs)
    scaling = (mx_lbsgd.LossScaling(trainer, **scaling_kwargs)
               if scaling_kwargs is not None else None)
    params = list(net.collect_params().values())
    scales, applied = [], []
    for step in range(steps):
        for m in range(micro):
            i = (step * micro + m) * 16
            xs = mx.gluon.utils.split_and_load(mx.nd.array(X[i:i + 16]), ctxs)
            ys = mx.gluon.utils.split_and_load(mx.nd.array(Y[i:i + 16]), ctxs)
            with mx.autograd.record():
                losses = [LOSS(net(x), y) for x, y in zip(xs, ys)]
                if scaling:
                    losses = scaling.scale_loss(losses)
            mx.autograd.backward(losses)
        for index, value, ctx_i in [v for k, v in inject if k == step]:
            params[index].list_grad()[ctx_i][:] = value
        if scaling:
            if clip:
                scaling.unscale()
                scaling.clip_global_norm(clip)
            applied.append(scaling.step(16 * micro))
            scales.append(scaling.scaler.scale)
        else:
            if clip:
                grads = [p.grad() for p in params]
                mx.gluon.utils.clip_global_norm(grads, clip)
            trainer.step(16 * micro)
        if grad_req == 'add':
            for p in params:
                p.zero_grad()
    return net, trainer, scaling, scales, applied


@pytest.mark.parametrize('optimizer', ['sgd', 'lbsgd', 'nag'])
def test_scaled_equals_control_without_overflow(optimizer):
    control = weights(run(6, optimizer=optimizer)[0])
    scaled = weights(run(6, dict(scaler=1024.0, force=True), optimizer=optimizer)[0])
    for a, b in zip(control, scaled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('value', [np.inf, -np.inf, np.nan], ids=['inf', '-inf', 'nan'])
@pytest.mark.parametrize('fused', PATHS)
def test_overflow_step_is_skipped_and_scale_follows_the_rule(value, fused):
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=256.0, growth_interval=3)
    inject = [(2, (3, value, 0)), (7, (1, value, 0))]
    net, trainer, _, scales, applied = run(10, dict(scaler=scaler, force=True, fused=fused),
                                           inject=inject)
    assert applied == [True, True, False, True, True, True, True, False, True, True]
    # growth after 3 finite steps, backoff on each overflow: init * 2**k * 0.5**j
    assert scales == [256, 256, 128, 128, 128, 256, 256, 128, 128, 128]
    assert scaler.total_skipped == 2
    assert all(np.all(np.isfinite(w)) for w in weights(net))


def test_skipped_step_changes_nothing():
    net, trainer, scaling, _, _ = run(3, dict(scaler=64.0, force=True))
    before = weights(net)
    states = [s.asnumpy() for s in trainer._updaters[0].states.values()]
    num_update = trainer.optimizer.num_update
    for p in net.collect_params().values():
        p.grad()[:] = 1.0
    next(iter(net.collect_params().values())).grad()[0] = np.inf
    assert scaling.step(16) is False
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(net)))
    assert all(np.array_equal(a, s.asnumpy())
               for a, s in zip(states, trainer._updaters[0].states.values()))
    assert trainer.optimizer.num_update == num_update


def test_overflow_on_one_device_skips_everywhere():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    inject = [(1, (2, np.inf, 1))]                # only device 1's copy
    net, _, _, scales, applied = run(3, dict(scaler=32.0, force=True), inject=inject,
                                     ctxs=ctxs, kvstore='device', update_on_kvstore=False)
    assert applied == [True, False, True]
    for p in net.collect_params().values():
        np.testing.assert_array_equal(p.data(ctxs[0]).asnumpy(), p.data(ctxs[1]).asnumpy())


def test_unscale_then_clip_equals_control_clip():
    control = weights(run(4, clip=0.5)[0])
    scaled = weights(run(4, dict(scaler=512.0, force=True), clip=0.5)[0])
    for a, b in zip(control, scaled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unscale_twice_or_clip_first_raises():
    _, _, scaling, _, _ = run(1, dict(scaler=8.0, force=True))
    with pytest.raises(RuntimeError, match='unscale'):
        scaling.clip_global_norm(1.0)
    scaling.unscale()
    with pytest.raises(RuntimeError, match='already called'):
        scaling.unscale()


def test_accumulation_with_grad_req_add():
    control = weights(run(3, grad_req='add', micro=2)[0])
    net, _, _, scales, _ = run(3, dict(scaler=mx_lbsgd.DynamicLossScaler(
        init_scale=128.0, growth_interval=1), force=True), grad_req='add', micro=2)
    assert scales == [256.0, 512.0, 1024.0]        # one update per window
    for a, b in zip(control, weights(net)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_two_trainers_share_one_scaler():
    net = mlp()
    params = list(net.collect_params().values())
    t1 = mx.gluon.Trainer(params[:2], 'sgd', dict(learning_rate=0.1))
    t2 = mx.gluon.Trainer(params[2:], 'lbsgd', dict(learning_rate=0.1))
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=16.0, growth_interval=1)
    scaling = mx_lbsgd.LossScaling([t1, t2], scaler, force=True)
    for step in range(2):
        with mx.autograd.record():
            loss = scaling.scale_loss(LOSS(net(mx.nd.array(X[:8])), mx.nd.array(Y[:8])))
        loss.backward()
        if step == 1:
            params[3].grad()[:] = np.nan            # only t2's parameter
        before = weights(net)
        applied = scaling.step(8)
    assert applied is False
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(net)))
    assert scaler.scale == 16.0 and scaler.total_steps == 2


def test_update_on_kvstore_is_refused():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = mlp()
    net.collect_params().reset_ctx(ctxs)
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', kvstore='device',
                               update_on_kvstore=True)
    scaling = mx_lbsgd.LossScaling(trainer, force=True)
    with mx.autograd.record():
        losses = [LOSS(net(mx.nd.array(X[:4], ctx=c)), mx.nd.array(Y[:4], ctx=c))
                  for c in ctxs]
    mx.autograd.backward(losses)
    with pytest.raises(ValueError, match='update_on_kvstore=False'):
        scaling.step(4)


def test_float32_only_is_a_no_op_with_a_warning():
    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd')
    scaling = mx_lbsgd.LossScaling(trainer)
    with pytest.warns(UserWarning, match='no float16 gradient'):
        assert scaling.scale == 1.0
    control = weights(run(2)[0])
    with pytest.warns(UserWarning, match='no float16 gradient'):
        plain = weights(run(2, {})[0])
    for a, b in zip(control, plain):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('fused', PATHS)
def test_finite_check_beyond_the_first_chunk(fused):
    from mx_lbsgd import _kernels
    arrays = [mx.nd.ones((3,), dtype='float16' if i % 2 else 'float32') for i in range(450)]
    assert _kernels.finite_flag(arrays, fused).asscalar() == 1
    arrays[431][1] = np.inf
    assert _kernels.finite_flag(arrays, fused).asscalar() == 0


def test_finite_flag_edge_cases():
    """No arrays; two contexts; big (per-tensor) and small (multi) arrays mixed; more
    gradient sets than the plan cache holds."""
    from mx_lbsgd import _kernels
    assert _kernels.finite_flag([], None).asscalar() == 1
    big = mx.nd.ones((1 << 16,))
    small = [mx.nd.ones((5,), ctx=mx.cpu(k % 2)) for k in range(4)]
    assert _kernels.finite_flag([big] + small, None).asscalar() == 1
    small[3][2] = np.nan                       # on the second context
    assert _kernels.finite_flag([big] + small, None).asscalar() == 0
    small[3][2] = 0
    big[7] = -np.inf
    assert _kernels.finite_flag([big] + small, None).asscalar() == 0
    sets = [[mx.nd.ones((3,)) * (i % 3 - 1) / (i % 3 - 1 or np.inf)] for i in range(80)]
    flags = [_kernels.finite_flag(s, None).asscalar() for s in sets]
    assert flags == [1.0 if i % 3 != 1 else 1.0 for i in range(80)]
    assert len(_kernels._FINITE_PLANS) <= 65
    sets[5][0][0] = np.inf
    assert _kernels.finite_flag(sets[5], None).asscalar() == 0
