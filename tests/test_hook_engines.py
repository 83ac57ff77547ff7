"""The LossScaling hook (issue 30): count_skipped_steps works under it as inside the
optimizers, and its own operations (unscale, clip_global_norm, the finite check) do not
depend on how the engine reduces the gradients: several devices in one process here,
Horovod in tests/test_hook_horovod.py."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import _compat
from harness import digits, mlp

pytestmark = pytest.mark.unit

X, Y, _, _ = digits()
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
BATCH = 16
OVERFLOW = (1, 4, 5)


def _scheduler(name):
    if name == 'lblamb':
        return mx_lbsgd.WarmupScheduler(base_lr=0.01, warmup_steps=3, strategy='linear',
                                        decay='poly', power=1, max_update=12)
    return mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)


def _train(name, count, hook, steps=8):
    """`steps` steps with overflows at OVERFLOW: the loss scaler inside the optimizer
    (hook=False) or the LossScaling hook over the same optimizer without one."""
    net = mlp(hidden=16)
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 6, growth_interval=2)
    params = dict(learning_rate=None, lr_scheduler=_scheduler(name), count_skipped_steps=count)
    if name == 'lbsgd':
        params.update(momentum=0.9, warmup_epochs=0)
    if not hook:
        params['loss_scaler'] = scaler
    trainer = gluon.Trainer(net.collect_params(), name, params, kvstore=None)
    scaling = mx_lbsgd.LossScaling(trainer, scaler, force=True) if hook else None
    seen = []
    for step in range(steps):
        x, y = nd.array(X[step * BATCH:(step + 1) * BATCH]), nd.array(Y[step * BATCH:
                                                                      (step + 1) * BATCH])
        with autograd.record():
            loss = LOSS(net(x), y) * scaler.scale
            if step in OVERFLOW:
                loss = loss * float('inf')
        loss.backward()
        applied = scaling.step(BATCH) if hook else trainer.step(BATCH) is None and \
            not trainer.optimizer.last_step_skipped
        opt = trainer.optimizer
        seen.append((applied, opt.last_step_skipped, opt.num_update, opt.learning_rate,
                     scaler.scale))
    return seen, [p.data().asnumpy() for p in net.collect_params().values()]


@pytest.mark.parametrize('count', [True, False])
@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
def test_count_skipped_steps_under_the_hook_as_inside_the_optimizer(name, count):
    inside, w_inside = _train(name, count, hook=False)
    hooked, w_hooked = _train(name, count, hook=True)
    assert [s[0] for s in hooked] == [s not in OVERFLOW for s in range(len(hooked))]
    assert hooked == inside
    for a, b in zip(w_inside, w_hooked):
        np.testing.assert_array_equal(a, b)
    # what the flag changes: with it, every step advances the schedule
    assert hooked[-1][2] == (len(hooked) if count else len(hooked) - len(OVERFLOW))


# -- engines -----------------------------------------------------------------------------
def _hook_step(ctxs, clip, mean=None, monkeypatch=None, scale=2.0 ** 10):
    """One hooked step of batch BATCH split over `ctxs` (kvstore 'device' when > 1):
    (the gradients after unscale() on every device, the norm clip returned, the weights).
    `mean`: pretend the reduction left this multiple of the mean over workers."""
    if mean is not None:
        monkeypatch.setattr(_compat, 'reduced_gradient_mean_factor', lambda t: mean)
    net = mlp(hidden=16)
    net.collect_params().reset_ctx(ctxs)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(
        learning_rate=0.1, momentum=0.9), kvstore='device' if len(ctxs) > 1 else None,
        update_on_kvstore=False)
    scaling = mx_lbsgd.LossScaling(trainer, scale, force=True)
    xs = gluon.utils.split_and_load(X[:BATCH], ctxs)
    ys = gluon.utils.split_and_load(Y[:BATCH], ctxs)
    with autograd.record():
        losses = scaling.scale_loss([LOSS(net(x), y) for x, y in zip(xs, ys)])
    autograd.backward(losses)
    scaling.unscale()
    grads = [[g.asnumpy() for g in p.list_grad()] for p in net.collect_params().values()]
    norm = scaling.clip_global_norm(clip).asscalar() if clip else None
    assert scaling.step(BATCH)
    return grads, norm, [p.data(c).asnumpy() for p in net.collect_params().values()
                         for c in p.list_ctx()]


def _reference(clip, devices):
    """One process, one device, no hook, no kvstore: the gradient of each of the `devices`
    shards of the batch that split_and_load gives the devices (the same rows, so the same
    kernels at the same batch size), added up as the 'device' kvstore adds the devices'
    copies, clipped, applied.

    That sum, not the gradient of the whole batch in one pass, is what allreduce_grads()
    leaves on every device, and it is a different float32 rounding of the same real
    number: oneDNN's sgemm rounds a row of a FullyConnected differently at another batch
    size (16 rows against 8: rows 6, 7, 14, 15 of the first layer's output differ by an
    ulp or two with its AVX2 kernels, nearly every row with its AVX-512 ones, at any
    number of threads), and the bias gradient's loop over 16 rows is not the sum of two
    loops over 8. Where the rows cancel (dense0_bias[6]: 16 terms, sum|t| = 3.44, sum
    0.00365) those ulps make a relative difference of 4e-5 with AVX2 kernels (the old
    rtol=1e-5 held with AVX-512 ones by chance). The hook adds no rounding (the scale is a
    power of two), so against this sum the comparison is exact on any CPU."""
    net = mlp(hidden=16)
    params = list(net.collect_params().values())
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(learning_rate=0.1,
                                                              momentum=0.9), kvstore=None)
    total = None
    for x, y in zip(gluon.utils.split_data(nd.array(X[:BATCH]), devices),
                    gluon.utils.split_data(nd.array(Y[:BATCH]), devices)):
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        shard = [p.grad().asnumpy() for p in params]
        # CommDevice::Reduce (src/kvstore/comm.h) copies the devices' gradients in their
        # order and ElementwiseSum (src/ndarray/ndarray_function-inl.h) evaluates
        # in_0 + in_1 + in_2 + in_3 in float32, left to right: ((g0 + g1) + g2) + g3
        total = shard if total is None else [t + g for t, g in zip(total, shard)]
    for p, g in zip(params, total):
        p.grad()[:] = g
    norm = None
    if clip:
        # in the Trainer's order of the parameters (by name), the order the hook adds up
        # their squared norms in: in the net's order the sum of 4 can round to another ulp
        norm = gluon.utils.clip_global_norm(
            [p.grad() for p in _compat.trainer_params(trainer)], clip)
    trainer.step(BATCH)
    return total, norm, [p.data().asnumpy() for p in params]


@pytest.mark.parametrize('clip', [None, 1.0])
@pytest.mark.parametrize('devices', [1, 2, 4])
def test_unscale_and_clip_are_the_same_on_any_number_of_devices(devices, clip):
    """After allreduce_grads() on a 'device' kvstore every device holds the sum over the
    devices, i.e. the worker's gradient: unscale() gives it on every device, clipping
    clips its norm, and the update equals the one-device run without a hook that adds up
    the same shards' gradients in the kvstore's order (see `_reference`), bit for bit."""
    ref_grads, ref_norm, ref_weights = _reference(clip, devices)
    grads, norm, weights = _hook_step([mx.cpu(k) for k in range(devices)], clip)
    for ref, copies in zip(ref_grads, grads):
        assert len(copies) == devices
        for g in copies:
            np.testing.assert_array_equal(g, ref)
    if clip:
        assert ref_norm > clip          # the clip bites
        assert norm == ref_norm
    for k, w in enumerate(weights):
        np.testing.assert_array_equal(w, ref_weights[k // devices])


@pytest.mark.parametrize('devices', [1, 2])
def test_the_mean_over_workers_is_folded_back_into_the_update(monkeypatch, devices):
    """A reduction that leaves W times the mean (dist_* kvstores, Horovod on gloo) or the
    mean (Horovod with NCCL): unscale() turns it into the mean, and the update is the
    same as without the factor (it goes back into rescale_grad)."""
    ctxs = [mx.cpu(k) for k in range(devices)]
    plain, _, w_plain = _hook_step(ctxs, None)
    halved, _, w_halved = _hook_step(ctxs, None, mean=0.5, monkeypatch=monkeypatch)
    for a, b in zip(plain, halved):
        for ga, gb in zip(a, b):
            np.testing.assert_array_equal(ga * 0.5, gb)
    for a, b in zip(w_plain, w_halved):
        np.testing.assert_array_equal(a, b)


def test_mean_factor_of_local_engines():
    net = mlp(hidden=16)
    for kvstore, ctxs in ((None, [mx.cpu()]), ('device', [mx.cpu(0), mx.cpu(1)]),
                          ('local', [mx.cpu(0), mx.cpu(1)])):
        net.collect_params().reset_ctx(ctxs)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', kvstore=kvstore,
                                update_on_kvstore=False)
        assert _compat.reduced_gradient_mean_factor(trainer) == 1.0


def test_finite_check_sees_an_overflow_on_any_device():
    """The skip decision covers every device's copy after the reduction: an inf planted on
    the second device only (after allreduce_grads) skips the step on both."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = mlp(hidden=16)
    net.collect_params().reset_ctx(ctxs)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(learning_rate=0.1),
                            kvstore='device', update_on_kvstore=False)
    scaling = mx_lbsgd.LossScaling(trainer, 8.0, force=True)
    before = [p.data(c).asnumpy() for p in net.collect_params().values() for c in ctxs]
    xs = gluon.utils.split_and_load(X[:BATCH], ctxs)
    ys = gluon.utils.split_and_load(Y[:BATCH], ctxs)
    with autograd.record():
        losses = scaling.scale_loss([LOSS(net(x), y) for x, y in zip(xs, ys)])
    autograd.backward(losses)
    scaling.unscale()
    list(net.collect_params().values())[0].list_grad()[1][0, 0] = np.inf
    assert not scaling.step(BATCH)
    after = [p.data(c).asnumpy() for p in net.collect_params().values() for c in ctxs]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert list(scaling.last_overflow.parameters) == [
        list(net.collect_params().values())[0].name]


