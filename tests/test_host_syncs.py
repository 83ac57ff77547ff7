"""No kernel path reads back to the host: fused (the GPU default), per-tensor and routed."""
import mxnet as mx
import pytest

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from harness import NAMES, make_problem

pytestmark = [pytest.mark.unit, pytest.mark.pipeline]

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
        assert calls == ['asscalar'] * 8
    elif native:
        assert calls == []
    else:
        assert calls == ['asscalar'] * (8 // batch_scale)
    assert float(optimizer.last_clip_coefficient.asscalar()) < 1.0     # it clipped
