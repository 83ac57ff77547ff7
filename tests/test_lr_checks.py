"""learning_rate and wd are checked like every other argument (issue 31 item 4): a negative
or non-finite value is refused with a ValueError naming the parameter and the allowed
range, on every entry (mx.optimizer.create, gluon.Trainer, direct construction,
set_learning_rate), before anything changes."""
import math

import pytest
import mxnet as mx
from mxnet import gluon

import mx_lbsgd

pytestmark = pytest.mark.unit

NAMES = ['lbsgd', 'lssgd', 'lblamb']
CLASSES = {'lbsgd': mx_lbsgd.LBSGD, 'lssgd': mx_lbsgd.LossScaledSGD, 'lblamb': mx_lbsgd.LAMB}
BAD = [
    pytest.param('learning_rate', -0.1, r'learning_rate must be in \[0.0, inf\); got -0.1',
                 id='lr-negative'),
    pytest.param('learning_rate', math.inf, 'learning_rate must be a finite real number',
                 id='lr-inf'),
    pytest.param('learning_rate', math.nan, 'learning_rate must be a finite real number',
                 id='lr-nan'),
    pytest.param('wd', -1e-4, r'wd must be in \[0.0, inf\); got -0.0001', id='wd-negative'),
    pytest.param('wd', -math.inf, 'wd must be a finite real number', id='wd-inf'),
    pytest.param('wd', math.nan, 'wd must be a finite real number', id='wd-nan'),
]


def _net():
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    return net


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('arg, value, match', BAD)
def test_bad_value_refused_on_every_entry(name, arg, value, match):
    with pytest.raises(ValueError, match=match):
        mx.optimizer.create(name, **{arg: value})
    with pytest.raises(ValueError, match=match):
        CLASSES[name](**{arg: value})
    net = _net()
    with pytest.raises(ValueError, match=match):
        gluon.Trainer(net.collect_params(), name, {arg: value})
    with pytest.raises(TypeError, match=arg):
        CLASSES[name](**{arg: 'fast'})


@pytest.mark.parametrize('name', NAMES)
def test_zero_and_scheduler_defaults_are_accepted(name):
    assert mx.optimizer.create(name, learning_rate=0.0, wd=0.0).lr == 0.0
    sched = mx.lr_scheduler.FactorScheduler(step=10, base_lr=0.05)
    opt = mx.optimizer.create(name, learning_rate=None, lr_scheduler=sched)
    assert opt.learning_rate == 0.05


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('value, match', [
    (-1.0, r'learning_rate must be in \[0.0, inf\)'),
    (math.nan, 'learning_rate must be a finite real number'),
    (math.inf, 'learning_rate must be a finite real number')])
def test_set_learning_rate_checks_before_changing(name, value, match):
    net = _net()
    trainer = gluon.Trainer(net.collect_params(), name, dict(learning_rate=0.1))
    with pytest.raises(ValueError, match=match):
        trainer.set_learning_rate(value)
    with pytest.raises(ValueError, match=match):
        trainer.optimizer.set_learning_rate(value)
    assert trainer.learning_rate == 0.1
    trainer.set_learning_rate(0.05)
    assert trainer.learning_rate == 0.05
