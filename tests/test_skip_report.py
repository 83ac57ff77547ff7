"""Reports a person can read (issue 40, item 7): a skipped step's text names the 5
parameters with the most non-finite values and "and N more" (the report object keeps every
one), and each alert goes to one channel: skipped steps to logger 'mx_lbsgd' (INFO), the
falling-scale alert to `warnings` (``overflow_alert='warn'``, the default) or to that
logger (``'log'``), never both."""
import logging
import pickle
import re
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import DynamicLossScaler, LossScaleFallingWarning
from mx_lbsgd.gluon import binding

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

MANY = 63


def make_params(n, size=MANY):
    """n float32 parameters p00, p01, ... of `size` elements each."""
    params = gluon.ParameterDict()
    for i in range(n):
        params.get('p%02d' % i, shape=(size,)).initialize(mx.init.One(), ctx=mx.cpu())
    return params


def backward(params, scale, infs):
    """Gradients of sum(w) * scale, then the first ``infs(i)`` elements of parameter i's
    gradient set to inf."""
    with autograd.record():
        loss = nd.add_n(*[p.data().sum() for p in params.values()]) * scale
    loss.backward()
    for i, p in enumerate(params.values()):
        n = infs(i)
        if n:
            grad = p.grad().asnumpy()
            grad[:n] = np.inf
            p.grad()[:] = nd.array(grad)


def setup(where, params, alert=None, scaler=None):
    """(source of the reports, one training step) for the optimizer or the hook."""
    scaler = scaler or DynamicLossScaler(init_scale=2.0 ** 10)
    if where == 'optimizer':
        opts = dict(loss_scaler=scaler)
        if alert is not None:
            opts['overflow_alert'] = alert
        trainer = gluon.Trainer(params, 'lssgd', opts, kvstore=None)
        return trainer.optimizer, lambda: trainer.step(1)
    trainer = gluon.Trainer(params, 'sgd', {}, kvstore=None)
    hook = (mx_lbsgd.LossScaling(trainer, scaler, force=True) if alert is None
            else mx_lbsgd.LossScaling(trainer, scaler, force=True, alert=alert))
    return hook, lambda: hook.step(1)


def scale_of(source):
    return source.loss_scaler.scale if hasattr(source, 'loss_scaler') else source.scale


NAMED = re.compile(r'(p\d\d) inf \((\d+)\)')


@pytest.mark.parametrize('where', ['optimizer', 'hook'])
def test_a_skip_report_names_five_and_how_many_more(where, caplog):
    params = make_params(MANY)
    source, step = setup(where, params)
    with caplog.at_level(logging.INFO, logger='mx_lbsgd'):
        backward(params, scale_of(source), lambda i: i + 1)    # p62 has the most: 63
        step()
    records = [r for r in caplog.records if hasattr(r, 'overflow_report')]
    assert len(records) == 1
    text = records[0].getMessage()
    assert NAMED.findall(text) == [('p%02d' % i, str(i + 1)) for i in range(62, 57, -1)]
    assert 'p58 inf (59) and %d more.' % (MANY - 5) in text and 'and 58 more' in text
    assert len(text) < 400, text                # was 2.8 KB with 63 parameters named
    # the report itself is complete: every parameter, in the history too
    report = source.last_overflow
    assert report is records[0].overflow_report and str(report) == text
    assert len(report.parameters) == len(report.counts) == MANY
    assert dict(report.counts) == {'p%02d' % i: i + 1 for i in range(MANY)}
    assert list(report.parameters)[:5] == ['p62', 'p61', 'p60', 'p59', 'p58']
    assert len(source.overflow_history[-1].parameters) == MANY


@pytest.mark.parametrize('offenders, tail', [(5, ''), (6, ' and 1 more')])
def test_five_or_fewer_are_all_named(offenders, tail):
    counts = {'q%d' % i: 10 - i for i in range(offenders)}
    report = mx_lbsgd.OverflowReport(step=2, scale=4.0, scale_after=2.0,
                                     parameters={n: 'nan' for n in counts}, counts=counts)
    named = ', '.join('q%d nan (%d)' % (i, 10 - i) for i in range(5))
    assert str(report) == 'step 2 skipped (loss scale 4 -> 2): %s%s.' % (named, tail)


