"""The loss-scale policy replays each framework's documented behaviour."""
import math
import pickle

import pytest

from mx_lbsgd.loss_scale import DynamicLossScaler, LossScaleStuckError

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

O, F = True, False      # overflow, finite

# Each seed's documented parameters mapped onto DynamicLossScaler, and a table of
# (run of overflow flags, scale expected after the run), written from the documentation.
SEEDS = [
    pytest.param(  # nnabla DynamicLossScalingUpdater(scale=8, scaling_factor=2, N=2000)
        dict(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
             min_scale=2.0 ** -24, max_scale=math.inf),
        [((O,), 4.0), ((O,), 2.0), ((F,) * 1999, 2.0), ((F,), 4.0),
         ((O,) * 5, 0.125), ((F,) * 2000, 0.25)], id='nnabla'),
    pytest.param(  # MindSpore DynamicLossScaleUpdateCell(2**12, scale_factor=2, scale_window=1000)
        dict(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5,
             growth_interval=1000, min_scale=1.0, max_scale=math.inf),
        [((F,) * 1000, 8192.0), ((O,), 4096.0), ((O,) * 20, 1.0), ((F,) * 999, 1.0),
         ((F,), 2.0)], id='mindspore'),
    pytest.param(  # Keras LossScaleOptimizer(initial_scale=32768, dynamic_growth_steps=2000)
        dict(init_scale=32768.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
             min_scale=2.0 ** -24, max_scale=math.inf),
        [((O,), 16384.0), ((F,) * 2000, 32768.0), ((F,) * 1999, 32768.0), ((O,), 16384.0),
         ((F,) * 1999, 16384.0), ((F,), 32768.0)], id='keras'),
    pytest.param(  # Ascend ExponentialUpdateLossScaleManager(2**15, incr_every_n_steps=1000,
        #            decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8)
        dict(init_scale=32768.0, growth_factor=2.0, backoff_factor=0.8, growth_interval=1000,
             hysteresis=2, min_scale=1.0, max_scale=math.inf),
        [((O,), 32768.0), ((F,), 32768.0), ((O,), 26214.4), ((O,), 26214.4),
         ((O,), 20971.52), ((F,) * 1000, 41943.04)], id='ascend'),
    pytest.param(  # PyTorch GradScaler() defaults
        dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
             min_scale=2.0 ** -24, max_scale=math.inf),
        [((O,), 32768.0), ((F,) * 2000, 65536.0), ((O, O, O), 8192.0)], id='pytorch'),
    pytest.param(  # DeepSpeed: hysteresis 2 (accumulated), window 1000, min scale 1
        dict(init_scale=2.0 ** 16, growth_interval=1000, hysteresis=2, min_scale=1.0,
             max_scale=math.inf),
        [((O,), 65536.0), ((O,), 32768.0), ((F,) * 999, 32768.0), ((O,), 32768.0),
         ((O,), 16384.0)], id='deepspeed'),
]


def replay(scaler, table):
    for flags, expected in table:
        for flag in flags:
            assert scaler.update(flag) is (not flag)
        assert scaler.scale == pytest.approx(expected, rel=1e-12), (flags[:3], expected)


@pytest.mark.parametrize('config, table', SEEDS)
def test_seed_behaviour(config, table):
    replay(DynamicLossScaler(**config), table)


def test_consecutive_hysteresis_resets_on_a_finite_step():
    scaler = DynamicLossScaler(init_scale=64.0, hysteresis=2, consecutive_hysteresis=True)
    replay(scaler, [((O, F, O, F, O), 64.0), ((O,), 32.0)])
    accumulated = DynamicLossScaler(init_scale=64.0, hysteresis=2)
    replay(accumulated, [((O, F, O), 32.0)])


def test_growth_is_capped_and_never_infinite():
    scaler = DynamicLossScaler(init_scale=2.0 ** 23, growth_interval=1)
    replay(scaler, [((F,), 2.0 ** 24), ((F,) * 5, 2.0 ** 24)])
    huge = DynamicLossScaler(init_scale=1e308, growth_interval=1, max_scale=math.inf)
    replay(huge, [((F,) * 3, 1e308)])
    assert huge.num_good_steps == 0     # the attempt still resets the window


def test_backoff_floors_at_min_scale():
    replay(DynamicLossScaler(init_scale=4.0, min_scale=1.0), [((O,) * 5, 1.0)])


def test_counters():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    for flag in (F, F, O, F, O, F):
        scaler.update(flag)
    assert (scaler.num_good_steps, scaler.num_bad_steps) == (1, 0)
    assert (scaler.total_skipped, scaler.total_steps) == (2, 6)
    assert scaler.scale == 4.0


