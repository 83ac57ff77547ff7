"""``lr_scaling=``: the estimator against exact moments, the gain against the exact gain of a
linear regression with known noise, the rules against plain training, the scheduler's
progress, skipped steps, host reads, checkpoints and bad input."""
import math

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import _native
from mx_lbsgd.counting import count_host_syncs
from mx_lbsgd.pipeline import lr_scaling as ls

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

D, B, NOISE = 10, 8, 1.0


# -- the pure piece --------------------------------------------------------------------
@pytest.mark.parametrize('mu2, trace, b_small, b_big', [
    (0.9, 19.9, 8, 32), (1e-3, 5.0, 4, 64), (2.0, 0.0, 16, 48), (0.0, 3.0, 1, 2)])
def test_moments_are_exact_on_expected_norms(mu2, trace, b_small, b_big):
    """E|g_b|^2 = |G|^2 + tr(Sigma) / b: fed the expectations, the estimator returns the
    moments (float64)."""
    g2, tr = ls.noise_moments(mu2 + trace / b_small, mu2 + trace / b_big, b_small, b_big)
    assert g2 == pytest.approx(mu2, abs=1e-12)
    assert tr == pytest.approx(trace, rel=1e-12, abs=1e-12)


def test_moments_from_sampled_gradients():
    """Mean squared norms of sampled per-example gradients (float64 numpy): the estimates
    approach the population's |G|^2 and tr(Sigma)."""
    rng = np.random.RandomState(3)
    mean = rng.normal(size=20) * 0.2
    cov = np.diag(rng.uniform(0.5, 2.0, size=20))
    small, big = [], []
    for _ in range(4000):
        g = rng.multivariate_normal(mean, cov, size=32)
        small.append(np.sum(g[:4].mean(0) ** 2))
        big.append(np.sum(g.mean(0) ** 2))
    g2, tr = ls.noise_moments(np.mean(small), np.mean(big), 4, 32)
    assert g2 == pytest.approx(np.sum(mean ** 2), rel=0.1)
    assert tr == pytest.approx(np.trace(cov), rel=0.05)


def test_smoothed_moments_are_bias_corrected():
    m = ls.SmoothedMoments()
    assert m.gradient_sq is None and m.trace_sigma is None
    for _ in range(3):
        m.add(2.0, 5.0, decay=0.9)
    assert m.gradient_sq == pytest.approx(2.0) and m.trace_sigma == pytest.approx(5.0)
    m.add(6.0, 5.0, decay=0.9)
    weights = np.array([0.1 * 0.9 ** k for k in (3, 2, 1, 0)])
    assert m.gradient_sq == pytest.approx(np.dot(weights, [2, 2, 2, 6]) / weights.sum())


def test_the_first_unbiased_estimate_restarts_the_averages():
    """The S = 1 difference estimator's early (biased) estimates are dropped when the
    unbiased ones begin: the averages then hold that one estimate alone, exactly."""
    m = ls.SmoothedMoments()
    for g2, tr in [(9.0, 1.0), (7.0, 3.0), (8.0, 2.0)]:
        m.add(g2, tr, decay=0.9, biased=True)
    assert m.biased and m.gradient_sq == pytest.approx(8.0, rel=0.2)
    m.add(2.5, 40.0, decay=0.9)
    assert not m.biased and m.samples == 4
    assert m.gradient_sq == 2.5 and m.trace_sigma == 40.0
    m.add(3.5, 40.0, decay=0.9)                 # unbiased ones then average as usual
    assert m.gradient_sq == pytest.approx((0.09 * 2.5 + 0.1 * 3.5) / 0.19)


@pytest.mark.parametrize('rule, power, expected', [
    ('linear', 1.0, 16.0), ('sqrt', 1.0, 4.0),
    ('adascale', 1.0, (0.5 + 1.0) / (0.5 / 16 + 1.0)),
    ('adascale', 0.5, math.sqrt((0.5 + 1.0) / (0.5 / 16 + 1.0)))])
