"""The native CPU operators (csrc/native_ops.cc) against the numpy reference and MXNet's own
operators, and the routing that picks them. Where the library was not built these tests
skip; CI's run then fails at its next step, which requires the library
(MX_LBSGD_NATIVE=1)."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

import mx_lbsgd
from mx_lbsgd import _native
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from reference import lamb_step

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

OPS = _native.ops()
needs_native = pytest.mark.skipif(OPS is None, reason='the native library is not built '
                                  '(no C++ compiler at install time) or MX_LBSGD_NATIVE=0')

# big tensors are split across threads, small ones fall inside one thread's range
SHAPES = [(3, 5), (70001,), (7,), (2, 1), (300, 400), (1,)]


def _arrays(dtype, seed=0, shapes=SHAPES, low=-1.0):
    rng = np.random.RandomState(seed)
    return [rng.uniform(low, 1, s).astype(dtype) for s in shapes]


@needs_native
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_sum_sq_equals_float64_numpy(dtype):
    xs = _arrays(dtype)
    got = OPS.sum_sq(*[nd.array(x, dtype=dtype) for x in xs], num_arrays=len(xs)).asnumpy()
    want = [np.sum(x.astype(np.float64) ** 2) for x in xs]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@needs_native
def test_sum_sq_of_float16_is_that_of_its_float32_values_bit_for_bit():
    # the F16C kernel adds its lanes in the order the float32 kernel does
    xs = _arrays('float16', seed=4)
    half = OPS.sum_sq(*[nd.array(x, dtype='float16') for x in xs], num_arrays=len(xs))
    wide = OPS.sum_sq(*[nd.array(x.astype(np.float32)) for x in xs], num_arrays=len(xs))
    np.testing.assert_array_equal(half.asnumpy(), wide.asnumpy())


FINITE_CASES = [
    pytest.param(None, id='all-finite'),
    pytest.param((1, 12345, np.inf), id='inf-mid-big-tensor'),
    pytest.param((1, 70000, -np.inf), id='minus-inf-last-element'),
    pytest.param((4, 0, np.nan), id='nan-in-big-tensor-first'),
    pytest.param((5, 0, np.nan), id='nan-in-last-tensor'),
    pytest.param((0, 14, np.inf), id='inf-first-tensor'),
]


@needs_native
@pytest.mark.parametrize('bad', FINITE_CASES)
@pytest.mark.parametrize('dtypes', [pytest.param(('float32',), id='fp32'),
                                    pytest.param(('float16',), id='fp16'),
                                    pytest.param(('float16', 'float32'), id='mixed')])
def test_all_finite_equals_numpy(bad, dtypes):
    xs = [x.astype(dtypes[i % len(dtypes)]) for i, x in enumerate(_arrays('float32', seed=3))]
    xs[2][0] = np.finfo(xs[2].dtype).max                 # the largest finite value
    xs[3].flat[0] = np.finfo(xs[3].dtype).tiny / 2       # a subnormal
    if bad is not None:
        which, at, value = bad
        xs[which].flat[at] = value
    got = OPS.all_finite(*[nd.array(x, dtype=x.dtype) for x in xs], num_arrays=len(xs))
    want = float(all(np.isfinite(x).all() for x in xs))
    assert got.shape == (1,) and got.dtype == np.float32
    assert got.asnumpy().tolist() == [want]
    # the same test on the calling thread: one host sync, no operator
    arrays = [nd.array(x, dtype=x.dtype) for x in xs]
    mx.nd.waitall()
    with count_kernel_launches() as launches, count_host_syncs() as syncs:
        host = mx_lbsgd._kernels.all_finite_now(arrays, None)
    assert host is bool(want) and launches == [] and syncs == ['host_all_finite']


@needs_native
def test_the_host_check_waits_for_the_writes_pending_on_its_arrays():
    grads = [nd.zeros((300, 400)) for _ in range(3)]
    mx.nd.waitall()
    for _ in range(3):          # keep the engine busy; the last write puts in a NaN
        big = nd.dot(nd.ones((400, 400)), nd.ones((400, 400)))
        grads[1] += big[:300] * 0
    grads[1][5, 5] = np.nan
    assert mx_lbsgd._kernels.all_finite_now(grads, None) is False
    grads[1][5, 5] = 1.0
    assert mx_lbsgd._kernels.all_finite_now(grads, None) is True


@needs_native
def test_the_host_check_leaves_other_arrays_to_the_operator():
    dense = [nd.array(x) for x in _arrays('float32')]
    sparse = nd.sparse.row_sparse_array(([[np.inf, 1.0]], [3]), shape=(5, 2))
    for arrays, fused in (([*dense, sparse], None), (dense, True), (dense, False),
                          ([nd.ones((3,), dtype='float64')], None),
                          ([nd.ones(((1 << 20) + 1,))], None)):      # too big for one thread
        with count_kernel_launches() as launches, count_host_syncs() as syncs:
            finite = mx_lbsgd._kernels.all_finite_now(arrays, fused)
        assert launches and syncs[-1] == 'asscalar' and 'host_all_finite' not in syncs
        assert finite is (arrays[-1] is not sparse)


@needs_native
def test_finite_flag_is_one_native_launch_on_cpu():
    grads = [nd.array(x) for x in _arrays('float32')] + \
        [nd.array(x, dtype='float16') for x in _arrays('float16', seed=1)]
    with count_kernel_launches() as launches, count_host_syncs() as syncs:
        flag = mx_lbsgd._kernels.finite_flag(grads, None)
    # MXNet's operators would need a call per dtype at least, and one per big array
    assert len(launches) == 1 and syncs == []
    assert flag.asscalar() == 1.0
    grads[7][0] = np.nan
    assert mx_lbsgd._kernels.finite_flag(grads, None).asscalar() == 0.0


LAMB_CASES = [
    pytest.param(dict(clip=None, bounds=(None, None), bias_correction=True, rescale=1.0,
                      applies=[1] * 6), id='plain'),
    pytest.param(dict(clip=0.05, bounds=(0.1, 5.0), bias_correction=False, rescale=0.5,
                      applies=[1, 0, 1, 1, 0, 1]), id='clip-bounds-nobc-excluded'),
    pytest.param(dict(clip=None, bounds=(None, 2.0), bias_correction=True, rescale=0.25,
                      applies=[0] * 6), id='all-excluded'),
]


def _lamb_problem(dtype, seed):
    weights = _arrays(dtype, seed)
    grads = _arrays(dtype, seed + 1)
    means = _arrays('float32', seed + 2, low=-0.1)
    variances = [np.abs(v) * 0.1 for v in _arrays('float32', seed + 3)]
    return weights, grads, means, variances


def _lamb_args(case, mp, weights, grads, means, variances, masters):
    """(arrays, attrs) of one mx_lbsgd_lamb_update call."""
    n = len(weights)
    lo, hi = case['bounds']
    arrays = weights + grads + means + variances + (masters if mp else [])
    return arrays, dict(
        num_tensors=n, multi_precision=int(mp), lrs='0.01,0.02,0.03,0.04,0.05,0.06',
        wds='0,0.1,0.01,0.001,0.2,0.3', steps='1,5,3,10,2,7',
        applies=','.join(map(str, case['applies'])), beta1=0.9, beta2=0.999, epsilon=1e-6,
        bias_correction=int(case['bias_correction']), rescale_grad=case['rescale'],
        clip_gradient=case['clip'] or -1, lower_bound=lo or -1, upper_bound=hi or -1)


def _lamb_call(case, mp, weights, grads, means, variances, masters):
    arrays, attrs = _lamb_args(case, mp, weights, grads, means, variances, masters)
    return OPS.lamb_update(*arrays, **attrs)


@needs_native
@pytest.mark.parametrize('mp', [pytest.param(False, id='fp32'), pytest.param(True, id='fp16mp')])
@pytest.mark.parametrize('case', LAMB_CASES)
def test_lamb_update_equals_the_reference_and_mxnet_moments(case, mp):
    dtype = 'float16' if mp else 'float32'
    w0, g0, m0, v0 = _lamb_problem(dtype, seed=3)
    weights, grads = [nd.array(w, dtype=dtype) for w in w0], [nd.array(g, dtype=dtype) for g in g0]
    means, variances = [nd.array(m) for m in m0], [nd.array(v) for v in v0]
    masters = [nd.array(w.astype(np.float32)) for w in w0]
    ratios = _lamb_call(case, mp, weights, grads, means, variances, masters).asnumpy()
    lrs, wds, steps = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06], [0, .1, .01, .001, .2, .3], [1, 5, 3, 10, 2, 7]
    for i in range(len(w0)):
        w, mean, var = lamb_step(
            w0[i].astype(np.float64), g0[i], m0[i].astype(np.float64), v0[i].astype(np.float64),
            t=steps[i], lr=lrs[i], wd=wds[i], lower_bound=case['bounds'][0],
            upper_bound=case['bounds'][1], bias_correction=case['bias_correction'],
            rescale=case['rescale'], clip=case['clip'], ratio=bool(case['applies'][i]))
        updated = masters[i] if mp else weights[i]
        # float32 arithmetic against float64 (the moments are checked bit for bit below)
        np.testing.assert_allclose(updated.asnumpy(), w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(means[i].asnumpy(), mean, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(variances[i].asnumpy(), var, rtol=1e-4, atol=1e-9)
        if mp:     # the float16 weights are the master copy rounded
            np.testing.assert_array_equal(weights[i].asnumpy(), masters[i].asnumpy().astype(np.float16))
        if not case['applies'][i]:
            assert ratios[i] == 1.0
    # the moments are MXNet's lamb_update_phase1's, bit for bit
    for i in range(len(w0)):
        m, v = nd.array(m0[i]), nd.array(v0[i])
        kwargs = dict(beta1=0.9, beta2=0.999, epsilon=1e-6, t=steps[i], wd=wds[i],
                      bias_correction=case['bias_correction'], rescale_grad=case['rescale'])
        if case['clip']:
            kwargs['clip_gradient'] = case['clip']
        nd.lamb_update_phase1(nd.array(w0[i].astype(np.float32)),
                              nd.array(g0[i].astype(np.float32)), m, v, **kwargs)
        np.testing.assert_array_equal(means[i].asnumpy(), m.asnumpy())
        np.testing.assert_array_equal(variances[i].asnumpy(), v.asnumpy())


@needs_native
def test_lamb_update_refuses_wrong_dtypes():
    w = [nd.ones((4,), dtype='float64')]
    with pytest.raises(mx.MXNetError, match='must be float32'):
        OPS.lamb_update(*(w * 4), num_tensors=1, multi_precision=0, lrs='0.1', wds='0',
                        steps='1', applies='1', beta1=0.9, beta2=0.999, epsilon=1e-6,
                        bias_correction=1, rescale_grad=1.0, clip_gradient=-1,
                        lower_bound=-1, upper_bound=-1).wait_to_read()


@needs_native
@pytest.mark.parametrize('op', ['sgd_update', 'lamb_update'])
def test_a_wrong_list_length_names_the_operator(op):
    """The per-tensor lists (lrs, wds, ...) are parsed by one helper for every operator;
    its error names the operator that called it."""
    w = [nd.ones((4,))]
    common = dict(num_tensors=1, multi_precision=0, lrs='0.1,0.2', wds='0', rescale_grad=1.0,
                  clip_gradient=-1.0)
    with pytest.raises(mx.MXNetError) as err:
        if op == 'sgd_update':
            OPS.sgd_update(*(w * 2), has_momentum=0, momentum=0.0, preloaded=0, **common)
        else:
            OPS.lamb_update(*(w * 4), steps='1', applies='1', beta1=0.9, beta2=0.999,
                            epsilon=1e-6, bias_correction=1, lower_bound=-1, upper_bound=-1,
                            **common)
        mx.nd.waitall()
    # (MXNet's message keeps those of earlier failed calls of the library's operators too)
    assert 'mx_lbsgd_%s: lrs needs 1 values, got 2' % op in str(err.value)


def _lamb_steps(fused, dtype='float32', mp=False, steps=3):
    rng = np.random.RandomState(0)
    shapes = [(300, 200), (200,), (5000,), (10, 10)]
    weights = [nd.array(rng.uniform(-1, 1, s), dtype=dtype) for s in shapes]
    opt = mx_lbsgd.LAMB(learning_rate=0.01, wd=0.01, multi_precision=mp, fused=fused,
                        trust_exclude=lambda name: name == '1')
    opt.idx2name = {i: str(i) for i in range(len(shapes))}
    updater = mx.optimizer.get_updater(opt)
    launches, syncs = [], []
    for _ in range(steps):
        grads = [nd.array(rng.uniform(-1, 1, s), dtype=dtype) for s in shapes]
        with count_kernel_launches() as calls, count_host_syncs(include_waitall=False) as read:
            updater(list(range(len(shapes))), grads, weights)
        launches.append(len(calls))
        syncs.append(len(read))
    return [w.asnumpy() for w in weights], launches, syncs


@needs_native
@pytest.mark.parametrize('dtype, mp', [pytest.param('float32', False, id='fp32'),
                                       pytest.param('float16', True, id='fp16mp')])
def test_routed_lamb_is_one_native_launch_and_no_host_sync(dtype, mp):
    native, launches, syncs = _lamb_steps(None, dtype, mp)
    assert launches[1:] == [1, 1] and syncs == [0, 0, 0]    # the first step creates states
    mxnet_ops, mxnet_launches, _ = _lamb_steps(True, dtype, mp)
    assert min(mxnet_launches) > 1
    for a, b in zip(native, mxnet_ops):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32),
                                   rtol=1e-3 if mp else 1e-5, atol=1e-3 if mp else 1e-6)


def test_native_library_can_be_disabled_and_required():
    """MX_LBSGD_NATIVE=0 routes to MXNet's operators; =1 fails loudly without a library."""
    code = ('import mx_lbsgd, mxnet as mx; from mx_lbsgd import _native; '
            'print(_native.ops() is None, hasattr(mx.nd, "mx_lbsgd_lamb_update"))')
    env = dict(os.environ, MX_LBSGD_NATIVE='0')
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ['True', 'False']
    env['MX_LBSGD_NATIVE'] = 'maybe'
    err = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
    assert err.returncode != 0 and 'MX_LBSGD_NATIVE must be' in err.stderr


