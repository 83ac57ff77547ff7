"""``batch_scale='auto'``: the window-time fit, goodput and the choice against float64
references, the segments' arithmetic against a replay, the difference estimator at S = 1,
training with changing windows against a numpy replay, the choice against the best window
of a known problem, resume, host reads, bad input and two Horovod ranks."""
import math

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from mx_lbsgd.pipeline import batch_choice as bc
from test_lr_scaling import B, D, NOISE, _net, _regression

pytestmark = [pytest.mark.unit, pytest.mark.pipeline]


# -- the pure piece --------------------------------------------------------------------
def _timings(pairs):
    out = []
    for length, seconds, count in pairs:
        t = bc.WindowTiming(length)
        for _ in range(count):
            t.add(seconds)
        out.append(t)
    return out


def test_fit_recovers_a_line_and_takes_half_of_one_length():
    t_micro, t_update = 0.013, 0.041
    fit = bc.fit_window_time(_timings([(b, b * t_micro + t_update, c)
                                       for b, c in ((1, 5), (2, 9), (4, 3))]))
    assert fit == pytest.approx((t_micro, t_update), rel=1e-9)
    assert bc.fit_window_time(_timings([(4, 0.2, 3)])) == pytest.approx((0.025, 0.1))
    assert bc.fit_window_time([bc.WindowTiming(2)]) is None
    # slower per micro-batch at the shorter window: no negative per-update cost
    slope, intercept = bc.fit_window_time(_timings([(1, 0.05, 4), (2, 0.06, 4)]))
    assert intercept >= 0.0 and slope > 0.0


def test_timing_ignores_outliers_and_unknown_windows():
    t = bc.WindowTiming(2)
    for _ in range(bc.OUTLIER_AFTER):
        assert t.add(0.1)
    assert not t.add(0.1 * bc.OUTLIER * 1.5)        # an evaluation between two updates
    assert not t.add(math.nan) and not t.add(-1.0)
    assert t.count == bc.OUTLIER_AFTER and t.seconds == pytest.approx(0.1)


def _reference_choice(current, bounds, t_micro, t_update, b, workers, noise, margin=0.02):
    """float64, from the formulas of the issue (Pollux's efficiency over the window)."""
    def g(length):
        m = length * b * workers
        return (noise + b) / (noise + m) * m / (length * t_micro + t_update)
    lengths = [n for n in range(bounds[0], bounds[1] + 1) if current / 2 <= n <= 2 * current]
    best = max(lengths, key=lambda n: (g(n), -abs(n - current)))
    return best if g(best) > (1 + margin) * g(current) else current


@pytest.mark.parametrize('current, bounds, t_micro, t_update, b, workers, noise', [
    (1, (1, 16), 0.01, 0.10, 32, 2, 1e4),      # reduction-bound, noisy: double
    (8, (1, 16), 0.01, 0.001, 32, 1, 10.0),    # compute-bound, clean: halve
    (4, (1, 16), 0.02, 0.05, 8, 1, 40.0),      # an interior optimum
    (4, (3, 5), 0.01, 1.0, 8, 1, 1e6),         # the bounds
    (5, (1, 16), 0.01, 0.04, 8, 4, 64.0),
    (2, (1, 16), 0.01, 0.04, 8, 1, math.inf),  # no gradient signal measured: E = 1
    # an odd window whose best length, 2, is below ceil(5 / 2): halving stops at 3
    (5, (1, 16), 0.01, 0.005, 8, 1, 40.0),
])
def test_choice_matches_the_reference(current, bounds, t_micro, t_update, b, workers, noise):
    got = bc.choose_window(current, bounds, t_micro, t_update, b, workers, noise)
    if (current, t_update) == (5, 0.005):
        assert got == 3
    assert got == _reference_choice(current, bounds, t_micro, t_update, b, workers,
                                    noise if math.isfinite(noise) else 1e300)
    assert current / 2 <= got <= 2 * current and bounds[0] <= got <= bounds[1]