def test_rules(rule, power, expected):
    piece = ls.LrScaling(rule, smoothing=0.0, power=power)
    piece.state.moments.add(1.0, 4.0, decay=0.0)        # mu2 = 1, sigma2 = 4 / 8
    assert piece.gain(16, base_batch=8) == pytest.approx(expected)
    assert piece.advance(16, base_batch=8) == pytest.approx(expected)
    step = 16.0 if rule != 'adascale' else (0.5 + 1.0) / (0.5 / 16 + 1.0)
    assert piece.state.progress == pytest.approx(step)


def test_adascale_without_estimates_or_signal():
    assert ls.adascale_gain(None, None, 8, 16) == 1.0
    assert ls.adascale_gain(0.0, 0.0, 8, 16) == 1.0
    assert ls.adascale_gain(0.0, 3.0, 8, 16) == 16.0      # pure noise: linear
    assert ls.adascale_gain(-1.0, -2.0, 8, 16) == 1.0     # clamped
    assert ls.adascale_gain(2.0, 0.0, 8, 16) == 1.0       # no noise: no gain


def test_state_round_trips_as_plain_values():
    piece = ls.LrScaling('adascale', 0.99, 1.0)
    piece.observe([0.5, 0.7], 0.1, 8, 64, 8)
    piece.advance(8, 8)
    saved = piece.state.as_dict()
    assert all(isinstance(v, (int, float, dict)) for v in saved.values())
    assert ls.LrScalingState.from_dict(saved) == piece.state


# -- under a Trainer -------------------------------------------------------------------
def _regression(seed=0):
    rng = np.random.RandomState(seed)
    wstar = rng.normal(size=(1, D)).astype('f')
    delta = 0.3 * np.ones((1, D), 'f')
    mu2 = float((delta.astype(np.float64) ** 2).sum())
    return rng, wstar, delta, mu2, (D + 1) * mu2 + D * NOISE ** 2


def _net(weight, ctx=None):
    net = gluon.nn.Dense(1, in_units=D, use_bias=False)
    net.initialize(ctx=ctx)
    net.weight.set_data(nd.array(weight))
    return net


def _step(net, trainer, rng, wstar, batch=B):
    x = rng.normal(size=(batch, D)).astype('f')
    y = x @ wstar.T + NOISE * rng.normal(size=(batch, 1)).astype('f')
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
    loss.backward()
    trainer.step(batch)


def _optimizer_args(name, scale, rule):
    args = dict(learning_rate=0.0, batch_scale=scale, lr_scaling=rule)
    if name == 'lbsgd':
        args['warmup_epochs'] = 0
    return args


@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
@pytest.mark.parametrize('scale', [4, 16])
@pytest.mark.parametrize('seed', [0, 1])
def test_gain_within_10_percent_of_exact(name, scale, seed):
    """y = x.w* + noise, x ~ N(0, I): at w = w* + delta the mean gradient is delta and
    tr(Sigma) = (d + 1)|delta|^2 + d noise^2 per example; lr 0 keeps w there. After 400
    updates the gain is within 10% of AdaScale's exact r (LAMB: of sqrt(r)), and the
    progress within 10% of 400 r."""
    rng, wstar, delta, mu2, trace = _regression(seed)
    net = _net(wstar + delta)
    trainer = gluon.Trainer(net.collect_params(), name, _optimizer_args(name, scale,
                                                                          'adascale'))
    for _ in range(400 * scale):
        _step(net, trainer, rng, wstar)
    sigma2 = trace / B
    exact = (sigma2 + mu2) / (sigma2 / scale + mu2)
    opt = trainer.optimizer
    power = 0.5 if name == 'lblamb' else 1.0
    assert opt.last_gain == pytest.approx(exact ** power, rel=0.1)
    assert opt.scale_invariant_steps == pytest.approx(400 * exact, rel=0.1)


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
def test_linear_rule_is_lbsgds_batch_scale_on_one_worker(fused):
    """One worker, no warmup: LBSGD multiplies the lr by batch_scale, as 'linear' does;
    the two runs are bit for bit equal, and progress counts S per update."""
    runs = []
    for rule in (None, 'linear'):
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            learning_rate=0.01, momentum=0.9, batch_scale=4, warmup_epochs=0,
            lr_scaling=rule, fused=fused))
        for _ in range(24):
            _step(net, trainer, rng, wstar)
        runs.append((net.weight.data().asnumpy(), trainer.optimizer))
    assert np.array_equal(runs[0][0], runs[1][0])
    assert runs[1][1].scale_invariant_steps == 6 * 4.0
    assert runs[1][1].last_gain == 4.0 and runs[0][1].last_gain is None