# -- the gradient noise scale monitor under the hook ----------------------------------------
def _noise_history(hook, unscale=False, steps=8):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = mlp(hidden=16)
    net.collect_params().reset_ctx(ctxs)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.05, momentum=0.9, warmup_epochs=0), kvstore='device',
        update_on_kvstore=False)
    scaling = (mx_lbsgd.LossScaling(trainer, mx_lbsgd.DynamicLossScaler(
        init_scale=2.0 ** 10, growth_interval=3), force=True) if hook else None)
    monitor = mx_lbsgd.GradientNoiseScale(trainer, interval=1, smoothing=0.0)
    for step in range(steps):
        xs = gluon.utils.split_and_load(X[step * 32:(step + 1) * 32], ctxs)
        ys = gluon.utils.split_and_load(Y[step * 32:(step + 1) * 32], ctxs)
        with autograd.record():
            losses = [LOSS(net(x), y) for x, y in zip(xs, ys)]
            if hook:
                losses = scaling.scale_loss(losses)
        autograd.backward(losses)
        if hook:
            if unscale:
                scaling.unscale()
            scaling.step(32)
        else:
            trainer.step(32)
    if hook:
        assert scaling.scaler.scale == 2.0 ** 12       # it grew twice on the way
    return [(h['update'], h['b_small'], h['b_big'], h['small_sq'], h['big_sq'])
            for h in monitor.history]


@pytest.mark.parametrize('unscale', [False, True])
def test_noise_scale_monitor_sees_through_the_hook(unscale):
    """GradientNoiseScale over a hooked Trainer: the hook's scale and batch are taken out,
    so the raw norms and batch sizes are those of the same run without the hook (with
    unscale() before the first step() the batch is not known yet: that update is left
    out)."""
    plain = _noise_history(False)
    hooked = _noise_history(True, unscale)
    if unscale:
        assert [h[0] for h in hooked] == [h[0] for h in plain[1:]]
        plain = plain[1:]
    assert len(hooked) == len(plain) > 5
    for a, b in zip(plain, hooked):
        assert a[:3] == b[:3]
        np.testing.assert_allclose(b[3:], a[3:], rtol=1e-5)
