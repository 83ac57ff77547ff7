"""Each piece of the update pipeline on its own, against the numpy reference: warmup, trust
ratio, the accumulation window (in the optimizer and at a Trainer) and the skip ledger."""
import math

import numpy as np
import pytest
import mxnet as mx

from mx_lbsgd import schedules
from mx_lbsgd.pipeline.progress import SkipLedger
from mx_lbsgd.pipeline.trust_ratio import DEFAULT_LARS_EXCLUDE, TrustRatio
from mx_lbsgd.pipeline.warmup import Warmup
from mx_lbsgd.gluon.window import TrainerWindow
from mx_lbsgd.pipeline.window import InOptimizerWindow
from reference import lars_factor, warmup_multiplier

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]


@pytest.mark.parametrize('shape', list(schedules.WARMUP_SHAPES))
@pytest.mark.parametrize('W, B, offset', [pytest.param(10, 4, 0, id='W10-B4'),
                                          pytest.param(7, 8, 3, id='W7-B8-offset3'),
                                          pytest.param(0, 2, 0, id='no-warmup')])
def test_warmup_multiplier_matches_reference(shape, W, B, offset):
    warmup = Warmup(shape, W, B, offset)
    for n in range(0, 15):
        assert warmup.multiplier(n) == pytest.approx(warmup_multiplier(offset + n, W, B, shape))
    positions = [3, 3, 5, 1]
    assert warmup.scale_lrs([0.1, 0.2, 0.3, 0.4], positions) == pytest.approx(
        [lr * warmup_multiplier(offset + p, W, B, shape)
         for lr, p in zip([0.1, 0.2, 0.3, 0.4], positions)])


def test_no_warmup_shape_keeps_the_rates():
    warmup = Warmup(None, 10, 4, 0)
    assert warmup.multiplier(3) == 1.0 and warmup.scale_lrs([0.5], [3]) == [0.5]


@pytest.mark.parametrize('exclude, name, applies', [
    pytest.param(DEFAULT_LARS_EXCLUDE, 'fc0_bias', False, id='bias'),
    pytest.param(DEFAULT_LARS_EXCLUDE, 'bn_gamma', False, id='gamma'),
    pytest.param(DEFAULT_LARS_EXCLUDE, 'fc0_weight', True, id='weight'),
    pytest.param(('weight',), 'fc0_weight', False, id='suffix'),
    pytest.param(lambda n: n.startswith('emb'), 'emb_weight', False, id='callable'),
    pytest.param((), None, True, id='no-names-no-exclusions')])
def test_trust_ratio_exclusions(exclude, name, applies):
    assert TrustRatio(0.001, 0.0, 0.0, math.inf, exclude).applies(name) is applies


def test_trust_ratio_without_names_refuses_when_it_must_exclude():
    with pytest.raises(ValueError, match='param_idx2name'):
        TrustRatio(0.001, 0.0, 0.0, math.inf, DEFAULT_LARS_EXCLUDE).applies(None)


@pytest.mark.parametrize('lo, hi', [pytest.param(0.0, math.inf, id='open'),
                                    pytest.param(0.5, 2.0, id='clipped')])
def test_trust_ratio_rates_match_reference(lo, hi):
    rng = np.random.RandomState(0)
    shapes = [(5, 3), (4,), (6,), (2, 2)]
    ws = [rng.uniform(-1, 1, s) for s in shapes]
    ws[2][:] = 0.0                                     # zero weight norm: ratio 1
    gs = [rng.uniform(-1, 1, s) for s in shapes]
    lrs, wds, keep = [0.1, 0.2, 0.3, 0.4], [1e-3, 0.0, 1e-3, 1e-3], [False, False, False, True]
    trust = TrustRatio(0.02, 1e-8, lo, hi, ())
    got = trust.for_kernel(keep).rates(weights=[mx.nd.array(w) for w in ws],
                                       grads=[mx.nd.array(g) for g in gs], lrs=lrs, wds=wds,
                                       rescale_grad=0.5, grad_norm=None).asnumpy()
    want = [lr if k else lr * lars_factor(w, g, wd, 0.02, 1e-8, 0.5, lo, hi)
            for w, g, lr, wd, k in zip(ws, gs, lrs, wds, keep)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize('B', [2, 4])     # the shell accumulates only when B > 1
def test_window_in_the_optimizer_sums_then_releases(B):
    rng = np.random.RandomState(1)
    window = InOptimizerWindow()
    accs = [mx.nd.zeros((3,)), mx.nd.zeros((2, 2))]
    total = [np.zeros((3,)), np.zeros((2, 2))]
    for k in range(1, 2 * B + 1):
        grads = [rng.uniform(-1, 1, a.shape) for a in accs]
        r = 0.5 + k
        out = window.add(accs=accs, grads=[mx.nd.array(g) for g in grads], positions=[k, k],
                         rescale_grad=r * 0.25, sparse=[], scratch={}, size=B)
        total = [t + r * g for t, g in zip(total, grads)]
        if k % B:
            assert out is None
            continue
        # released: the window's mean in units of the last micro-batch's rescale_grad (as a
        # Trainer's reduced gradient), applied with that rescale_grad times the unscale
        released, rescale = out
        assert rescale == r * 0.25
        for a, t in zip(released, total):
            np.testing.assert_allclose(a.asnumpy(), t / (r * B), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rescale * a.asnumpy(), 0.25 * t / B, rtol=1e-5,
                                       atol=1e-6)
        total = [np.zeros_like(t) for t in total]


def test_window_in_the_optimizer_refuses_mixed_positions():
    window = InOptimizerWindow()
    with pytest.raises(RuntimeError, match='different positions'):
        window.add(accs=[mx.nd.zeros((1,))] * 2, grads=[mx.nd.ones((1,))] * 2,
                   positions=[1, 2], rescale_grad=1.0, sparse=[], scratch={}, size=2)


@pytest.mark.parametrize('B', [2, 3])
def test_window_at_a_trainer_writes_the_mean_in_units_of_the_last_rescale(B):
    rng = np.random.RandomState(2)
    window = TrainerWindow()
    accs = [mx.nd.zeros((4,))]
    total = np.zeros((4,))
    for k in range(1, B + 1):
        g = rng.uniform(-1, 1, (4,))
        grads = [mx.nd.array(g)]
        r = 0.25 * k
        closes = window.add(accs=accs, grads=grads, rescale_grad=r, size=B, position=k - 1)
        total += r * g
        assert closes is (k == B)
        assert window.position == k % B
    np.testing.assert_allclose(grads[0].asnumpy(), total / (r * B), rtol=1e-6)


@pytest.mark.parametrize('count, window, num_update, want_num, want_skipped', [
    pytest.param(False, 1, 5, 5, 0, id='plain-not-counted'),
    pytest.param(True, 1, 5, 6, 1, id='plain-counted'),
    pytest.param(False, 4, 7, 4, 0, id='window-rewound'),
    pytest.param(True, 4, 7, 8, 4, id='window-counted')])
def test_skip_ledger(count, window, num_update, want_num, want_skipped):
    ledger = SkipLedger(count)
    assert ledger.skipped(num_update, window) == want_num
    assert ledger.skipped_updates == want_skipped
    assert ledger.counted(3, 3) == (3 + want_skipped if want_skipped else 3)
