"""'lblamb': MXNet's LAMB on the update pipeline. Against MXNet's own LAMB (the same update
at batch_scale=1), the numpy reference (every setting), and one big batch (accumulation)."""
import itertools

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from reference import lamb_step, warmup_lr
from harness import flag_read

pytestmark = [pytest.mark.unit, pytest.mark.fallback, pytest.mark.pipeline]

SHAPES = [(40, 30), (70000,), (7,), (3, 5)]          # big and small: both kernel paths
NAMES = ['enc0_weight', 'enc0_bias', 'ln_gamma', 'dec_weight']
DTYPES = {'fp32': ('float32', False), 'fp64': ('float64', False), 'fp16mp': ('float16', True)}
# MXNet's multi-tensor and per-tensor operators; None: the native operator when built (CI),
# else MXNet's operators routed by size
PATHS = {'fused': True, 'pertensor': False, 'routed': None}

# MXNet 1.9.1's test_lamb / test_multilamb grid: clip, rescale, wd, bias correction, bounds
GRID = [pytest.param(dict(dtype=d, clip_gradient=c, rescale_grad=r, wd=w, bias_correction=b,
                          lower_bound=lo, upper_bound=hi, fused=PATHS[p]),
                     id='%s-clip%s-rescale%s-wd%s-bc%d-lb%s-ub%s-%s' % (d, c, r, w, b, lo, hi, p))
        for d, c, r, w, b, (lo, hi), p in itertools.product(
            DTYPES, (None, 0.4), (1.0, 0.7), (0.0, 0.01), (True, False),
            ((None, None), (0.5, None), (None, 2.0), (1e-3, 1e3)), PATHS)]


def _problem(steps, dtype, seed=0):
    rng = np.random.RandomState(seed)
    weights = [rng.uniform(-1, 1, s).astype(dtype) for s in SHAPES]
    grads = [[rng.uniform(-1, 1, s).astype(dtype) for s in SHAPES] for _ in range(steps)]
    return weights, grads


def _run(opt, weights, grads, dtype):
    updater = mx.optimizer.get_updater(opt)
    w_nd = [nd.array(w, dtype=dtype) for w in weights]
    for step in grads:
        updater(list(range(len(w_nd))), [nd.array(g, dtype=dtype) for g in step], w_nd)
    return [w.asnumpy() for w in w_nd], updater


@pytest.mark.parametrize('case', GRID)
def test_equals_mxnet_lamb_and_the_reference(case):
    dtype, mp = DTYPES[case['dtype']]
    args = {k: v for k, v in case.items() if k not in ('dtype', 'fused')}
    args.update(learning_rate=0.01, multi_precision=mp)
    weights, grads = _problem(4, dtype)
    ours, updater = _run(mx.optimizer.create('lblamb', fused=case['fused'], **args), weights,
                         grads, dtype)
    theirs = mx.optimizer.LAMB(**args)
    if case['fused'] is False:
        theirs.aggregate_num = 1                   # MXNet's per-tensor phase1/phase2 path
    # same kernels: the same bits (MXNet's per-tensor fp16 path never updates its master
    # copy: test_mxnet_per_tensor_mp_lamb_keeps_its_master_copy)
    if case['fused'] is True or (case['fused'] is False and not mp):
        mxnet_w, _ = _run(theirs, weights, grads, dtype)
        for a, b in zip(ours, mxnet_w):
            np.testing.assert_array_equal(a, b)
    ref = [w.astype(np.float64) for w in weights]
    moments = [(np.zeros_like(w), np.zeros_like(w)) for w in ref]
    for t, step in enumerate(grads, start=1):
        for i, g in enumerate(step):
            ref[i], *moments[i] = lamb_step(
                ref[i], g, *moments[i], t=t, lr=0.01, wd=args['wd'],
                lower_bound=args['lower_bound'], upper_bound=args['upper_bound'],
                bias_correction=args['bias_correction'], rescale=args['rescale_grad'],
                clip=args['clip_gradient'])
    for i, (w, r) in enumerate(zip(ours, ref)):
        got = updater.states[i][0].asnumpy() if mp else w       # the fp32 master copy
        # fp64: MXNet's kernels take beta1, beta2, epsilon and lr as float32, and
        # multi_lamb_update sums the squares of the trust ratio's norms in float32
        exact = dtype == 'float64' and case['fused'] is False
        np.testing.assert_allclose(got, r, rtol=1e-6 if exact else 1e-4,
                                   atol=1e-7 if exact else 1e-5)