EXIT_WITH_PENDING_STEPS = """
import sys
import mxnet as mx
import mx_lbsgd
kind = sys.argv[1]
kw = dict(lbsgd=dict(momentum=0.9), clip=dict(momentum=0.9, max_grad_norm=1.0),
          lars=dict(momentum=0.9, warmup_strategy='lars'), lblamb={},
          fp16=dict(momentum=0.9, multi_precision=True))[kind]
shapes = [(1000, 1000)] * 4 + [(1000,)] * 200
opt = mx.optimizer.create('lblamb' if kind == 'lblamb' else 'lbsgd', learning_rate=0.1,
                          param_idx2name={i: 'w%d' % i for i in range(len(shapes))}, **kw)
updater = mx.optimizer.get_updater(opt)
dtype = 'float16' if kind == 'fp16' else 'float32'
w = [mx.nd.random.uniform(shape=s, dtype=dtype) for s in shapes]
g = [mx.nd.random.uniform(shape=s, dtype=dtype) for s in shapes]
for _ in range(10):
    updater(list(range(len(shapes))), g, w)
print(mx_lbsgd.native_library() is not None, flush=True)
"""


@needs_native
@pytest.mark.parametrize('kind', ['lbsgd', 'clip', 'lars', 'lblamb', 'fp16'])
def test_the_interpreter_exits_cleanly_with_pushed_steps_pending(kind):
    """Ten steps of 4M parameters pushed, and the script ends without waiting for them: the
    engine finishes or drops them and the held arrays are released in MXNet's shutdown
    without a crash or a hang (exit status 0, nothing on stderr but MXNet's own notes)."""
    out = subprocess.run([sys.executable, '-c', EXIT_WITH_PENDING_STEPS, kind],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ['True']
    noise = [line for line in out.stderr.splitlines() if line.strip()
             and 'graph_executor' not in line]
    assert not noise, out.stderr[-3000:]


@needs_native
@pytest.mark.horovod
def test_loads_after_horovods_mxnet_binding():
    """Horovod's binding, imported first, once made mx.library.load crash (fixed by linking
    with -Bsymbolic)."""
    pytest.importorskip('horovod.mxnet')
    code = 'import horovod.mxnet, mx_lbsgd; print(mx_lbsgd.native_library() is not None)'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ['True'], out.stderr[-2000:]


def _mxnet_sgd(preloaded, mp, momentum, w, g, m, w32, lr, wd, kwargs, per_tensor=False):
    """MXNet's own operator for one tensor, updating w (and m, w32) in place: SGD's
    multi-tensor operator (its preloaded form with device rates), or with `per_tensor` the
    per-tensor one NAG runs without momentum."""
    tensors = [w, g] + ([m] if momentum else []) + ([w32] if mp else [])
    kind = '%ssgd_%supdate' % ('mp_' if mp else '', 'mom_' if momentum else '')
    if preloaded:
        getattr(nd, 'preloaded_multi_' + kind)(*tensors, nd.array([lr]), nd.array([wd]),
                                               out=[w], num_weights=1, **kwargs)
    elif per_tensor:
        getattr(nd, kind)(*tensors, out=w, lr=lr, wd=wd, **kwargs)
    else:
        getattr(nd, 'multi_' + kind)(*tensors, out=[w], num_weights=1, lrs=(lr,), wds=(wd,),
                                     **kwargs)


@needs_native
@pytest.mark.parametrize('preloaded', [pytest.param(False, id='lrs'),
                                       pytest.param(True, id='lr-vector'),
                                       pytest.param(None, id='nag-nomom')])
@pytest.mark.parametrize('mp', [pytest.param(False, id='fp32'), pytest.param(True, id='fp16mp')])
@pytest.mark.parametrize('momentum', [pytest.param(0.0, id='nomom'), pytest.param(0.9, id='mom')])
@pytest.mark.parametrize('clip', [pytest.param(None, id='noclip'), pytest.param(0.3, id='clip')])
def test_sgd_update_is_mxnets_arithmetic_bit_for_bit(preloaded, mp, momentum, clip):
    """SGD's multi_sgd_* (and preloaded_multi_sgd_*) operators; with nesterov=1 and no
    momentum NAG's sgd_update (preloaded=None here)."""
    per_tensor = preloaded is None
    if per_tensor and momentum:
        pytest.skip('NAG with momentum is test_nesterov.py\'s nag_mom_update test')
    preloaded = bool(preloaded)
    dtype = 'float16' if mp else 'float32'
    w0, g0 = _arrays(dtype, 5), _arrays(dtype, 6)
    m0 = _arrays('float32', 7, low=-0.1)
    lrs, wds = [0.1, 0.05, 0.2, 0.01, 0.3, 0.07], [1e-4, 0.0, 1e-3, 0.1, 5e-4, 0.02]
    kwargs = dict(rescale_grad=0.37, clip_gradient=clip or -1.0)
    if momentum:
        kwargs['momentum'] = momentum
    ours = dict(w=[nd.array(w, dtype=dtype) for w in w0], g=[nd.array(g, dtype=dtype) for g in g0],
                m=[nd.array(m) for m in m0], w32=[nd.array(w.astype(np.float32)) for w in w0])
    arrays = ours['w'] + ours['g'] + (ours['m'] if momentum else []) + (ours['w32'] if mp else [])
    if preloaded:
        arrays.append(nd.array(lrs))
    OPS.sgd_update(*arrays, num_tensors=len(w0), has_momentum=int(bool(momentum)),
                   momentum=momentum, multi_precision=int(mp), preloaded=int(preloaded),
                   lrs=','.join(map(repr, lrs)), wds=','.join(map(repr, wds)),
                   rescale_grad=0.37, clip_gradient=clip or -1.0, nesterov=int(per_tensor))
    for i in range(len(w0)):
        w, g = nd.array(w0[i], dtype=dtype), nd.array(g0[i], dtype=dtype)
        m, w32 = nd.array(m0[i]), nd.array(w0[i].astype(np.float32))
        _mxnet_sgd(preloaded, mp, momentum, w, g, m, w32, lrs[i], wds[i], kwargs, per_tensor)
        np.testing.assert_array_equal(ours['w'][i].asnumpy(), w.asnumpy())
        if momentum:
            np.testing.assert_array_equal(ours['m'][i].asnumpy(), m.asnumpy())
        if mp:
            np.testing.assert_array_equal(ours['w32'][i].asnumpy(), w32.asnumpy())
        assert not np.array_equal(w.asnumpy(), w0[i])


@needs_native
@pytest.mark.parametrize('args, launches', [
    pytest.param(dict(momentum=0.9), 1, id='linear-one-launch'),
    # the norms, the rates and the update in the same call
    pytest.param(dict(momentum=0.9, lars=True), 1, id='lars-one-launch'),
])
def test_routed_lbsgd_is_one_native_update_and_no_host_sync(args, launches):
    rng = np.random.RandomState(0)
    shapes = [(300, 200), (200,), (5000,), (10, 10)]
    weights = [nd.array(rng.uniform(-1, 1, s)) for s in shapes]
    opt = mx_lbsgd.LBSGD(learning_rate=0.1, wd=1e-4, **args)
    opt.idx2name = {i: 'l%d_weight' % i for i in range(len(shapes))}
    updater = mx.optimizer.get_updater(opt)
    counts = []
    for step in range(3):
        grads = [nd.array(rng.uniform(-1, 1, s)) for s in shapes]
        with count_kernel_launches() as calls, count_host_syncs(include_waitall=False) as read:
            updater(list(range(len(shapes))), grads, weights)
        assert not read
        counts.append(len(calls))
    if launches is not None:
        assert counts[1:] == [launches, launches]
    else:
        assert counts[1] == counts[2] < len(shapes) + 6


# -- LARS inside mx_lbsgd_sgd_update: the rates of _kernels.lars_lrs, in the update's call --

LARS_CASES = [
    pytest.param(0.0, np.inf, (), id='multi_lars-alone'),
    pytest.param(0.0, np.inf, (1, 4), id='kept-layers'),
    # a zero gradient (2) and a zero weight (5) keep a ratio of 1 outside [0.5, 0.8]
    pytest.param(0.5, 0.8, (), id='range-excludes-1'),
    pytest.param(1e-3, 1e300, (0,), id='max-beyond-float32'),
]


def _lars_call(in_kernel, shapes, mp, momentum, nesterov, lars_min, lars_max, keep, clip_norm):
    """One native update with LARS: its rates computed in the call (`in_kernel`), or by
    `_kernels.lars_lrs` and handed over as the preloaded lr vector. Returns the arrays."""
    from mx_lbsgd.families import GradNorm, KernelTrust
    dtype = 'float16' if mp else 'float32'
    w0, g0 = _arrays(dtype, 11, shapes), _arrays(dtype, 12, shapes)
    g0[2 % len(shapes)][...] = 0
    w0[5 % len(shapes)][...] = 0
    n = len(shapes)
    lrs, wds = [0.1 + 0.01 * i for i in range(n)], [1e-4 * (i % 3) for i in range(n)]
    keep_lr = [i in keep for i in range(n)]
    w = [nd.array(x, dtype=dtype) for x in w0]
    g = [nd.array(x, dtype=dtype) for x in g0]
    m = [nd.array(x) for x in _arrays('float32', 13, shapes, low=-0.1)]
    # master copies that float16 cannot hold: the norms must come from them
    w32 = [nd.array(x.astype(np.float32) + 1e-4 * y) for x, y in
           zip(w0, _arrays('float32', 14, shapes))]
    norm = None
    if clip_norm:
        sum_sq = OPS.sum_sq(*g, num_arrays=n, total=1)
        norm = GradNorm(sum_sq, factor=0.37, max_norm=clip_norm, eps=1e-6)
    trust = KernelTrust(eta=0.02, eps=1e-9, lars_min=lars_min, lars_max=lars_max,
                        keep_lr=keep_lr)
    arrays = w + g + (m if momentum else []) + (w32 if mp else [])
    attrs = dict(num_tensors=n, has_momentum=int(bool(momentum)), momentum=momentum,
                 nesterov=int(nesterov), multi_precision=int(mp), rescale_grad=0.37,
                 clip_gradient=-1.0, lrs=','.join(map(repr, lrs)),
                 wds=','.join(map(repr, wds)))
    if norm is not None:
        attrs.update(norm.native_attrs())
    if in_kernel:
        attrs.update(trust.native_attrs(), preloaded=0)
    else:
        arrays.append(trust.rates(weights=w32 if mp else w, grads=g, lrs=lrs, wds=wds,
                                  rescale_grad=0.37, grad_norm=norm))
        attrs.update(preloaded=1)
    OPS.sgd_update(*(arrays + ([norm.sum_sq] if norm is not None else [])), **attrs)
    return [x.asnumpy() for x in w + m + w32]


@needs_native
@pytest.mark.parametrize('lars_min, lars_max, keep', LARS_CASES)
@pytest.mark.parametrize('mp', [pytest.param(False, id='fp32'), pytest.param(True, id='fp16mp')])
@pytest.mark.parametrize('momentum, nesterov', [pytest.param(0.0, False, id='nomom'),
                                                pytest.param(0.9, False, id='mom'),
                                                pytest.param(0.9, True, id='nag')])
@pytest.mark.parametrize('clip_norm', [pytest.param(None, id='noclip'),
                                       pytest.param(0.5, id='global-norm')])
def test_lars_in_the_update_call_equals_the_rates_apart_bit_for_bit(
        lars_min, lars_max, keep, mp, momentum, nesterov, clip_norm):
    # SHAPES (190k elements) make one group of the in-call LARS, split across the threads
    # as mx_lbsgd_sum_sq splits them, so even the sums agree bit for bit
    args = (SHAPES, mp, momentum, nesterov, lars_min, lars_max, keep, clip_norm)
    ours, apart = _lars_call(True, *args), _lars_call(False, *args)
    for got, want in zip(ours, apart):
        np.testing.assert_array_equal(got, want)
    first = _arrays('float16' if mp else 'float32', 11, SHAPES)
    assert not np.array_equal(ours[0], first[0])


@needs_native
@pytest.mark.parametrize('lars_min, lars_max, keep', LARS_CASES[1:3])
def test_lars_in_the_update_call_over_several_groups(lars_min, lars_max, keep):
    # 2.1M elements: groups of at most 262,144 elements, each big tensor one group of its
    # own, split across the threads apart from the whole route: the sums may differ in the
    # last bits
    shapes = [(700001,), (3,), (650000,), (5, 2), (480000,), (1,), (300000,)]
    args = (shapes, False, 0.9, False, lars_min, lars_max, keep, 0.5)
    ours, apart = _lars_call(True, *args), _lars_call(False, *args)
    for got, want in zip(ours, apart):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(ours[0], _arrays('float32', 11, shapes)[0])


# -- mx_lbsgd_sgd_update pushed to MXNet's engine directly (_native.invoke) ---------------

def _sgd_call(mp, momentum, nesterov, lars, preloaded, norm, shapes=SHAPES, seed=20):
    """(arrays, attrs) of one mx_lbsgd_sgd_update call, fresh arrays each time."""
    from mx_lbsgd.families import GradNorm, KernelTrust
    dtype = 'float16' if mp else 'float32'
    n = len(shapes)
    w = [nd.array(x, dtype=dtype) for x in _arrays(dtype, seed, shapes)]
    g = [nd.array(x, dtype=dtype) for x in _arrays(dtype, seed + 1, shapes)]
    m = [nd.array(x) for x in _arrays('float32', seed + 2, shapes, low=-0.1)]
    w32 = [nd.array(x.astype(np.float32)) for x in _arrays(dtype, seed, shapes)]
    lrs, wds = [0.1 + 0.01 * i for i in range(n)], [1e-4 * (i % 3) for i in range(n)]
    arrays = w + g + (m if momentum else []) + (w32 if mp else [])
    attrs = dict(num_tensors=n, has_momentum=int(bool(momentum)), momentum=momentum,
                 nesterov=int(nesterov), multi_precision=int(mp), rescale_grad=0.37,
                 clip_gradient=0.5 if preloaded else -1.0, lrs=','.join(map(repr, lrs)),
                 wds=','.join(map(repr, wds)), preloaded=int(preloaded))
    if preloaded:
        arrays.append(nd.array([0.2 + 0.03 * i for i in range(n)]))
    if lars:
        attrs.update(KernelTrust(eta=0.02, eps=1e-9, lars_min=0.0, lars_max=np.inf,
                                 keep_lr=[i == 1 for i in range(n)]).native_attrs())
    if norm:
        grad_norm = GradNorm(OPS.sum_sq(*g, num_arrays=n, total=1), factor=0.37,
                             max_norm=0.5, eps=1e-6)
        attrs.update(grad_norm.native_attrs())
        arrays.append(grad_norm.sum_sq)
    return arrays, attrs


PUSH_CASES = [
    pytest.param(False, 0.0, False, False, False, False, id='fp32-nomom'),
    pytest.param(True, 0.9, False, False, False, False, id='fp16mp-mom'),
    pytest.param(False, 0.9, True, False, False, True, id='fp32-nag-global-norm'),
    pytest.param(True, 0.9, False, True, False, True, id='fp16mp-lars-global-norm'),
    pytest.param(False, 0.9, False, False, True, False, id='fp32-lr-vector-clip'),
]


@needs_native
@pytest.mark.parametrize('mp, momentum, nesterov, lars, preloaded, norm', PUSH_CASES)
def test_the_pushed_update_is_the_operators_bits(mp, momentum, nesterov, lars, preloaded,
                                                 norm):
    from mx_lbsgd import _compat
    case = (mp, momentum, nesterov, lars, preloaded, norm)
    pushed, attrs = _sgd_call(*case)
    cache = {}
    held, loose = (pushed[:-1], pushed[-1:]) if norm else (pushed, [])   # (the norm: new
    assert _compat.push_prepared(OPS.library, OPS.pushed[OPS.sgd_update],  # at each step)
                                 OPS.sgd_update, held, attrs, cache, loose=loose)
    called, attrs = _sgd_call(*case)
    OPS.sgd_update(*called, **attrs)
    for got, want in zip(pushed, called):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    assert not np.array_equal(pushed[0].asnumpy(), _sgd_call(*case)[0][0].asnumpy())


@needs_native
def test_a_new_norm_each_step_keeps_the_held_arrays():
    """The clipping norm is a new array at every step: it is copied per call, and the
    copies of the other arrays, made once, stay."""
    arrays, attrs = _sgd_call(False, 0.9, False, False, False, True)
    held, norm = arrays[:-1], arrays[-1]
    scratch = {}
    kept = []
    for step in range(3):
        fresh = norm.copy()
        _native.invoke(OPS.sgd_update, held, attrs, scratch, loose=[fresh])
        kept.append([entry[1][0] for entry in scratch['native_calls'].values()])
    assert len(kept[0]) == 1 and kept[0] == kept[1] == kept[2]
    want, _ = _sgd_call(False, 0.9, False, False, False, True)
    for _ in range(3):
        OPS.sgd_update(*want, **attrs)
    for got, expected in zip(held, want):
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())