def test_sqrt_rule_scales_the_applied_step():
    """lr 0.1, 'sqrt' at batch_scale 4, plain SGD: w moves by 0.1 * 2 * the window's mean
    gradient."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.1, batch_scale=4, warmup_epochs=0, lr_scaling='sqrt'))
    before = net.weight.data().asnumpy().astype(np.float64)
    grads = []
    for _ in range(4):
        x = rng.normal(size=(B, D)).astype('f')
        y = x @ wstar.T
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
        loss.backward()
        grads.append(net.weight.grad().asnumpy().astype(np.float64) / B)
        trainer.step(B)
    expected = before - 0.1 * 2.0 * np.mean(grads, axis=0)
    np.testing.assert_allclose(net.weight.data().asnumpy(), expected, rtol=1e-5, atol=1e-6)


def test_scheduler_sees_scale_invariant_steps():
    """FactorScheduler(step=8): with 'linear' at S = 4 the lr halves after 2 updates (8
    base batches), where the plain optimizer would wait for 8 micro-batches too; with
    'adascale' it follows the sum of the gains."""
    for rule in ('linear', 'adascale'):
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        sched = mx.lr_scheduler.FactorScheduler(step=8, factor=0.5, base_lr=0.01)
        trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            learning_rate=0.01, lr_scheduler=sched, batch_scale=4, warmup_epochs=0,
            lr_scaling=rule))
        seen = []
        for _ in range(6 * 4):
            _step(net, trainer, rng, wstar)
            if trainer.optimizer.window_position == 0:
                seen.append((trainer.optimizer.scale_invariant_steps, sched.base_lr))
        for progress, lr in seen:
            assert lr == pytest.approx(0.01 * 0.5 ** max(0, math.ceil(progress / 8) - 1))


def _window_with_an_inf(net, trainer, rng):
    """A window of 2 micro-batches whose second gradient is infinite."""
    for k in range(2):
        x = nd.array(rng.normal(size=(B, D)).astype('f'))
        with autograd.record():
            loss = (net(x) * (np.inf if k == 1 else 1.0)).sum()
        loss.backward()
        trainer.step(B)


def test_skipped_steps_move_nothing():
    """An overflowing window: the update is skipped, and the estimates, the progress and
    the last gain stay as they were."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=2, warmup_epochs=0, lr_scaling='adascale',
        loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=1.0)))
    for _ in range(8):
        _step(net, trainer, rng, wstar)
    opt = trainer.optimizer
    before = (opt.scale_invariant_steps, opt.last_gain,
              opt._pieces.lr_gain.piece.state.as_dict(), net.weight.data().asnumpy())
    _window_with_an_inf(net, trainer, rng)
    assert opt.last_step_skipped
    after = (opt.scale_invariant_steps, opt.last_gain,
             opt._pieces.lr_gain.piece.state.as_dict(), net.weight.data().asnumpy())
    assert after[:3] == before[:3]
    assert np.array_equal(after[3], before[3])


