"""Global-norm clipping of the applied gradient (``max_grad_norm``).

- Against the numpy float64 reference (tests/reference.py): lbsgd, lbsgd + LARS, lssgd and
  lblamb; batch_scale 1 and 4; float32 and float16 with master copies; every kernel path;
  the Trainer, the hook, Module and a bare Updater; clipping active and not.
- Against the GluonNLP-style loop: MXNet's own 'lamb' and 'sgd' on grad_req='add'
  gradients divided by the window's batch and clipped with gluon.utils.clip_global_norm.
- Non-finite gradients: skipped with a loss scaler (scale backs off, the report names the
  parameter); without one, never a NaN in a weight.
- The hook clipping any MXNet optimizer, bad input, and the refusals.
"""
import math
import pickle
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from digits_mlp import load_digits, mlp
import test_window_matrix as matrix

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

ACTIVE, INACTIVE = 0.5, 100.0     # the matrix's gradient norms are about 1.5


def _cases():
    for opt in matrix.OPTIMIZERS:
        for dtype in matrix.DTYPES:
            for batch_scale in (1, 4):
                for path in matrix.PATHS:
                    for entry in ('trainer', 'hook', 'module', 'updater'):
                        if not matrix._allowed(opt, entry, batch_scale):
                            continue
                        for clip in (ACTIVE, INACTIVE) if path == 'default' else (ACTIVE,):
                            yield pytest.param(opt, dtype, batch_scale, path, entry, clip,
                                               id='%s-%s-B%d-%s-%s-%g' % (
                                                   opt, dtype, batch_scale, path, entry, clip))


@pytest.mark.parametrize('opt, dtype_id, batch_scale, path, entry, clip', list(_cases()))
def test_clip_matrix_against_the_reference(opt, dtype_id, batch_scale, path, entry, clip):
    optimizer, coefficients = matrix.check_against_reference(
        opt, dtype_id, batch_scale, path, entry, max_grad_norm=clip)
    if clip == ACTIVE:
        assert max(coefficients) < 0.9       # the clip bites on every update
    else:
        assert coefficients == [1.0] * len(coefficients)
    # the last update's coefficient and norm, as the optimizer reports them
    got = float(optimizer.last_clip_coefficient.asscalar())
    np.testing.assert_allclose(got, coefficients[-1], rtol=2e-3 if dtype_id == 'fp16mp'
                               else 1e-5)
    norm = float(optimizer.last_grad_norm.asscalar())
    if clip == ACTIVE:
        np.testing.assert_allclose(clip / (norm + 1e-6), got, rtol=1e-6)
    else:
        assert norm < clip


# -- the GluonNLP-style loop ------------------------------------------------------------

X, Y, _, _ = load_digits()
BATCH, WINDOW, UPDATES = 16, 4, 5
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def _param(net, suffix):
    return next(p for n, p in net.collect_params().items() if n.endswith(suffix))


def _micro(k):
    lo = (k * BATCH) % (len(X) - BATCH)
    return nd.array(X[lo:lo + BATCH]), nd.array(Y[lo:lo + BATCH])


def _gluonnlp_loop(name, args, max_norm):
    """MXNet's optimizer with grad_req='add': the window's summed gradients divided by
    the window's batch, clipped with gluon.utils.clip_global_norm, then update(1)."""
    net = mlp(hidden=(32,), seed=1)
    params = net.collect_params()
    params.setattr('grad_req', 'add')
    trainer = gluon.Trainer(params, name, args)
    norms = []
    for u in range(UPDATES):
        params.zero_grad()
        for k in range(WINDOW):
            x, y = _micro(u * WINDOW + k)
            with autograd.record():
                loss = LOSS(net(x), y)
            loss.backward()
        grads = [p.grad() for p in params.values()]
        for g in grads:
            g /= BATCH * WINDOW
        norms.append(gluon.utils.clip_global_norm(grads, max_norm))
        trainer.update(1)
    return [p.data().asnumpy() for p in params.values()], norms