def run_descent(where, alert, caplog):
    """Three overflowing steps: the falling-scale alert fires once (warn_backoffs=2).
    Returns (the LossScaleFallingWarnings, every other warning, the WARNING records, the
    INFO records of skipped steps)."""
    params = make_params(3, size=4)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, warn_backoffs=2)
    source, step = setup(where, params, alert, scaler)
    with caplog.at_level(logging.INFO, logger='mx_lbsgd'), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(3):
            backward(params, scale_of(source), lambda i: 1)
            step()
    assert scaler.total_skipped == 3
    falling = [w for w in caught if issubclass(w.category, LossScaleFallingWarning)]
    # (a library's deprecation notice may come up while MXNet imports lazily)
    others = [w for w in caught if not issubclass(w.category, (
        LossScaleFallingWarning, DeprecationWarning, PendingDeprecationWarning))]
    records = [r for r in caplog.records if r.name == 'mx_lbsgd']
    return (falling, others, [r for r in records if r.levelno == logging.WARNING],
            [r for r in records if hasattr(r, 'overflow_report')])


@pytest.mark.parametrize('where', ['optimizer', 'hook'])
@pytest.mark.parametrize('alert', [None, 'warn'])
def test_the_falling_scale_alert_is_a_warning_only(where, alert, caplog):
    falling, others, warning_records, skip_records = run_descent(where, alert, caplog)
    assert len(falling) == 1 and not others, [str(w.message) for w in others]
    message = falling[0].message
    assert str(message).startswith('loss scale falling: 2 backoffs without a growth')
    assert message.offenders == [('p00', 2), ('p01', 2), ('p02', 2)]
    assert warning_records == []                 # not logged as well
    assert len(skip_records) == 1                # the skipped steps: INFO, rate-limited


@pytest.mark.parametrize('where', ['optimizer', 'hook'])
def test_the_falling_scale_alert_is_a_log_record_only(where, caplog):
    falling, others, warning_records, skip_records = run_descent(where, 'log', caplog)
    assert falling == [] and others == [], [str(w.message) for w in others]
    assert len(warning_records) == 1
    record = warning_records[0]
    assert record.getMessage().startswith('loss scale falling: 2 backoffs without a growth')
    assert 'Parameters that overflowed most: p00 (2 step(s))' in record.getMessage()
    assert record.offenders == [('p00', 2), ('p01', 2), ('p02', 2)]
    assert len(skip_records) == 1


BAD = [pytest.param('both', id='both'), pytest.param('WARN', id='upper-case'),
       pytest.param(None, id='None'), pytest.param(True, id='True')]


@pytest.mark.parametrize('value', BAD)
@pytest.mark.parametrize('make', [
    pytest.param(lambda v: mx_lbsgd.LBSGD(overflow_alert=v), id='LBSGD'),
    pytest.param(lambda v: mx_lbsgd.LossScaledSGD(overflow_alert=v), id='LossScaledSGD'),
    pytest.param(lambda v: mx_lbsgd.LAMB(overflow_alert=v), id='LAMB'),
    pytest.param(lambda v: mx.optimizer.create('lbsgd', overflow_alert=v), id='create'),
    pytest.param(lambda v: gluon.Trainer(make_params(1), 'lblamb', {'overflow_alert': v}),
                 id='Trainer'),
])
def test_a_bad_channel_names_the_parameter_and_the_choices(make, value):
    with pytest.raises(ValueError, match=r"^overflow_alert=%s is not supported; expected one "
                       r"of \('warn', 'log'\)$" % re.escape(repr(value))):
        make(value)


@pytest.mark.parametrize('value', BAD)
def test_a_bad_hook_channel_is_refused_before_anything_changes(value):
    trainer = gluon.Trainer(make_params(1), 'sgd', {}, kvstore=None)
    scaler = DynamicLossScaler(init_scale=8.0)
    with pytest.raises(ValueError, match=r"^alert=%s is not supported; expected one of "
                       r"\('warn', 'log'\)$" % re.escape(repr(value))):
        mx_lbsgd.LossScaling(trainer, scaler, alert=value)
    assert binding.bound(trainer) is None and binding.loss_scaling_of(trainer) is None
    assert scaler.state_dict() == DynamicLossScaler(init_scale=8.0).state_dict()


def test_the_channel_travels_with_the_optimizer():
    opt = mx_lbsgd.LossScaledSGD(overflow_alert='log')
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.overflow_alert == 'log' and copy._pieces.overflow.alert == 'log'
    state = opt.__getstate__()
    del state['overflow_alert']                  # pickled before the setting existed
    old = mx_lbsgd.LossScaledSGD.__new__(mx_lbsgd.LossScaledSGD)
    old.__setstate__(state)
    assert old._pieces.overflow.alert == 'warn'
