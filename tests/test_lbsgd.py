import itertools

import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd
from mx_lbsgd import _kernels
from mx_lbsgd.counting import count_host_syncs
from harness import NAMES, SHAPES, make_problem, run_optimizer
from reference import LBSGDReference

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

DTYPES = {  # id -> (weight dtype, multi_precision, rtol on weights)
    'fp32': ('float32', False, 2e-5),
    'fp64': ('float64', False, 1e-6),   # kernels take lr, wd, momentum as float32
    'fp16mp': ('float16', True, 2e-5),
}
PATH_IDS = {True: 'fused', False: 'pertensor', None: 'routed'}
PATHS = [pytest.param(f, id=i) for f, i in PATH_IDS.items()]
CASES = [
    pytest.param(dict(dtype=d, momentum=m, strategy=s, B=b, fused=f),
                 id='%s-mom%s-%s-B%d-%s' % (d, m, s, b, PATH_IDS[f]))
    for d, m, s, b, f in itertools.product(DTYPES, (0.0, 0.9), mx_lbsgd.WARMUP_STRATEGIES,
                                           (1, 4), (True, False, None))
]
# LARS combined with every warmup shape: lr * warmup multiplier * trust ratio
LARS_WARMUP_CASES = [
    pytest.param(dict(dtype=d, momentum=m, strategy=s, B=b, fused=f, lars=True),
                 id='%s-mom%s-lars+%s-B%d-%s' % (d, m, s, b, PATH_IDS[f]))
    for d, m, s, b, f in itertools.product(DTYPES, (0.0, 0.9), mx_lbsgd.schedules.WARMUP_SHAPES,
                                           (1, 4), (True, False, None))
]

OPT_ARGS = dict(learning_rate=0.1, wd=1e-3, rescale_grad=0.5, clip_gradient=0.04,
                warmup_epochs=3, updates_per_epoch=2, lars_eta=0.02)


def compare_with_reference(case, steps=8, shapes=SHAPES, names=NAMES, zero=(), **extra):
    """`zero`: layers whose gradient is all zero at every step."""
    dtype, mp, rtol = DTYPES[case['dtype']]
    args = dict(OPT_ARGS, **extra)
    weights, grads = make_problem(steps, shapes)
    for step in grads:
        for i in zero:
            step[i] = np.zeros_like(step[i])
    if dtype == 'float16':   # the reference starts from what fp16 can hold
        weights = [w.astype(np.float16) for w in weights]
        grads = [[g.astype(np.float16) for g in step] for step in grads]
    opt = mx_lbsgd.LBSGD(momentum=case['momentum'], warmup_strategy=case['strategy'],
                         batch_scale=case['B'], multi_precision=mp, fused=case['fused'],
                         lars=case.get('lars'), param_idx2name=dict(enumerate(names)), **args)
    with count_host_syncs(include_waitall=False) as syncs:
        got, updater, w_nd = run_optimizer(opt, weights, grads, dtype, read=False)
    assert syncs == [], 'the update read values back to the host'
    got = [w.asnumpy() for w in got]
    ref = LBSGDReference(weights, names, lr=args['learning_rate'], wd=args['wd'],
                         momentum=case['momentum'], strategy=case['strategy'], B=case['B'],
                         warmup_epochs=args['warmup_epochs'],
                         updates_per_epoch=args['updates_per_epoch'],
                         rescale=args['rescale_grad'], clip=args['clip_gradient'],
                         eta=args['lars_eta'], eps=args.get('lars_eps', 0.0),
                         lars_min=args.get('lars_min', 0.0),
                         lars_max=args.get('lars_max', np.inf), wd_mults=_wd_mults(names),
                         exclude=tuple(args.get('lars_exclude', ('bias', 'gamma', 'beta'))),
                         lars=case.get('lars'))
    for step in grads:
        ref.step(step)
    for i, (w, r) in enumerate(zip(got, ref.w)):
        if mp:
            master = updater.states[i][1].asnumpy()
            np.testing.assert_allclose(master, r, rtol=rtol, atol=1e-6, err_msg=names[i])
            np.testing.assert_array_equal(w, master.astype(np.float16))
        else:
            np.testing.assert_allclose(w, r, rtol=rtol, atol=1e-6 * (dtype != 'float64'),
                                       err_msg=names[i])
    assert any(not np.array_equal(w, w0) for w, w0 in zip(got, weights))
    return got, updater