def _ours(name, args, max_norm):
    net = mlp(hidden=(32,), seed=1)
    if name == 'lbsgd':
        # plain SGD: after its warmup LBSGD multiplies lr by batch_scale (MXNet's LBSGD)
        args = dict(args, warmup_epochs=0, learning_rate=args['learning_rate'] / WINDOW)
    trainer = gluon.Trainer(net.collect_params(), name,
                            dict(args, batch_scale=WINDOW, max_grad_norm=max_norm))
    norms = []
    for u in range(UPDATES):
        for k in range(WINDOW):
            x, y = _micro(u * WINDOW + k)
            with autograd.record():
                loss = LOSS(net(x), y)
            loss.backward()
            trainer.step(BATCH)
        norms.append(float(trainer.optimizer.last_grad_norm.asscalar()))
    return [p.data().asnumpy() for p in net.collect_params().values()], norms


@pytest.mark.parametrize('ours, theirs, args, max_norm', [
    ('lblamb', 'lamb', dict(learning_rate=0.01, wd=0.01), 0.5),
    ('lbsgd', 'sgd', dict(learning_rate=0.5, momentum=0.9, wd=1e-4), 0.5),
], ids=['lamb', 'sgd'])
def test_equals_the_gluonnlp_loop(ours, theirs, args, max_norm):
    mine, my_norms = _ours(ours, args, max_norm)
    ref, ref_norms = _gluonnlp_loop(theirs, args, max_norm)
    assert min(ref_norms) > max_norm               # the clip bites on every update
    np.testing.assert_allclose(my_norms, ref_norms, rtol=1e-5)
    for a, b in zip(mine, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- non-finite gradients ---------------------------------------------------------------

def _snapshot(trainer, net):
    """Weights, master copies and optimizer states (not the accumulators), as numpy."""
    updater, opt = trainer._updaters[0], trainer.optimizer
    out = []

    def walk(x):
        if isinstance(x, nd.NDArray):
            out.append(x.asnumpy().copy())
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
    for i, p in enumerate(net.collect_params().values()):
        out.append(p.data().asnumpy().copy())
        if i in updater.states:
            family, master, _ = opt.split_state(p.data(), updater.states[i])
            walk((family, master))
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_an_inf_in_one_micro_batch_skips_the_window_and_backs_off():
    """The BERT recipe: lblamb, float16 with master copies, a dynamic scaler, batch_scale=4,
    clip 1.0. An inf in the third micro-batch of the second window skips that window
    whole: weights, master copies and moments unchanged; the scale halves; the report
    names the parameter."""
    net = mlp(hidden=(32,), dtype='float16', seed=2)
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=10 ** 6)
    trainer = gluon.Trainer(net.collect_params(), 'lblamb', dict(
        learning_rate=0.01, wd=0.01, multi_precision=True, batch_scale=4,
        max_grad_norm=1.0, loss_scaler=scaler))
    poisoned = _param(net, 'dense0_weight')
    before = None
    for k in range(12):
        if k == 4:
            before = _snapshot(trainer, net)
        x, y = _micro(k)
        with autograd.record():
            loss = LOSS(net(x.astype('float16')), y) * scaler.scale
        loss.backward()
        if k == 6:
            poisoned.grad()[0, 0] = np.inf
        trainer.step(BATCH)
        if k == 7:
            assert trainer.optimizer.last_step_skipped
            _assert_same(_snapshot(trainer, net), before)
            report = trainer.optimizer.last_overflow
            assert report is not None and any('dense0_weight' in n for n in report.parameters)
            assert scaler.scale == 2.0 ** 9
    assert trainer.optimizer.applied_updates == 2
    assert not math.isnan(float(trainer.optimizer.last_grad_norm.asscalar()))


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
@pytest.mark.parametrize('opt, args', [('lbsgd', dict(momentum=0.9, lars=True)),
                                       ('lblamb', dict())], ids=['lars', 'lamb'])
def test_without_a_scaler_a_nonfinite_norm_writes_nothing(opt, args, fused):
    """No loss scaler: a NaN gradient never reaches a weight. The compiled kernels skip on
    the device (no host read); MXNet's operators read the norm and skip with a warning
    that names the parameter."""
    net = mlp(hidden=(32,), seed=3)
    trainer = gluon.Trainer(net.collect_params(), opt, dict(
        args, learning_rate=0.1, wd=1e-3, max_grad_norm=1.0, fused=fused))
    for k in range(3):
        x, y = _micro(k)
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        if k == 2:
            before = _snapshot(trainer, net)
            _param(net, 'dense1_bias').grad()[1] = np.nan
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            trainer.step(BATCH)
            after = _snapshot(trainer, net)
    _assert_same(after, before)
    assert math.isnan(float(trainer.optimizer.last_grad_norm.asscalar()))
    on_device = fused is None and mx_lbsgd.native_library() is not None
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if on_device:
        assert texts == []
    else:
        assert any('dense1_bias' in t for t in texts), texts
        assert trainer.optimizer.last_step_skipped