def _replay(lengths_by_update):
    """Micro-batch by micro-batch: (updates, position) after each count."""
    out, updates, position = [(0, 0)], 0, 0
    for length in lengths_by_update:
        for _ in range(length):
            position += 1
            if position == length:
                updates, position = updates + 1, 0
            out.append((updates, position))
    return out


def test_segments_count_updates_and_positions_as_a_replay():
    lengths = [2] * 3 + [4] * 5 + [8] * 2 + [4] * 3 + [3] * 4
    state = bc.BatchChoiceState.start(2)
    counted = 0
    for length in lengths:
        state.begin_window(counted, length)
        counted += length
    assert [s.length for s in state.segments] == [2, 4, 8, 4, 3]
    expected = _replay(lengths)
    for k, (updates, position) in enumerate(expected):
        assert (state.update_of(k), state.position(k)) == (updates, position), k
    with pytest.raises(RuntimeError, match='inside a window'):
        state.begin_window(counted + 1, 2)


def test_a_rewound_window_replaces_its_segment():
    state = bc.BatchChoiceState.start(2)
    state.begin_window(4, 4)
    state.begin_window(4, 8)            # the window starting at 4 was skipped and re-begun
    assert [(s.first_micro_batch, s.length) for s in state.segments] == [(0, 2), (4, 8)]


def test_state_round_trips_and_refuses_malformed():
    chooser = bc.BatchChoice((1, 8), interval=1)
    chooser.measured(1, 0.02)
    chooser.applied(base_batch=16, workers=2, noise_scale=1e4)
    chooser.window_begins(1)
    saved = chooser.state.as_dict()
    assert bc.BatchChoiceState.from_dict(saved) == chooser.state
    for bad in (dict(saved, since_choice=-1), dict(saved, segments=[]),
                dict(saved, timings=[dict(length=1, count=2, seconds='x')])):
        with pytest.raises(TypeError, match='batch_scale state'):
            bc.BatchChoiceState.from_dict(bad)


def test_no_choice_without_estimates_and_every_interval():
    chooser = bc.BatchChoice((1, 8), interval=3)
    chooser.measured(1, 0.02)
    for _ in range(3):
        chooser.applied(base_batch=16, workers=2, noise_scale=None)
    assert chooser.state.pending is None and chooser.state.since_choice == 3
    chooser.applied(base_batch=16, workers=2, noise_scale=1e4)
    assert chooser.state.pending == 2 and chooser.state.since_choice == 0
    assert chooser.window_begins(0) == 2 and chooser.state.pending is None


# -- under a Trainer -------------------------------------------------------------------
def _batch(rng, wstar, batch=B):
    x = rng.normal(size=(batch, D)).astype('f')
    return x, x @ wstar.T + NOISE * rng.normal(size=(batch, 1)).astype('f')


def _step(net, trainer, x, y):
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
    loss.backward()
    trainer.step(len(x))


class _Clock:
    """Virtual host seconds: each micro-batch takes t_micro, each update t_update more
    (counted after the step that applies it), so the time between two updates' reads is
    n * t_micro + t_update for a window of n."""

    def __init__(self, t_micro, t_update):
        self.now, self.t_micro, self.t_update = 100.0, t_micro, t_update

    def __call__(self):
        return self.now

    def step(self, opt, run):
        self.now += self.t_micro
        run()
        if opt.window_position == 0:
            self.now += self.t_update


