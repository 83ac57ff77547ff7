"""The fused (GPU) path never reads back to the host; forced here on CPU."""
import mxnet as mx
import pytest

import mx_lbsgd
from mx_lbsgd._syncs import count_host_syncs
from harness import NAMES, make_problem

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


CASES = [pytest.param(s, b, d, mp, id='%s-B%d-%s' % (s, b, d))
         for s in mx_lbsgd.WARMUP_STRATEGIES for b in (1, 4)
         for d, mp in (('float32', False), ('float16', True))]


@pytest.mark.parametrize('strategy, batch_scale, dtype, mp', CASES)
def test_fused_path_has_no_host_sync(strategy, batch_scale, dtype, mp):
    opt = mx_lbsgd.LBSGD(warmup_strategy=strategy, batch_scale=batch_scale, momentum=0.9,
                         multi_precision=mp, fused=True, warmup_epochs=1,
                         updates_per_epoch=8, param_idx2name=dict(enumerate(NAMES)))
    calls, _ = run_steps(opt, dtype, 20)
    assert calls == []
    assert opt.num_update == 20


def test_counter_sees_a_sync():
    with count_host_syncs() as calls:
        mx.nd.ones((2,)).asnumpy()
    assert calls == ['asnumpy']


def test_per_tensor_lars_reads_once_per_call():
    opt = mx_lbsgd.LBSGD(warmup_strategy='lars', fused=False,
                         param_idx2name=dict(enumerate(NAMES)))
    calls, _ = run_steps(opt, 'float32', 3)
    assert calls == ['asnumpy'] * 3