def test_static_mode_keeps_scale_but_skips():
    scaler = DynamicLossScaler.static(128.0)
    flags = (O, F, F, O) + (F,) * 3000
    assert [scaler.update(f) for f in flags[:4]] == [False, True, True, False]
    replay(scaler, [(flags[4:], 128.0)])
    assert scaler.total_skipped == 2


def test_disabled_never_skips_and_scales_by_one():
    scaler = DynamicLossScaler(enabled=False)
    assert scaler.scale == 1.0
    assert scaler.update(True) is True
    assert scaler.total_skipped == 0


@pytest.mark.parametrize('policy', ['warn', 'raise'])
def test_stuck_at_min_scale(policy):
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0, stuck_patience=3,
                               on_stuck=policy)
    scaler.update(O)                      # 2 -> 1
    scaler.update(O)
    scaler.update(O)
    if policy == 'raise':
        with pytest.raises(LossScaleStuckError, match='stuck at 1'):
            scaler.update(O)
    else:
        with pytest.warns(RuntimeWarning, match='stuck at 1'):
            scaler.update(O)
    assert scaler.stuck_steps == 3


def test_finite_step_clears_stuck_count():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, stuck_patience=2,
                               on_stuck='raise')
    for flag in (O, F, O, F, O):
        scaler.update(flag)
    assert scaler.stuck_steps == 1


def test_state_round_trip_mid_growth_window():
    a = DynamicLossScaler(init_scale=1024.0, growth_interval=10, hysteresis=2)
    for flag in (F,) * 4 + (O,) + (F,) * 6:
        a.update(flag)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    c = pickle.loads(pickle.dumps(a))
    flags = (F,) * 3 + (O, O) + (F,) * 12
    for flag in flags:
        assert a.update(flag) == b.update(flag) == c.update(flag)
        assert a.scale == b.scale == c.scale
    assert a.state_dict() == b.state_dict() == c.state_dict()


@pytest.mark.parametrize('state', [{}, {'config': {}}, {'config': {'growth_factor': 0.5},
                                                         'state': {}}, None])
def test_load_state_dict_rejects_garbage(state):
    scaler = DynamicLossScaler()
    before = scaler.state_dict()
    with pytest.raises(ValueError):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


BAD = [
    pytest.param(dict(growth_factor=1.0), 'growth_factor', id='growth_factor'),
    pytest.param(dict(backoff_factor=1.0), 'backoff_factor', id='backoff-1'),
    pytest.param(dict(backoff_factor=0.0), 'backoff_factor', id='backoff-0'),
    pytest.param(dict(init_scale=0.0), 'init_scale', id='init-0'),
    pytest.param(dict(init_scale=math.inf), 'init_scale', id='init-inf'),
    pytest.param(dict(init_scale=float('nan')), 'init_scale', id='init-nan'),
    pytest.param(dict(min_scale=4.0, max_scale=2.0), 'min_scale', id='min>max'),
    pytest.param(dict(min_scale=-1.0), 'min_scale', id='min-negative'),
    pytest.param(dict(growth_interval=0), 'growth_interval', id='interval'),
    pytest.param(dict(hysteresis=0), 'hysteresis', id='hysteresis'),
    pytest.param(dict(on_stuck='panic'), 'on_stuck', id='on_stuck'),
    pytest.param(dict(init_scale=2.0 ** 30), 'init_scale', id='init>max'),
]


@pytest.mark.parametrize('kwargs, match', BAD)
def test_invalid_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DynamicLossScaler(**kwargs)


# -- the good-step count: restarted by an overflow and by a growth, kept across a reload --
def trace(scaler, flags):
    """(scale, num_good_steps, num_bad_steps) after each step."""
    out = []
    for flag in flags:
        scaler.update(flag)
        out.append((scaler.scale, scaler.num_good_steps, scaler.num_bad_steps))
    return out


# growth_interval=4, hysteresis=3, init 64; tables worked out by hand from the rule in
# loss_scale's docstring. Without the restart, the 4th finite step (the first after the
# overflow) would grow the scale to 128.
GOOD_RESET = [
    pytest.param(False, [
        (F, (64.0, 1, 0)), (F, (64.0, 2, 0)), (F, (64.0, 3, 0)),
        (O, (64.0, 0, 1)),                      # restarts the count, no backoff yet (1 < 3)
        (F, (64.0, 1, 1)), (F, (64.0, 2, 1)), (F, (64.0, 3, 1)),
        (F, (128.0, 0, 0)),                     # 4 finite steps since the overflow
        (O, (128.0, 0, 1)), (O, (128.0, 0, 2)),
        (F, (128.0, 1, 2)),                     # accumulated hysteresis keeps bad = 2
        (O, (64.0, 0, 0)),                      # third overflow since the growth: backoff
        (F, (64.0, 1, 0)), (F, (64.0, 2, 0)), (F, (64.0, 3, 0)), (F, (128.0, 0, 0)),
    ], id='accumulated-hysteresis'),
    pytest.param(True, [
        (F, (64.0, 1, 0)), (F, (64.0, 2, 0)), (F, (64.0, 3, 0)),
        (O, (64.0, 0, 1)),
        (F, (64.0, 1, 0)), (F, (64.0, 2, 0)), (F, (64.0, 3, 0)),
        (F, (128.0, 0, 0)),
        (O, (128.0, 0, 1)), (O, (128.0, 0, 2)),
        (F, (128.0, 1, 0)),                     # consecutive hysteresis: bad restarts too
        (O, (128.0, 0, 1)),                     # so no backoff here
        (O, (128.0, 0, 2)), (O, (64.0, 0, 0)),
    ], id='consecutive-hysteresis'),
]


