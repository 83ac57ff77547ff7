"""mx-lbsgd study (mx_lbsgd_demo.study): steps to target against batch size, McCandlish's
fit (study_fit), the lr search, AdaScale's rows and the goodput-chosen batch, the outputs,
the argument errors; benchmarks/study.py."""
import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from mx_lbsgd_demo import study
from mx_lbsgd_demo.cli import main
from mx_lbsgd_demo.study_fit import fit_tradeoff, predicted_steps

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_RUNS = [
    pytest.param([], ['sgd', 'lbsgd-linear', 'lbsgd-lars', 'fp16-scaled'], [16, 64, 256],
                 id='all-methods'),
    pytest.param(['--methods', 'sgd', '--batch-sizes', '32', '64'], ['sgd'], [32, 64],
                 id='two-batches-no-fit'),
]


@pytest.mark.parametrize('argv, methods, batches', TINY_RUNS)
def test_tiny_study_writes_consistent_json_table_and_picture(argv, methods, batches,
                                                              tmp_path, capsys):
    assert main(['study', '--tiny', '--quiet', '--out', str(tmp_path)] + argv) == 0
    _check_outputs(capsys.readouterr().out, tmp_path, methods, batches)


def _check_outputs(printed, folder, methods, batches):
    """study.json, study.md and study.png of a tiny study agree with each other and with
    what it printed."""
    assert '| method | %s |' % ' | '.join(map(str, batches)) in printed
    data = json.loads((folder / 'study.json').read_text())
    assert data['batch_sizes'] == batches and list(data['methods']) == methods
    for name, m in data['methods'].items():
        steps = m['steps_to_target']
        assert len(steps) == len(m['lr']) == len(m['b_simple']) == len(batches)
        for s, e, b, cap in zip(steps, m['examples_to_target'], batches,
                                m['grids']):
            assert (s is None and e is None) or (0 < s <= 120 and e == s * b)
            assert s is None or s == min(r[1] for r in cap if r[1] is not None)
        if m['fit'] is None:
            assert m['b_crit'] is None
        else:
            assert 0 < m['b_crit'] < math.inf
            assert m['e_min'] == pytest.approx(m['s_min'] * m['b_crit'])
        assert all(v is None or v > 0 for v in m['b_simple'])
        assert name in data['b_simple'] and '| %s |' % name in printed
    assert data['b_simple']['summary'] > 0
    if len(batches) < 3:
        assert all(m['b_crit'] is None for m in data['methods'].values())
    else:
        # the small batches are in the (near) perfect-scaling regime on this data: 16 x
        # the batch must need fewer steps for every method that reached the target
        for m in data['methods'].values():
            first, last = m['steps_to_target'][0], m['steps_to_target'][-1]
            assert first is None or last is None or last < first
    assert (folder / 'study.png').read_bytes()[:4] == b'\x89PNG'
    assert (folder / 'study.md').read_text().startswith('Steps to 0.80 validation')
    assert (folder / 'study.md').read_text().strip() in printed
    return data


FITS = [
    pytest.param([16, 32, 64, 128, 256, 512, 1024], 100.0, 150.0, id='mid'),
    pytest.param([16, 32, 64, 128, 256, 512, 1024], 40.0, 1000.0, id='large-bcrit'),
    pytest.param([8, 64, 512], 3000.0, 20.0, id='three-points-small-bcrit'),
]


@pytest.mark.parametrize('batches, s_min, b_crit', FITS)
def test_fit_recovers_s_min_and_e_min_from_the_formula(batches, s_min, b_crit):
    steps = predicted_steps(batches, s_min, b_crit)
    e_min = s_min * b_crit
    # the data obey (S / S_min - 1)(E / E_min - 1) = 1 exactly
    for b, s in zip(batches, steps):
        assert (s / s_min - 1) * (s * b / e_min - 1) == pytest.approx(1.0)
    fit = fit_tradeoff(batches, steps)
    assert fit['s_min'] == pytest.approx(s_min, rel=1e-6)
    assert fit['e_min'] == pytest.approx(e_min, rel=1e-6)
    assert fit['b_crit'] == pytest.approx(b_crit, rel=1e-6)
    assert fit['rms_log_residual'] < 1e-6 and fit['points'] == len(batches)