@needs_native
def test_the_pushed_update_waits_for_its_inputs_and_its_readers_wait_for_it():
    """The gradients are written by a slow operation still running when the update is
    pushed; the update must read them after it, and the weights' reader after the update."""
    arrays, attrs = _sgd_call(False, 0.9, False, False, False, False)
    n = len(SHAPES)
    targets = _arrays('float32', 40)
    # (made first: nd.array waits for the engine's worker, which the slow product occupies)
    sources = [nd.array(t) for t in targets]
    big = nd.array(np.random.RandomState(0).uniform(-1, 1, (1200, 1200)))
    mx.nd.waitall()
    slow = nd.dot(nd.dot(big, big), big)          # ~0.1 s of work ahead of the gradients
    for g, source in zip(arrays[n:2 * n], sources):
        nd.broadcast_add(nd.zeros_like(g) * slow[0, 0], source, out=g)
    cache = {}
    _native.invoke(OPS.sgd_update, arrays, attrs, {'native_calls': cache})
    assert any(key[0] == 'push' for key in cache)
    got = [a.asnumpy() for a in arrays]
    want, attrs = _sgd_call(False, 0.9, False, False, False, False)
    for g, t in zip(want[n:2 * n], targets):
        g[:] = t
    OPS.sgd_update(*want, **attrs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b.asnumpy())