@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
@pytest.mark.parametrize('seed', [0, 1])
def test_difference_estimator_at_scale_one(name, seed):
    """One worker, one device, batch_scale 1: the difference estimator's moments predict
    AdaScale's r at S = 16 within 10% of the exact one, and B_noise within 10%."""
    rng, wstar, delta, mu2, trace = _regression(seed)
    net = _net(wstar + delta)
    args = dict(learning_rate=0.0, lr_scaling='adascale')
    if name == 'lbsgd':
        args['warmup_epochs'] = 0
    trainer = gluon.Trainer(net.collect_params(), name, args)
    for _ in range(2000):
        _step(net, trainer, *_batch(rng, wstar))
    piece = trainer.optimizer._pieces.lr_gain.piece
    sigma2 = trace / B
    assert piece.state.moments.biased
    assert piece.ratio(16, B) == pytest.approx((sigma2 + mu2) / (sigma2 / 16 + mu2), rel=0.1)
    assert piece.state.moments.noise_scale == pytest.approx(trace / mu2, rel=0.1)
    assert trainer.optimizer.last_gain == 1.0          # S = 1


def _auto_trainer(net, name='lbsgd', rule='linear', bounds=(1, 8), interval=2, clock=None,
                  **extra):
    args = dict(learning_rate=0.05, batch_scale='auto', batch_scale_bounds=bounds,
                batch_scale_interval=interval, lr_scaling=rule, **extra)
    if name == 'lbsgd':
        args.setdefault('warmup_epochs', 0)
    trainer = gluon.Trainer(net.collect_params(), name, args)
    if clock is not None:
        trainer.optimizer._pieces.lr_gain._clock = clock
    return trainer


