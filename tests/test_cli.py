"""End to end tests of the ``mx-lbsgd`` command (mx_lbsgd_demo.cli)."""
import csv
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from mx_lbsgd_demo.cli import main
from reference import warmup_multiplier

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {'args', 'final_test_acc', 'best_test_acc', 'best_epoch', 'epochs_to_target',
                'target_acc', 'wall_time_s', 'skipped_steps', 'total_steps', 'versions',
                'plots', 'files'}


def _env():
    """The environment for a subprocess: this checkout's mx_lbsgd first on sys.path."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
    return env


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _one_line_error(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert 'Traceback' not in err
    assert ': error: ' in lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_train_writes_metrics_summary_and_plot(tmp_path, capsys):
    out = tmp_path / 'run'
    assert main(['train', '--single', '--epochs', '2', '--batch-scale', '2', '--out',
                 str(out), '--quiet']) == 0
    printed = capsys.readouterr().out
    assert 'test accuracy' in printed
    rows = _rows(out / 'metrics.csv')
    assert [int(r['epoch']) for r in rows] == [1, 2]
    for r in rows:
        for key in ('train_acc', 'test_acc'):
            assert 0.0 <= float(r[key]) <= 1.0
        assert float(r['train_loss']) > 0 and float(r['loss_scale']) == 1.0
        assert int(r['skipped_steps']) == 0
    assert float(rows[-1]['test_acc']) > 0.8           # two epochs already learn digits
    assert float(rows[0]['seconds']) < float(rows[1]['seconds'])
    steps = _rows(out / 'steps.csv')
    assert len(steps) == 2 * (1348 // 32)
    lrs = [float(s['lr']) for s in steps]     # linear warmup from 0.05 to 0.1 in 1 epoch
    assert lrs[0] == pytest.approx(0.05 * (1 + 1 / 42))
    assert lrs[-1] == pytest.approx(0.1) and lrs == sorted(lrs)
    summary = json.loads((out / 'summary.json').read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary['final_test_acc'] == pytest.approx(float(rows[-1]['test_acc']))
    assert summary['args']['optimizer'] == 'lbsgd' and summary['args']['batch_scale'] == 2
    assert summary['versions']['mxnet'] == '1.9.1'
    for name in summary['plots']:
        assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


DEMO_SUMMARY_KEYS = {'effective_batch_size', 'batch_scale', 'warmup_strategy', 'dtype',
                     'final_loss_scale', 'skipped_steps', 'updates', 'baseline'}


def test_default_train_is_the_large_batch_demo_with_a_baseline(tmp_path, capsys):
    # the default run, shortened to 2 epochs: main run (32 x 8 = 256, linear warmup,
    # fp16 + dynamic loss scaling) and the fp32 batch-32 sgd baseline, one picture
    out = tmp_path / 'demo'
    assert main(['train', '--epochs', '2', '--out', str(out), '--quiet']) == 0
    printed = capsys.readouterr().out
    assert 'main: test accuracy' in printed and 'baseline: test accuracy' in printed
    summary = json.loads((out / 'summary.json').read_text())
    assert SUMMARY_KEYS | DEMO_SUMMARY_KEYS <= set(summary)
    assert summary['effective_batch_size'] == 256 and summary['batch_scale'] == 8
    assert summary['warmup_strategy'] == 'linear' and summary['dtype'] == 'float16'
    assert summary['args']['loss_scale'] == 'dynamic'
    assert summary['args']['warmup_epochs'] == 5.0
    base = summary['baseline']
    assert (base['optimizer'], base['batch_size'], base['batch_scale'], base['dtype'],
            base['final_loss_scale'], base['skipped_steps']) == ('sgd', 32, 1, 'float32', 1.0, 0)
    assert base['effective_batch_size'] == 32 and base['args']['epochs'] == 2
    assert 0.8 < base['final_test_acc'] <= 1.0
    # per-step lr: the warmup from 0.05 towards 0.05 * 8 (5 epochs; 2 trained)
    steps = _rows(out / 'steps.csv')
    assert len(steps) == 2 * 42
    lrs = [float(s['lr']) for s in steps]
    assert lrs[0] == pytest.approx(0.05 * (1 + 7 * 1 / 210))
    assert 0.05 < lrs[-1] < 0.4 and max(lrs) < 0.4 and lrs[-1] > lrs[0] * 2
    scales = [float(s['loss_scale']) for s in steps]
    skipped = sum(int(s['skipped']) for s in steps)
    # it rises at every step but after a skipped window (LBSGD uncounts its micro-batches)
    assert sum(b <= a for a, b in zip(lrs, lrs[1:])) <= skipped
    assert scales[0] == 2.0 ** 16 and summary['skipped_steps'] == skipped >= 1
    assert summary['final_loss_scale'] < 2.0 ** 16
    for old in ('effective_batch', 'loss_scale', 'test_accuracy'):    # one name each
        assert old not in summary and old not in base
    base_steps = _rows(out / 'baseline-steps.csv')
    assert len(base_steps) == 2 * 42
    assert {float(s['lr']) for s in base_steps} == {0.05}
    assert {float(s['loss_scale']) for s in base_steps} == {1.0}
    assert len(_rows(out / 'baseline-metrics.csv')) == 2
    # one picture, both runs
    assert 'baseline' in summary['plots']['training.png']
    assert (out / 'training.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert set(summary['files']) == {'metrics.csv', 'steps.csv', 'baseline-metrics.csv',
                                     'baseline-steps.csv', 'training.png', 'summary.json'}


def test_single_is_the_former_default_run(tmp_path):
    out = tmp_path / 'single'
    assert main(['train', '--single', '--epochs', '1', '--out', str(out), '--quiet']) == 0
    summary = json.loads((out / 'summary.json').read_text())
    assert 'baseline' not in summary and not (out / 'baseline-metrics.csv').exists()
    args = summary['args']
    assert (args['batch_scale'], args['dtype'], args['warmup_epochs'], args['loss_scale'],
            args['growth_interval']) == (1, 'float32', 1.0, 'none', 100)
    assert summary['effective_batch_size'] == 32 and summary['final_loss_scale'] == 1.0
    # --no-baseline keeps the new defaults; flags given explicitly win in both modes
    out = tmp_path / 'nobase'
    assert main(['train', '--no-baseline', '--epochs', '1', '--batch-scale', '4',
                 '--no-steps', '--out', str(out), '--quiet']) == 0
    summary = json.loads((out / 'summary.json').read_text())
    assert 'baseline' not in summary and summary['effective_batch_size'] == 128
    assert summary['dtype'] == 'float16' and summary['args']['epochs'] == 1


def test_train_lr_scaling_and_auto_batch(tmp_path, capsys):
    """--lr-scaling adascale --batch-scale auto on the demo's float16, loss-scaled lbsgd:
    every step's lr is the base lr times the gain, the window moves by at most 2x between
    lengths in the bounds, and summary.json, the CSVs and the plot say so."""
    out = tmp_path / 'run'
    assert main(['train', '--no-baseline', '--epochs', '3', '--lr-scaling', 'adascale',
                 '--batch-scale', 'auto', '--batch-scale-bounds', '1', '8', '--out', str(out),
                 '--quiet']) == 0
    printed = capsys.readouterr().out
    assert 'lr_scaling adascale: final gain' in printed and 'windows 1 (update 0)' in printed
    steps = _rows(out / 'steps.csv')
    windows = [int(s['window']) for s in steps]
    assert min(windows) >= 1 and max(windows) <= 8 and len(set(windows)) > 1
    changes = [(a, b) for a, b in zip(windows, windows[1:]) if a != b]
    assert all(b <= 2 * a and a <= 2 * b for a, b in changes)
    for s in steps:
        assert float(s['gain']) >= 1.0
        assert float(s['lr']) == pytest.approx(0.05 * float(s['gain']), rel=1e-6)
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['lr_scaling'] == 'adascale' and summary['batch_scale'] == 'auto'
    assert summary['args']['batch_scale_bounds'] == [1, 8]
    history = summary['batch_history']
    assert history[0] == {'update': 0, 'batch_scale': 1, 'batch': 32}
    assert [h['batch_scale'] for h in history] == \
        [w for i, w in enumerate(windows) if i == 0 or windows[i - 1] != w]
    assert summary['final_batch_scale'] == windows[-1]
    assert summary['effective_batch_size'] == 32 * windows[-1]
    assert summary['final_gain'] == pytest.approx(float(steps[-1]['gain']))
    assert summary['progress'] > summary['updates']
    epochs = _rows(out / 'metrics.csv')
    assert [int(r['window']) for r in epochs][-1] == windows[-1]
    assert 'lr_scaling' in summary['plots']['training.png']
    assert (out / 'training.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_train_lblamb_fp16_accumulated_with_loss_scaling(tmp_path):
    """The default main run's shape (fp16, batch_scale 8, dynamic loss scale) with LAMB."""
    out = tmp_path / 'lamb'
    assert main(['train', '--optimizer', 'lblamb', '--no-baseline', '--epochs', '8',
                 '--out', str(out), '--quiet']) == 0
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['optimizer'], summary['dtype'], summary['effective_batch_size']) == \
        ('lblamb', 'float16', 256)
    assert summary['updates'] == summary['total_steps'] // 8 - summary['skipped_steps']
    assert summary['final_test_acc'] > 0.85


