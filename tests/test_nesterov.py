"""``'lbsgd'`` with ``nesterov=True`` against MXNet 1.9.1's ``'nag'`` (``mx.optimizer.NAG``,
``nag_mom_update`` / ``mp_nag_mom_update``) and the numpy reference's NAG rule.

- MXNet 1.9.1's own NAG unit test (tests/python/unittest/test_optimizer.py::test_nag: its
  grid of momentum, clip_gradient, rescale_grad, wd, multi_precision and dtypes), with the
  package's optimizer in place of ``mx.optimizer.NAG`` and the numpy reference (the rule of
  1.9.1's PyNAG) as the other side; the reference is checked against MXNet's NAG on the same
  grid, so the two are one rule;
- bit for bit equal to ``'nag'`` in a 32-step Gluon run, float32 and float16 with
  ``multi_precision``, on every kernel path; in a Module run; with row_sparse gradients;
- the native operator's NAG arithmetic equal to ``nag_mom_update`` / ``mp_nag_mom_update``;
- states interchangeable with ``'nag'``'s; bad input refused.

LARS, warmup, the window, fp16 master copies, clipping and every entry are in the window
and clipping matrices (tests/test_window_matrix.py, tests/test_clip.py: 'nag-lars').
CI runs this file again on MXNet's operators alone (MX_LBSGD_NATIVE=0).
"""
import itertools

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.test_utils import compare_optimizer

import mx_lbsgd
from mx_lbsgd import _native
from digits_mlp import load_digits, mlp
from reference import NumpySGD

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

# MXNet 1.9.1 tests/python/unittest/test_optimizer.py::test_nag, as data
OPTIONS = [[{}, {'momentum': 0.9}],
           [{}, {'clip_gradient': 0.4}, {'clip_gradient': 0.5}],
           [{}, {'rescale_grad': 0.14}, {'rescale_grad': 0.8}],
           [{}, {'wd': 0.03}, {'wd': 0.05}, {'wd': 0.07}],
           [{}, {'multi_precision': False}, {'multi_precision': True}]]


def _grid(dtype):
    for parts in itertools.product(*OPTIONS):
        kwargs = {k: v for part in parts for k, v in part.items()}
        if dtype == 'float16' and not kwargs.get('multi_precision'):
            continue
        yield kwargs


def test_grid_has_mxnet_1_9_1_size():
    assert [len(list(_grid(d))) for d in ('float16', 'float32', 'float64')] == [72, 216, 216]


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64'])
def test_mxnet_nag_unit_test_with_lbsgd_in_place_of_nag(dtype, fused):
    """compare_optimizer(reference, ours) and compare_optimizer(reference, mx NAG) on every
    case of 1.9.1's grid, with its tolerances (states compared too)."""
    for kwargs in _grid(dtype):
        for theirs in (mx_lbsgd.LBSGD(nesterov=True, fused=fused, **kwargs),
                       mx.optimizer.NAG(**kwargs)):
            mx.random.seed(0)
            try:
                compare_optimizer(NumpySGD(nesterov=True, **kwargs), theirs, (3, 4, 5),
                                  np.dtype(dtype), rtol=1e-3, atol=1e-4)
            except AssertionError as error:
                raise AssertionError('%s %s: %s' % (type(theirs).__name__, kwargs,
                                                    error)) from None


def _train_gluon(opt_name, options, dtype, steps=32):
    x, y, _, _ = load_digits()
    net = mlp((32, 16), dtype=dtype, seed=3)
    trainer = gluon.Trainer(net.collect_params(), opt_name, options)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(steps):
        xb = nd.array(x[step * 32:(step + 1) * 32], dtype=dtype)
        yb = nd.array(y[step * 32:(step + 1) * 32])
        with autograd.record():
            loss = loss_fn(net(xb).astype('float32'), yb)
        loss.backward()
        trainer.step(32)
    states = trainer._updaters[0].states     # noqa: SLF001  (test reads MXNet's Updater)
    return ([p.data().asnumpy() for p in net.collect_params().values()],
            [states[i] for i in sorted(states)])


