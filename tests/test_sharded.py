"""`mx_lbsgd.ShardedTrainer` (optimizer state sharded over Horovod ranks): real horovodrun
jobs on loopback.

- Equivalence: the final weights equal horovod's DistributedTrainer with the same optimizer
  to 1e-6 relative (fp32), with accumulation, fp16 master weights, LARS and LAMB trust
  ratios, an inf on one rank (skipped everywhere, the scale backs off) and clipping; the
  state a rank holds is at most its share.
- Checkpoints: one consolidated file that resumes 2 -> 1, 1 -> 2 and 2 -> 4 ranks to the
  uninterrupted run's weights; a save inside a window is refused.
- Errors: no hvd.init(), parameters that differ across ranks, sparse gradients, a states
  file of another model.
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
from test_kvstore import CLIP, SCALED, WARMUP, config  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dist_worker.py')
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
NOT_WEIGHTS = ('record', 'comm', 'norms')


def run_job(cfg, folder, ranks=2, timeout=180):
    os.makedirs(str(folder), exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.environ.get('PYTHONPATH')])))
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', str(ranks), '-H', 'localhost:%d' % ranks,
                       sys.executable, WORKER, json.dumps(cfg), str(folder)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=timeout, env=env)
    return proc.returncode, proc.stdout


def load(folder, ranks=2):
    """(weights, record, norms) of rank 0, after checking every rank holds the same, and
    every rank's info.json (sharded runs)."""
    saved = [np.load(str(folder / ('rank%d.npz' % r))) for r in range(ranks)]
    for name in saved[0].files:
        for other in saved[1:]:
            np.testing.assert_array_equal(saved[0][name], other[name], err_msg=name)
    info = []
    for r in range(ranks):
        path = folder / ('rank%d.info.json' % r)
        info.append(json.loads(path.read_text()) if path.exists() else None)
    weights = {k: saved[0][k] for k in saved[0].files if k not in NOT_WEIGHTS}
    return weights, saved[0]['record'], saved[0]['norms'], info


def hvd(optimizer, params, **extra):
    return config('gluon', optimizer, params, kvstore='horovod', **extra)


EQUIVALENT = [
    pytest.param(hvd('lbsgd', dict(warmup_strategy='linear', batch_scale=4, **WARMUP),
                     steps=8), id='lbsgd-B4'),
    pytest.param(hvd('lbsgd', dict(warmup_strategy='lars', max_grad_norm=CLIP), steps=5),
                 id='lars-clip'),
    pytest.param(hvd('lblamb', dict(learning_rate=0.01, batch_scale=4, trust_exclude=True),
                     steps=8), id='lamb-B4'),
    pytest.param(hvd('lblamb', dict(SCALED, learning_rate=0.01, batch_scale=4,
                                    max_grad_norm=CLIP), steps=12, inject={'5': 1}),
                 id='lamb-scaled-B4-clip-inf-mid-window'),
    pytest.param(hvd('lblamb', dict(SCALED, learning_rate=0.01, batch_scale=2,
                                    multi_precision=True), steps=6, dtype='float16'),
                 id='lamb-fp16-master-B2'),
    pytest.param(hvd('lssgd', dict(SCALED, multi_precision=True), steps=5, dtype='float16',
                     inject={'2': 0}, reports=True, split_step=True),
                 id='lssgd-fp16-master-inf-reports-split-step'),
]