@pytest.mark.parametrize('batches, steps', [
    pytest.param([16, 64], [400, 100], id='two-points'),
    pytest.param([16, 64, 256, 1024], [None, 100, None, 30], id='two-reached'),
    pytest.param([16, 64, 256, 1024], [6400, 1600, 400, 100], id='perfect-scaling'),
    pytest.param([16, 64, 256, 1024], [100, 100, 100, 100], id='no-scaling'),
])
def test_fit_is_none_when_the_data_cannot_pin_b_crit(batches, steps):
    assert fit_tradeoff(batches, steps) is None


def test_lr_search_extends_past_the_edge_and_caps_runs_at_the_fewest_steps(monkeypatch):
    """Fake training whose steps are least at lr = 0.1 * B / 16: the search starts at
    0.025 at B = 16, extends upwards twice, then recentres on twice the choice."""
    calls = []

    def fake(spec):
        calls.append(spec)
        best = 0.1 * spec['batch'] / 16
        steps = round(1000 * 16 / spec['batch'] * (1 + math.log2(spec['lr'] / best) ** 2))
        reached = steps <= spec['cap']
        return dict(steps=steps if reached else None, last_step=min(steps, spec['cap']),
                    b_simple=50.0, b_simple_at_target=60.0, skipped=0, wall_time_s=0.0,
                    curve=[(min(steps, spec['cap']), 0.9 if reached else 0.5)])

    monkeypatch.setattr(study, 'train_to_target', fake)
    settings = dict(lr=0.025, lars_lr=1.0, grid_points=3, grid_extend=2, max_steps=5000,
                    max_epochs=1000, train_samples=1000,
                    seed=0, target=0.9, micro_batch=64, warmup_updates=0, dataset='digits')
    cells = study.tune_method('sgd', [16, 32], settings)
    first = [c['lr'] for c in calls if c['batch'] == 16]
    assert first == [0.025, 0.0125, 0.05, 0.1, 0.2]
    assert [c['cap'] for c in calls if c['batch'] == 16] == [5000, 5000, 5000, 2000, 1000]
    assert cells[0]['lr'] == pytest.approx(0.1) and cells[0]['steps'] == 1000
    assert [c['lr'] for c in calls if c['batch'] == 32] == [0.2, 0.1, 0.4]
    assert cells[1]['lr'] == pytest.approx(0.2) and cells[1]['steps'] == 500


@pytest.fixture(scope='module')
def adascale_study(tmp_path_factory):
    """One tiny study of adascale and adascale-auto (B 16, 64, 256): (printed, folder)."""
    folder = tmp_path_factory.mktemp('adascale-study')
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.delenv('MX_LBSGD_FUSED', raising=False)
        assert main(['study', '--tiny', '--quiet', '--methods', 'adascale', 'adascale-auto',
                     '--out', str(folder)]) == 0
    return printed.getvalue(), folder


def test_tiny_adascale_study_writes_consistent_json_table_and_picture(adascale_study):
    printed, folder = adascale_study
    data = _check_outputs(printed, folder, ['adascale'], [16, 64, 256])
    assert data['trainings'] == 3 + 1 and data['settings']['methods'] == [
        'adascale', 'adascale-auto']
    for row in ('| S | 1 | 4 | 16 |', '| mean / last gain |', '| progress to target |',
                '| adascale-auto | %d |' % data['auto']['steps_to_target'],
                'Against the fixed-batch adascale rows: steps '):
        assert row in printed