def test_changing_windows_train_as_their_replay():
    """'linear' plain SGD with a changing window: each update applies lr x S x the mean
    of its window's gradients (float64 numpy replay of the same window lengths)."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    clock = _Clock(t_micro=0.01, t_update=0.2)
    trainer = _auto_trainer(net, clock=clock)
    opt = trainer.optimizer
    w = (wstar + delta).astype(np.float64)
    window, lengths = [], []
    for _ in range(120):
        x, y = _batch(rng, wstar)
        window.append(x.T.astype(np.float64) @ (x.astype(np.float64) @ w.T - y) / B)
        clock.step(opt, lambda: _step(net, trainer, x, y))
        if opt.window_position == 0:
            size = opt.batch_scale
            assert len(window) == size
            w = w - 0.05 * size * np.mean(window, axis=0).T
            window, lengths = [], lengths + [size]
    assert len(set(lengths)) > 1                       # the window did change
    assert all(b <= 2 * a and a <= 2 * b for a, b in zip(lengths, lengths[1:]))
    taken = [length for first, length in opt.window_history if first < len(lengths)]
    assert taken == [k for i, k in enumerate(lengths) if i == 0 or lengths[i - 1] != k]
    np.testing.assert_allclose(net.weight.data().asnumpy(), w, rtol=1e-4, atol=1e-5)
    assert opt.applied_updates == len(lengths)


@pytest.mark.parametrize('t_micro, t_update', [(0.01, 0.04), (0.01, 0.3), (0.01, 0.0005)])
def test_choice_finds_the_best_window_of_a_known_problem(t_micro, t_update):
    """Virtual times T(B) = B t_micro + t_update and the regression's B_noise: the window
    settles where the exact goodput is within the choice's margin of its best in the
    bounds, and moves by at most 2x at a time."""
    rng, wstar, delta, mu2, trace = _regression(0)
    net = _net(wstar + delta)
    clock = _Clock(t_micro, t_update)
    trainer = _auto_trainer(net, rule='adascale', bounds=(1, 16), interval=4, clock=clock)
    trainer.optimizer.set_learning_rate(0.0)
    opt = trainer.optimizer
    while opt.applied_updates < 300:
        clock.step(opt, lambda: _step(net, trainer, *_batch(rng, wstar)))
    noise = trace / mu2

    def exact(length):
        return bc.goodput(length, t_micro, t_update, B, 1, noise)
    best = max(exact(n) for n in range(1, 17))
    assert exact(opt.batch_scale) >= best / 1.05
    lengths = [length for _, length in opt.window_history]
    assert all(b <= 2 * a and a <= 2 * b for a, b in zip(lengths, lengths[1:]))


@pytest.mark.parametrize('saver, at', [('mx_lbsgd', 60), ('mx_lbsgd', 61), ('mxnet', None)])
@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
def test_resume_is_bit_for_bit(tmp_path, saver, at, name):
    """Save after `at` micro-batches (mxnet's save_states: at the first window boundary
    after 60), load into a fresh Trainer, train to 160: the weights, the gain, the
    progress, the window lengths and the chooser's state (but for how many windows were
    timed: the window across the restart is not) equal the uninterrupted run's. (The
    clock's window times are exact, so a window left unmeasured changes no mean.)"""
    total = 160

    def fresh():
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        clock = _Clock(0.01, 0.05)
        extra = dict(momentum=0.9) if name == 'lbsgd' else {}
        return net, _auto_trainer(net, name, 'adascale', clock=clock, **extra), rng, \
            wstar, clock

    def train(net, trainer, rng, wstar, clock, until):
        while until(trainer.optimizer):
            clock.step(trainer.optimizer, lambda: _step(net, trainer, *_batch(rng, wstar)))

    def outcome(net, trainer):
        opt = trainer.optimizer
        chosen = opt._pieces.lr_gain.chooser.state
        return (net.weight.data().asnumpy(), opt.scale_invariant_steps, opt.last_gain,
                opt.window_history, opt._pieces.lr_gain.piece.state.as_dict(), opt.batch_scale,
                [(t.length, t.seconds) for t in chosen.timings], chosen.pending)

    net, trainer, rng, wstar, clock = fresh()
    train(net, trainer, rng, wstar, clock, lambda o: o.micro_batches < total)
    whole = outcome(net, trainer)
    assert len(whole[3]) > 1

    net, trainer, rng, wstar, clock = fresh()
    if at is None:
        train(net, trainer, rng, wstar, clock,
              lambda o: o.micro_batches < 60 or o.window_position)
    else:
        train(net, trainer, rng, wstar, clock, lambda o: o.micro_batches < at)
    path = str(tmp_path / 'states')
    if saver == 'mx_lbsgd':
        mx_lbsgd.checkpoint.save_states(trainer, path)
    else:
        trainer.save_states(path)
    weights, state, now = net.weight.data().copy(), rng.get_state(), clock.now
    net, trainer, rng, wstar, clock = fresh()
    rng.set_state(state)
    clock.now = now
    net.weight.set_data(weights)
    if saver == 'mx_lbsgd':
        mx_lbsgd.checkpoint.load_states(trainer, path)
    else:
        trainer.load_states(path)
        trainer.optimizer._pieces.lr_gain._clock = clock
    train(net, trainer, rng, wstar, clock, lambda o: o.micro_batches < total)
    resumed = outcome(net, trainer)
    assert np.array_equal(whole[0], resumed[0])
    assert whole[1:] == resumed[1:]


def test_resume_at_scale_one_keeps_the_previous_gradient(tmp_path):
    """The difference estimator's last gradient goes into mx_lbsgd checkpoints: a run
    resumed at S = 1 estimates as the uninterrupted one."""
    def fresh():
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        return net, gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            learning_rate=0.01, warmup_epochs=0, lr_scaling='adascale')), rng, wstar

    net, trainer, rng, wstar = fresh()
    for _ in range(30):
        _step(net, trainer, *_batch(rng, wstar))
    whole = trainer.optimizer._pieces.lr_gain.piece.state.as_dict()
    net, trainer, rng, wstar = fresh()
    for _ in range(17):
        _step(net, trainer, *_batch(rng, wstar))
    path = str(tmp_path / 'states')
    mx_lbsgd.checkpoint.save_states(trainer, path)
    weights, state = net.weight.data().copy(), rng.get_state()
    net, trainer, rng, wstar = fresh()
    rng.set_state(state)
    net.weight.set_data(weights)
    mx_lbsgd.checkpoint.load_states(trainer, path)
    for _ in range(13):
        _step(net, trainer, *_batch(rng, wstar))
    assert trainer.optimizer._pieces.lr_gain.piece.state.as_dict() == whole