def _wd_mults(names):
    """MXNet's Optimizer: with names given, wd applies only to *_weight and *_gamma."""
    return {n: 0.0 for n in names if not n.endswith(('_weight', '_gamma'))}


@pytest.mark.parametrize('case', CASES + LARS_WARMUP_CASES)
def test_matches_numpy_reference(case):
    compare_with_reference(case)


@pytest.mark.parametrize('shape', list(mx_lbsgd.schedules.WARMUP_SHAPES))
def test_lars_with_warmup_differs_from_either_alone(shape):
    """The combination is not silently one of its parts."""
    case = dict(dtype='fp32', momentum=0.9, strategy=shape, B=4, fused=None)
    combined, _ = compare_with_reference(dict(case, lars=True))
    warmup_only, _ = compare_with_reference(case)
    lars_only, _ = compare_with_reference(dict(case, strategy='lars'))
    for other in (warmup_only, lars_only):
        assert any(not np.allclose(a, b, rtol=1e-4) for a, b in zip(combined, other))


def test_lars_false_contradicts_the_lars_strategy():
    with pytest.raises(ValueError, match="lars=False contradicts warmup_strategy='lars'"):
        mx_lbsgd.LBSGD(warmup_strategy='lars', lars=False)
    with pytest.raises(ValueError, match=r"lars=1 is not supported; expected one of"):
        mx_lbsgd.LBSGD(lars=1)


@pytest.mark.parametrize('fused', PATHS)
@pytest.mark.parametrize('strategy', ['linear', 'lars'])
def test_more_tensors_than_one_kernel_takes(strategy, fused):
    shapes = [(3,), (2, 2), (5,)] * 45     # 135 tensors: three chunks of at most 60
    names = ['l%d_%s' % (i, 'bias' if i % 3 == 0 else 'weight') for i in range(len(shapes))]
    case = dict(dtype='fp32', momentum=0.9, strategy=strategy, B=4, fused=fused)
    compare_with_reference(case, shapes=shapes, names=names)


LARS_VARIANTS = [
    pytest.param(dict(lars_eta=0.5, lars_min=0.3, lars_max=2.0, lars_eps=1e-3), id='clipped'),
    pytest.param(dict(lars_eta=0.5, lars_min=0.3), id='clip-below'),
    pytest.param(dict(lars_eta=0.5, lars_max=0.8), id='clip-above'),
    # every layer LARS-applied with the clip range open: multi_lars gives the rates directly
    pytest.param(dict(lars_exclude=()), id='all-layers-open'),
    pytest.param(dict(lars_exclude=(), rescale_grad=0.125), id='all-layers-rescaled'),
    pytest.param(dict(lars_exclude=(), lars_max=1.5, lars_eta=0.5), id='all-layers-clipped'),
]


@pytest.mark.parametrize('fused', PATHS)
@pytest.mark.parametrize('dtype', ['fp32', 'fp16mp'])
@pytest.mark.parametrize('variant', LARS_VARIANTS)
def test_lars_variants(variant, dtype, fused):
    case = dict(dtype=dtype, momentum=0.9, strategy='lars', B=1, fused=fused)
    compare_with_reference(case, **variant)


@pytest.mark.parametrize('fused', PATHS)
@pytest.mark.parametrize('bounds', [dict(lars_min=2.0), dict(lars_max=0.5),
                                    dict(lars_min=1.5, lars_max=3.0)],
                         ids=['above-1', 'below-1', 'band-above-1'])
def test_lars_keeps_the_rate_of_a_layer_without_gradient(bounds, fused):
    """A layer whose gradient is all zero keeps its lr (a trust ratio of 1, as MXNet's
    multi_lars and LBSGD give it) even where [lars_min, lars_max] excludes 1: the clip
    applies to the layers with a gradient only. (Without that guard its ratio would be
    eta |w| / (wd |w| + eps), clipped into the bounds: its weight decay would change.)"""
    case = dict(dtype='fp32', momentum=0.9, strategy='lars', B=1, fused=fused)
    got, _ = compare_with_reference(case, zero=(0, 2), lars_exclude=(), lars_eta=0.5,
                                    **bounds)
    weights, _ = make_problem(8, SHAPES)
    assert not np.array_equal(got[0], weights[0])       # weight decay moved it