def _trainer_run(optimizer, args, steps, B=1, ctxs=(mx.cpu(),), kvstore=None, inject=(),
                 dtype='float32', first=0, weights=None, load=None, save=None):
    """Micro-batches `first` .. `first + steps - 1` (gradients drawn per micro-batch, so a
    resumed run sees the same ones), from `weights` (default: drawn) and states `load`."""
    rng = np.random.RandomState(0)
    params = [gluon.Parameter(n, shape=s, dtype=dtype) for n, s in zip(NAMES, SHAPES)]
    start = weights or [rng.uniform(-1, 1, s) for s in SHAPES]
    for p, w in zip(params, start):
        p.initialize(ctx=list(ctxs))
        p.set_data(nd.array(w).astype(dtype))
    trainer = gluon.Trainer(params, optimizer, args, kvstore=kvstore,
                            update_on_kvstore=False if kvstore else None)
    if load:
        trainer.load_states(load)
    micro = []
    scaler = getattr(trainer.optimizer, 'loss_scaler', None)
    for step in range(first, first + steps):
        draw = np.random.RandomState(1000 + step)
        per_dev = [[draw.uniform(-1, 1, s) for s in SHAPES] for _ in ctxs]
        scale = scaler.scale if scaler is not None else 1.0
        with autograd.record():
            losses = [nd.add_n(*[(p.data(c).astype('float32') * nd.array(g, ctx=c)).sum()
                                 for p, g in zip(params, gs)]) * scale
                      for c, gs in zip(ctxs, per_dev)]
        autograd.backward(losses)
        if step in inject:
            params[0].list_grad()[-1][:] = np.inf
        micro.append([sum(gs[i] for gs in per_dev) for i in range(len(params))])
        trainer.step(8)
    if save:
        trainer.save_states(save)
    return params, start, micro, trainer


@pytest.mark.parametrize('direction', [pytest.param(('lamb', 'lblamb'), id='mxnet-to-ours'),
                                       pytest.param(('lblamb', 'lamb'), id='ours-to-mxnet')])
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_trainer_states_move_both_ways_with_mxnet_lamb(tmp_path, direction, dtype):
    args = dict(learning_rate=0.01, wd=0.01, multi_precision=dtype == 'float16')
    path = str(tmp_path / 'lamb.states')
    whole, _, _, _ = _trainer_run(direction[0], args, 6, dtype=dtype)
    half, _, _, _ = _trainer_run(direction[0], args, 3, dtype=dtype, save=path)
    resumed, _, _, trainer = _trainer_run(
        direction[1], args, 3, dtype=dtype, first=3, load=path,
        weights=[p.data().asnumpy() for p in half])
    assert trainer.optimizer.num_update == 6
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a.data().asnumpy(), b.data().asnumpy())


def _reference(start, micro, B, rescale, skip_windows=(), exclude=(), lr=0.01, wd=0.01):
    """LAMB on the window means: one big batch per update."""
    w = [np.array(x, dtype=np.float64) for x in start]
    moments = [(np.zeros_like(x), np.zeros_like(x)) for x in w]
    t = 0
    for k in range(0, len(micro) - len(micro) % B, B):
        if k // B in skip_windows:
            continue
        t += 1
        for i in range(len(w)):
            g = sum(m[i] for m in micro[k:k + B]) / B
            w[i], *moments[i] = lamb_step(w[i], g, *moments[i], t=t, lr=lr, wd=wd,
                                          rescale=rescale, ratio=not NAMES[i].endswith(exclude))
    return w


@pytest.mark.parametrize('ctxs, kvstore', [
    pytest.param((mx.cpu(),), None, id='1dev'),
    pytest.param((mx.cpu(0), mx.cpu(1)), 'device', id='2dev-device')])
@pytest.mark.parametrize('B', [1, 4])
@pytest.mark.parametrize('fused', [True, False, None], ids=['multi', 'pertensor', 'default'])
def test_accumulation_is_one_big_batch(ctxs, kvstore, B, fused):
    args = dict(learning_rate=0.01, wd=0.01, batch_scale=B, fused=fused)
    params, start, micro, trainer = _trainer_run('lblamb', args, 12, B, ctxs, kvstore)
    ref = _reference(start, micro, B, rescale=1 / 8.)
    for p, r in zip(params, ref):
        for d in p.list_data():
            np.testing.assert_allclose(d.asnumpy(), r, rtol=1e-4, atol=1e-5)
    assert trainer.optimizer.num_update == 12 // B          # applied updates
    assert trainer.optimizer.applied_updates == 12 // B