@pytest.mark.parametrize('scaled', [False, True])
def test_no_host_read_beyond_the_gains(scaled):
    """'auto' reads nothing more than 'adascale' at a fixed window: one read per update
    (the loss scaler's flag read when there is one)."""
    counts = {}
    for auto in (False, True):
        rng, wstar, delta, _, _ = _regression(0)
        net = _net(wstar + delta)
        extra = dict(loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=1.0)) if scaled else {}
        if auto:
            trainer = _auto_trainer(net, rule='adascale', bounds=(4, 4), **extra)
        else:
            trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
                learning_rate=0.05, batch_scale=4, warmup_epochs=0, lr_scaling='adascale',
                **extra))
        for _ in range(8):
            _step(net, trainer, *_batch(rng, wstar))
        with count_host_syncs(include_waitall=False) as calls:
            for _ in range(4 * 5):
                _step(net, trainer, *_batch(rng, wstar))
        counts[auto] = len(calls)
    assert counts[True] == counts[False] == 5


# -- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['lbsgd', 'lblamb'])
@pytest.mark.parametrize('kwargs, error, match', [
    (dict(batch_scale='auto', lr_scaling='adascale'), ValueError,
     r"batch_scale='auto' needs batch_scale_bounds=\(lo, hi\)"),
    (dict(batch_scale='auto', batch_scale_bounds=(4, 2), lr_scaling='adascale'), ValueError,
     'batch_scale_bounds must be ordered'),
    (dict(batch_scale='auto', batch_scale_bounds=(0, 2), lr_scaling='adascale'), ValueError,
     r'batch_scale_bounds\[0\] must be an integer >= 1'),
    (dict(batch_scale='auto', batch_scale_bounds=(1, 2.5), lr_scaling='adascale'), TypeError,
     r'batch_scale_bounds\[1\] must be an integer >= 1'),
    (dict(batch_scale='auto', batch_scale_bounds=(1, True), lr_scaling='adascale'), TypeError,
     r'batch_scale_bounds\[1\] must be an integer'),
    (dict(batch_scale='auto', batch_scale_bounds=8, lr_scaling='adascale'), TypeError,
     r'batch_scale_bounds must be a pair \(lo, hi\)'),
    (dict(batch_scale='auto', batch_scale_bounds=(1, 8)), ValueError,
     "batch_scale='auto' needs lr_scaling="),
    (dict(batch_scale='max', lr_scaling='adascale'), ValueError,
     "batch_scale='max' is not supported; expected an integer >= 1 or 'auto'"),
    (dict(batch_scale=2, batch_scale_bounds=(1, 8)), ValueError,
     "batch_scale_bounds=.* needs batch_scale='auto'"),
    (dict(batch_scale='auto', batch_scale_bounds=(1, 8), lr_scaling='adascale',
          batch_scale_interval=0), ValueError, 'batch_scale_interval must be an integer >= 1'),
])
def test_bad_auto_arguments(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        mx.optimizer.create(name, **kwargs)


def test_lssgd_has_no_window():
    with pytest.raises(ValueError, match="'lssgd' takes no batch_scale"):
        mx.optimizer.create('lssgd', batch_scale='auto', batch_scale_bounds=(1, 4),
                            lr_scaling='adascale')


def _one_step_refused(trainer, net, match, step=None):
    before = net.weight.data().asnumpy()
    x = nd.ones((2, D))
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    with pytest.raises(ValueError, match=match):
        (step or trainer.step)(2)
    assert np.array_equal(net.weight.data().asnumpy(), before)
    assert trainer.optimizer.micro_batches == 0


def test_auto_refused_where_the_window_is_not_at_the_trainer():
    """A LossScaling hook reduces every micro-batch: 'auto' is refused at the first step,
    before anything changes (the hook's scale too)."""
    net = _net(np.ones((1, D), 'f'))
    trainer = _auto_trainer(net)
    hook = mx_lbsgd.LossScaling(trainer, force=True)
    scale = hook.scaler.scale
    _one_step_refused(trainer, net, "batch_scale='auto' needs the accumulation window",
                      step=hook.step)
    assert hook.scaler.scale == scale


def test_auto_refused_on_kvstore_updates():
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = gluon.nn.Dense(1, in_units=D, use_bias=False)
    net.initialize(mx.init.One(), ctx=ctx)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.1, warmup_epochs=0, lr_scaling='adascale', batch_scale='auto',
        batch_scale_bounds=(1, 4)), kvstore='device', update_on_kvstore=True)
    for c in ctx:
        with autograd.record():
            loss = net(nd.ones((2, D), ctx=c)).sum()
        loss.backward()
    with pytest.raises(ValueError,
                       match="lr_scaling='adascale', batch_scale='auto'.*update_on_kvstore"):
        trainer.step(4)
    assert (net.weight.data(ctx[0]).asnumpy() == 1).all()
    assert trainer.optimizer.micro_batches == 0