MIXED_SHAPES = [(400, 400), (7,), (64, 3, 3, 3), (5, 4), (140000,), (1,)]   # fp16: 2**17
MIXED_NAMES = ['fc0_weight', 'fc0_bias', 'conv0_weight', 'fc1_weight', 'emb_weight',
               'bn_gamma']


@pytest.mark.parametrize('strategy', mx_lbsgd.WARMUP_STRATEGIES)
@pytest.mark.parametrize('dtype, B', [('fp32', 1), ('fp16mp', 4)])
def test_routing_mixes_both_paths_in_one_step(strategy, dtype, B):
    case = dict(dtype=dtype, momentum=0.9, strategy=strategy, B=B, fused=None)
    compare_with_reference(case, shapes=MIXED_SHAPES, names=MIXED_NAMES)
    dtype = np.float16 if dtype == 'fp16mp' else np.float32
    assert _kernels.route([int(np.prod(s)) for s in MIXED_SHAPES], 'cpu', None, dtype) == \
        ([0, 4], [1, 2, 3, 5])


def test_begin_epoch_offsets_the_warmup():
    opt = mx_lbsgd.LBSGD(warmup_strategy='linear', batch_scale=4, warmup_epochs=2,
                         updates_per_epoch=4, begin_epoch=1, learning_rate=0.1)
    weights, grads = make_problem(4, shapes=[(3,)], zero_grad=None)
    got, _, _ = run_optimizer(opt, weights, grads, 'float32')
    # n = 1*4 + 4 = 8 = W: the multiplier is already batch_scale
    expected = weights[0] - 0.1 * 4 * np.mean([g[0] for g in grads], axis=0)
    np.testing.assert_allclose(got[0], expected, rtol=1e-6)


@pytest.mark.parametrize('fused', PATHS)
def test_fp16_gradients_above_256_keep_lars_finite(fused):
    """CPU multi_sum_sq squares fp16 in fp16 (inf above 256); our norms must not."""
    shapes = [(64, 32), (32,)]
    names = ['fc_weight', 'fc_bias']
    rng = np.random.RandomState(3)
    weights = [rng.uniform(-300, 300, s).astype(np.float16) for s in shapes]
    grads = [[rng.uniform(300, 2000, s).astype(np.float16) for s in shapes] for _ in range(3)]
    opt = mx_lbsgd.LBSGD(warmup_strategy='lars', multi_precision=True, momentum=0.9,
                         learning_rate=1.0, lars_eta=0.01, fused=fused,
                         param_idx2name=dict(enumerate(names)))
    got, updater, _ = run_optimizer(opt, weights, grads, 'float16')
    ref = LBSGDReference(weights, names, lr=1.0, wd=0.0, momentum=0.9, strategy='lars',
                         eta=0.01)
    for step in grads:
        ref.step(step)
    master = updater.states[0][1].asnumpy()
    assert np.all(np.isfinite(master))
    assert not np.array_equal(got[0], weights[0])       # the layer is not frozen
    np.testing.assert_allclose(master, ref.w[0], rtol=1e-5, atol=1e-3)


def test_gradient_accumulation_touches_no_weight_between_updates():
    opt = mx_lbsgd.LBSGD(batch_scale=4, momentum=0.9, learning_rate=0.1)
    weights, grads = make_problem(3, zero_grad=None)
    got, updater, _ = run_optimizer(opt, weights, grads, 'float32')
    for w, w0 in zip(got, weights):
        np.testing.assert_array_equal(w, w0.astype(np.float32))
    assert all(np.all(s[0].asnumpy() == 0) for s in updater.states.values())