@needs_native
def test_the_pushed_update_holds_its_arrays_until_it_ran():
    """The caller drops the gradients and the kept call right after the push, while the
    update still waits for a slow writer of the gradients: the update reads them all the
    same (the library holds its own references)."""
    n = len(SHAPES)
    arrays, attrs = _sgd_call(False, 0.9, False, False, False, False)
    want, _ = _sgd_call(False, 0.9, False, False, False, False)
    OPS.sgd_update(*want, **attrs)
    fresh = [nd.array(x) for x in _arrays('float32', 21)]     # the values _sgd_call gave
    big = nd.array(np.random.RandomState(0).uniform(-1, 1, (1200, 1200)))
    mx.nd.waitall()
    slow = nd.dot(nd.dot(big, big), big)
    grads = arrays[n:2 * n]
    for g, f in zip(grads, fresh):
        nd.broadcast_add(nd.zeros_like(g) * slow[0, 0], f, out=g)
    weights, moms = arrays[:n], arrays[2 * n:]
    cache = {}
    _native.invoke(OPS.sgd_update, arrays, attrs, {'native_calls': cache})
    assert any(key[0] == 'push' for key in cache)
    del arrays, grads, fresh, g
    cache.clear()
    for got, expected in zip(weights + moms, want[:n] + want[2 * n:]):
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())