def test_checkpoints_that_cannot_resume_are_refused(tmp_path):
    """Windows outside this optimizer's bounds, or a fixed batch_scale's run under way:
    refused before any state loads."""
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    clock = _Clock(0.01, 0.3)
    trainer = _auto_trainer(net, clock=clock)
    while trainer.optimizer.batch_scale < 4:
        clock.step(trainer.optimizer, lambda: _step(net, trainer, *_batch(rng, wstar)))
    auto_path = str(tmp_path / 'auto')
    mx_lbsgd.checkpoint.save_states(trainer, auto_path)
    fixed = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=2, warmup_epochs=0, lr_scaling='linear'))
    for _ in range(4):
        _step(net, fixed, *_batch(rng, wstar))
    fixed_path = str(tmp_path / 'fixed')
    mx_lbsgd.checkpoint.save_states(fixed, fixed_path)
    for path, bounds, match in ((auto_path, (1, 2), r'outside .*batch_scale_bounds=\(1, 2\)'),
                                (fixed_path, (1, 8), 'written with a fixed batch_scale')):
        target = _auto_trainer(net, bounds=bounds)
        with pytest.raises(ValueError, match=match):
            mx_lbsgd.checkpoint.load_states(target, path)
        assert target.optimizer.micro_batches == 0
        assert target.optimizer.window_history == [(0, 1)]


def test_a_fixed_optimizer_warns_about_an_auto_state(tmp_path):
    rng, wstar, delta, _, _ = _regression(0)
    net = _net(wstar + delta)
    trainer = _auto_trainer(net, bounds=(2, 2))
    for _ in range(4):
        _step(net, trainer, *_batch(rng, wstar))
    path = str(tmp_path / 'states')
    mx_lbsgd.checkpoint.save_states(trainer, path)
    plain = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.01, batch_scale=2, warmup_epochs=0, lr_scaling='linear'))
    with pytest.warns(RuntimeWarning, match="batch_scale='auto' state .* fixed batch_scale=2"):
        mx_lbsgd.checkpoint.load_states(plain, path)


# -- on two workers --------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize('sharded', [False, True], ids=['horovod', 'sharded'])
def test_every_rank_takes_the_same_windows(sharded, tmp_path):
    """Two Horovod ranks whose host clocks differ: the window lengths they take are the
    same at every update (the times are reduced with the norms), and they change."""
    pytest.importorskip('horovod.mxnet')
    from test_lr_scaling import _worker_results
    cfg = dict(kvstore='horovod', batch_scale='auto', bounds=[1, 8], interval=4, batch=8,
               updates=60, lr_scaling='adascale', sharded=sharded)
    if sharded:
        cfg['optimizer'] = 'lblamb'
    results = _worker_results(tmp_path, cfg)
    assert results[0]['windows'] == results[1]['windows']
    assert results[0]['history'] == results[1]['history']
    assert results[0]['timings'] == results[1]['timings']
    assert len(results[0]['history']) > 1
    assert results[0]['seconds'] != results[1]['seconds']
    assert results[0]['gain'] == results[1]['gain']