# -- the hook, for any optimizer ----------------------------------------------------------

def _hook_run(name, args, max_norm, poison=None, reference=False):
    net = mlp(hidden=(32,), seed=4)
    params = net.collect_params()
    params.setattr('grad_req', 'add')
    trainer = gluon.Trainer(params, name, args)
    scaling = None if reference else mx_lbsgd.LossScaling(
        trainer, mx_lbsgd.DynamicLossScaler(init_scale=8.0, growth_interval=10 ** 6),
        force=True, max_grad_norm=max_norm)
    norms = []
    for u in range(3):
        params.zero_grad()
        for k in range(WINDOW):
            x, y = _micro(u * WINDOW + k)
            with autograd.record():
                loss = LOSS(net(x), y)
                if scaling is not None:
                    loss = scaling.scale_loss(loss)
            loss.backward()
        if poison == u:
            _param(net, 'dense0_bias').grad()[0] = np.inf
        if reference:
            grads = [p.grad() for p in params.values()]
            for g in grads:
                g /= BATCH * WINDOW
            norms.append(gluon.utils.clip_global_norm(grads, max_norm))
            trainer.update(1)
        else:
            applied = scaling.step(BATCH * WINDOW)
            assert applied == (poison != u)
            norms.append(float(scaling.last_grad_norm.asscalar()))
    return [p.data().asnumpy() for p in params.values()], norms, scaling


@pytest.mark.parametrize('name, args', [('sgd', dict(learning_rate=0.5, momentum=0.9)),
                                        ('adam', dict(learning_rate=0.01)),
                                        ('lbsgd', dict(learning_rate=0.5, momentum=0.9))])
def test_the_hook_clips_the_window_of_any_optimizer(name, args):
    mine, my_norms, _ = _hook_run(name, args, 0.5)
    ref, ref_norms, _ = _hook_run(name, args, 0.5, reference=True)
    assert min(ref_norms) > 0.5
    np.testing.assert_allclose(my_norms, ref_norms, rtol=1e-5)
    for a, b in zip(mine, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_hook_skips_a_nonfinite_norm_and_backs_off():
    mine, norms, scaling = _hook_run('sgd', dict(learning_rate=0.5), 0.5, poison=1)
    assert math.isinf(norms[1]) and scaling.scaler.scale == 4.0
    assert any('dense0_bias' in n for n in scaling.overflow_history[-1].parameters)


def test_the_hook_refuses_double_clipping():
    net = mlp(hidden=(8,))
    for args in (dict(max_grad_norm=1.0), dict(batch_scale=2)):
        trainer = gluon.Trainer(net.collect_params(), 'lbsgd', args)
        with pytest.raises(ValueError, match='max_grad_norm'):
            mx_lbsgd.LossScaling(trainer, max_grad_norm=1.0)


# -- arguments and refusals --------------------------------------------------------------

@pytest.mark.parametrize('value, error', [(-1.0, ValueError), (float('nan'), ValueError),
                                          (float('inf'), ValueError), ('1', TypeError),
                                          (True, TypeError)])
@pytest.mark.parametrize('name', ['lbsgd', 'lssgd', 'lblamb', 'hook'])
def test_bad_max_grad_norm_names_the_parameter(name, value, error):
    with pytest.raises(error, match='max_grad_norm'):
        if name == 'hook':
            net = mlp(hidden=(8,))
            mx_lbsgd.LossScaling(gluon.Trainer(net.collect_params(), 'sgd'),
                                 max_grad_norm=value)
        else:
            mx.optimizer.create(name, max_grad_norm=value)


@pytest.mark.parametrize('value', [None, 0, 0.0])
def test_none_or_zero_is_off(value):
    opt = mx.optimizer.create('lblamb', max_grad_norm=value)
    assert opt.max_grad_norm is None and opt.last_grad_norm is None


def test_updates_on_the_kvstore_are_refused():
    net = mlp(hidden=(8,))
    net.collect_params().reset_ctx([mx.cpu(0), mx.cpu(1)])
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(max_grad_norm=1.0),
                            kvstore='device', update_on_kvstore=True)
    x, y = _micro(0)
    with autograd.record():
        losses = [LOSS(net(x.as_in_context(c)), y.as_in_context(c))
                  for c in (mx.cpu(0), mx.cpu(1))]
    autograd.backward(losses)
    with pytest.raises(ValueError, match='max_grad_norm cannot run with update_on_kvstore'):
        trainer.step(BATCH)
    with pytest.raises(ValueError, match='max_grad_norm'):
        pickle.dumps(mx.optimizer.create('lbsgd', max_grad_norm=1.0), protocol=0)