@pytest.mark.parametrize('cfg', EQUIVALENT)
def test_sharded_equals_distributed_trainer(tmp_path, cfg):
    code, log = run_job(dict(cfg, sharded=True), tmp_path / 'sharded')
    assert code == 0, log
    code, log = run_job(dict(cfg, memory=True), tmp_path / 'plain')
    assert code == 0, log
    weights, record, norms, info = load(tmp_path / 'sharded')
    ref_weights, ref_record, ref_norms, ref_info = load(tmp_path / 'plain')
    fp16 = cfg.get('dtype') == 'float16'
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-3 if fp16 else 1e-6,
                                   atol=1e-3 if fp16 else 1e-7, err_msg=name)
    np.testing.assert_array_equal(record, ref_record)        # scales and skips
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    if cfg.get('inject'):
        assert record[:, 1].sum() == len(cfg['inject'])
    # every rank holds pieces; each holds the state of its slice: an even split
    holders = info[0]['partition']
    assert sorted({r for ranks in holders.values() for r in ranks}) == [0, 1]
    unsharded = ref_info[0]['state_bytes'][0]
    for r in range(2):
        assert info[r]['state_bytes'][0] <= 1.05 * unsharded / 2 + 8192
    assert sum(i['state_bytes'][0] for i in info) == unsharded
    if cfg.get('reports'):       # the overflowing parameter is named
        reports = [[r for r in json.loads((tmp_path / 'sharded' / ('rank%d.reports.json' % k))
                                          .read_text()) if r] for k in range(2)]
        named = {n for rank in reports for r in rank for n in r['parameters']}
        assert named == {n for n in holders if n.endswith('dense0_bias')}
    exchange = info[0]['exchange']
    # a reduce-scatter and an allgather: one ring allreduce's bytes, less the padding
    assert exchange['reduce'] + exchange['gather'] <= 1.05 * exchange['ring_allreduce']


def test_four_ranks(tmp_path):
    cfg = hvd('lblamb', dict(SCALED, learning_rate=0.01, batch_scale=2, max_grad_norm=CLIP),
              steps=6, batch=8, inject={'3': 2})
    code, log = run_job(dict(cfg, sharded=True), tmp_path / 'sharded', ranks=4, timeout=300)
    assert code == 0, log
    code, log = run_job(cfg, tmp_path / 'plain', ranks=4, timeout=300)
    assert code == 0, log
    weights, record, norms, info = load(tmp_path / 'sharded', 4)
    ref_weights, ref_record, ref_norms, _ = load(tmp_path / 'plain', 4)
    for name, w in ref_weights.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(record, ref_record)
    assert sorted({r for ranks in info[0]['partition'].values() for r in ranks}) == [0, 1, 2, 3]


RESUME = hvd('lblamb', dict(SCALED, learning_rate=0.01, batch_scale=2, max_grad_norm=CLIP,
                            trust_exclude=True), steps=8, batch=16, sharded=True, tiny=True)
GLOBAL_BATCH = 48


@pytest.mark.parametrize('before, after, sharded', [(4, 2, True), (3, 1, True), (2, 3, True),
                                                    (2, 2, False)],
                         ids=['4-to-2', '3-to-1', '2-to-3', 'sharded-to-unsharded'])
