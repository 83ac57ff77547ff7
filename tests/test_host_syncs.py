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