def test_train_float16_dynamic_loss_scale(tmp_path):
    out = tmp_path / 'fp16'
    assert main(['train', '--single', '--epochs', '1', '--dtype', 'float16', '--optimizer',
                 'sgd', '--out', str(out), '--quiet']) == 0
    rows = _rows(out / 'metrics.csv')
    assert len(rows) == 1
    steps = _rows(out / 'steps.csv')
    scales = [float(s['loss_scale']) for s in steps]
    skipped = sum(int(s['skipped']) for s in steps)
    assert scales[0] == 2.0 ** 16           # DynamicLossScaler's initial scale
    assert skipped >= 1 and min(scales) < scales[0]   # overflow at 2**16, backed off
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['args']['loss_scale'] == 'dynamic'
    assert summary['skipped_steps'] == skipped
    assert summary['final_loss_scale'] == float(rows[0]['loss_scale'])
    assert 0.0 <= summary['final_underflow_fraction'] < 0.01
    assert 0.0 <= float(rows[0]['test_acc']) <= 1.0


def test_train_float16_unscaled_lbsgd(tmp_path):
    out = tmp_path / 'none'
    assert main(['train', '--single', '--epochs', '1', '--dtype', 'float16', '--loss-scale',
                 'none', '--out', str(out), '--quiet', '--no-steps']) == 0
    assert not (out / 'steps.csv').exists()
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['skipped_steps'] == 0 and summary['final_loss_scale'] == 1.0
    assert summary['final_test_acc'] > 0.8