def test_adascale_rows_run_one_lr_at_batch_scale_b_over_the_smallest(adascale_study):
    m = json.loads((adascale_study[1] / 'study.json').read_text())['methods']['adascale']
    lr = m['lr'][0]
    assert m['lr'] == [lr] * 3 and m['micro_batch'] == 16 and m['batch_scale'] == [1, 4, 16]
    assert m['lr_scaling'] == 'adascale'
    # tuned at 16 only: every larger batch is one run at that lr, capped by the budget
    assert [[r[0] for r in grid] for grid in m['grids'][1:]] == [[lr], [lr]]
    steps = m['steps_to_target']
    assert m['gain_mean'][0] == m['gain_last'][0] == 1.0 and m['progress_to_target'][0] \
        == pytest.approx(steps[0])
    for s, k, mean, last, progress in zip(steps, m['batch_scale'], m['gain_mean'],
                                          m['gain_last'], m['progress_to_target']):
        assert 1.0 <= mean <= k and 1.0 <= last <= k
        assert progress == pytest.approx(mean * s)
    assert m['b_simple'][0] is None       # one micro-batch per update: one batch size


def _window_of(history, update):
    """The window length of (1-based) update `update` from [[first_update, length]]."""
    return [k for u, k in history if u < update][-1]


def test_auto_row_keeps_windows_in_bounds_changing_at_most_2x(adascale_study):
    data = json.loads((adascale_study[1] / 'study.json').read_text())
    auto, fixed = data['auto'], data['methods']['adascale']
    assert auto['batch_scale_bounds'] == [1, 16] and auto['batch_scale_interval'] == 4
    assert auto['lr'] == fixed['lr'][0] and auto['micro_batch'] == 16
    steps, history = auto['steps_to_target'], auto['window_history']
    assert steps is not None and history[0] == [0, 1] and len(history) >= 2
    assert all(1 <= k <= 16 for _, k in history)
    for (u0, k0), (u1, k1) in zip(history, history[1:]):
        assert u0 < u1 < steps and k0 != k1 and k0 <= 2 * k1 and k1 <= 2 * k0
    assert auto['examples_to_target'] == 16 * sum(_window_of(history, u)
                                                  for u in range(1, steps + 1))
    assert auto['final_window'] == history[-1][1]
    assert auto['final_batch'] == 16 * auto['final_window']
    assert auto['mean_batch'] == pytest.approx(auto['examples_to_target'] / steps)
    assert auto['batches_taken'] == sorted({16 * k for _, k in history})
    for key, value in (('steps', steps), ('examples', auto['examples_to_target'])):
        above, below = auto['against_fixed'][key]['above'], auto['against_fixed'][key]['below']
        assert above or below
        assert above is None or (value <= above[1] and above[0] in data['batch_sizes'])
        assert below is None or (value >= below[1] and below[0] in data['batch_sizes'])


def test_adascale_optimizers_take_the_base_lr_without_warmup():
    base = dict(lr=0.05, base_batch=16, micro_batch=128, warmup_updates=20)
    fixed = study._optimizer(dict(base, method='adascale', batch=64), 1000)
    assert (fixed.lr_scaling, fixed.batch_scale, fixed.warmup_epochs) == ('adascale', 4, 0)
    assert fixed.learning_rate == 0.05 and study._window(dict(base, method='adascale',
                                                               batch=64)) == (16, 4)
    auto = study._optimizer(dict(base, method='adascale-auto', batch=16, bounds=[1, 16],
                                 interval=4), 1000)
    assert (auto.lr_scaling, auto.batch_scale, auto.batch_scale_bounds,
            auto.batch_scale_interval) == ('adascale', 1, (1, 16), 4)
    assert auto.learning_rate == 0.05 and auto.window_history == [(0, 1)]