@pytest.mark.parametrize('rule', ['linear', 'sqrt', 'adascale'])
@pytest.mark.parametrize('fused', [None, False], ids=['default', 'pertensor'])
def test_a_step_skipped_by_clipping_moves_nothing(rule, fused):
    """No loss scaler, clipping: a non-finite gradient norm skips the update (on the device
    with the native kernels, after one read with MXNet's operators); the weights, the last
    gain and the estimates stay as they were, and the progress too where the host knows of
    the skip: with MXNet's operators, or 'adascale' (whose norms it reads). The native
    kernels' skip under 'linear'/'sqrt', which read nothing, counts as an update."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=2, warmup_epochs=0, lr_scaling=rule,
        max_grad_norm=1.0, fused=fused))
    for _ in range(8):
        _step(net, trainer, rng, wstar)
    opt = trainer.optimizer
    before = (opt.scale_invariant_steps, opt.last_gain,
              opt._pieces.lr_gain.piece.state.as_dict(), net.weight.data().asnumpy())
    native = fused is None and _native.ops() is not None     # the default route's kernels
    with pytest.warns(RuntimeWarning, match='not finite') if not native else _no_warning():
        _window_with_an_inf(net, trainer, rng)
    after = (opt.scale_invariant_steps, opt.last_gain,
             opt._pieces.lr_gain.piece.state.as_dict(), net.weight.data().asnumpy())
    unseen = native and rule != 'adascale'
    assert after[0] == before[0] + (opt.last_gain ** (2 if rule == 'sqrt' else 1)
                                    if unseen else 0.0)
    assert after[1] == before[1]
    assert after[2]['moments'] == before[2]['moments']
    assert np.array_equal(after[3], before[3])


def _no_warning():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize('fused', [None, False], ids=['default', 'pertensor'])
@pytest.mark.parametrize('clip', [False, True])
@pytest.mark.parametrize('scaled', [False, True])
def test_one_host_read_per_update(scaled, clip, fused):
    """'adascale' adds at most one read per update: its norms come along with the loss
    scaler's flag read or clipping's norm read when the step has one, else they are the
    one read; 'linear' reads nothing more than the step did."""
    counts = {}
    for rule in (None, 'linear', 'adascale'):
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        args = dict(learning_rate=0.01, batch_scale=4, warmup_epochs=0, lr_scaling=rule,
                    fused=fused, max_grad_norm=1.0 if clip else None)
        if scaled:
            args['loss_scaler'] = mx_lbsgd.DynamicLossScaler(init_scale=1.0)
        trainer = gluon.Trainer(net.collect_params(), 'lbsgd', args)
        for _ in range(4):
            _step(net, trainer, rng, wstar)
        with count_host_syncs(include_waitall=False) as calls:
            for _ in range(4 * 5):
                _step(net, trainer, rng, wstar)
        counts[rule] = len(calls)
    assert counts['linear'] == counts[None] <= 5
    assert counts['adascale'] == max(counts[None], 5)


def _train(trainer, net, rng, wstar, steps):
    for _ in range(steps):
        _step(net, trainer, rng, wstar)


@pytest.mark.parametrize('saver, at', [('mx_lbsgd', 20), ('mx_lbsgd', 22), ('mxnet', 20)])
@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
def test_resume_is_bit_for_bit(tmp_path, saver, at, name):
    """Save after `at` micro-batches (20: a window boundary; 22: inside a window, whose
    small norms the checkpoint keeps), load into a fresh Trainer, train to 40: the
    weights, the progress, the gain and the estimates equal the uninterrupted run's."""
    args = dict(learning_rate=0.01, batch_scale=4, lr_scaling='adascale')
    if name == 'lbsgd':
        args.update(warmup_epochs=0, momentum=0.9)

    def fresh():
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        return net, gluon.Trainer(net.collect_params(), name, dict(args)), rng, wstar

    def outcome(net, trainer):
        opt = trainer.optimizer
        return (net.weight.data().asnumpy(), opt.scale_invariant_steps, opt.last_gain,
                opt._pieces.lr_gain.piece.state.as_dict())

    net, trainer, rng, wstar = fresh()
    _train(trainer, net, rng, wstar, 40)
    whole = outcome(net, trainer)

    net, trainer, rng, wstar = fresh()
    _train(trainer, net, rng, wstar, at)
    path = str(tmp_path / 'states')
    if saver == 'mx_lbsgd':
        mx_lbsgd.checkpoint.save_states(trainer, path)
    else:
        trainer.save_states(path)
    weights = net.weight.data().copy()
    state = rng.get_state()
    net, trainer, rng, wstar = fresh()
    rng.set_state(state)
    net.weight.set_data(weights)
    if saver == 'mx_lbsgd':
        mx_lbsgd.checkpoint.load_states(trainer, path)
    else:
        trainer.load_states(path)
    _train(trainer, net, rng, wstar, 40 - at)
    resumed = outcome(net, trainer)
    assert np.array_equal(whole[0], resumed[0])
    assert whole[1:] == resumed[1:]