@pytest.mark.parametrize('argv, words', [
    (['train', '--batch-size', '0'], ['--batch-size', '>= 1']),
    (['train', '--epochs', '0'], ['--epochs']),
    (['train', '--lr', '0'], ['--lr', '> 0']),
    (['train', '--batch-scale', '0'], ['--batch-scale']),
    (['train', '--optimizer', 'foo'], ['--optimizer', 'foo']),
    (['train', '--dtype', 'float64'], ['--dtype', 'float64']),
    (['train', '--loss-scale', '-4'], ['--loss-scale']),
    (['train', '--momentum', '1'], ['--momentum']),
    (['train', '--optimizer', 'sgd', '--warmup-strategy', 'sqrt'], ['--warmup-strategy']),
    (['train', '--optimizer', 'lars', '--batch-scale', '4'], ['--batch-scale']),
    (['train', '--batch-size', '5000'], ['batch_size']),
    (['train', '--batch-scale', 'many'], ['--batch-scale', 'many']),
    (['train', '--batch-scale', 'auto'], ['--batch-scale', 'auto', '--lr-scaling']),
    (['train', '--optimizer', 'sgd', '--lr-scaling', 'adascale'], ['--lr-scaling', 'sgd']),
    (['train', '--optimizer', 'lssgd', '--lr-scaling', 'sqrt', '--batch-scale', 'auto'],
     ['--batch-scale', 'lssgd']),
    (['train', '--batch-scale-bounds', '1', '4'], ['--batch-scale-bounds', 'auto']),
    (['train', '--lr-scaling', 'adascale', '--batch-scale', 'auto', '--batch-scale-bounds',
      '4', '2'], ['--batch-scale-bounds', 'LO must be <= HI']),
    (['schedule', '--batch-scale', '0.5'], ['--batch-scale']),
    (['schedule', '--every', '0'], ['--every']),
    (['nonsense'], ['COMMAND']),
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys, tmp_path):
    assert main(argv + (['--out', str(tmp_path)] if argv[0] == 'train' else [])) == 2
    captured = capsys.readouterr()
    _one_line_error(captured.err, *words)
    assert not list(tmp_path.iterdir())


def test_subprocess_errors_have_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'mx_lbsgd_demo', 'train', '--batch-size', '0'],
                          cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2
    _one_line_error(proc.stderr, 'mx-lbsgd train: error:', '--batch-size')
    assert proc.stdout == ''