ONEDNN_STEP = r"""
import sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon
import mx_lbsgd
optimizer, args, out, predict = sys.argv[1], eval(sys.argv[2]), sys.argv[3], sys.argv[4]
mx.random.seed(0)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(64, 3, in_channels=3, padding=1),
        gluon.nn.Conv2D(64, 3, in_channels=64, padding=1), gluon.nn.Flatten(),
        gluon.nn.Dense(4))
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), optimizer, args)
x = mx.nd.random.uniform(shape=(8, 3, 16, 16))
y = mx.nd.array(np.arange(8) % 4)
for step in range(2):
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    if predict == '1':
        net(x)  # predict mode: oneDNN reorders the convolutions' weights into its layout
    trainer.step(8)
np.savez(out, *[p.data().asnumpy() for p in net.collect_params().values()])
"""


@needs_native
@pytest.mark.parametrize('optimizer, args', [
    pytest.param('lbsgd', dict(momentum=0.9), id='lbsgd'),
    pytest.param('lbsgd', dict(momentum=0.9, max_grad_norm=0.5), id='lbsgd-clip'),
    pytest.param('lbsgd', dict(momentum=0.9, warmup_strategy='lars', warmup_epochs=1,
                               updates_per_epoch=10), id='lbsgd-lars'),
    pytest.param('lssgd', dict(momentum=0.9, loss_scaler=1.0), id='lssgd'),
    pytest.param('lblamb', dict(), id='lblamb'),
])
def test_weights_in_onednns_layout_are_updated_as_by_mxnets_operators(tmp_path, optimizer,
                                                                      args):
    """A forward pass in predict mode leaves the convolutions' weights in oneDNN's own
    layout. The pushed operators must neither wait forever for their reorder nor update a
    copy: the weights equal those of the same steps without that pass, bit for bit, and
    (SGD) those of MXNet's operators."""
    def run(native, predict):
        out = str(tmp_path / ('%s%s.npz' % (native, predict)))
        env = dict(os.environ, MX_LBSGD_NATIVE=native)
        done = subprocess.run([sys.executable, '-c', ONEDNN_STEP, optimizer,
                               repr(dict(args, learning_rate=0.1)), out, predict], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return [v for _, v in sorted(np.load(out).items())]
    ours = run('1', '1')
    for got, want in zip(ours, run('1', '0')):
        np.testing.assert_array_equal(got, want)
    if optimizer != 'lblamb':      # (a clipping norm's sums may differ in the last bits)
        for got, want in zip(ours, run('0', '1')):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _lars_steps(dtype, tracked, write=None, steps=5, nesterov=False):
    """The weights after `steps` LARS updates of one optimizer (gradients written into the
    same arrays, as backward does), and how many tensors' weight norms the library read;
    `write(step, weights)` runs between the steps. `tracked`: whether the library knows where
    the engine versions are (else every step reads every weight norm)."""
    from mx_lbsgd import _compat
    shapes = [(300, 200), (200,), (64, 3, 3, 3), (64,), (1000, 300), (10,), (70001,)] * 2
    rng = np.random.RandomState(3)
    weights = [nd.array(rng.uniform(-0.1, 0.1, s), dtype=dtype) for s in shapes]
    grads = [nd.zeros(s, dtype=dtype) for s in shapes]
    updater = mx.optimizer.get_updater(mx_lbsgd.LBSGD(
        learning_rate=0.1, momentum=0.9, wd=1e-4, warmup_strategy='lars', warmup_epochs=1,
        updates_per_epoch=10, lars_exclude=(), multi_precision=dtype == 'float16',
        nesterov=nesterov))
    if not tracked:
        OPS.library.mx_lbsgd_track_versions(ctypes.c_int64(-1), ctypes.c_int64(-1))
    try:
        before = OPS.library.mx_lbsgd_weight_norms_read()
        for step in range(steps):
            for g, shape in zip(grads, shapes):
                g[:] = rng.uniform(-0.01, 0.01, shape)
            updater(list(range(len(shapes))), grads, weights)
            if write is not None:
                write(step, weights)
        mx.nd.waitall()
        read = OPS.library.mx_lbsgd_weight_norms_read() - before
    finally:
        assert _compat.track_engine_versions(OPS.library)
    return [w.asnumpy() for w in weights], read


@needs_native
@pytest.mark.parametrize('dtype, nesterov', [('float32', False), ('float16', False),
                                             ('float32', True)])
def test_lars_takes_weight_norms_from_the_update_that_wrote_the_weights(dtype, nesterov):
    """The update sums |w|^2 of the weights it writes; the next step uses those sums while
    nothing else wrote a weight (its engine version is the one the update left), bit for bit
    what reading the weights gives. A weight written between the steps (in place, through a
    view, or replaced from numpy) is read again, that one alone."""
    assert OPS.tracks_versions
    n = 14
    want, read = _lars_steps(dtype, tracked=False, nesterov=nesterov)
    assert read == 5 * n
    got, read = _lars_steps(dtype, tracked=True, nesterov=nesterov)
    assert read == n                    # the first step alone
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)

    master = dtype == 'float16'         # the norms are those of the master copies then

    def write(step, weights):
        if step == 1:
            weights[4][:] = weights[4] * 1.5
        elif step == 2:
            view = weights[0][10:20]
            view += 1
        elif step == 3:
            weights[6][:] = np.full(70001, 0.01, dtype)
    want, _ = _lars_steps(dtype, tracked=False, write=write, nesterov=nesterov)
    got, read = _lars_steps(dtype, tracked=True, write=write, nesterov=nesterov)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert read == n + (0 if master else 3)


@needs_native
def test_the_engine_version_probe_reads_this_mxnet():
    """The layout `_compat.track_engine_versions` gives the library passes its probe on the
    1.9.1 wheel (with oneDNN: the variable after the chunk's oneDNN memory)."""
    from mx_lbsgd import _compat
    assert _compat._engine_version_layout() in [(72, 8), (56, 8)]


ENGINE_STEPS = r"""
import sys
import numpy as np
import mxnet as mx
import mx_lbsgd
numpy_mode, out = sys.argv[1] == '1', sys.argv[2]
if numpy_mode:                     # zero-size arrays exist only with numpy shapes
    mx.npx.set_np()
array = mx.np.array if numpy_mode else mx.nd.array
rng = np.random.RandomState(0)
shapes = [(300, 200), (200,), (64, 3, 3, 3), (64,), (70001,)] * 2
if numpy_mode:
    shapes = shapes + [(0,), (4, 0)]
saved = []
for name, args in [('lbsgd', dict(momentum=0.9)),
                   ('lbsgd', dict(momentum=0.9, warmup_strategy='lars', lars_exclude=())),
                   ('lbsgd', dict(momentum=0.9, max_grad_norm=0.5)),
                   ('lblamb', dict()), ('lssgd', dict(momentum=0.9, loss_scaler=8.0))]:
    weights = [array(rng.uniform(-0.1, 0.1, s).astype('float32')) for s in shapes]
    grads = [array(np.zeros(s, 'float32')) for s in shapes]
    updater = mx.optimizer.get_updater(mx.optimizer.create(name, learning_rate=0.1, **args))
    for step in range(4):
        for g, s in zip(grads, shapes):
            g[:] = array(rng.uniform(-0.01, 0.01, s).astype('float32'))
        updater(list(range(len(shapes))), grads, weights)
    saved += [w.asnumpy() for w in weights]
np.savez(out, *saved)
"""