def test_a_window_of_one_stands_off_the_line():
    """A window of 1 has no accumulation pass: once two longer lengths are timed, the line
    goes through those and the window of 1 keeps its own time; before, the line goes
    through every length timed."""
    t_micro, t_update, alone = 0.002, 0.005, 0.006      # below the line's 0.007
    timings = _timings([(1, alone, 8), (2, 2 * t_micro + t_update, 8),
                        (4, 4 * t_micro + t_update, 8)])
    assert bc.fit_window_time(timings) == pytest.approx((t_micro, t_update), rel=1e-9)
    assert bc.single_window_time(timings) == alone
    assert bc.single_window_time(timings[:2]) is None
    slope, _ = bc.fit_window_time(timings[:2])
    assert slope == pytest.approx(2 * t_micro + t_update - alone)
    # the choice counts the window of 1 at its own time
    got = bc.choose_window(2, (1, 16), t_micro, t_update, 32, 2, 100.0, single=alone)
    assert got == _reference_choice_of(lambda n: alone if n == 1 else n * t_micro + t_update,
                                       2, (1, 16), 32, 2, 100.0)


def _reference_choice_of(seconds, current, bounds, b, workers, noise, margin=0.02):
    def g(length):
        m = length * b * workers
        return (noise + b) / (noise + m) * m / seconds(length)
    lengths = [n for n in range(bounds[0], bounds[1] + 1) if current / 2 <= n <= 2 * current]
    best = max(lengths, key=lambda n: (g(n), -abs(n - current)))
    return best if g(best) > (1 + margin) * g(current) else current


@pytest.mark.parametrize('bounds, timed, window, pending', [
    ((1, 16), [1], 1, 2),           # one length: twice it
    ((1, 16), [1, 2], 2, 4),        # one length of 2 or more: twice it, whatever the goodput
    ((1, 16), [1, 2], 1, 2),        # back at 1: towards the lengths still to time
    ((1, 8), [8], 8, 4),            # at hi: half
    ((1, 2), [1, 2], 2, 1),         # the bounds hold one length >= 2: the goodput decides
    ((1, 16), [1, 2, 4], 4, 2),     # the line has its points: the goodput decides
])
def test_exploring_until_the_line_has_points(bounds, timed, window, pending):
    """Tiny noise scale (every longer window wastes examples): while exploring the choice
    still grows; once the line has its points the goodput shrinks the window."""
    chooser = bc.BatchChoice(bounds, interval=1)
    for n in timed:
        for _ in range(4):
            chooser.measured(n, 0.01 * n + 0.005)
    chooser.state.segments[-1] = bc.Segment(0, 0, window)
    chooser.applied(base_batch=32, workers=2, noise_scale=1.0)
    assert chooser.state.pending == pending


def test_the_noise_scale_monitor_follows_an_auto_window_from_one():
    """GradientNoiseScale on one device accepts batch_scale='auto' whose bounds start at 1
    (its windows are at the reduction once they grow), and measures the regression's
    B_noise within 10% once they have grown."""
    rng, wstar, delta, mu2, trace = _regression(0)
    net = _net(wstar + delta)
    clock = _Clock(0.01, 0.3)
    trainer = _auto_trainer(net, rule='adascale', bounds=(1, 16), interval=4, clock=clock)
    monitor = mx_lbsgd.GradientNoiseScale(trainer, interval=1)
    opt = trainer.optimizer
    opt.set_learning_rate(0.0)
    while opt.applied_updates < 400:
        clock.step(opt, lambda: _step(net, trainer, *_batch(rng, wstar)))
    assert opt.batch_scale > 1
    assert monitor.b_simple == pytest.approx(trace / mu2, rel=0.1)