def test_help_exits_0(capsys):
    assert main(['--help']) == 0
    assert 'schedule' in capsys.readouterr().out
    assert main(['train', '--help']) == 0
    text = capsys.readouterr().out
    assert '--warmup-strategy' in text and '--single' in text and '--no-baseline' in text


def _table(text):
    lines = [l.split() for l in text.strip().splitlines()[1:]]
    header, body = lines[0], lines[1:]
    return header, [[float(v) for v in row] for row in body]


@pytest.mark.parametrize('warmup, scale, steps, every', [(100, 8, 130, 7), (10, 4, 10, 1),
                                                         (0, 3, 5, 1), (33, 2.5, 40, 3)])
def test_schedule_matches_reference(warmup, scale, steps, every, capsys):
    assert main(['schedule', '--warmup-steps', str(warmup), '--batch-scale', str(scale),
                 '--steps', str(steps), '--every', str(every)]) == 0
    header, rows = _table(capsys.readouterr().out)
    assert header == ['step', 'linear', 'power2', 'sqrt']
    assert [int(r[0]) for r in rows] == list(range(0, steps + 1, every))
    for row in rows:
        for name, value in zip(header[1:], row[1:]):
            want = warmup_multiplier(int(row[0]), warmup, scale, name)
            assert value == pytest.approx(want, abs=1e-6), (name, row[0])


def test_schedule_plot_and_mxnet_columns(tmp_path, capsys):
    png = tmp_path / 'warmup.png'
    assert main(['schedule', '--warmup-steps', '20', '--batch-scale', '4', '--mxnet',
                 '--plot', str(png)]) == 0
    header, rows = _table(capsys.readouterr().out.split('wrote')[0])
    assert header[4:] == ['mxnet:linear', 'mxnet:power2', 'mxnet:sqrt']
    assert all(math.isnan(v) for v in rows[0][4:])     # MXNet never uses step 0
    for row in rows[1:]:    # MXNet's own LBSGD multiplier, measured, agrees
        assert row[1:4] == pytest.approx(row[4:7])
    assert png.read_bytes()[:4] == b'\x89PNG'


@pytest.fixture
def bench_calls(monkeypatch):
    """The benchmark module and arguments `mx-lbsgd bench` would run (nothing runs)."""
    seen = {}
    for name in ('bench_step', 'bench_loss_scale', 'bench_shapes'):
        monkeypatch.setattr('mx_lbsgd_bench.%s.main' % name,
                            lambda argv, prog=None, _name=name: seen.update(
                                module=_name, argv=argv, prog=prog))
    return seen


