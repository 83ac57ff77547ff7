"""Horovod (gloo, CPU) as an engine: real 2-process jobs started by horovodrun.

Equivalence: 2 workers of batch b give the weights of one process of batch 2b; reductions
are counted (horovod allreduce calls per step).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

pytest.importorskip('horovod.mxnet')

from harness import horovodrun  # noqa: E402
import dist_worker  # noqa: E402
from test_kvstore import (CLIP, SCALED, WARMUP, assert_same, check_norms, config,  # noqa: E402
                          reference)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dist_worker.py')
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')


def run_job(cfg, tmp_path, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.environ.get('PYTHONPATH')])))
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, WORKER, json.dumps(cfg), str(tmp_path)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=timeout, env=env)
    return proc.returncode, proc.stdout


def results(tmp_path):
    ranks = [np.load(str(tmp_path / ('rank%d.npz' % r))) for r in range(2)]
    for name in ranks[0].files:                  # every worker holds the same weights
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
    saved = ranks[0]
    return ({k: saved[k] for k in saved.files if k not in ('record', 'comm', 'norms')},
            saved['record'], list(saved['comm']))


def hvd(api, optimizer, params, **extra):
    return config(api, optimizer, params, kvstore='horovod', **extra)


def window(B, steps, n=4):
    return [n if (s + 1) % B == 0 else 0 for s in range(steps)]


EQUIVALENT = [
    pytest.param(hvd('gluon', 'lbsgd', dict(warmup_strategy=s, batch_scale=B, **WARMUP),
                     steps=8), window(B, 8), id='gluon-%s-B%d' % (s, B))
    for s, B in (('linear', 4), ('power2', 2), ('sqrt', 1), ('lars', 4))
] + [
    pytest.param(hvd('gluon', 'lssgd', SCALED, inject={'2': 1}), window(1, 5),
                 id='gluon-lssgd-inf-on-one-worker'),
    pytest.param(hvd('gluon', 'lbsgd', dict(SCALED, warmup_strategy='linear', batch_scale=4,
                                            **WARMUP), steps=8, inject={'1': 1}),
                 window(4, 8), id='gluon-lbsgd-scaled-B4-inf-mid-window'),
    pytest.param(hvd('gluon', 'lblamb', dict(learning_rate=0.01, batch_scale=4), steps=8),
                 window(4, 8), id='gluon-lblamb-B4'),
    pytest.param(hvd('gluon', 'lblamb', dict(SCALED, learning_rate=0.01, batch_scale=4),
                     steps=8, inject={'1': 1}),
                 window(4, 8), id='gluon-lblamb-scaled-B4-inf-mid-window'),
    pytest.param(hvd('gluon', 'sgd', {}, hook=SCALED['loss_scaler'], inject={'2': 0}),
                 window(1, 5), id='gluon-hook-inf-on-one-worker'),
    pytest.param(hvd('module', 'lbsgd', dict(warmup_strategy='lars'), names=True),
                 window(1, 5), id='module-distopt-lars-with-names'),
    pytest.param(hvd('module', 'lbsgd', dict(warmup_strategy='linear', batch_scale=2,
                                             **WARMUP), steps=6),
                 window(1, 6), id='module-distopt-linear-B2-reduces-every-micro-batch'),
]


@pytest.mark.parametrize('cfg, comm', EQUIVALENT)
def test_two_workers_equal_one_process(tmp_path, cfg, comm):
    code, log = run_job(cfg, tmp_path)
    assert code == 0, log
    weights, record, got_comm = results(tmp_path)
    ref_weights, ref_record, _ = reference(cfg, 2)
    if cfg.get('hook'):
        ref_record = [(s, k) for s, k in ref_record]
    assert_same(weights, record, ref_weights, ref_record, rtol=1e-3, atol=1e-4)
    assert got_comm == comm
    if cfg.get('inject'):
        assert record[:, 1].sum() == len(cfg['inject'])      # skipped on every worker


@pytest.mark.parametrize('cfg, comm', [
    pytest.param(hvd('gluon', 'lblamb', dict(SCALED, learning_rate=0.01, batch_scale=4,
                                             max_grad_norm=CLIP), steps=12, inject={'5': 1}),
                 window(4, 12), id='gluon-lblamb-scaled-B4-clip-inf-mid-window'),
    pytest.param(hvd('gluon', 'sgd', {}, hook=SCALED['loss_scaler'], hook_clip=CLIP,
                     inject={'2': 0}), window(1, 5), id='gluon-hook-clip-inf-on-one-worker'),
])
def test_clipping_two_workers(tmp_path, cfg, comm):
    """The BERT recipe's clipping under Horovod: the norm of the allreduced gradient, the
    same on both ranks, with no allreduce of its own; an inf on one rank skips everywhere."""
    code, log = run_job(cfg, tmp_path)
    assert code == 0, log
    weights, record, got_comm = results(tmp_path)
    ranks_norms = [np.load(str(tmp_path / ('rank%d.npz' % r)))['norms'] for r in range(2)]
    ref_weights, ref_record, _ = reference(cfg, 2)
    check_norms(ranks_norms, list(dist_worker.NORMS), cfg)
    assert_same(weights, record, ref_weights, ref_record, rtol=1e-3, atol=1e-4)
    assert got_comm == comm
    assert record[:, 1].sum() == len(cfg['inject'])      # skipped on every worker


MULTS = [
    pytest.param(hvd('module', 'lbsgd', dict(warmup_strategy='lars', **WARMUP), names=True,
                     mults={'lr': {'fc1_bias': 0.0, 'fc2_weight': 0.5},
                            'wd': {'fc1_weight': 20.0, 'fc2_bias': 1.0}}),
                 'fc1_bias', id='module-distopt-lars'),
    pytest.param(hvd('gluon', 'lbsgd', dict(warmup_strategy='linear', batch_scale=2, **WARMUP),
                     steps=6, mults={'lr': {'dense0_bias': 0.0, 'dense1_weight': 0.5},
                                     'wd': {'dense0_weight': 20.0}}),
                 'dense0_bias', id='gluon-trainer-linear-B2'),
]


@pytest.mark.parametrize('cfg, frozen', MULTS)
def test_lr_and_wd_mults_reach_the_wrapped_optimizer(tmp_path, cfg, frozen):
    """lr_mult / wd_mult set through horovod's wrappers act as in one process; lr_mult 0
    freezes a parameter (biases start at 0 and stay there)."""
    code, log = run_job(cfg, tmp_path)
    assert code == 0, log
    weights, record, _ = results(tmp_path)
    ref_weights, ref_record, _ = reference(cfg, 2)
    plain_weights, _, _ = reference(dict(cfg, mults={}), 2)
    assert_same(weights, record, ref_weights, ref_record, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(weights[frozen], 0)
    assert np.abs(plain_weights[frozen]).max() > 1e-3       # it would have moved
    for name in ref_weights:                                  # every mult changed something
        if name != frozen and name in str(cfg['mults']):
            assert np.abs(weights[name] - plain_weights[name]).max() > 1e-5, name


def test_module_lars_without_names_is_refused(tmp_path):
    """horovod's DistributedOptimizer keeps the names Module gives it to itself: LARS
    cannot know the excluded layers, and says what to pass instead of scaling biases."""
    code, log = run_job(hvd('module', 'lbsgd', dict(warmup_strategy='lars')), tmp_path)
    assert code != 0
    assert 'param_idx2name' in log and 'ValueError' in log, log


def test_fp16_compression_overflow_is_skipped_everywhere(tmp_path):
    """A gradient of 1e5 is finite in fp32 but inf after hvd.Compression.fp16: the
    allreduce result overflows and every rank skips that step and backs off."""
    cfg = hvd('gluon', 'lssgd', SCALED, compression='fp16', inject={'2': 1},
              inject_value=1e5)
    code, log = run_job(cfg, tmp_path)
    assert code == 0, log
    weights, record, _ = results(tmp_path)
    assert list(record[:, 1]) == [0, 0, 1, 0, 0]
    assert record[2, 0] == record[1, 0] / 2
    assert all(np.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize('at, per_rank', [pytest.param(4, False, id='rank0-window-boundary'),
                                          pytest.param(5, True, id='every-rank-mid-window')])
def test_resume_bit_for_bit(tmp_path, at, per_rank):
    base = hvd('gluon', 'lbsgd', dict(SCALED, warmup_strategy='linear', batch_scale=4,
                                      **WARMUP), steps=10)
    straight = tmp_path / 'straight'
    resumed = tmp_path / 'resumed'
    straight.mkdir()
    resumed.mkdir()
    assert run_job(base, straight)[0] == 0
    code, log = run_job(dict(base, resume=dict(at=at, per_rank=per_rank)), resumed)
    assert code == 0, log
    a, b = results(straight), results(resumed)
    for name in a[0]:
        np.testing.assert_array_equal(a[0][name], b[0][name])
    np.testing.assert_array_equal(a[1], b[1])


def test_mx_lbsgd_train_under_horovodrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.environ.get('PYTHONPATH')])))
    out = tmp_path / 'run'
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, '-m', 'mx_lbsgd_demo', 'train', '--kvstore', 'horovod',
                       '--epochs', '3', '--batch-scale', '2', '--out', str(out)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=180, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['final_test_acc'] > 0.5 and summary['num_workers'] == 2
    assert '[1]<stdout>:wrote' not in proc.stdout          # only rank 0 writes