def _engine_steps(tmp_path, tag, numpy_mode, **env):
    out = str(tmp_path / ('%s.npz' % tag))
    done = subprocess.run([sys.executable, '-c', ENGINE_STEPS, str(int(numpy_mode)), out],
                          env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [v for _, v in sorted(np.load(out).items(), key=lambda kv: int(kv[0][4:]))]


@needs_native
def test_more_engine_workers_give_the_same_bits(tmp_path):
    """With four CPU workers in MXNet's engine (MXNET_CPU_WORKER_NTHREADS=4) the pushed
    operations of lbsgd (linear, LARS, clipped), lblamb and lssgd may run on any worker,
    beside each other: the weights equal the one-worker run's bit for bit."""
    one = _engine_steps(tmp_path, 'one', False, MXNET_CPU_WORKER_NTHREADS='1')
    four = _engine_steps(tmp_path, 'four', False, MXNET_CPU_WORKER_NTHREADS='4')
    assert len(one) == 50
    for a, b in zip(one, four):
        np.testing.assert_array_equal(a, b)


@needs_native
def test_zero_size_parameters_update_as_with_mxnets_operators(tmp_path):
    """numpy-mode parameters with no elements ((0,), (4, 0)) beside others: the native
    operators update the rest as MXNet's operators do and leave the empty ones empty."""
    ours = _engine_steps(tmp_path, 'native', True, MX_LBSGD_NATIVE='1')
    theirs = _engine_steps(tmp_path, 'mxnet', True, MX_LBSGD_NATIVE='0')
    assert len(ours) == 60 and [a.shape for a in ours[10:12]] == [(0,), (4, 0)]
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape
        # lblamb (arrays 36-47): MXNet's LAMB sums its norms in another order (the native
        # LAMB is checked against the numpy reference above); 7e-7 apart here
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6 if 36 <= k < 48 else 1e-7)


@needs_native
def test_arrays_sharing_storage_go_through_mxnets_call():
    """Weights that are views of one buffer share one engine variable: pushed as they are,
    the engine would wait forever; they take MXNet's call, which removes duplicates."""
    from mx_lbsgd import _compat
    sizes = [int(np.prod(s)) for s in SHAPES]
    n = len(SHAPES)
    arrays, attrs = _sgd_call(False, 0.9, False, False, False, False)
    flat = nd.concat(*[a.reshape((-1,)) for a in arrays[:n]], dim=0)
    starts = np.cumsum([0] + sizes)
    views = [flat[int(a):int(b)].reshape(s) for a, b, s in zip(starts, starts[1:], SHAPES)]
    shared = views + arrays[n:]
    assert not _compat.push_prepared(OPS.library, OPS.pushed[OPS.sgd_update],
                                     OPS.sgd_update, shared, attrs, {})
    _native.invoke(OPS.sgd_update, shared, attrs, {})
    want, _ = _sgd_call(False, 0.9, False, False, False, False)
    OPS.sgd_update(*want, **attrs)
    for view, expected in zip(views, want[:n]):
        np.testing.assert_array_equal(view.asnumpy(), expected.asnumpy())


@needs_native
def test_a_bad_pushed_call_raises_before_anything_runs():
    """Also after good calls on the same arrays, whose checks the library keeps."""
    arrays, attrs = _sgd_call(False, 0.9, False, False, False, False)
    scratch = {}
    _native.invoke(OPS.sgd_update, arrays, attrs, scratch)
    assert any(key[0] == 'push' for key in scratch['native_calls'])
    before = [a.asnumpy() for a in arrays]
    with pytest.raises(mx.MXNetError, match='mx_lbsgd_sgd_update: lrs needs 6 values, got 2'):
        _native.invoke(OPS.sgd_update, arrays, dict(attrs, lrs='0.1,0.2'), scratch)
    with pytest.raises(mx.MXNetError, match='mx_lbsgd_sgd_update: expected 24 arrays, got 18'):
        _native.invoke(OPS.sgd_update, arrays, dict(attrs, multi_precision=1), scratch)
    with pytest.raises(mx.MXNetError, match='array 0 must be float16'):
        _native.invoke(OPS.sgd_update, arrays[:18], dict(attrs, multi_precision=1,
                                                        has_momentum=0), scratch)
    with pytest.raises(mx.MXNetError, match='array 6 must be float32'):
        _native.invoke(OPS.sgd_update, arrays[:6] + [a.astype('float16') for a in arrays[6:]],
                       attrs, scratch)
    # the shape function's own refusal, not a count of outputs the caller did not pass
    short = arrays[:7] + [arrays[7][:1]] + arrays[8:]
    with pytest.raises(mx.MXNetError, match='array 7 differs in shape from weight 1$'):
        _native.invoke(OPS.sgd_update, short, attrs, scratch)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a.asnumpy(), b)


def _operator_call(name, seed):
    """(function, inputs, attrs, output shape) of one call of a native operator with an
    output that is read, on fresh arrays: float32 and float16 inputs, an inf in one."""
    mixed = [nd.array(x, dtype=d) for x, d in
             zip(_arrays('float32', seed), ['float32', 'float16'] * 3)]
    n = len(mixed)
    if name == 'accumulate':
        accs = [nd.array(x) for x in _arrays('float32', seed + 1)]
        mixed[3][0, 0] = np.inf
        return (OPS.accumulate, accs + mixed,
                dict(num_tensors=n, mode=1, check_finite=1, factor=0.37), (1,))
    if name == 'all_finite':
        mixed[4][7, 9] = np.nan
        return OPS.all_finite, mixed, dict(num_arrays=n), (1,)
    total = name == 'sum_sq_total'
    return OPS.sum_sq, mixed, dict(num_arrays=n, total=int(total)), ((1,) if total else (n,))


@needs_native
@pytest.mark.parametrize('name', ['sum_sq', 'sum_sq_total', 'all_finite', 'accumulate'])
def test_a_pushed_operator_writes_what_the_operator_writes(name):
    from mx_lbsgd import _compat
    function, arrays, attrs, shape = _operator_call(name, 30)
    out = nd.zeros(shape) - 1
    assert _compat.push_prepared(OPS.library, OPS.pushed[function], function, arrays, attrs,
                                 {}, outputs=[out])
    _, called, attrs = _operator_call(name, 30)[:3]
    want = function(*called, **attrs)
    np.testing.assert_array_equal(out.asnumpy(), want.asnumpy())
    for got, expected in zip(arrays, called):
        np.testing.assert_array_equal(got.asnumpy(), expected.asnumpy())
    if name == 'accumulate':
        assert out.asnumpy()[0] == 0.0           # the inf of gradient 3
        assert not np.array_equal(arrays[0].asnumpy(), _arrays('float32', 31)[0])


@needs_native
@pytest.mark.parametrize('mp', [pytest.param(False, id='fp32'), pytest.param(True, id='fp16mp')])
def test_the_pushed_lamb_update_is_the_operators_bits(mp):
    from mx_lbsgd import _compat
    dtype = 'float16' if mp else 'float32'
    case = dict(bounds=(None, None), applies=[1, 0, 1, 1, 1, 1], bias_correction=True,
                rescale=0.5, clip=None)

    def problem():
        w, g, m, v = _lamb_problem(dtype, seed=5)
        return ([nd.array(x, dtype=dtype) for x in w], [nd.array(x, dtype=dtype) for x in g],
                [nd.array(x) for x in m], [nd.array(x) for x in v],
                [nd.array(x.astype(np.float32)) for x in w])
    called = problem()
    _lamb_call(case, mp, *called)
    pushed = problem()
    arrays, attrs = _lamb_args(case, mp, *pushed)
    assert _compat.push_prepared(OPS.library, OPS.pushed[OPS.lamb_update], OPS.lamb_update,
                                 arrays, attrs, {})
    for got, want in zip(sum(pushed, []), sum(called, [])):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    assert not np.array_equal(pushed[0][0].asnumpy(), problem()[0][0].asnumpy())


@needs_native
def test_an_output_sharing_an_inputs_storage_goes_through_mxnets_call():
    from mx_lbsgd import _compat
    function, arrays, attrs, shape = _operator_call('sum_sq', 30)
    assert not _compat.push_prepared(OPS.library, OPS.pushed[function], function, arrays,
                                     attrs, {}, outputs=[arrays[0].reshape((-1,))[:6]])
    out = nd.zeros(shape)
    assert _native.call(function, arrays, out, **attrs) is out
    np.testing.assert_array_equal(out.asnumpy(), function(*arrays, **attrs).asnumpy())


# -- mx_lbsgd_accumulate: the accumulation window's micro-batch in one call -------------

def _window_arrays(dtypes, seed):
    grads = [nd.array(x, dtype=dtypes[i % len(dtypes)])
             for i, x in enumerate(_arrays('float32', seed))]
    accs = [nd.array(x) for x in _arrays('float32', seed + 1)]
    return accs, grads


