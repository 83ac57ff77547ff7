"""No kernel path reads back to the host: fused (the GPU default), per-tensor and routed."""
import mxnet as mx
import pytest

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from harness import NAMES, flag_read, make_problem

pytestmark = [pytest.mark.unit, pytest.mark.pipeline, pytest.mark.fallback]

def run_steps(opt, dtype, steps):
    weights, grads = make_problem(steps)
    updater = mx.optimizer.get_updater(opt)
    w_nd = [mx.nd.array(w, dtype=dtype) for w in weights]
    g_steps = [[mx.nd.array(g, dtype=dtype) for g in step] for step in grads]
    mx.nd.waitall()
    with count_host_syncs() as calls:
        for g_nd in g_steps:
            updater(list(range(len(w_nd))), g_nd, w_nd)
    mx.nd.waitall()
    return calls, w_nd


CASES = [pytest.param(s, b, d, mp, f, id='%s-B%d-%s-%s' % (s, b, d, f))
         for s in mx_lbsgd.WARMUP_STRATEGIES for b in (1, 4)
         for d, mp in (('float32', False), ('float16', True)) for f in (True, False, None)]


@pytest.mark.parametrize('strategy, batch_scale, dtype, mp, fused', CASES)
def test_no_host_sync_in_20_steps(strategy, batch_scale, dtype, mp, fused):
    opt = mx_lbsgd.LBSGD(warmup_strategy=strategy, batch_scale=batch_scale, momentum=0.9,
                         multi_precision=mp, fused=fused, warmup_epochs=1,
                         updates_per_epoch=8, param_idx2name=dict(enumerate(NAMES)),
                         lars_min=0.1, lars_max=10.0)
    calls, _ = run_steps(opt, dtype, 20)
    assert calls == []
    assert opt.num_update == 20


def test_counter_sees_a_sync():
    with count_host_syncs() as calls:
        mx.nd.ones((2,)).asnumpy()
    assert calls == ['asnumpy']


CLIP_CASES = [pytest.param(o, b, d, mp, f, s, id='%s-B%d-%s-%s-%s' % (o, b, d, f, s))
              for o in ('lbsgd', 'lars', 'lblamb') for b in (1, 4)
              for d, mp in (('float32', False), ('float16', True)) for f in (True, False, None)
              for s in ('plain', 'scaled')]


@pytest.mark.parametrize('opt, batch_scale, dtype, mp, fused, scaling', CLIP_CASES)
def test_clipping_keeps_the_host_syncs(opt, batch_scale, dtype, mp, fused, scaling):
    """max_grad_norm through a bare Updater (the step assembled by the gate): a
    loss-scaled step reads one value, whose sum-of-squares pass is also the norm; a plain
    step reads nothing on the native kernels, which skip a non-finite norm on the device,
    and one value (the norm) on MXNet's operators, which cannot."""
    args = dict(batch_scale=batch_scale, multi_precision=mp, fused=fused, max_grad_norm=0.01,
                param_idx2name=dict(enumerate(NAMES)))
    if scaling == 'scaled':
        args['loss_scaler'] = mx_lbsgd.DynamicLossScaler(init_scale=1.0)
    if opt == 'lblamb':
        optimizer = mx_lbsgd.LAMB(**args)
    else:
        optimizer = mx_lbsgd.LBSGD(momentum=0.9, lars=opt == 'lars', **args)
    calls, _ = run_steps(optimizer, dtype, 8)
    native = fused is None and mx_lbsgd.native_library() is not None
    if scaling == 'scaled':
        # the window's decision reads the norm (B = 1: the norm is the finite check)
        assert calls == (['asscalar'] if batch_scale == 1 else [flag_read(fused)]) * 8
    elif native:
        assert calls == []
    else:
        assert calls == ['asscalar'] * (8 // batch_scale)
    assert float(optimizer.last_clip_coefficient.asscalar()) < 1.0     # it clipped


@pytest.mark.parametrize('scaled', [False, True], ids=['plain', 'scaled'])
@pytest.mark.parametrize('batch_scale', [1, 4, 'auto'])
def test_lr_scaling_reads_once_per_update(batch_scale, scaled):
    """lr_scaling='adascale' under a Trainer (at S = 1 with the difference estimator), and
    batch_scale='auto' whose choice rides on the same values: one host read per applied
    update, which is the loss scaler's flag read when there is one."""
    from mxnet import autograd, gluon
    net = gluon.nn.HybridSequential()
    for _ in range(3):
        net.add(gluon.nn.Dense(8, in_units=8, activation='relu'))
    net.initialize(mx.init.Xavier())
    args = dict(learning_rate=0.01, warmup_epochs=0, lr_scaling='adascale',
                batch_scale=batch_scale)
    if batch_scale == 'auto':
        args.update(batch_scale_bounds=(1, 8), batch_scale_interval=2)
    if scaled:
        args['loss_scaler'] = mx_lbsgd.DynamicLossScaler(init_scale=1.0)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', args)
    opt = trainer.optimizer
    x = mx.nd.random.normal(shape=(4, 8))

    def step():
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(4)
    for _ in range(24):
        step()
    before = opt.applied_updates
    with count_host_syncs(include_waitall=False) as calls:
        for _ in range(40):
            step()
    assert opt.applied_updates > before
    assert len(calls) == opt.applied_updates - before