def test_accumulation_does_not_alias_the_gradient_buffer():
    """MXNet's LBSGD kept a reference to the first gradient: overwriting the buffer
    (as backward does) changed what it had accumulated."""
    opt = mx_lbsgd.LBSGD(batch_scale=2, learning_rate=1.0, warmup_epochs=0)
    updater = mx.optimizer.get_updater(opt)
    w = mx.nd.zeros((3,))
    g = mx.nd.ones((3,))
    updater(0, g, w)
    g[:] = 3.0        # backward writes the next micro-batch into the same buffer
    updater(0, g, w)
    np.testing.assert_allclose(w.asnumpy(), -2.0 * (1.0 + 3.0) / 2)


def test_fp16_accumulation_without_master_copy_is_refused():
    opt = mx_lbsgd.LBSGD(batch_scale=2)
    with pytest.raises(ValueError, match='multi_precision=True'):
        mx.optimizer.get_updater(opt)(0, mx.nd.ones((2,), dtype='float16'),
                                      mx.nd.ones((2,), dtype='float16'))


BAD_ARGS = [
    pytest.param(dict(warmup_strategy='cubic'), ValueError,
                 r"expected one of \('linear', 'power2', 'sqrt', 'lars'\)", id='strategy'),
    pytest.param(dict(batch_scale=0), ValueError, 'batch_scale', id='batch_scale-0'),
    pytest.param(dict(batch_scale=2.5), TypeError, 'batch_scale', id='batch_scale-float'),
    pytest.param(dict(batch_scale=True), TypeError, 'batch_scale', id='batch_scale-bool'),
    pytest.param(dict(warmup_epochs=-1), ValueError, 'warmup_epochs', id='warmup_epochs'),
    pytest.param(dict(updates_per_epoch=0), ValueError, 'updates_per_epoch', id='upe'),
    pytest.param(dict(lars_eta=0.0), ValueError, 'lars_eta', id='lars_eta'),
    pytest.param(dict(lars_min=2.0, lars_max=1.0), ValueError, 'lars_min', id='lars_range'),
    pytest.param(dict(momentum=1.0), ValueError, 'momentum', id='momentum'),
    pytest.param(dict(lars_exclude=3), TypeError, 'lars_exclude', id='lars_exclude'),
    pytest.param(dict(fused='yes'), ValueError, 'fused', id='fused'),
    pytest.param(dict(momentum=float('nan')), ValueError, 'momentum', id='momentum-nan'),
    pytest.param(dict(warmup_epochs=float('inf')), ValueError, 'warmup_epochs',
                 id='warmup_epochs-inf'),
    pytest.param(dict(warmup_epochs=float('nan')), ValueError, 'warmup_epochs',
                 id='warmup_epochs-nan'),
    pytest.param(dict(lars_eta=float('inf')), ValueError, 'lars_eta', id='lars_eta-inf'),
    pytest.param(dict(lars_eps=float('nan')), ValueError, 'lars_eps', id='lars_eps-nan'),
    pytest.param(dict(lars_min=float('inf')), ValueError, 'lars_min', id='lars_min-inf'),
    pytest.param(dict(lars_max=float('nan')), ValueError, 'lars_max', id='lars_max-nan'),
    # MXNet's multi_lars refuses a float32 underflow when it runs; refused here at creation
    pytest.param(dict(lars_eps=1e-50), ValueError, 'lars_eps', id='lars_eps-underflow'),
    pytest.param(dict(lars_eta=1e39), ValueError, 'lars_eta', id='lars_eta-overflow'),
    pytest.param(dict(lars_min=1e-45), ValueError, 'lars_min', id='lars_min-subnormal'),
    pytest.param(dict(learning_rate=float('nan')), ValueError, 'learning_rate', id='lr-nan'),
    pytest.param(dict(wd=float('inf')), ValueError, 'wd', id='wd-inf'),
    pytest.param(dict(rescale_grad=float('nan')), ValueError, 'rescale_grad',
                 id='rescale-nan'),
    pytest.param(dict(clip_gradient=float('nan')), ValueError, 'clip_gradient',
                 id='clip-nan'),
]