def test_adascale_tunes_at_the_smallest_batch_only(monkeypatch):
    """Fake training, fewest steps at lr 0.1 at every batch: the grid runs at B = 16, every
    larger batch runs once at the lr chosen there, and the auto run takes it too."""
    calls = []

    def fake(spec):
        calls.append(spec)
        steps = round(1000 * 16 / spec['batch'] * (1 + math.log2(spec['lr'] / 0.1) ** 2))
        reached = steps <= spec['cap']
        return dict(steps=steps if reached else None, last_step=min(steps, spec['cap']),
                    b_simple=None, b_simple_at_target=None, skipped=0, wall_time_s=0.0,
                    curve=[(min(steps, spec['cap']), 0.9 if reached else 0.5)],
                    progress=float(steps), gain_mean=1.0, gain_last=1.0, examples=16 * steps,
                    window_history=[[0, 1]], window=1)

    monkeypatch.setattr(study, 'train_to_target', fake)
    settings = dict(lr=0.025, lars_lr=1.0, grid_points=3, grid_extend=2, max_steps=5000,
                    max_epochs=100, train_samples=1000, seed=0, target=0.9, micro_batch=64,
                    warmup_updates=0, dataset='digits', batch_sizes=[16, 32, 128],
                    auto_interval=8)
    out = study.tune_adascale([16, 32, 128], settings, auto=True)
    assert [c['lr'] for c in calls if c['batch'] == 16 and c['method'] == 'adascale'] == [
        0.025, 0.0125, 0.05, 0.1, 0.2]
    later = [c for c in calls if c['batch'] > 16]
    assert [(c['batch'], c['lr'], c['cap']) for c in later] == [(32, 0.1, 3125),
                                                                (128, 0.1, 782)]
    assert all(c['base_batch'] == 16 for c in calls)
    assert [c['lr'] for c in out['cells']] == [0.1] * 3
    (auto,) = [c for c in calls if c['method'] == 'adascale-auto']
    assert (auto['batch'], auto['lr'], auto['bounds'], auto['interval'], auto['cap'],
            auto['max_examples']) == (16, 0.1, [1, 8], 8, 5000, 100 * 1000)
    assert out['auto']['steps'] == 1000 and out['auto']['bounds'] == [1, 8]


@pytest.mark.parametrize('argv, words', [
    pytest.param(['--batch-sizes', '1000'], '--batch-sizes', id='not-a-multiple'),
    pytest.param(['--batch-sizes', '20480'], '<= 10314', id='too-large'),
    pytest.param(['--target', '1.5'], '--target', id='target'),
    pytest.param(['--micro-batch', '0'], '--micro-batch', id='micro-batch'),
    pytest.param(['--max-steps', '0'], '--max-steps', id='max-steps'),
    pytest.param(['--lr', '0'], '--lr', id='lr'),
    pytest.param(['--methods', 'adam'], 'adam', id='method'),
    pytest.param(['--methods', 'sgd', 'adascale-auto'], '--methods: adascale-auto',
                 id='auto-without-adascale'),
    pytest.param(['--methods', 'adascale', '--batch-sizes', '32', '48'],
                 '--batch-sizes: [48]', id='adascale-batch-not-a-multiple'),
    pytest.param(['--auto-interval', '0'], '--auto-interval', id='auto-interval'),
])
def test_bad_arguments_exit_2_naming_the_option(argv, words, tmp_path, capsys):
    assert main(['study', '--out', str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith('mx-lbsgd study: error: ') and words in err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_study_script_runs_directly_in_two_processes(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'study.py'),
                           '--tiny', '--methods', 'sgd', 'lbsgd-linear', '--batch-sizes',
                           '64', '--jobs', '2', '--quiet', '--out', str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert '| sgd |' in proc.stdout and '| lbsgd-linear |' in proc.stdout
    data = json.loads((tmp_path / 'study.json').read_text())
    assert data['settings']['jobs'] == 2 and list(data['methods']) == ['sgd', 'lbsgd-linear']


@pytest.mark.multiprocess
def test_pool_workers_exit_when_the_study_is_killed():
    """run_many's spawned workers watch their parent: a SIGKILLed study leaves none behind."""
    import time
    code = (
        'import multiprocessing, os, signal, time\n'
        'from concurrent.futures import ProcessPoolExecutor\n'
        'from mx_lbsgd_demo.study import _exit_with_parent\n'
        'if __name__ == "__main__":\n'
        '    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),\n'
        '                               initializer=_exit_with_parent,\n'
        '                               initargs=(os.getpid(),))\n'
        '    print(pool.submit(os.getpid).result(), flush=True)\n'
        '    pool.submit(time.sleep, 120)\n'
        '    os.kill(os.getpid(), signal.SIGKILL)\n')
    proc = subprocess.run([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True,
                          timeout=600, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == -9
    worker = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 120      # a bound: the loop ends when the worker does
    while os.path.exists('/proc/%d' % worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists('/proc/%d' % worker)