def test_bench_runs_the_benchmark_module(bench_calls):
    """No flag: bench_shapes (the benchmark the README reports); --step: the superseded
    bench_step; --loss-scale: bench_loss_scale. Each gets its own prog for its help."""
    seen = bench_calls
    assert main(['bench']) == 0
    assert seen == dict(module='bench_shapes', argv=[], prog='mx-lbsgd bench')
    assert main(['bench', '--rounds', '1', '--dtypes', 'float32']) == 0
    assert seen == dict(module='bench_shapes', argv=['--rounds', '1', '--dtypes', 'float32'],
                        prog='mx-lbsgd bench')
    assert main(['bench', '--step', '--rounds', '1']) == 0
    assert seen == dict(module='bench_step', argv=['--rounds', '1'], prog='mx-lbsgd bench --step')
    assert main(['bench', '--loss-scale', '--quick']) == 0
    assert seen == dict(module='bench_loss_scale', argv=['--quick'],
                        prog='mx-lbsgd bench --loss-scale')


def test_bench_shapes_runs_the_shapes_module(bench_calls):
    seen = bench_calls
    assert main(['bench', '--shapes', '--quick', '--only', 'sweep']) == 0   # the former flag
    assert seen == dict(module='bench_shapes', argv=['--quick', '--only', 'sweep'],
                        prog='mx-lbsgd bench')
    assert main(['bench', '--', '--help']) == 0
    assert seen['argv'] == ['--help']
    assert main(['bench', '--help-benchmark']) == 0
    assert seen['argv'] == ['--help']
    assert main(['bench', '--step', '--loss-scale']) == 2      # one benchmark at a time


@pytest.mark.parametrize('flags, prog', [([], 'mx-lbsgd bench'),
                                         (['--step'], 'mx-lbsgd bench --step'),
                                         (['--loss-scale'], 'mx-lbsgd bench --loss-scale')])
def test_bench_sub_help_names_the_command(flags, prog, capsys):
    assert main(['bench'] + flags + ['--help-benchmark']) == 0
    text = capsys.readouterr().out
    assert text.startswith('usage: %s [-h]' % prog), text[:200]
    assert main(['bench'] + flags + ['--', '--help']) == 0
    assert capsys.readouterr().out.startswith('usage: %s [-h]' % prog)


def test_bench_help_says_what_runs(capsys):
    assert main(['bench', '--help']) == 0
    text = ' '.join(capsys.readouterr().out.split())
    assert 'By default runs mx_lbsgd_bench.bench_shapes' in text
    assert '--step' in text and 'superseded' in text


def test_train_help_describes_every_panel_of_training_png(capsys):
    from mx_lbsgd_demo.plots import TRAINING_PANELS
    assert main(['train', '--help']) == 0
    text = ' '.join(capsys.readouterr().out.split())
    png = text[text.index('training.png ('):text.index(') to --out')]
    for panel in ('test accuracy', 'learning rate', 'loss scale', 'train loss',
                  'B_simple per epoch', 'lr gain per update', 'window length and batch'):
        assert panel in png, png
    # the four above, B_simple, the lr gain and the window (the help's seven)
    assert [p.key for p in TRAINING_PANELS] == ['accuracy', 'lr', 'loss_scale', 'loss',
                                                'noise', 'gain', 'window']


def test_bench_script_argument_error_passes_through(capsys):
    # the benchmark's own parser rejects this before any benchmarking starts
    assert main(['bench', '--dtypes', 'float64']) == 2
    _one_line_error(capsys.readouterr().err, 'mx-lbsgd bench: error:', 'float64')