@pytest.mark.parametrize('kwargs, exc, match', BAD_ARGS)
def test_bad_arguments_raise_naming_the_parameter(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mx_lbsgd.LBSGD(**kwargs)
    with pytest.raises(exc, match=match):
        mx.optimizer.create('lbsgd', **kwargs)


@pytest.mark.parametrize('fused', [None, True, False], ids=['routed', 'fused', 'pertensor'])
@pytest.mark.parametrize('opt, extra', [
    ('lbsgd', dict(momentum=0.9)), ('lbsgd', dict(momentum=0.9, loss_scaler=8.0)),
    ('lssgd', dict(momentum=0.9)), ('lblamb', {})], ids=['lbsgd', 'lbsgd-scaled', 'lssgd',
                                                          'lblamb'])
@pytest.mark.parametrize('bad', ['size', 'shape'])
def test_a_gradient_of_another_shape_is_refused_by_name_before_anything_changes(
        opt, extra, fused, bad):
    """The compiled kernels see element counts alone, so a (3, 2) gradient of a (2, 3) weight
    would update without a word: the call is refused, naming the parameter, and leaves
    weights, states and counts as they were; the right gradients then update as usual."""
    o = mx.optimizer.create(opt, learning_rate=0.1, fused=fused, **extra)
    o.idx2name = {0: 'fc_weight', 1: 'fc_bias'}
    updater = mx.optimizer.get_updater(o)
    weights = [mx.nd.ones((2, 3)), mx.nd.ones((4,))]
    grads = [mx.nd.full((2, 3), 0.5), mx.nd.full((4,), 0.5)]
    updater([0, 1], grads, weights)

    def arrays():
        def flat(x):
            if isinstance(x, mx.nd.NDArray):
                return [x.asnumpy()]
            return [a for y in (x if isinstance(x, (list, tuple)) else ()) for a in flat(y)]
        return [w.asnumpy() for w in weights] + flat([updater.states[i] for i in (0, 1)])
    before = (o.num_update, dict(o._index_update_count), arrays())
    wrong = (mx.nd.full((3, 2), 0.5), grads[1]) if bad == 'shape' else \
        (grads[0], mx.nd.full((5,), 0.5))
    name = 'fc_weight' if bad == 'shape' else 'fc_bias'
    with pytest.raises(ValueError, match="gradient of parameter '%s' has shape" % name):
        updater([0, 1], list(wrong), weights)
    assert (o.num_update, o._index_update_count) == before[:2]
    after = arrays()
    assert len(after) == len(before[2]) > 2
    for a, b in zip(after, before[2]):
        np.testing.assert_array_equal(a, b)
    updater([0, 1], grads, weights)
    assert o.num_update == before[0] + 1
    assert not np.array_equal(weights[0].asnumpy(), before[2][0])


def test_bad_fused_environment_variable(monkeypatch):
    monkeypatch.setenv('MX_LBSGD_FUSED', 'maybe')
    with pytest.raises(ValueError, match="MX_LBSGD_FUSED='maybe'"):
        mx_lbsgd.LBSGD()


@pytest.mark.parametrize('exclude, applied', [
    pytest.param(None, [True, False], id='default-bias'),
    pytest.param(['weight'], [False, True], id='suffixes'),
    pytest.param(lambda name: True, [False, False], id='callable')])
@pytest.mark.parametrize('strategy', ['lars', 'linear'])
def test_lars_exclude_names_from_gluon_param_dict(exclude, applied, strategy):
    """An excluded layer moves by lr * g (ratio 1); a LARS layer by lr * ratio * g."""
    net = mx.gluon.nn.Dense(4, in_units=3)
    net.initialize(mx.init.Uniform(1.0))
    params = list(net.collect_params().values())   # weight, bias
    params[1].set_data(mx.nd.ones((4,)))
    trainer = mx.gluon.Trainer(params, mx_lbsgd.LBSGD(
        warmup_strategy=strategy, lars=True, lars_exclude=exclude, learning_rate=0.5,
        warmup_epochs=0), kvstore=None)
    before = [p.data().asnumpy() for p in params]
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
    loss.backward()
    grads = [p.grad().asnumpy() for p in params]
    trainer.step(1)
    plain = [np.allclose(p.data().asnumpy(), w - 0.5 * g, rtol=1e-5)
             for p, w, g in zip(params, before, grads)]
    assert plain == [not a for a in applied]