def _flat(state):
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _flat(s)]
    return [] if state is None else [state.asnumpy()]


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_32_gluon_steps_equal_nag_bit_for_bit(dtype, fused):
    common = dict(learning_rate=0.1, momentum=0.9, wd=1e-3,
                  multi_precision=dtype == 'float16')
    ours, our_states = _train_gluon('lbsgd', dict(common, nesterov=True, fused=fused), dtype)
    theirs, their_states = _train_gluon('nag', common, dtype)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(our_states, their_states):      # the same layout and values
        for x, y in zip(_flat(a), _flat(b), strict=True):
            np.testing.assert_array_equal(x, y)
    sgd, _ = _train_gluon('lbsgd', dict(common, fused=fused), dtype)
    assert any(not np.array_equal(a, b) for a, b in zip(sgd, theirs))   # NAG is not SGD


def test_module_fit_equals_nag():
    x, y, _, _ = load_digits()
    data = mx.sym.var('data')
    out = mx.sym.FullyConnected(mx.sym.Activation(mx.sym.FullyConnected(
        data, num_hidden=16, name='fc0'), act_type='relu'), num_hidden=10, name='fc1')
    sym = mx.sym.SoftmaxOutput(out, name='softmax')

    def fit(name, options):
        mx.random.seed(1)
        it = mx.io.NDArrayIter(x[:256], y[:256], batch_size=32, label_name='softmax_label')
        mod = mx.mod.Module(sym, context=mx.cpu())
        mod.fit(it, optimizer=name, optimizer_params=options, num_epoch=2,
                initializer=mx.init.Xavier())
        return {k: v.asnumpy() for k, v in mod.get_params()[0].items()}

    common = dict(learning_rate=0.1, momentum=0.9, wd=1e-4)
    ours, theirs = fit('lbsgd', dict(common, nesterov=True)), fit('nag', common)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_row_sparse_gradients_equal_nag():
    """NAG has no sparse kernel: MXNet's storage fallback updates every row; so does ours."""
    def run(name, options):
        mx.random.seed(2)
        emb = gluon.nn.Embedding(20, 4, sparse_grad=True)
        emb.initialize(mx.init.Uniform())
        trainer = gluon.Trainer(emb.collect_params(), name, options)
        for step in range(5):
            idx = nd.array([(step * 3 + k) % 20 for k in range(4)])
            with autograd.record():
                loss = (emb(idx) ** 2).sum()
            loss.backward()
            trainer.step(4)
        return emb.weight.data().asnumpy()

    common = dict(learning_rate=0.1, momentum=0.9, wd=1e-2)
    np.testing.assert_array_equal(run('lbsgd', dict(common, nesterov=True)),
                                  run('nag', common))


@pytest.mark.skipif(_native.ops() is None, reason='the native library is not built or '
                    'MX_LBSGD_NATIVE=0')
@pytest.mark.parametrize('clip', [-1.0, 0.3])
@pytest.mark.parametrize('mp', [False, True], ids=['fp32', 'fp16mp'])
def test_native_operator_equals_nag_mom_update(mp, clip):
    """Tensors that split across threads and ones inside one thread's range."""
    rng = np.random.RandomState(0)
    shapes = [(3, 5), (70001,), (7,), (300, 400), (1,)]
    wdt = 'float16' if mp else 'float32'
    ws = [rng.uniform(-1, 1, s).astype(wdt) for s in shapes]
    gs = [rng.uniform(-1, 1, s).astype(wdt) for s in shapes]
    ms = [rng.uniform(-0.1, 0.1, s).astype('float32') for s in shapes]
    lrs, wds = [0.1, 0.05, 0.2, 0.01, 0.3], [1e-3, 0.0, 0.05, 1e-4, 0.02]
    ours = [nd.array(w, dtype=wdt) for w in ws]
    our_m = [nd.array(m) for m in ms]
    our_32 = [nd.array(w.astype('float32')) for w in ws] if mp else []
    _native.ops().sgd_update(
        *ours, *[nd.array(g, dtype=wdt) for g in gs], *our_m, *our_32,
        num_tensors=len(shapes), has_momentum=1, momentum=0.9, nesterov=1,
        multi_precision=int(mp), preloaded=0, lrs=_native.attribute_list(lrs),
        wds=_native.attribute_list(wds), rescale_grad=0.7, clip_gradient=clip)
    for i in range(len(shapes)):
        w, m = nd.array(ws[i], dtype=wdt), nd.array(ms[i])
        kwargs = dict(lr=lrs[i], wd=wds[i], momentum=0.9, rescale_grad=0.7,
                      **({'clip_gradient': clip} if clip > 0 else {}))
        if mp:
            w32 = nd.array(ws[i].astype('float32'))
            nd.mp_nag_mom_update(w, nd.array(gs[i], dtype=wdt), m, w32, out=w, **kwargs)
            np.testing.assert_array_equal(our_32[i].asnumpy(), w32.asnumpy())
        else:
            nd.nag_mom_update(w, nd.array(gs[i]), m, out=w, **kwargs)
        np.testing.assert_array_equal(ours[i].asnumpy(), w.asnumpy(), err_msg=str(shapes[i]))
        np.testing.assert_array_equal(our_m[i].asnumpy(), m.asnumpy(), err_msg=str(shapes[i]))