# -- every command from the installed package, away from the source checkout --------------
#: Runs ``python -m mx_lbsgd_demo ARGV`` as the installed ``mx-lbsgd`` would, failing on any
#: file opened or imported from the checkout's benchmarks/ folder.
AWAY_FROM_CHECKOUT = textwrap.dedent('''
    import os, runpy, sys
    forbidden = os.path.join(sys.argv[1], 'benchmarks') + os.sep

    def refuse(event, args):
        if event == 'open' and isinstance(args[0], str) and \\
                os.path.abspath(args[0]).startswith(forbidden):
            raise RuntimeError('opened %s' % args[0])
    sys.addaudithook(refuse)
    sys.argv = ['mx-lbsgd'] + sys.argv[2:]
    runpy.run_module('mx_lbsgd_demo', run_name='__main__', alter_sys=True)
''')

INSTALLED_COMMANDS = [
    pytest.param(['train', '--single', '--epochs', '1', '--hidden', '16', '--no-steps',
                  '--quiet', '--out', 'run'], ['test accuracy', 'summary.json'], id='train'),
    pytest.param(['schedule', '--warmup-steps', '8', '--batch-scale', '4', '--mxnet',
                  '--plot', 'warmup.png'], ['mxnet:linear', 'wrote warmup.png'],
                 id='schedule-mxnet-plot'),
    pytest.param(['bench', '--step', '--rounds', '1', '--dtypes', 'float32', '--only',
                  'mxnet SGD (per-tensor)', 'lbsgd linear'], ['| float32 | lbsgd linear |'],
                 id='bench-step'),
    pytest.param(['bench', '--loss-scale', '--quick', '--rounds', '1', '--warmup', '0',
                  '--dtypes', 'float32'], ['| float32 | ours-hook |'], id='bench-loss-scale'),
    pytest.param(['bench', '--quick', '--rounds', '1', '--only', 'loss-scale'],
                 ['Loss-scaled gluon.Trainer step'], id='bench'),
    pytest.param(['study', '--tiny', '--methods', 'sgd', 'lbsgd-linear', '--batch-sizes',
                  '128', '--quiet', '--out', 'study'], ['| lbsgd-linear |', 'study.json'],
                 id='study'),
    pytest.param(['mlm', '--steps', '2', '--warmup', '1', '--batch-scale', '2', '--vocab',
                  '16', '--hidden', '8', '--layers', '1', '--seq-len', '8', '--batch-size', '4',
                  '--quiet', '--out', 'mlm'], ['mlm: 2 updates', 'mlm/summary.json'], id='mlm'),
    pytest.param(['launch', '-n', '1', '--timeout', '60', '--', sys.executable, '-c',
                  'import os; print("role", os.environ["DMLC_ROLE"])'], ['role worker'],
                 id='launch', marks=pytest.mark.multiprocess),
]