def test_resume_at_another_world_size(tmp_path, before, after, sharded):
    """Save at step 4 (a window boundary) at `before` ranks; resume at `after` ranks with the
    same global batch (with ``sharded`` False, on hvd.DistributedTrainer): the weights of
    the uninterrupted run at `after` ranks."""
    first = dict(RESUME, batch=GLOBAL_BATCH // before, stop_at=4)
    code, log = run_job(first, tmp_path / 'first', before)
    assert code == 0, log
    second = dict(RESUME, batch=GLOBAL_BATCH // after, sharded=sharded,
                  start_from={'dir': str(tmp_path / 'first'), 'at': 4})
    code, log = run_job(second, tmp_path / 'second', after, timeout=300)
    assert code == 0, log
    whole = dict(RESUME, batch=GLOBAL_BATCH // after, sharded=sharded)
    code, log = run_job(whole, tmp_path / 'whole', after, timeout=300)
    assert code == 0, log
    weights, _, _, _ = load(tmp_path / 'second', after)
    ref, _, _, _ = load(tmp_path / 'whole', after)
    for name, w in ref.items():
        np.testing.assert_allclose(weights[name], w, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_rank_dying_mid_save_leaves_the_old_file(tmp_path):
    """Rank 1 exits inside save_states (at its first allgather): the job fails, and the
    states file an earlier save wrote is byte for byte what it was."""
    import hashlib
    code, log = run_job(dict(RESUME, stop_at=4), tmp_path)
    assert code == 0, log
    states = tmp_path / 'trainer.states'
    before = hashlib.sha256(states.read_bytes()).hexdigest()
    code, log = run_job(dict(RESUME, stop_at=6, die_in_save=1), tmp_path)
    assert code != 0
    assert hashlib.sha256(states.read_bytes()).hexdigest() == before
    assert not [p for p in os.listdir(str(tmp_path)) if p.startswith('.trainer.states')]


def test_a_save_inside_a_window_is_refused(tmp_path):
    code, log = run_job(dict(RESUME, stop_at=3), tmp_path)
    assert code != 0 and 'exit with status code 3' in log, log
    assert 'save at a window boundary' in log


def test_parameters_that_differ_across_ranks_are_refused(tmp_path):
    code, log = run_job(dict(RESUME, perturb_rank=1), tmp_path)
    assert code != 0 and 'exit with status code 3' in log, log
    assert 'differs across ranks' in log and 'broadcast_parameters' in log


SINGLE = r'''
import sys
import horovod.mxnet as hvd
import mxnet as mx
import mx_lbsgd
net = mx.gluon.nn.Dense(3, in_units=4)
net.initialize()
try:
    mx_lbsgd.ShardedTrainer(net.collect_params(), 'lbsgd')
except RuntimeError as err:
    print('NOT INITIALIZED:', err)
hvd.init()
emb = mx.gluon.nn.Embedding(10, 4, sparse_grad=True)
emb.initialize()
try:
    mx_lbsgd.ShardedTrainer(emb.collect_params(), 'lbsgd')
except ValueError as err:
    print('SPARSE:', err)
other = mx.gluon.nn.Dense(5, in_units=4)
other.initialize()
trainer = mx_lbsgd.ShardedTrainer(other.collect_params(), 'lbsgd', dict(momentum=0.9))
with mx.autograd.record():
    loss = other(mx.nd.ones((2, 4))).sum()
loss.backward()
trainer.step(2)
trainer.save_states(sys.argv[1])
mine = mx_lbsgd.ShardedTrainer(net.collect_params(), 'lbsgd', dict(momentum=0.9))
try:
    mine.load_states(sys.argv[1])
except ValueError as err:
    print('OTHER MODEL:', err)
try:
    mx_lbsgd.LossScaling(mine)
except ValueError as err:
    print('REFUSED:', err)
'''


def test_errors_name_the_cause(tmp_path):
    proc = subprocess.run([sys.executable, '-c', SINGLE, str(tmp_path / 'other.states')],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    out = proc.stdout
    assert 'NOT INITIALIZED: ShardedTrainer: horovod is not initialized; call hvd.init()' in out
    assert 'SPARSE: ShardedTrainer: parameter(s)' in out and 'sparse gradients' in out
    assert 'OTHER MODEL:' in out and 'does not fit' in out, out
    assert 'REFUSED: LossScaling cannot drive a ShardedTrainer' in out


EARLY = r"""
import sys
import numpy as np
import mxnet as mx
import horovod.mxnet as hvd
import mx_lbsgd
hvd.init()
mx.random.seed(1)
net = mx.gluon.nn.Dense(16)                 # shapes unknown until the first forward
net.initialize(mx.init.Xavier())
trainer = mx_lbsgd.ShardedTrainer(net.collect_params(), 'lblamb', dict(
    learning_rate=0.01, batch_scale=2))
x = mx.nd.array(np.random.RandomState(hvd.rank()).randn(4, 8))
for step in range(6):
    with mx.autograd.record():
        loss = net(x).sum()
    loss.backward()
    if step == 0:
        first = net.weight.data().asnumpy()
    trainer.step(4)
print('rank %d: %d updates, moved %s' % (hvd.rank(), trainer.optimizer.applied_updates,
                                         not np.array_equal(first, net.weight.data().asnumpy())),
      flush=True)
other = mx.gluon.nn.Dense(16, in_units=8)
other.initialize(mx.init.One())
saver = mx_lbsgd.ShardedTrainer(other.collect_params(), 'lblamb', dict(learning_rate=0.01))
saver.save_states(sys.argv[1])             # before the first update: states created
for step in range(2):
    with mx.autograd.record():
        loss = other(x).sum()
    loss.backward()
    saver.step(4)
print('rank %d: saved, then %d updates' % (hvd.rank(), saver.optimizer.applied_updates),
      flush=True)
"""


def test_deferred_shapes_with_a_window_and_a_save_before_the_first_update(tmp_path):
    """A ShardedTrainer made before the parameters' shapes are known trains with
    ``batch_scale=2`` (it lays out its slices at the first step, before the window sums the
    first micro-batch); one saved before its first update goes on training."""
    script = tmp_path / 'early.py'
    script.write_text(EARLY)
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2', sys.executable,
                       str(script), str(tmp_path / 'early.states')],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout
    for rank in range(2):
        assert 'rank %d: 3 updates, moved True' % rank in proc.stdout, proc.stdout
        assert 'rank %d: saved, then 2 updates' % rank in proc.stdout, proc.stdout


MX_LBSGD = os.path.join(os.path.dirname(sys.executable), 'mx-lbsgd')


def test_mlm_shard_states_equals_the_distributed_trainer(tmp_path):
    """`mx-lbsgd mlm --horovod --shard-states` (fp16 lblamb, loss scaling, clipping,
    hybridized with static_alloc): every rank ends with the same parameter bytes, and the
    run follows the one on hvd.DistributedTrainer: the same loss scales and skips, and its
    losses and gradient norms within 1e-3 (float16 weights: the split tensors' trust ratios
    come from MXNet's LAMB operators, the others' from the native kernel, which sums the
    norms in double, so a master copy may differ in its last bit and round to another
    float16 weight)."""
    summaries = []
    for flags in (['--shard-states'], []):
        out = tmp_path / ('sharded' if flags else 'plain')
        proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2', MX_LBSGD,
                           'mlm', '--horovod', '--steps', '12', '--warmup', '2', '--quiet',
                           '--out', str(out)] + flags,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
        assert proc.returncode == 0, proc.stdout
        summary = json.loads((out / 'summary.json').read_text())
        assert summary['shard_states'] == bool(flags)
        assert len(set(summary['param_sha256_per_rank'])) == 1
        if flags:
            assert summary['optimizer_state_bytes'] > 0
        summaries.append(summary)
    sharded, plain = summaries
    for key in ('skipped_steps', 'final_loss_scale', 'updates', 'clipped_updates'):
        assert sharded[key] == plain[key], key
    for key in ('loss', 'grad_norm'):         # (no norm of a skipped update: NaN)
        curves = [[np.nan if r[key] is None else r[key] for r in s['loss_curve']]
                  for s in (sharded, plain)]
        np.testing.assert_allclose(*curves, rtol=1e-3, err_msg=key)


def test_mlm_shard_states_needs_horovod(tmp_path):
    proc = subprocess.run([MX_LBSGD, 'mlm', '--shard-states', '--out', str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert 'argument --shard-states: needs --horovod' in proc.stdout


NOISE = r'''
import json, sys
import numpy as np
import mxnet as mx
import horovod.mxnet as hvd
import mx_lbsgd
sys.path.insert(0, sys.argv[2])
from harness import digits, mlp
hvd.init()
x, y, _, _ = digits()
out = {}
for kind in ('plain', 'sharded'):
    net = mlp()
    make = mx_lbsgd.ShardedTrainer if kind == 'sharded' else hvd.DistributedTrainer
    trainer = make(net.collect_params(), 'lblamb', dict(learning_rate=0.01, batch_scale=2))
    noise = mx_lbsgd.GradientNoiseScale(trainer, interval=2)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(12):
        lo = (step * hvd.size() + hvd.rank()) * 16
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x[lo:lo + 16])), mx.nd.array(y[lo:lo + 16]))
        loss.backward()
        trainer.step(16)
    noise.flush()
    out[kind] = [h['big_sq'] for h in noise.history] + [noise.b_simple]
if hvd.rank() == 0:
    json.dump(out, open(sys.argv[1], 'w'))
'''


def test_gradient_noise_scale_sees_every_shard(tmp_path):
    """GradientNoiseScale on a ShardedTrainer: the reduced gradient's norm (summed over the
    shards) and B_simple equal those on hvd.DistributedTrainer."""
    script = tmp_path / 'noise.py'
    script.write_text(NOISE)
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2', sys.executable,
                       str(script), str(tmp_path / 'out.json'),
                       os.path.dirname(os.path.abspath(__file__))],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    out = json.loads((tmp_path / 'out.json').read_text())
    assert len(out['plain']) > 2 and out['plain'][-1] is not None
    np.testing.assert_allclose(out['sharded'], out['plain'], rtol=1e-5)
