"""``mx-lbsgd mlm``: BERT-style masked-LM pre-training with lblamb (mx_lbsgd_demo.mlm).

Tiny models throughout: each run takes seconds on 2 cores."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
import mx_lbsgd
from mx_lbsgd import checkpoint
from mx_lbsgd_demo import mlm
from mx_lbsgd_demo.cli import main
from harness import horovodrun

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
TINY = ['--vocab', '32', '--hidden', '16', '--layers', '1', '--heads', '2', '--seq-len', '8',
        '--quiet']


def _env(**extra):
    env = dict(os.environ, **extra)
    env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
    return env


def _run(argv):
    assert main(['mlm'] + argv) == 0


def _summary(out):
    with open(os.path.join(str(out), 'summary.json')) as f:
        return json.load(f)


def _checkpoint(folder):
    """(parameters, per-file optimizer states, progress) of a checkpoint folder; a states
    file is read as mx_lbsgd.checkpoint.load_states reads it (checked, restricted)."""
    params = {k: v.asnumpy() for k, v in mx.nd.load(os.path.join(folder, 'model.params')).items()}
    states = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith('.states'):
            device_states, progress = checkpoint._read(os.path.join(folder, name))
            states[name] = dict(states=device_states[0], optimizer=progress)
    with open(os.path.join(folder, 'progress.json')) as f:
        progress = json.load(f)
    return params, states, progress


def _arrays(obj, prefix=''):
    """Flatten nested states into {path: numpy array or plain value}."""
    if isinstance(obj, mx.nd.NDArray):
        return {prefix: obj.asnumpy()}
    if isinstance(obj, dict):
        out = {}
        for k in obj:
            out.update(_arrays(obj[k], '%s/%s' % (prefix, k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_arrays(v, '%s/%d' % (prefix, i)))
        return out
    if isinstance(obj, mx.lr_scheduler.LRScheduler):
        return {prefix: sorted(vars(obj).items())}
    return {prefix: obj}


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert a[k].tobytes() == b[k].tobytes(), k       # bit for bit
        else:
            assert a[k] == b[k], k


# -- 1. it learns ---------------------------------------------------------------------------
LEARNING = [
    pytest.param(['--dtype', 'float16', '--vocab', '32', '--hidden', '32', '--layers', '1',
                  '--heads', '2', '--seq-len', '16', '--batch-size', '16', '--batch-scale', '2',
                  '--steps', '200', '--warmup', '10', '--growth-interval', '20', '--quiet'],
                 id='fp16-B2-dynamic-loss-scale'),
]


@pytest.mark.parametrize('argv', LEARNING)
def test_short_run_learns(tmp_path, argv):
    _run(argv + ['--out', str(tmp_path)])
    s = _summary(tmp_path)
    losses = [r['loss'] for r in s['loss_curve']]
    assert len(losses) == s['steps'] == 200 and all(math.isfinite(l) for l in losses)
    assert s['last_loss'] < s['first_loss'] - 0.5, (s['first_loss'], s['last_loss'])
    assert s['eval_after']['loss'] < s['eval_before']['loss'] - 0.5
    assert s['final_masked_acc'] > 4 * s['chance_acc'], s['final_masked_acc']
    # fp16 with loss scaling: some overflow steps are skipped, never most of them
    assert 1 <= s['skipped_steps'] <= 0.15 * s['steps']
    assert s['applied_updates'] == s['steps'] - s['skipped_steps']
    assert 1.0 <= s['final_loss_scale'] <= 2.0 ** 16
    assert s['param_sha256_per_rank'] and s['world_size'] == 1


# -- 2. bit-for-bit resume in a new process ---------------------------------------------------
RESUME_BASE = TINY + ['--dtype', 'float16', '--batch-size', '4', '--batch-scale', '3',
                      '--steps', '6', '--warmup', '2', '--growth-interval', '2',
                      '--checkpoint-every', '2']


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp('straight')
    _run(RESUME_BASE + ['--out', str(out)])
    return out


@pytest.mark.parametrize('stop_after', [pytest.param(6, id='window-boundary'),
                                        pytest.param(10, id='mid-window')])
def test_resume_in_a_new_process_is_bit_for_bit(tmp_path, straight, stop_after):
    _run(RESUME_BASE + ['--out', str(tmp_path), '--stop-after', str(stop_after)])
    stopped = tmp_path / 'checkpoints' / ('micro-batch-%07d' % stop_after)
    names = sorted(os.listdir(str(stopped)))
    assert names == (['model.params', 'progress.json', 'trainer.rank0.states']
                     if stop_after % 3 else ['model.params', 'progress.json', 'trainer.states'])
    proc = subprocess.run([sys.executable, '-m', 'mx_lbsgd_demo', 'mlm'] + RESUME_BASE
                          + ['--out', str(tmp_path), '--resume', str(stopped)],
                          env=_env(), cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    final = 'checkpoints/micro-batch-0000018'
    a_params, a_states, a_progress = _checkpoint(str(straight / final))
    b_params, b_states, b_progress = _checkpoint(str(tmp_path / final))
    _assert_identical(a_params, b_params)
    assert a_states.keys() == b_states.keys() == {'trainer.states'}
    _assert_identical(_arrays(a_states), _arrays(b_states))
    # moments, fp32 master copies and accumulators are all in there, and so is the scaler
    state = a_states['trainer.states']['states']
    assert {len(s) for s in state.values()} == {3}       # (master, (mean, var), acc)
    # 18 micro-batches, windows of 3: LAMB counts applied updates, not skipped windows
    assert a_states['trainer.states']['optimizer']['num_update'] == 6 - \
        a_states['trainer.states']['optimizer']['loss_scaler']['state']['total_skipped']
    scaler = a_states['trainer.states']['optimizer']['loss_scaler']
    assert scaler['state']['total_skipped'] >= 1 and scaler['state']['scale'] != 2.0 ** 16
    assert a_progress['history'] == b_progress['history']
    assert _summary(straight)['loss_curve'] == _summary(tmp_path)['loss_curve']


def test_resume_with_other_settings_is_refused(tmp_path, straight, capsys):
    ckpt = str(straight / 'checkpoints')           # a folder of checkpoints: the latest
    argv = [a if a != '3' else '2' for a in RESUME_BASE]          # --batch-scale 2
    assert main(['mlm'] + argv + ['--out', str(tmp_path), '--resume', ckpt]) == 2
    err = capsys.readouterr().err
    assert '--resume' in err and '--batch-scale 3' in err and 'Traceback' not in err


# -- 3. Horovod: identical ranks; 2 ranks == 1 process with the same global micro-batches ---
# fp32: horovod's reduction sums the ranks' gradients in another order than one process of
# 2B does, so equal to float32 rounding (amplified a little by LAMB's normalisation). fp16:
# each rank's float16 gradient is rounded (and may overflow) on its own before the sum, so
# a loss-scale skip can differ from one process of 2B: there only the ranks are compared.
HOROVOD = [
    pytest.param(TINY + ['--dtype', 'float32', '--batch-size', '4', '--batch-scale', '2',
                         '--steps', '5', '--warmup', '2'], True,
                 id='fp32-B2-equals-one-process-of-2B'),
    pytest.param(TINY + ['--dtype', 'float16', '--batch-size', '4', '--batch-scale', '2',
                         '--steps', '5', '--warmup', '2', '--growth-interval', '2'], False,
                 id='fp16-B2-loss-scaled-ranks-identical'),
]


def _horovodrun(argv, cwd):
    pytest.importorskip('horovod.mxnet', reason='horovod with MXNet support is not installed '
                                                '(bash scripts/install_horovod.sh)')
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, '-m', 'mx_lbsgd_demo', 'mlm', '--horovod'] + argv,
                      env=_env(OMP_NUM_THREADS='1'), cwd=str(cwd),
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=900)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize('argv, compare', HOROVOD)
def test_horovod_two_ranks(tmp_path, argv, compare):
    hvd_out, one_out = tmp_path / 'hvd', tmp_path / 'one'
    log = _horovodrun(argv + ['--out', str(hvd_out)], tmp_path)
    assert log.count('wrote ') == 1                                # only rank 0 reports
    two = _summary(hvd_out)
    assert two['world_size'] == 2 and two['effective_batch_size'] == 16
    digests = two['param_sha256_per_rank']
    assert len(digests) == 2 and digests[0] == digests[1]          # identical on both ranks
    final = 'checkpoints/micro-batch-0000010'
    a, _, _ = _checkpoint(str(hvd_out / final))
    assert all(np.isfinite(v).all() for v in a.values())
    if not compare:
        assert two['skipped_steps'] >= 1 and two['applied_updates'] >= 1
        return
    # one process whose micro-batch holds both ranks' sequences (rank r: r*B .. (r+1)*B-1)
    batch = argv.index('--batch-size') + 1
    _run(argv[:batch] + ['8'] + argv[batch + 1:] + ['--out', str(one_out)])
    one = _summary(one_out)
    b, _, _ = _checkpoint(str(one_out / final))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert [r['lr'] for r in two['loss_curve']] == [r['lr'] for r in one['loss_curve']]
    np.testing.assert_allclose([r['loss'] for r in two['loss_curve']],
                               [r['loss'] for r in one['loss_curve']], rtol=1e-5)
    assert two['applied_updates'] == one['applied_updates'] == 5
    assert two['eval_after']['loss'] != pytest.approx(two['eval_before']['loss'], abs=1e-3)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_horovod_resume_mid_window_bit_for_bit(tmp_path):
    """2 ranks stopped inside a window write one states file each (their accumulators
    differ); a new horovodrun job resumes them to the same bits as an uninterrupted job."""
    argv = RESUME_BASE + ['--batch-size', '2']
    _horovodrun(argv + ['--out', str(tmp_path / 'straight')], tmp_path)
    _horovodrun(argv + ['--out', str(tmp_path / 'resumed'), '--stop-after', '8'], tmp_path)
    stopped = tmp_path / 'resumed' / 'checkpoints' / 'micro-batch-0000008'
    assert sorted(os.listdir(str(stopped))) == ['model.params', 'progress.json',
                                                'trainer.rank0.states', 'trainer.rank1.states']
    _horovodrun(argv + ['--out', str(tmp_path / 'resumed'), '--resume', str(stopped)],
                tmp_path)
    final = 'checkpoints/micro-batch-0000018'
    a = _checkpoint(str(tmp_path / 'straight' / final))
    b = _checkpoint(str(tmp_path / 'resumed' / final))
    _assert_identical(a[0], b[0])
    _assert_identical(_arrays(a[1]), _arrays(b[1]))
    assert a[2]['history'] == b[2]['history']
    s_a, s_b = _summary(tmp_path / 'straight'), _summary(tmp_path / 'resumed')
    assert s_a['param_sha256_per_rank'] == s_b['param_sha256_per_rank']


# -- 4. the learning rate LAMB applies: linear warmup, then linear decay ---------------------
@pytest.mark.parametrize('lr, warmup, steps, batch_scale', [
    pytest.param(0.02, 3, 8, 2, id='warmup3-of-8-B2'),
    pytest.param(0.01, 0, 4, 1, id='no-warmup-B1'),
])
def test_lr_follows_linear_warmup_then_linear_decay(tmp_path, lr, warmup, steps, batch_scale):
    """The lr of update t, recovered from the update of a bias (out of the trust ratio and of
    weight decay, so w -= lr_t * m_hat / (sqrt(v_hat) + eps)), equals the closed form
    lr * t / W during warmup and lr * (1 - (t - W) / (N - W)) after."""
    args = mlm._parser().parse_args(TINY + [
        '--dtype', 'float32', '--batch-size', '4', '--batch-scale', str(batch_scale),
        '--steps', str(steps), '--warmup', str(warmup), '--lr', str(lr),
        '--out', str(tmp_path)])
    net, trainer, _ = mlm._build(args, mlm._World(False), None)
    opt = trainer.optimizer
    index = [p.name for p in trainer._params].index('mlm_decoder_bias')
    bias = net.collect_params()['mlm_decoder_bias']
    data = mlm.MarkovTokens(args.vocab, args.seq_len, args.seed)
    for t in range(1, steps + 1):
        before = bias.data().asnumpy().astype(np.float64)
        for k in range(batch_scale):
            x, pos, y = data.batch('train', (t - 1) * batch_scale + k, 0, 4)
            with mx.autograd.record():
                loss = mlm._token_losses(net(mx.nd.array(x), mx.nd.array(pos)),
                                         mx.nd.array(y)).mean(axis=-1)
            loss.backward()
            trainer.step(4)
        mean, var = [s.asnumpy().astype(np.float64)
                     for s in trainer._updaters[0].states[index][:2]]
        direction = (mean / (1 - opt.beta1 ** t)) / (np.sqrt(var / (1 - opt.beta2 ** t))
                                                     + opt.epsilon)
        step = before - bias.data().asnumpy()
        big = np.abs(direction) > 0.1
        assert big.sum() >= 4
        used = np.median(step[big] / direction[big])
        expected = (lr * t / warmup if t < warmup
                    else lr * (1 - (t - warmup) / (steps - warmup)))
        assert used == pytest.approx(expected, rel=1e-4, abs=1e-9), t
        assert trainer.learning_rate == pytest.approx(expected, rel=1e-12)
    assert opt.applied_updates == steps


# -- 5. bad command lines ---------------------------------------------------------------------
BAD = [
    pytest.param(['--steps', '0'], ['--steps', '>= 1'], id='steps'),
    pytest.param(['--batch-size', '0'], ['--batch-size'], id='batch-size'),
    pytest.param(['--batch-scale', 'two'], ['--batch-scale', 'two'], id='batch-scale'),
    pytest.param(['--dtype', 'float64'], ['--dtype', 'float64'], id='dtype'),
    pytest.param(['--lr', '0'], ['--lr', '> 0'], id='lr'),
    pytest.param(['--steps', '10', '--warmup', '10'], ['--warmup', '< --steps'], id='warmup'),
    pytest.param(['--hidden', '64', '--heads', '3'], ['--heads', 'divide --hidden'],
                 id='heads'),
    pytest.param(['--steps', '2', '--warmup', '1', '--batch-scale', '2', '--stop-after', '5'],
                 ['--stop-after', '<= --steps x --batch-scale'], id='stop-after'),
    pytest.param(['--checkpoint-every', '-1'], ['--checkpoint-every'], id='checkpoint-every'),
    pytest.param(['--resume', '/nonexistent/mlm-run'], ['--resume', 'no checkpoint'],
                 id='resume-missing'),
    pytest.param(['--seed', '-3'], ['--seed'], id='seed'),
]


@pytest.mark.parametrize('argv, words', BAD)
def test_bad_arguments_exit_2_naming_the_option(tmp_path, capsys, argv, words):
    out = tmp_path / 'run'
    assert main(['mlm'] + argv + ['--out', str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('mx-lbsgd mlm: error: '), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not out.exists()


@pytest.mark.horovod
def test_horovod_flag_without_horovod_names_the_option(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'horovod.mxnet', None)
    assert main(['mlm', '--horovod', '--out', str(tmp_path / 'run')] + TINY) == 2
    err = capsys.readouterr().err
    assert '--horovod' in err and 'Traceback' not in err


# -- the data --------------------------------------------------------------------------------
def test_markov_tokens_are_deterministic_and_shardable():
    data = mlm.MarkovTokens(32, 16, seed=5)
    whole = data.batch('train', 7, 0, 8)
    halves = [data.batch('train', 7, 0, 4), data.batch('train', 7, 4, 4)]
    for k in range(3):
        joined = np.concatenate([halves[0][k], halves[1][k]])
        if k == 1:                         # positions index the flattened batch
            joined[4:] += 4 * 16
        np.testing.assert_array_equal(whole[k], joined)
    x, pos, y = whole
    assert x.shape == (8, 16) and pos.shape == y.shape == (8, 2)
    assert (x.reshape(-1)[pos.astype(int)] == mlm.MASK).mean() > 0.5
    assert not np.array_equal(data.batch('train', 8, 0, 8)[0], x)
    assert not np.array_equal(data.batch('eval', 7, 0, 8)[0], x)