@pytest.mark.parametrize('argv, words', INSTALLED_COMMANDS)
def test_every_command_runs_from_the_installed_package(argv, words, tmp_path):
    """Each command's quick form runs in a folder outside the checkout, with the checkout
    off sys.path (only the installed mx_lbsgd), and never opens benchmarks/."""
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    proc = subprocess.run([sys.executable, '-c', AWAY_FROM_CHECKOUT, ROOT] + argv,
                          cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for word in words:
        assert word in proc.stdout, (word, proc.stdout)
    assert 'opened ' not in proc.stderr
    assert not (tmp_path / 'docs').exists()         # nothing written unasked


def test_launch_delegates(monkeypatch):
    seen = {}
    monkeypatch.setattr('mx_lbsgd.launch.main', lambda argv: seen.setdefault('argv', argv)
                        and 7)
    assert main(['launch', '-n', '2', '--', 'python', 'x.py']) == 7
    assert seen['argv'] == ['-n', '2', '--', 'python', 'x.py']


@pytest.mark.multiprocess
def test_train_dist_sync_two_workers_rank0_writes(tmp_path):
    out = tmp_path / 'dist'
    worker = [sys.executable, '-m', 'mx_lbsgd_demo', 'train', '--single', '--kvstore',
              'dist_sync', '--epochs', '1', '--no-steps', '--out', str(out)]
    # generous bounds, not deadlines: the job ends by itself in ~1 min when idle, and
    # took 80 s alone and more at load average 12 on 2 cores
    proc = subprocess.run([sys.executable, '-m', 'mx_lbsgd_demo', 'launch', '-n', '2',
                           '--timeout', '900', '--'] + worker, cwd=str(tmp_path),
                          env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # only kv.rank 0 reports, labelled by the launcher with its kv.rank
    assert proc.stdout.count('] test accuracy') == 1
    assert '[worker 0] test accuracy' in proc.stdout, proc.stdout
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['num_workers'] == 2 and summary['rank'] == 0
    assert summary['effective_batch_size'] == 64
    assert summary['steps_per_epoch'] == (1348 // 2) // 32
    # same result as any other run: the initial weights are broadcast before the first
    # step (a race inside MXNet's lazy broadcast gave ~0.2 on a loaded machine)
    assert summary['final_test_acc'] > 0.7
    assert len(_rows(out / 'metrics.csv')) == 1


# -- the demo extra (scikit-learn, tqdm, matplotlib) --------------------------------------
DEMO_TOP = ('sklearn', 'matplotlib', 'tqdm')


def _block_modules(monkeypatch, names):
    """Make `import NAME` (and its submodules) fail as if NAME were not installed."""
    for name in list(sys.modules):
        if name.split('.')[0] in names:
            monkeypatch.setitem(sys.modules, name, None)
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def _no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError('training started')
    monkeypatch.setattr('mx_lbsgd_demo.train.train', refuse)


def _demo_error(err, prog, *missing):
    _one_line_error(err, prog + ': error:', "pip install 'mx_lbsgd[demo]'", *missing)


@pytest.mark.parametrize('blocked, missing', [
    (('sklearn',), ['scikit-learn']), (('matplotlib',), ['matplotlib']), (('tqdm',), ['tqdm']),
    (DEMO_TOP, ['scikit-learn, matplotlib, tqdm'])])
def test_train_without_demo_extra_exits_2(blocked, missing, monkeypatch, tmp_path, capsys):
    _block_modules(monkeypatch, blocked)
    _no_training(monkeypatch)
    out = tmp_path / 'run'
    assert main(['train', '--epochs', '1', '--out', str(out)]) == 2
    captured = capsys.readouterr()
    _demo_error(captured.err, 'mx-lbsgd train', *missing)
    assert captured.out == '' and not out.exists()


def test_train_without_demo_extra_patched_import(monkeypatch, tmp_path, capsys):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.split('.')[0] == 'sklearn':
            raise ModuleNotFoundError("No module named 'sklearn'", name='sklearn')
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, '__import__', fake_import)
    _no_training(monkeypatch)
    assert main(['train', '--out', str(tmp_path / 'run')]) == 2
    _demo_error(capsys.readouterr().err, 'mx-lbsgd train', 'scikit-learn')
    assert not list(tmp_path.iterdir())


def test_commands_without_demo_extra(monkeypatch, tmp_path, capsys):
    _block_modules(monkeypatch, DEMO_TOP)
    # what needs no demo extra still works
    assert main(['--help']) == 0
    assert main(['train', '--help']) == 0
    assert main(['schedule', '--warmup-steps', '4', '--batch-scale', '2']) == 0
    assert 'linear' in capsys.readouterr().out
    # bad arguments are still reported as such
    assert main(['train', '--batch-size', '0']) == 2
    _one_line_error(capsys.readouterr().err, '--batch-size')
    # what needs it: one line, status 2, nothing written
    png = tmp_path / 'warmup.png'
    assert main(['schedule', '--plot', str(png)]) == 2
    captured = capsys.readouterr()
    _demo_error(captured.err, 'mx-lbsgd schedule', '--plot', 'matplotlib')
    assert captured.out == '' and not png.exists()
    assert main(['study', '--tiny', '--out', str(tmp_path / 'study')]) == 2
    _demo_error(capsys.readouterr().err, 'mx-lbsgd study', 'scikit-learn, matplotlib')
    assert not list(tmp_path.iterdir())


def test_import_needs_no_demo_extra(tmp_path):
    # a fresh interpreter: importing the package and the CLI, --help and a schedule
    # table import none of the demo modules (they are blocked, and must stay unimported)
    code = textwrap.dedent('''
        import sys
        sys.modules.update(sklearn=None, matplotlib=None, tqdm=None)
        import mx_lbsgd, mx_lbsgd_demo.cli, mx_lbsgd_demo.train, mx_lbsgd_demo.study
        from mx_lbsgd_demo.cli import main
        assert main(['schedule', '--steps', '2']) == 0
        assert main(['train', '--help']) == 0
        for name in ('sklearn', 'matplotlib', 'tqdm'):
            assert sys.modules[name] is None, name
        sys.exit(main(['train', '--out', 'run']))
    ''')
    proc = subprocess.run([sys.executable, '-c', code], cwd=str(tmp_path),
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    _demo_error(proc.stderr, 'mx-lbsgd train', 'scikit-learn, matplotlib, tqdm')
    assert not (tmp_path / 'run').exists()


# -- --out ---------------------------------------------------------------------------------
def _file(tmp_path):
    path = tmp_path / 'a-file'
    path.write_text('not a folder')
    return path


@pytest.mark.parametrize('make_out, words', [
    (lambda tmp: _file(tmp) / 'run', ['a-file is not a folder']),
    (lambda tmp: _file(tmp) / 'deeper' / 'run', ['a-file is not a folder']),
    (lambda tmp: _file(tmp), ['exists and is not a folder']),
    (lambda tmp: '/proc/mx-lbsgd-no-such-dir/run', ['cannot create a folder in /proc']),
])
def test_train_unwritable_out_exits_2_before_training(make_out, words, monkeypatch,
                                                      tmp_path, capsys):
    _no_training(monkeypatch)
    out = str(make_out(tmp_path))
    assert main(['train', '--out', out]) == 2
    captured = capsys.readouterr()
    _one_line_error(captured.err, 'mx-lbsgd train: error: argument --out:', out,
                    'not writable', *words)
    assert captured.out == ''
    assert [p.name for p in tmp_path.iterdir()] in ([], ['a-file'])


@pytest.mark.skipif(not hasattr(os, 'geteuid') or os.geteuid() == 0,
                    reason='root writes into read-only folders')
def test_train_read_only_out_exits_2(monkeypatch, tmp_path, capsys):
    _no_training(monkeypatch)
    ro = tmp_path / 'ro'
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(['train', '--out', str(ro / 'run')]) == 2
    finally:
        ro.chmod(0o755)
    _one_line_error(capsys.readouterr().err, '--out', 'not writable')
    assert not list(ro.iterdir())


def test_train_writable_out_check_leaves_nothing(monkeypatch, tmp_path):
    # a new nested --out passes the check without being created before training
    seen = []

    def stop(cfg, **callbacks):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        raise KeyboardInterrupt
    monkeypatch.setattr('mx_lbsgd_demo.train.train', stop)
    assert main(['train', '--out', str(tmp_path / 'new' / 'run')]) == 130
    assert seen == [[]]


# -- the warmup strategies come from mx_lbsgd.schedules --------------------------------------
def test_warmup_strategy_choices_read_the_registry(monkeypatch, capsys):
    from mx_lbsgd import schedules
    from mx_lbsgd_demo import schedule_command, train_command
    assert schedule_command.SHAPES == tuple(schedules.WARMUP_SHAPES)
    action = next(a for a in train_command._parser()._actions
                  if '--warmup-strategy' in a.option_strings)
    assert tuple(action.choices) == tuple(schedules.WARMUP_STRATEGIES)
    registry = {name: None for name in schedules.WARMUP_STRATEGIES}   # a mapping works too
    registry['cubic'] = None
    monkeypatch.setattr(schedules, 'WARMUP_STRATEGIES', registry)
    assert main(['train', '--help']) == 0
    assert 'cubic' in capsys.readouterr().out
