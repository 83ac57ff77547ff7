"""A warmup whose length comes from MXNet's default ``updates_per_epoch`` (32) is said once,
with the defaults that apply and the parameter to set; nothing is said where the length is
given or where the warmup changes nothing."""
import warnings

import pytest
import mxnet as mx

import mx_lbsgd

pytestmark = pytest.mark.unit


def _said(**kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        opt = mx.optimizer.create('lbsgd', **kwargs)
    return opt, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_warmup_without_updates_per_epoch_is_said_with_the_defaults():
    opt, said = _said(batch_scale=8, warmup_strategy='sqrt', warmup_epochs=2)
    assert len(said) == 1
    assert "warmup_strategy='sqrt'" in said[0] and 'updates_per_epoch' in said[0]
    assert 'default of 32' in said[0] and '64 micro-batches' in said[0]
    assert opt.updates_per_epoch == 32 and opt.lr_multiplier() == 1.0


def test_the_default_warmup_of_a_window_is_said_too():
    _, said = _said(batch_scale=4)
    assert len(said) == 1 and "warmup_strategy='linear'" in said[0] and '160' in said[0]


@pytest.mark.parametrize('kwargs', [
    dict(batch_scale=8, warmup_strategy='linear', updates_per_epoch=100),
    dict(batch_scale=1, warmup_strategy='linear'),              # the multiplier stays 1
    dict(batch_scale=8, warmup_strategy='linear', warmup_epochs=0),
    dict(batch_scale=8, warmup_strategy='lars'),                # LARS, no warmup
    dict(momentum=0.9)])
def test_nothing_is_said_where_the_length_is_given_or_does_not_matter(kwargs):
    assert _said(**kwargs)[1] == []


def test_lssgd_says_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        mx_lbsgd.LossScaledSGD(momentum=0.9)
    assert not [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize('value, error', [(0, ValueError), (2.5, TypeError)])
def test_bad_updates_per_epoch_names_the_parameter(value, error):
    with pytest.raises(error, match='updates_per_epoch'):
        mx_lbsgd.LBSGD(updates_per_epoch=value)