def _window_sequence(accs, grads_per_micro, factor, scratch):
    """Micro-batches 1..B-1 summed into `accs`, micro-batch B's mean written into its
    gradients (what `TrainerWindow` does); returns the arrays after each stage."""
    stages = []
    for k, grads in enumerate(grads_per_micro[:-1]):
        mx_lbsgd._kernels.accumulate(accs=accs, grads=grads, first=k == 0, rescale_grad=factor,
                                     scratch=scratch)
        stages.append([a.asnumpy() for a in accs])
    last = grads_per_micro[-1]
    mx_lbsgd._kernels.write_mean(grads=last, accs=accs, rescale_grad=factor,
                                 mean_factor=1.0 / (factor * len(grads_per_micro)),
                                 scratch=scratch)
    stages.append([g.asnumpy() for g in last])
    return stages


def _sgd_update_reads(value):
    """The float32 that sgd_update takes for rescale_grad=`value` (MXNet reads a float
    parameter with dmlc-core's own parser, not always as numpy's float32(value) rounds)."""
    weight = nd.zeros(1)
    nd.sgd_update(weight, -nd.ones(1), out=weight, lr=1.0, wd=0.0, rescale_grad=value)
    return weight.asnumpy()[0]


# 1/49152 (a batch of 4096 in windows of 12): sgd_update reads it one ulp off float32's
@needs_native
@pytest.mark.parametrize('factor', [pytest.param(1.0, id='factor1'),
                                    pytest.param(0.37, id='factor0.37'),
                                    pytest.param(1 / 49152, id='factor1/49152')])
@pytest.mark.parametrize('dtypes', [pytest.param(('float32',), id='fp32'),
                                    pytest.param(('float16',), id='fp16'),
                                    pytest.param(('float16', 'float32'), id='mixed')])
def test_accumulate_is_the_per_tensor_paths_bits_and_numpy(monkeypatch, dtypes, factor):
    B = 4
    micro = [_window_arrays(dtypes, seed=10 * k)[1] for k in range(B)]
    copies = [[g.copy() for g in grads] for grads in micro]
    accs, _ = _window_arrays(dtypes, seed=99)
    with count_kernel_launches() as launches:
        native = _window_sequence(accs, micro, factor, {})
    assert len(launches) == B          # one call per micro-batch: one context
    monkeypatch.setattr(_native, 'ops', lambda: None)     # MXNet's per-tensor operators
    accs, _ = _window_arrays(dtypes, seed=99)
    with count_kernel_launches() as launches:
        per_tensor = _window_sequence(accs, copies, factor, {})
    assert len(launches) >= B * len(SHAPES)
    for stage_native, stage_mxnet in zip(native, per_tensor):
        for a, b in zip(stage_native, stage_mxnet):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    # numpy, in float32 arithmetic for the sums and float64 for the mean; the first
    # micro-batch scaled as _mul_scalar reads the factor, the others as sgd_update does
    f, f_add = np.float32(factor), np.float32(_sgd_update_reads(factor))
    if factor == 1 / 49152:
        assert f_add != f
    grads = [[g.asnumpy().astype(np.float32) for g in grads] for grads in copies[:-1]]
    acc = [g * f for g in grads[0]]
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in acc]),
                                  np.concatenate([a.ravel() for a in native[0]]))
    for k in range(1, B - 1):
        acc = [a + f_add * g for a, g in zip(acc, grads[k])]
        for a, b in zip(acc, native[k]):
            np.testing.assert_array_equal(a, b)
    for i, got in enumerate(native[-1]):
        last = _window_arrays(dtypes, seed=10 * (B - 1))[1][i].asnumpy().astype(np.float64)
        want = (acc[i].astype(np.float64) + factor * last) / (factor * B)
        np.testing.assert_allclose(got.astype(np.float64), want,
                                   rtol=1e-3 if got.dtype == np.float16 else 1e-6,
                                   atol=1e-3 if got.dtype == np.float16 else 1e-7)


@needs_native
def test_accumulate_refuses_wrong_dtypes():
    acc, grad = nd.zeros((3,), dtype='float16'), nd.ones((3,), dtype='float16')
    with pytest.raises(mx.MXNetError, match=r'array 0 must be float32 \(an accumulator\)'):
        OPS.accumulate(acc, grad, num_tensors=1, mode=1, factor=1.0).wait_to_read()
    with pytest.raises(mx.MXNetError, match='array 1 must be float16 or float32'):
        OPS.accumulate(nd.zeros((3,)), nd.ones((3,), dtype='float64'), num_tensors=1, mode=1,
                       factor=1.0).wait_to_read()


def _trainer_window_launches(dtype, ctxs, tensors=20):
    """Operator calls of each `trainer.step` of one window of 'lblamb' (batch_scale=4)
    on `tensors` parameters per context."""
    params = [mx.gluon.Parameter('p%d_weight' % i, shape=(3, i + 1), dtype=dtype)
              for i in range(tensors)]
    for p in params:
        p.initialize(ctx=ctxs)
    trainer = mx.gluon.Trainer(params, 'lblamb', dict(batch_scale=4,
                                                      multi_precision=dtype == 'float16'),
                               kvstore='device' if len(ctxs) > 1 else None,
                               update_on_kvstore=False if len(ctxs) > 1 else None)
    counts = []
    for _ in range(8):
        with mx.autograd.record():
            losses = [nd.add_n(*[p.data(c).sum() for p in params]) for c in ctxs]
        mx.autograd.backward(losses)
        mx.nd.waitall()
        with count_kernel_launches() as launches:
            trainer.step(1)
        counts.append(len(launches))
    return counts


@needs_native
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_window_micro_batch_is_one_operator_call_per_device(monkeypatch, dtype):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    native = _trainer_window_launches(dtype, ctxs)
    # micro-batches 2 and 3 of the second window (the first creates the states): one
    # mx_lbsgd_accumulate per device, and nothing else
    assert native[5:7] == [len(ctxs), len(ctxs)]
    monkeypatch.setattr(_native, 'ops', lambda: None)
    per_tensor = _trainer_window_launches(dtype, ctxs)
    # MXNet's operators: an axpy per tensor and device, and a Cast before it for float16
    assert per_tensor[5:7] == [20 * len(ctxs) * (2 if dtype == 'float16' else 1)] * 2


@needs_native
@pytest.mark.parametrize('which', ['lamb', 'sgd'])
def test_native_updates_take_float32_gradients_with_master_copies(which):
    """An accumulated window hands float32 gradients to float16 weights with master
    copies: the same update as float16 gradients of the same values, in one call."""
    w0 = _arrays('float16', 21)
    g0 = _arrays('float16', 22)
    results = []
    for grad_dtype in ('float16', 'float32'):
        w = [nd.array(x, dtype='float16') for x in w0]
        g = [nd.array(x.astype(grad_dtype), dtype=grad_dtype) for x in g0]
        w32 = [nd.array(x.astype(np.float32)) for x in w0]
        n = len(w0)
        if which == 'lamb':
            mean = [nd.zeros(x.shape) for x in w0]
            var = [nd.zeros(x.shape) for x in w0]
            OPS.lamb_update(*w, *g, *mean, *var, *w32, num_tensors=n, multi_precision=1,
                            lrs=','.join(['0.01'] * n), wds=','.join(['0.01'] * n),
                            steps=','.join(['1'] * n), applies=','.join(['1'] * n),
                            beta1=0.9, beta2=0.999, epsilon=1e-6, bias_correction=1,
                            rescale_grad=0.5, clip_gradient=-1, lower_bound=-1,
                            upper_bound=-1).wait_to_read()
        else:
            mom = [nd.zeros(x.shape) for x in w0]
            OPS.sgd_update(*w, *g, *mom, *w32, num_tensors=n, has_momentum=1, momentum=0.9,
                           multi_precision=1, preloaded=0, lrs=','.join(['0.1'] * n),
                           wds=','.join(['0.001'] * n), rescale_grad=0.5,
                           clip_gradient=-1.0)
        results.append(([x.asnumpy() for x in w], [x.asnumpy() for x in w32]))
        for a, b in zip(results[-1][0], results[-1][1]):
            np.testing.assert_array_equal(a, b.astype(np.float16))
    for a, b in zip(*[r[1] for r in results]):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, w0[0]) if a.shape == w0[0].shape else True


@needs_native
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_window_in_the_optimizer_is_one_operator_call_per_micro_batch(monkeypatch, dtype):
    """Module, the LossScaling hook, bare Updaters: the window inside the optimizer."""
    def launches_per_call():
        opt = mx_lbsgd.LAMB(batch_scale=4, multi_precision=dtype == 'float16')
        updater = mx.optimizer.get_updater(opt)
        weights = [nd.ones((3, i + 1), dtype=dtype) for i in range(20)]
        counts = []
        for _ in range(8):
            grads = [nd.ones(w.shape, dtype=dtype) for w in weights]
            mx.nd.waitall()
            with count_kernel_launches() as launches:
                updater(list(range(20)), grads, weights)
            counts.append(len(launches))
        return counts
    assert launches_per_call()[5:7] == [1, 1]
    monkeypatch.setattr(_native, 'ops', lambda: None)
    assert launches_per_call()[5:7] == [20 * (2 if dtype == 'float16' else 1)] * 2