def test_gpu_kernel_path_on_cpu(monkeypatch):
    """The path fp16 weights and gradients with master copies take on a GPU
    (mp_nag_mom_update, and with device rates the rule on fp32 copies), run on CPU by
    pretending the arrays are on a GPU; it equals the reference's NAG."""
    from mx_lbsgd.families import sgd as sgd_family
    monkeypatch.setattr(sgd_family, '_native_mp',
                        lambda w, g, master: master is not None and g.dtype == w.dtype)
    kwargs = dict(learning_rate=0.1, momentum=0.9, wd=0.03, rescale_grad=0.8,
                  multi_precision=True)
    for opt in (mx_lbsgd.LBSGD(nesterov=True, fused=False, **kwargs),
                mx_lbsgd.LBSGD(nesterov=True, fused=True, max_grad_norm=0.05, **kwargs)):
        mx.random.seed(0)
        reference = NumpySGD(nesterov=True, **kwargs)
        if opt.max_grad_norm:
            # the norm of compare_optimizer's uniform gradients is far above 0.05: the
            # reference sees the clipped gradient (rescale_grad * c)
            reference = None
        if reference is not None:
            compare_optimizer(reference, opt, (3, 4, 5), np.dtype('float16'),
                              rtol=1e-3, atol=1e-4)
        else:
            w = nd.array(np.random.RandomState(1).uniform(-1, 1, (6, 5)), dtype='float16')
            g = nd.array(np.random.RandomState(2).uniform(-1, 1, (6, 5)), dtype='float16')
            state = opt.create_state_multi_precision(0, w)
            before = w.asnumpy().astype(np.float64)
            opt.update_multi_precision(0, w, g, state)
            gd = g.asnumpy().astype(np.float64) * 0.8
            c = min(1.0, 0.05 / (np.sqrt((gd ** 2).sum()) + 1e-6))
            expect = before - 0.1 * (0.9 + 1) * (c * gd + 0.03 * before)
            np.testing.assert_allclose(w.asnumpy(), expect, rtol=2e-3, atol=2e-3)


def test_states_load_into_nag_and_back():
    x, y, _, _ = load_digits()

    def trainer_for(net, name, options):
        return gluon.Trainer(net.collect_params(), name, options)

    common = dict(learning_rate=0.1, momentum=0.9, wd=1e-3)
    runs = {}
    for first, second in (('lbsgd', 'nag'), ('nag', 'lbsgd')):
        net = mlp((16,), seed=5)
        trainer = trainer_for(net, first, dict(common, **({'nesterov': True}
                                                         if first == 'lbsgd' else {})))
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

        def step(k):
            with autograd.record():
                loss = loss_fn(net(nd.array(x[k * 32:(k + 1) * 32])),
                               nd.array(y[k * 32:(k + 1) * 32]))
            loss.backward()
            trainer.step(32)
        for k in range(3):
            step(k)
        # the states alone (Trainer.save_states also pickles the optimizer, which would
        # replace the other one on loading)
        states = trainer._updaters[0].get_states(dump_optimizer=False)   # noqa: SLF001
        trainer = trainer_for(net, second, dict(common, **({'nesterov': True}
                                                          if second == 'lbsgd' else {})))
        trainer._updaters[0].set_states(states)                            # noqa: SLF001
        for k in range(3, 6):
            step(k)
        runs[first] = [p.data().asnumpy() for p in net.collect_params().values()]
    for a, b in zip(runs['lbsgd'], runs['nag']):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('value', ['yes', 1, None])
def test_bad_nesterov_names_the_parameter(value):
    with pytest.raises(TypeError, match='nesterov must be True or False'):
        mx_lbsgd.LBSGD(momentum=0.9, nesterov=value)