def test_a_window_with_an_overflow_is_skipped_whole():
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 4, growth_interval=100)
    args = dict(learning_rate=0.01, wd=0.01, batch_scale=4, loss_scaler=scaler)
    with count_host_syncs(include_waitall=False) as syncs:
        params, start, micro, trainer = _trainer_run(
            'lblamb', args, 12, 4, (mx.cpu(0), mx.cpu(1)), 'device', inject={5})
    assert scaler.total_steps == 3 and scaler.total_skipped == 1
    assert trainer.optimizer.num_update == 2                 # t of the next update: 3
    ref = _reference(start, micro, 4, rescale=1 / 8., skip_windows={1})
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.data(mx.cpu(1)).asnumpy(), r, rtol=1e-4, atol=1e-5)
    assert syncs.count(flag_read()) == 3                     # one host read per window


@pytest.mark.parametrize('exclude, suffixes', [
    pytest.param(True, ('bias', 'gamma', 'beta'), id='bert'),
    pytest.param(['_weight'], ('_weight',), id='suffixes')])
@pytest.mark.parametrize('fused', [True, None], ids=['multi', 'default'])
def test_trust_ratio_exclusions_by_name(exclude, suffixes, fused):
    args = dict(learning_rate=0.01, wd=0.01, trust_exclude=exclude, fused=fused)
    params, start, micro, _ = _trainer_run('lblamb', args, 3)
    ref = _reference(start, micro, 1, rescale=1 / 8., exclude=suffixes)
    plain = _reference(start, micro, 1, rescale=1 / 8.)
    for i, (p, r) in enumerate(zip(params, ref)):
        np.testing.assert_allclose(p.data().asnumpy(), r, rtol=1e-4, atol=1e-5)
        assert NAMES[i].endswith(suffixes) != np.allclose(r, plain[i], rtol=1e-4)


def test_mxnet_per_tensor_mp_lamb_keeps_its_master_copy():
    """The MXNet 1.9.1 defect that `_single_tensor_lamb` avoids: mp_lamb_update_phase2 writes
    the fp16 weight but not the fp32 master copy, which stays at the initial weights."""
    weights, grads = _problem(3, 'float16')
    theirs = mx.optimizer.LAMB(learning_rate=0.01, multi_precision=True)
    theirs.aggregate_num = 1
    _, updater = _run(theirs, weights, grads, 'float16')
    np.testing.assert_array_equal(updater.states[0][0].asnumpy(),
                                  weights[0].astype(np.float32))
    _, ours = _run(mx_lbsgd.LAMB(learning_rate=0.01, multi_precision=True, fused=False),
                   weights, grads, 'float16')
    assert not np.array_equal(ours.states[0][0].asnumpy(), weights[0].astype(np.float32))


def test_lr_scheduler_counts_applied_updates():
    """BERT's schedule: linear warmup, then linear decay (WarmupScheduler, power 1)."""
    sched = mx_lbsgd.WarmupScheduler(base_lr=0.01, warmup_steps=3, decay='poly', power=1,
                                     max_update=8)
    # (MXNet's Optimizer sets the scheduler's base_lr to learning_rate)
    args = dict(learning_rate=0.01, lr_scheduler=sched, wd=0.0, batch_scale=2)
    _, _, _, trainer = _trainer_run('lblamb', args, 10, 2)
    opt = trainer.optimizer
    assert opt.num_update == 5
    assert opt.learning_rate == pytest.approx(warmup_lr(5, 0.01, 3, 'linear', decay='poly',
                                                        max_update=8, power=1))
    assert [sched(t) for t in (1, 3, 8)] == pytest.approx([0.01 / 3, 0.01, 0.0])


def test_sparse_gradients_are_refused_by_name():
    emb = gluon.nn.Embedding(10, 4, sparse_grad=True)
    emb.initialize()
    trainer = gluon.Trainer(emb.collect_params(), 'lblamb', kvstore=None)
    with autograd.record():
        loss = emb(nd.array([1, 2])).sum()
    loss.backward()
    before = emb.weight.data().asnumpy()
    with pytest.raises(ValueError, match=r"LAMB has no sparse update.*'embedding\d*_weight'"):
        trainer.step(1)
    np.testing.assert_array_equal(emb.weight.data().asnumpy(), before)


@pytest.mark.parametrize('name, value, message', [
    pytest.param('beta1', 1.0, r'beta1 must be in \[0.0, 1.0\)', id='beta1'),
    pytest.param('epsilon', 0.0, r'epsilon must be in \(0.0', id='epsilon'),
    pytest.param('batch_scale', 0, 'batch_scale must be an integer >= 1', id='batch_scale'),
    pytest.param('trust_exclude', 3, 'trust_exclude must be None, True', id='exclude')])
def test_bad_arguments_name_the_parameter(name, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        mx_lbsgd.LAMB(**{name: value})


def test_registered_names():
    assert isinstance(mx.optimizer.create('lblamb'), mx_lbsgd.LAMB)
    assert type(mx.optimizer.create('lamb')) is mx.optimizer.LAMB     # MXNet's stays MXNet's