def test_pickling_keeps_clipping():
    opt = mx.optimizer.create('lblamb', max_grad_norm=2.0, batch_scale=2)
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.max_grad_norm == 2.0 and copy._pieces.clip is not None


# -- sparse gradients -----------------------------------------------------------------------

@pytest.mark.parametrize('batch_scale', [1, 2])
def test_row_sparse_gradients_are_clipped_with_the_rest(batch_scale):
    """An Embedding with sparse_grad=True and a dense layer: the norm covers the stored
    rows of the row_sparse gradient and the dense one; the lazy update moves only the
    rows present (numpy reference: lazy_sgd_rows / sgd_step on c * g)."""
    from reference import clip_coefficient, lazy_sgd_rows, sgd_step
    rng = np.random.RandomState(5)
    emb = gluon.Parameter('emb_weight', shape=(10, 4), grad_stype='row_sparse')
    dense = gluon.Parameter('fc_weight', shape=(3, 4))
    for p in (emb, dense):
        p.initialize(mx.init.Uniform(0.5), ctx=mx.cpu())
    w_emb, w_dense = emb.data().asnumpy().astype(np.float64), dense.data().asnumpy().astype(
        np.float64)
    m_emb, m_dense = np.zeros_like(w_emb), np.zeros_like(w_dense)
    trainer = gluon.Trainer([emb, dense], 'lbsgd', dict(
        learning_rate=0.1, momentum=0.9, warmup_epochs=0, batch_scale=batch_scale,
        max_grad_norm=0.3), update_on_kvstore=False)
    acc_emb, acc_dense, rows_seen = 0.0, 0.0, set()
    for k in range(2 * batch_scale):
        ids = nd.array(rng.choice(10, 3, replace=False))
        c_in = nd.array(rng.uniform(-1, 1, (3, 4)))
        with autograd.record():
            e = nd.Embedding(ids, emb.data(), input_dim=10, output_dim=4, sparse_grad=True)
            loss = (e * c_in).sum() + (nd.dot(e, dense.data().T) ** 2).sum()
        loss.backward()
        acc_emb = acc_emb + emb.grad().tostype('default').asnumpy().astype(np.float64)
        acc_dense = acc_dense + dense.grad().asnumpy().astype(np.float64)
        rows_seen |= set(emb.grad().indices.asnumpy().astype(int).tolist())
        trainer.step(1)
        if (k + 1) % batch_scale:
            continue
        g_emb, g_dense = acc_emb / batch_scale, acc_dense / batch_scale
        c = clip_coefficient([g_emb, g_dense], 1.0, 0.3)
        assert c < 0.9
        lr = 0.1 * batch_scale          # LBSGD's lr after its warmup
        w_emb, m_emb = lazy_sgd_rows(w_emb, m_emb, c * g_emb, sorted(rows_seen), lr, 0.0, 0.9)
        w_dense, m_dense = sgd_step(w_dense, c * g_dense, m_dense, lr, 0.0, 0.9, 1.0, None)
        acc_emb, acc_dense, rows_seen = 0.0, 0.0, set()
        np.testing.assert_allclose(float(trainer.optimizer.last_clip_coefficient.asscalar()),
                                   c, rtol=1e-5)
    np.testing.assert_allclose(emb.data().asnumpy(), w_emb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dense.data().asnumpy(), w_dense, rtol=1e-5, atol=1e-6)