@pytest.mark.parametrize('consecutive, table', GOOD_RESET)
def test_overflow_mid_interval_restarts_the_good_count(consecutive, table):
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=4, hysteresis=3,
                               consecutive_hysteresis=consecutive, max_scale=math.inf)
    flags = [flag for flag, _ in table]
    assert trace(scaler, flags) == [want for _, want in table]


GROWTH_RESET = [
    pytest.param(dict(init_scale=8.0, growth_interval=3, hysteresis=2), [
        (O, (8.0, 0, 1)),
        (F, (8.0, 1, 1)), (F, (8.0, 2, 1)),
        (F, (16.0, 0, 0)),                      # growth clears good and bad
        (F, (16.0, 1, 0)), (F, (16.0, 2, 0)),   # the count starts again from 0
        (O, (16.0, 0, 1)),                      # bad was cleared: 1 < 2, no backoff
        (F, (16.0, 1, 1)), (F, (16.0, 2, 1)), (F, (32.0, 0, 0)),
        (F, (32.0, 1, 0)), (F, (32.0, 2, 0)), (F, (64.0, 0, 0)),
    ], id='growth-clears-good-and-bad'),
    pytest.param(dict(init_scale=2.0 ** 23, growth_interval=2, max_scale=2.0 ** 24), [
        (F, (2.0 ** 23, 1, 0)), (F, (2.0 ** 24, 0, 0)),
        (F, (2.0 ** 24, 1, 0)), (F, (2.0 ** 24, 0, 0)),   # capped: the count still restarts
        (O, (2.0 ** 23, 0, 0)),
        (F, (2.0 ** 23, 1, 0)), (F, (2.0 ** 24, 0, 0)),
    ], id='capped-growth-restarts-the-count'),
    pytest.param(dict(init_scale=4.0, growth_interval=2, backoff_factor=0.25,
                      min_scale=1.0), [
        (F, (4.0, 1, 0)), (O, (1.0, 0, 0)),     # backoff to the floor clears the count
        (F, (1.0, 1, 0)), (O, (1.0, 0, 0)),     # at min_scale: still a "scale change"
        (F, (1.0, 1, 0)), (F, (2.0, 0, 0)),
    ], id='backoff-clears-the-count'),
]


@pytest.mark.parametrize('config, table', GROWTH_RESET)
def test_growth_and_backoff_restart_the_good_count(config, table):
    scaler = DynamicLossScaler(**config)
    assert trace(scaler, [flag for flag, _ in table]) == [want for _, want in table]


# (flags before the save, flags after it, scales expected after each later flag); the
# configuration travels in the state_dict, so the target's own (defaults) must not matter
RELOAD = [
    pytest.param((F, F, F), (F, F, F), [32.0, 64.0, 64.0], id='3-of-5-done'),
    pytest.param((F, O, F, F, F, F), (F, F, F), [32.0, 32.0, 32.0], id='after-an-overflow'),
    pytest.param((F, F, F, F, F, F), (F, F, F, F), [64.0, 64.0, 64.0, 128.0],
                 id='just-after-a-growth'),
    pytest.param((F, F, F, F, O), (F, F, F, F, F), [16.0, 16.0, 16.0, 16.0, 32.0],
                 id='overflow-right-before-growth'),
]


@pytest.mark.parametrize('how', ['load_state_dict', 'pickle', 'deepcopy'])
@pytest.mark.parametrize('before, after, scales', RELOAD)
def test_reload_mid_interval_keeps_the_good_count(before, after, scales, how):
    import copy
    source = DynamicLossScaler(init_scale=32.0, growth_interval=5)
    for flag in before:
        source.update(flag)
    if how == 'load_state_dict':
        target = DynamicLossScaler()          # growth_interval 2000: the file's must win
        target.load_state_dict(source.state_dict())
    elif how == 'pickle':
        target = pickle.loads(pickle.dumps(source))
    else:
        target = copy.deepcopy(source)
    assert (target.num_good_steps, target.num_bad_steps) == (source.num_good_steps,
                                                             source.num_bad_steps)
    got = []
    for flag in after:
        target.update(flag)
        got.append(target.scale)
    assert got == scales