def test_reading_the_learning_rate_moves_nothing():
    """trainer.learning_rate is the scheduler's rate at the progress: reading it every
    micro-batch (an epoch log) leaves the run bit for bit as it was."""
    runs = []
    for read in (False, True):
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        sched = mx.lr_scheduler.MultiFactorScheduler(step=[10, 20], factor=0.5, base_lr=0.01)
        trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            learning_rate=0.01, lr_scheduler=sched, batch_scale=4, warmup_epochs=0,
            lr_scaling='adascale'))
        seen = []
        for _ in range(40):
            _step(net, trainer, rng, wstar)
            if read:
                seen.append(trainer.learning_rate)
        runs.append(net.weight.data().asnumpy())
        if read:
            progress = trainer.optimizer.scale_invariant_steps
            assert seen[-1] == 0.01 * 0.5 ** ((progress > 10) + (progress > 20))
    assert np.array_equal(runs[0], runs[1])


def test_a_state_for_another_optimizer(tmp_path):
    """A checkpoint with an lr_scaling state loaded into an optimizer without a rule warns;
    a malformed state is refused before anything loads."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=4, warmup_epochs=0, lr_scaling='adascale'))
    _train(trainer, net, rng, wstar, 8)
    path = str(tmp_path / 'states')
    mx_lbsgd.checkpoint.save_states(trainer, path)
    plain = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=4, warmup_epochs=0))
    with pytest.warns(RuntimeWarning, match='lr_scaling state .* lr_scaling=None'):
        mx_lbsgd.checkpoint.load_states(plain, path)
    with pytest.raises(TypeError, match='must be numbers'):
        ls.LrScalingState.from_dict(dict(progress='3'))


# -- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['lbsgd', 'lssgd', 'lblamb'])
def test_bad_rule_or_smoothing(name):
    with pytest.raises(ValueError, match="lr_scaling.*'linear', 'sqrt', 'adascale'"):
        mx.optimizer.create(name, lr_scaling='cubic')
    with pytest.raises(ValueError, match='lr_scaling_smoothing'):
        mx.optimizer.create(name, lr_scaling='adascale', lr_scaling_smoothing=1.0)


def test_update_on_kvstore_is_refused():
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = _net(np.ones((1, D), 'f'), ctx)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.1, warmup_epochs=0, lr_scaling='adascale'), kvstore='device',
        update_on_kvstore=True)
    for c in ctx:
        x = nd.ones((2, D), ctx=c)
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
    with pytest.raises(ValueError, match="lr_scaling='adascale'.*update_on_kvstore=False"):
        trainer.step(4)
    assert (net.weight.data(ctx[0]).asnumpy() == 1).all()


# -- on several workers ----------------------------------------------------------------
def _worker_results(tmp_path, cfg):
    """tests/noise_worker.py on 2 workers (Horovod or the dist_sync launcher)."""
    import io
    import json
    import os
    import subprocess
    import sys
    import noise_worker
    from harness import horovodrun
    from mx_lbsgd.launch import launch
    worker = os.path.abspath(noise_worker.__file__)
    env = {'PYTHONPATH': os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(worker)), os.path.dirname(worker),
        os.environ.get('PYTHONPATH')]))}
    argv = [sys.executable, worker, json.dumps(cfg), str(tmp_path)]
    if cfg['kvstore'] == 'horovod':
        runner = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
        proc = horovodrun([runner, '--gloo', '-np', '2', '-H', 'localhost:2'] + argv,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, env=dict(os.environ, **env))
        assert proc.returncode == 0, proc.stdout[-3000:]
    else:
        out = io.StringIO()
        assert launch(argv, 2, 1, timeout=300, stream=out, env=env) == 0, out.getvalue()
    results = []
    for rank in range(2):
        with open(str(tmp_path / ('rank%d.json' % rank))) as f:
            results.append(json.load(f))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize('cfg', [
    pytest.param(dict(kvstore='horovod', batch_scale=2), id='horovod-S4',
                 marks=pytest.mark.horovod),
    pytest.param(dict(kvstore='horovod', batch_scale=8), id='horovod-S16',
                 marks=pytest.mark.horovod),
    pytest.param(dict(kvstore='horovod', batch_scale=2, sharded=True, optimizer='lblamb'),
                 id='sharded-lblamb-S4', marks=pytest.mark.horovod),
    pytest.param(dict(kvstore='dist_sync', batch_scale=2), id='dist_sync-S4'),
])
def test_gain_within_10_percent_on_two_workers(cfg, tmp_path):
    """S = batch_scale x 2 workers: on each rank the gain is within 10% of AdaScale's exact r
    (LAMB: sqrt(r)) for tests/noise_worker.py's problem, both ranks hold the same gain and
    progress, and the progress is within 10% of updates x r."""
    if cfg['kvstore'] == 'horovod':
        pytest.importorskip('horovod.mxnet')
    cfg = dict(cfg, batch=8, updates=300, lr_scaling='adascale')
    results = _worker_results(tmp_path, cfg)
    power = 0.5 if cfg.get('optimizer') == 'lblamb' else 1.0
    for result in results:
        exact = result['truth']['gain']
        assert result['gain'] == pytest.approx(exact ** power, rel=0.1)
        assert result['progress'] == pytest.approx(cfg['updates'] * exact, rel=0.1)
    assert results[0]['gain'] == results[1]['gain']
    assert results[0]['progress'] == results[1]['progress']


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_uneven_batches_give_every_rank_the_same_gain(tmp_path):
    """Rank 0 steps batches of 8, rank 1 of 9: the ranks still take the same gain and
    progress (the estimator uses the workers' mean batch)."""
    pytest.importorskip('horovod.mxnet')
    cfg = dict(kvstore='horovod', batch_scale=2, batch=8, uneven=1, updates=60,
               lr_scaling='adascale')
    results = _worker_results(tmp_path, cfg)
    assert results[0]['gain'] == results[1]['gain'] != 1.0
    assert results[0]['progress'] == results[1]['progress']


def test_worker_sums_never_share_a_name():
    """The reduction of the norms is named by the Trainer's number: a Trainer freed (by the
    cyclic collector, at different times on different workers) never hands its number to a
    new one, so two live Trainers never share a name."""
    import gc
    import weakref
    from mx_lbsgd import _compat

    def trainer():
        return gluon.Trainer(_net(np.ones((1, D), 'f')).collect_params(), 'lbsgd',
                             dict(lr_scaling='adascale', batch_scale=2))
    x = nd.zeros((1,))
    first, second = trainer(), trainer()
    _compat.sum_over_workers(first, x)
    _compat.sum_over_workers(second, x)
    freed = weakref.ref(first)
    del first
    gc.collect()
    assert freed() is None
    third = trainer()
    _compat.sum_over_workers(third, x)
    assert _compat._WORKER_SUMS[third] != _compat._WORKER_SUMS[second]
