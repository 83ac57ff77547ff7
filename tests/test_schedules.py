import math

import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd
from mx_lbsgd import schedules
from reference import warmup_lr, warmup_multiplier

pytestmark = pytest.mark.unit

POINTS = [0, 1, 3, 7, 10, 11, 50]


@pytest.mark.parametrize('mode', list(schedules.WARMUP_SHAPES))
@pytest.mark.parametrize('W, B', [pytest.param(10, 8, id='W10-B8'),
                                  pytest.param(1, 4, id='W1-B4'),
                                  pytest.param(0, 4, id='W0-B4'),
                                  pytest.param(10, 1, id='W10-B1')])
def test_warmup_multiplier_matches_reference(mode, W, B):
    for n in POINTS:
        got = schedules.warmup_multiplier(n, W, B, mode)
        assert got == pytest.approx(warmup_multiplier(n, W, B, mode), rel=1e-12)
        assert got == schedules.warmup_multiplier(n, W, B, mode)   # pure


@pytest.mark.parametrize('n, W, B, mode, expected', [
    pytest.param(5, 10, 4, 'linear', 2.5, id='linear-half'),
    pytest.param(5, 10, 4, 'power2', 1.75, id='power2-half'),
    pytest.param(4, 16, 4, 'sqrt', 2.5, id='sqrt-quarter'),
    pytest.param(0, 10, 8, 'sqrt', 1.0, id='start'),
    pytest.param(10, 10, 8, 'power2', 8.0, id='end'),
    pytest.param(99, 10, 8, 'linear', 8.0, id='after'),
    pytest.param(3, 0, 6, 'linear', 6.0, id='no-warmup'),
])
def test_warmup_multiplier_closed_form(n, W, B, mode, expected):
    assert schedules.warmup_multiplier(n, W, B, mode) == pytest.approx(expected, rel=1e-15)


def test_every_registered_shape_has_a_reference():
    """A strategy added to schedules.WARMUP_SHAPES needs its formula in tests/reference.py."""
    for mode in schedules.WARMUP_SHAPES:
        assert warmup_multiplier(5, 10, 3, mode) == pytest.approx(
            schedules.warmup_multiplier(5, 10, 3, mode))
    assert mx_lbsgd.WARMUP_STRATEGIES == tuple(schedules.WARMUP_SHAPES) + ('lars',)
    table = schedules.strategy_table()
    assert all('`%s`' % name in table for name in mx_lbsgd.WARMUP_STRATEGIES)


@pytest.mark.parametrize('mode', ['linear', 'power2', 'sqrt'])
def test_warmup_multiplier_equals_mxnet_builtin_formula(mode):
    builtin = mx_lbsgd.MXNET_LBSGD(warmup_strategy=mode, batch_scale=8, warmup_epochs=2,
                                   updates_per_epoch=5)
    for n in POINTS:
        assert schedules.warmup_multiplier(n, 10, 8, mode) == pytest.approx(
            builtin._get_lbmult(n), rel=1e-12)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"expected one of \('linear', 'power2', 'sqrt'\)"):
        schedules.warmup_multiplier(1, 10, 4, 'cubic')


SCHEDULERS = [
    pytest.param(dict(warmup_steps=10, strategy='linear'), id='linear'),
    pytest.param(dict(warmup_steps=10, strategy='power2', warmup_begin_lr=0.01), id='power2'),
    pytest.param(dict(warmup_steps=10, strategy='sqrt', decay='poly', max_update=40,
                      final_lr=0.001, power=2.0), id='sqrt-poly'),
    pytest.param(dict(warmup_steps=5, strategy='linear', decay='cosine', max_update=30),
                 id='linear-cosine'),
    pytest.param(dict(warmup_steps=0, strategy='linear', decay='poly', max_update=20,
                      power=1.0), id='no-warmup-poly'),
]


@pytest.mark.parametrize('kwargs', SCHEDULERS)
def test_warmup_scheduler_matches_reference_and_is_pure(kwargs):
    sched = mx_lbsgd.WarmupScheduler(base_lr=0.4, **kwargs)
    ref = dict(W=kwargs['warmup_steps'], mode=kwargs['strategy'],
               begin_lr=kwargs.get('warmup_begin_lr', 0.0), decay=kwargs.get('decay'),
               max_update=kwargs.get('max_update'), final_lr=kwargs.get('final_lr', 0.0),
               power=kwargs.get('power', 2.0))
    for t in [0, 1, 4, 5, 9, 10, 11, 25, 29, 30, 40, 100]:
        expected = warmup_lr(t, 0.4, **ref)
        assert sched(t) == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert sched(t) == sched(t)
    assert sched(3) == mx_lbsgd.WarmupScheduler(base_lr=0.4, **kwargs)(3)


def test_warmup_scheduler_drives_mxnet_sgd():
    sched = mx_lbsgd.WarmupScheduler(base_lr=1.0, warmup_steps=4, strategy='sqrt')
    opt = mx.optimizer.SGD(lr_scheduler=sched)
    updater = mx.optimizer.get_updater(opt)
    w = mx.nd.zeros((1,))
    seen = []
    for _ in range(6):
        before = w.asscalar()
        updater(0, mx.nd.ones((1,)), w)
        seen.append(before - w.asscalar())
    np.testing.assert_allclose(seen, [math.sqrt(t / 4) if t < 4 else 1.0 for t in range(1, 7)],
                               rtol=1e-6)


@pytest.mark.parametrize('kwargs, match', [
    pytest.param(dict(strategy='cubic'), 'strategy', id='strategy'),
    pytest.param(dict(decay='step', max_update=10), 'decay', id='decay'),
    pytest.param(dict(decay='poly'), 'max_update', id='no-max-update'),
    pytest.param(dict(warmup_steps=10, decay='poly', max_update=10), 'max_update',
                 id='max-update-too-small'),
    pytest.param(dict(warmup_steps=-1), 'warmup_steps', id='warmup-steps'),
])
def test_warmup_scheduler_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mx_lbsgd.WarmupScheduler(**kwargs)