# -- the micro-batch's finite flag out of the accumulate's own pass -----------------------

def _with_bad(xs, bad):
    xs = [x.copy() for x in xs]
    xs[2][0] = np.finfo(xs[2].dtype).max                 # the largest finite value
    xs[3].flat[0] = np.finfo(xs[3].dtype).tiny / 2       # a subnormal
    if bad is not None:
        which, at, value = bad
        xs[which].flat[at] = value
    return xs


@needs_native
@pytest.mark.parametrize('mode', [0, 1, 2])
@pytest.mark.parametrize('bad', FINITE_CASES)
@pytest.mark.parametrize('dtypes', [pytest.param(('float32',), id='fp32'),
                                    pytest.param(('float16',), id='fp16'),
                                    pytest.param(('float16', 'float32'), id='mixed')])
def test_accumulate_check_finite_is_all_finites_flag_and_the_same_bits(mode, bad, dtypes):
    """check_finite=1: the output is mx_lbsgd_all_finite's flag of the gradients as they
    were read (mode 2 overwrites them), and every array is written exactly as without it."""
    xs = _with_bad([x.astype(dtypes[i % len(dtypes)])
                    for i, x in enumerate(_arrays('float32', seed=3))], bad)
    acc0 = _arrays('float32', seed=4)
    attrs = dict(num_tensors=len(xs), mode=mode, factor=0.37)
    if mode == 2:
        attrs.update(lr=-0.25, wd=(0.25 * 0.37 - 1.0) / 0.25, mean_factor=0.25)
    results = []
    for check in (0, 1):
        grads = [nd.array(x, dtype=x.dtype) for x in xs]
        accs = [nd.array(a) for a in acc0]
        before = OPS.all_finite(*grads, num_arrays=len(grads))
        out = OPS.accumulate(*accs, *grads, check_finite=check, **attrs)
        results.append((out.asnumpy(), before.asnumpy(), [a.asnumpy() for a in accs],
                        [g.asnumpy() for g in grads]))
    (off, _, accs_off, grads_off), (flag, want, accs_on, grads_on) = results
    assert off.tolist() == [0.0]                          # the output without the check
    assert flag.dtype == np.float32 and flag.tolist() == want.tolist()
    assert flag.tolist() == [float(all(np.isfinite(x).all() for x in xs))]      # numpy
    for a, b in zip(accs_off + grads_off, accs_on + grads_on):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)              # nan where nan, inf where inf
    if mode < 2 and bad is not None:                      # the inf/nan went into the window
        assert not np.isfinite(np.concatenate([a.ravel() for a in accs_on])).all()


def _window_with_flags(accs, micro, factor, fused):
    """`_window_sequence` with check_finite: the flag of every micro-batch, and the arrays."""
    flags, stages = [], []
    for k, grads in enumerate(micro[:-1]):
        flags.append(mx_lbsgd._kernels.accumulate(
            accs=accs, grads=grads, first=k == 0, rescale_grad=factor, scratch={},
            check_finite=True, fused=fused))
        stages.append([a.asnumpy() for a in accs])
    flags.append(mx_lbsgd._kernels.write_mean(
        grads=micro[-1], accs=accs, rescale_grad=factor, mean_factor=1.0 / (factor * len(micro)),
        scratch={}, check_finite=True, fused=fused))
    stages.append([g.asnumpy() for g in micro[-1]])
    return [f.asnumpy().tolist() for f in flags], stages


@needs_native
@pytest.mark.parametrize('dtypes', [pytest.param(('float32',), id='fp32'),
                                    pytest.param(('float16', 'float32'), id='mixed'),
                                    pytest.param(('float16', 'float64'), id='fp64-rest')])
def test_fused_window_flags_are_the_two_call_paths_bits(monkeypatch, dtypes):
    """A window whose micro-batches 2 and 4 hold an inf / nan: the flags and the arrays of
    the fused calls equal finite_flag-then-accumulate (the code before the fusion) and
    MXNet's per-tensor path, bit for bit; float64 gradients (accumulated in float64, which
    the native operator does not take) get a finite_flag of their own."""
    B, factor = 4, 0.5

    def problem():
        micro = [_window_arrays(dtypes, seed=10 * k)[1] for k in range(B)]
        micro[1][4][3, 7] = np.inf
        micro[3][1][123] = np.nan
        accs = [nd.zeros(g.shape, dtype=np.promote_types(g.dtype, np.float32))
                for g in micro[0]]
        return accs, micro

    accs, micro = problem()
    with count_kernel_launches() as launches:
        fused_flags, fused = _window_with_flags(accs, micro, factor, None)
    native_only = 'float64' not in dtypes
    if native_only:
        assert len(launches) == B                 # one call per micro-batch, flag included
    accs, micro = problem()
    two_call_flags, two_call = [], []
    for k, grads in enumerate(micro):
        two_call_flags.append(mx_lbsgd._kernels.finite_flag(grads, None).asnumpy().tolist())
        if k < B - 1:
            mx_lbsgd._kernels.accumulate(accs=accs, grads=grads, first=k == 0, rescale_grad=factor,
                                         scratch={})
            two_call.append([a.asnumpy() for a in accs])
        else:
            mx_lbsgd._kernels.write_mean(grads=grads, accs=accs, rescale_grad=factor,
                                         mean_factor=1.0 / (factor * B), scratch={})
            two_call.append([g.asnumpy() for g in grads])
    monkeypatch.setattr(_native, 'ops', lambda: None)     # MXNet's operators
    accs, micro = problem()
    mxnet_flags, mxnet = _window_with_flags(accs, micro, factor, None)
    assert fused_flags == two_call_flags == mxnet_flags == [[1.0], [0.0], [1.0], [0.0]]
    for stages in (two_call, mxnet):
        for stage_a, stage_b in zip(fused, stages):
            for a, b in zip(stage_a, stage_b):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)


def _scaled_window_launches(dtype, ctxs, tensors=20):
    """Operator calls of each `trainer.step` of 'lblamb' (batch_scale=4) with a loss scaler."""
    params = [mx.gluon.Parameter('p%d_weight' % i, shape=(3, i + 1), dtype=dtype)
              for i in range(tensors)]
    for p in params:
        p.initialize(ctx=ctxs)
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=8.0, growth_interval=1000)
    trainer = mx.gluon.Trainer(params, 'lblamb', dict(batch_scale=4, loss_scaler=scaler,
                                                      multi_precision=dtype == 'float16'),
                               kvstore='device' if len(ctxs) > 1 else None,
                               update_on_kvstore=False if len(ctxs) > 1 else None)
    counts = []
    for _ in range(8):
        with mx.autograd.record():
            losses = [nd.add_n(*[p.data(c).sum() for p in params]) * scaler.scale
                      for c in ctxs]
        mx.autograd.backward(losses)
        mx.nd.waitall()
        with count_kernel_launches() as launches:
            trainer.step(1)
        counts.append(len(launches))
    assert trainer.optimizer.last_overflow is None
    return counts


@needs_native
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
@pytest.mark.parametrize('devices', [1, 2])
def test_scaled_window_micro_batch_is_one_call_per_device_flag_included(monkeypatch, dtype,
                                                                        devices):
    """With a loss scaler each micro-batch keeps a finite flag for the overflow report; it
    comes out of the accumulate: one call per device (and the AND of the devices' flags),
    where finite_flag + accumulate took two per device (and the AND)."""
    ctxs = [mx.cpu(i) for i in range(devices)]
    combine = 2 * (devices - 1)       # per further device: a copy to the first, nd.minimum
    assert _scaled_window_launches(dtype, ctxs)[5:7] == [devices + combine] * 2
    monkeypatch.setattr(_native, 'ops', lambda: None)
    per_tensor = _scaled_window_launches(dtype, ctxs)
    # MXNet's operators: an axpy per tensor and device, a Cast before it for float16, and
    # the flag's own finite check (one multi_all_finite per device: 20 small tensors)
    assert per_tensor[5:7] == [(20 * (2 if dtype == 'float16' else 1) + 1) * devices
                               + combine] * 2
