"""`mx_lbsgd.ShardedTrainer`'s even slices at 2, 3 and 4 ranks (horovodrun, gloo, loopback)
against ``hvd.DistributedTrainer`` with the same optimizer, after 10 updates:

- ``'lblamb'`` with BERT's exclusions (``trust_exclude``), ``max_grad_norm``, a loss scaler
  with an inf on rank 1 in update 3, and ``batch_scale=2``;
- ``'lbsgd'`` with LARS and linear warmup; ``'lbsgd'`` with ``nesterov=True``;
- float16 weights with fp32 master copies (``'lblamb'``, ``multi_precision``).

The model is the digits MLP times a one-element scale (``tiny``): ``dense0_weight`` holds
85% of the elements and crosses every slice boundary at each size, and ``tiny_scale`` has
fewer elements than ranks. The float32 weights agree within 1e-6; each rank holds at most
1.05x an even split of the optimizer state plus 8 KB; the exchange sends at most 1.05x a
ring allreduce of the gradients. Float16 weights are the same bits at 2 ranks (with the
native operators; within 1e-3 on MXNet's own); at 3 and 4
the order of the float16 gradient sums makes even ``hvd.DistributedTrainer`` differ from
itself run to run, so they are compared within 5e-3 (at most 1% of the weights beyond
1e-3).
"""
import os

import numpy as np
import pytest

from test_kvstore import CLIP, SCALED, WARMUP
from test_sharded import hvd, load, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

pytest.importorskip('horovod.mxnet')

CONFIGS = {
    'lamb-bert-clip-inf-B2': hvd('lblamb', dict(SCALED, learning_rate=0.01, batch_scale=2,
                                               max_grad_norm=CLIP, trust_exclude=True),
                                 steps=20, inject={'4': 1}),
    'lars-warmup': hvd('lbsgd', dict(learning_rate=0.5, momentum=0.9, lars=True,
                                     warmup_strategy='linear', **WARMUP), steps=10),
    'nesterov': hvd('lbsgd', dict(learning_rate=0.1, momentum=0.9, nesterov=True,
                                  wd=1e-4), steps=10),
    'fp16-master': hvd('lblamb', dict(SCALED, learning_rate=0.01, multi_precision=True),
                       steps=10, dtype='float16'),
}


#: float16 weights and a float32 tensor of 20 elements, which at 3 ranks is split over
#: ranks 0 and 1 while rank 2 holds no float32 element: rank 2 takes part in the float32
#: norms' collective with zeros (`SliceNorms.nothing`)
MIXED = hvd('lblamb', dict(SCALED, learning_rate=0.01, multi_precision=True), steps=10,
            dtype='float16', tiny_size=20, tiny_dtype='float32')


def _native_operators():
    from mx_lbsgd import _native
    return os.environ.get('MX_LBSGD_NATIVE') != '0' and _native.ops() is not None


@pytest.mark.parametrize('ranks, name', [(r, n) for n in CONFIGS for r in (2, 3, 4)]
                         + [(3, 'mixed-dtypes')])
def test_even_slices_equal_the_distributed_trainer(tmp_path, name, ranks):
    if ranks > 2 and os.environ.get('MX_LBSGD_NATIVE') == '0':
        pytest.skip('the 3- and 4-rank jobs run once, with the native operators (CI runs '
                    'the Horovod jobs twice); at 2 ranks they run on MXNet\'s own too')
    base = MIXED if name == 'mixed-dtypes' else CONFIGS[name]
    cfg = dict(base, tiny=True, batch=16 if ranks < 4 else 8)
    code, log = run_job(dict(cfg, sharded=True), tmp_path / 'sharded', ranks, timeout=300)
    assert code == 0, log
    code, log = run_job(dict(cfg, memory=True), tmp_path / 'plain', ranks, timeout=300)
    assert code == 0, log
    weights, record, norms, info = load(tmp_path / 'sharded', ranks)
    ref_weights, ref_record, ref_norms, ref_info = load(tmp_path / 'plain', ranks)
    fp16 = cfg.get('dtype') == 'float16'
    for key, w in ref_weights.items():
        if fp16 and ranks > 2:
            # float16 gradients summed over 3+ ranks depend on the order of the sums:
            # hvd.DistributedTrainer's own weights differ from run to run (its fusion
            # varies; measured after 10 updates at 4 ranks: up to 2.4e-4 between two of
            # its runs), while the sharded runs repeat bit for bit
            far = np.abs(weights[key].astype(np.float64) - w.astype(np.float64)) > 1e-3
            assert far.mean() <= 0.01, (key, far.sum())
            np.testing.assert_allclose(weights[key], w, rtol=0, atol=5e-3, err_msg=key)
            continue
        # float16 at 2 ranks: the same bits with the native operators, which sum every
        # norm in double on both sides; MXNet's own multi-tensor LAMB sums the unsplit
        # tensors' norms in float32, and a master copy's last bit may round differently
        tolerance = (0, 0) if fp16 and _native_operators() else \
            (1e-3, 1e-3) if fp16 else (1e-6, 1e-7)
        np.testing.assert_allclose(weights[key], w, rtol=tolerance[0], atol=tolerance[1],
                                   err_msg=key)
    np.testing.assert_array_equal(record, ref_record)        # scales and skips
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    if cfg.get('inject'):
        assert record[:, 1].tolist().index(1) == 5 and record[:, 1].sum() == 1   # update 3
    holders = {n.split('_', 1)[1]: r for n, r in info[0]['partition'].items()}
    assert holders['dense0_weight'] == list(range(ranks))    # crosses every boundary
    assert holders['scale'] == ([0, 1] if cfg.get('tiny_size') else [holders['scale'][0]])
    unsharded = ref_info[0]['state_bytes'][0]
    assert sum(i['state_bytes'][0] for i in info) == unsharded
    for r in range(ranks):
        assert info[r]['state_bytes'][0] <= 1.05 * unsharded / ranks + 8192
        exchange = info[r]['exchange']
        assert exchange['reduce'] + exchange['gather'] <= 1.05 * exchange['ring_allreduce']
