"""Where the semantics agree, our LBSGD gives MXNet's own optimizers' results."""
import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd
from harness import NAMES, make_problem, run_optimizer

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

COMMON = dict(learning_rate=0.05, wd=1e-3, rescale_grad=0.7, momentum=0.9,
              param_idx2name=dict(enumerate(NAMES)))
PATHS = [pytest.param(True, id='fused'), pytest.param(False, id='pertensor')]
DTYPES = [pytest.param('float32', False, id='fp32'),
          pytest.param('float16', True, id='fp16mp')]


def _run(opt, dtype, steps=6):
    weights, grads = make_problem(steps)
    return run_optimizer(opt, weights, grads, dtype)[0]


@pytest.mark.parametrize('dtype, mp', DTYPES)
@pytest.mark.parametrize('fused', PATHS)
@pytest.mark.parametrize('strategy', ['linear', 'power2', 'sqrt'])
def test_batch_scale_1_equals_mxnet_sgd(strategy, fused, dtype, mp):
    ours = _run(mx_lbsgd.LBSGD(warmup_strategy=strategy, fused=fused, multi_precision=mp,
                               **COMMON), dtype)
    theirs = _run(mx.optimizer.SGD(multi_precision=mp, **COMMON), dtype)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('strategy', ['linear', 'power2', 'sqrt'])
def test_batch_scale_1_equals_mxnet_builtin_lbsgd(strategy):
    ours = _run(mx_lbsgd.LBSGD(warmup_strategy=strategy, **COMMON), 'float32')
    theirs = _run(mx_lbsgd.MXNET_LBSGD(warmup_strategy=strategy, **COMMON), 'float32')
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('fused', [pytest.param(None, id='default')] + PATHS)
def test_lars_equals_mxnet_lars(fused):
    """mx.optimizer.LARS: eta, eps, no momentum correction, names ending in bias/gamma/beta
    skipped; its wd_mult is 0 for names not ending in _weight, ours (MXNet's default)
    keeps *_gamma, so the names here have no gamma."""
    names = ['fc0_weight', 'fc0_bias', 'conv0_weight', 'x_bias', 'bn0_beta', 'fc1_weight']
    common = dict(COMMON, param_idx2name=dict(enumerate(names)))
    ours = _run(mx_lbsgd.LBSGD(warmup_strategy='lars', lars_eta=0.01, lars_eps=1e-4,
                               fused=fused, **common), 'float32')
    theirs = _run(mx.optimizer.LARS(eta=0.01, eps=1e-4, momentum_correction=False, **common),
                  'float32')
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_mxnet_builtin_lbsgd_loses_first_micro_batch_ours_does_not():
    """Documents the defect we fix: the built-in aliases the first accumulated gradient."""
    def run(opt):
        updater = mx.optimizer.get_updater(opt)
        w, g = mx.nd.zeros((2,)), mx.nd.ones((2,))
        updater(0, g, w)
        g[:] = 5.0
        updater(0, g, w)
        return w.asnumpy()
    kwargs = dict(batch_scale=2, warmup_epochs=0, learning_rate=1.0)
    np.testing.assert_allclose(run(mx_lbsgd.LBSGD(**kwargs)), -(1 + 5) / 2 * 2)
    assert not np.allclose(run(mx_lbsgd.MXNET_LBSGD(**kwargs)), -(1 + 5) / 2 * 2)
