"""``mx-lbsgd``: bad inputs and unwritable outputs are one line (exit 2) before any work;
a write that fails after the work keeps the results elsewhere and says where (issue 31)."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd_bench import bench_loss_scale, bench_shapes, bench_step
from mx_lbsgd_demo import args as demo_args
from mx_lbsgd_demo import study
from mx_lbsgd_demo.cli import main

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNWRITABLE = '/proc/mx-lbsgd-test/x'       # /proc refuses new files, even to root


def _one_line(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert 'Traceback' not in err and ': error: ' in lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Every benchmark's and the study's work fails the test if it starts."""
    def refuse(*args, **kwargs):
        raise AssertionError('work started')
    for module, name in ((bench_step, 'run'), (bench_loss_scale, 'run'),
                         (bench_shapes, 'sweep'), (bench_shapes, 'resnet'),
                         (bench_shapes, 'loss_scale'), (study, 'run_many')):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr('mx_lbsgd_demo.train.train', refuse)
    monkeypatch.setattr('mx_lbsgd.launch.launch', refuse)


@pytest.mark.parametrize('argv, words', [
    (['study', '--tiny', '--out', UNWRITABLE], ['mx-lbsgd study: error:', '--out', UNWRITABLE]),
    (['schedule', '--plot', UNWRITABLE + '.png'], ['mx-lbsgd schedule: error:', '--plot']),
    (['schedule', '--plot', '/'], ['--plot', 'is a folder']),
    (['bench', '--json', UNWRITABLE], ['mx-lbsgd bench: error:', '--json', UNWRITABLE]),
    (['bench', '--plot', UNWRITABLE + '.png'], ['mx-lbsgd bench: error:', '--plot']),
    (['bench', '--plot', 'x.png', '--only', 'resnet'], ['--plot', 'sweep', '--only']),
    (['bench', '--step', '--json', UNWRITABLE], ['mx-lbsgd bench --step: error:', '--json']),
    (['bench', '--loss-scale', '--json', UNWRITABLE],
     ['mx-lbsgd bench --loss-scale: error:', '--json']),
    (['bench', '--rounds', '0'], ['mx-lbsgd bench: error:', '--rounds', '>= 1']),
    (['bench', '--rounds', '-1'], ['--rounds', '>= 1']),
    (['bench', '--step', '--rounds', '0'], ['mx-lbsgd bench --step: error:', '--rounds']),
    (['bench', '--step', '--rounds', '-1'], ['--rounds']),
    (['bench', '--step', '--only', 'nonsense'], ['--only', 'nonsense']),
    (['bench', '--loss-scale', '--quick', '--rounds', '0'], ['--rounds', '>= 1']),
    (['bench', '--loss-scale', '--warmup', '-1'], ['--warmup']),
    # found by the sweep of every command
    (['bench', '--plot', 'p.txt'], ['--plot', 'p.txt', 'png']),
    (['schedule', '--plot', 'w.txt'], ['mx-lbsgd schedule: error:', '--plot', 'w.txt', 'png']),
    (['train', '--seed', '-1'], ['mx-lbsgd train: error:', '--seed', '>= 0']),
    (['train', '--seed', '2147483648'], ['--seed', '<= 2147483647']),
    (['study', '--seed', '2147483648'], ['mx-lbsgd study: error:', '--seed', '<= 2147483647']),
    (['launch', '-n', '0', '--', 'true'], ['mx-lbsgd launch: error:', '-n', '>= 1']),
    (['launch', '-n', '1'], ['mx-lbsgd launch: error:', 'command']),
    (['launch', '-n', '1', '--timeout', '0', '--', 'true'], ['--timeout', '> 0']),
])
def test_bad_input_or_output_is_one_line_before_any_work(argv, words, no_work, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_line(captured.err, *words)
    assert captured.out == ''          # nothing computed, nothing printed


def test_study_writes_into_a_temporary_folder_when_out_fails_late(tmp_path, capsys):
    """--out was writable when checked, then is not (a file took its place): the
    results go to a temporary folder, named on stderr and in the 'wrote' line."""
    blocked = tmp_path / 'out'
    blocked.write_text('not a folder')
    result = {'trainings': 1, 'cells': []}
    folder = study._write_results('mx-lbsgd study', str(blocked), result, '| table |',
                                  lambda result, path: open(path, 'wb').close())
    try:
        assert folder != str(blocked)
        with open(os.path.join(folder, 'study.json')) as f:
            assert json.load(f) == result
        with open(os.path.join(folder, 'study.md')) as f:
            assert f.read() == '| table |\n'
        assert os.path.exists(os.path.join(folder, 'study.png'))
        _one_line(capsys.readouterr().err, '--out', str(blocked), 'temporary folder')
    finally:
        for name in ('study.json', 'study.md', 'study.png'):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


def test_benchmark_json_kept_when_the_write_fails_late(tmp_path, capsys):
    gone = tmp_path / 'gone'
    gone.write_text('')                 # a file where the folder should be
    results = {'rows': [1, 2, 3]}
    with pytest.raises(SystemExit) as exit_:
        bench_step.save_json(str(gone / 'r.json'), results, 'mx-lbsgd bench')
    assert exit_.value.code == 2
    line = _one_line(capsys.readouterr().err, 'mx-lbsgd bench: error:', '--json',
                     str(gone / 'r.json'), 'kept in')
    spare = line.rsplit('kept in ', 1)[1]
    try:
        with open(spare) as f:
            assert json.load(f) == results
    finally:
        os.remove(spare)


def test_schedule_plot_error_after_the_table(tmp_path, monkeypatch, capsys):
    """If the plot cannot be written after all, the printed table stays the result and the
    error is one line naming --plot."""
    def fail(*args):
        raise PermissionError(13, 'Permission denied')
    monkeypatch.setattr('mx_lbsgd_demo.plots.plot_schedule', fail)
    png = tmp_path / 'w.png'
    assert main(['schedule', '--warmup-steps', '4', '--batch-scale', '2', '--plot',
                 str(png)]) == 2
    captured = capsys.readouterr()
    assert 'linear' in captured.out                # the table was printed
    _one_line(captured.err, '--plot', str(png), 'Permission denied')


def test_writable_file_check_leaves_nothing(tmp_path):
    target = tmp_path / 'new' / 'deeper' / 'r.json'
    demo_args.require_writable_file('p', '--json', str(target))
    assert list(tmp_path.iterdir()) == []


def test_unwritable_out_before_training_from_a_process(tmp_path):
    """The installed command, in a process: study --tiny --out /proc/... fails at once."""
    proc = subprocess.run([sys.executable, '-m', 'mx_lbsgd_demo', 'study', '--tiny', '--out',
                           UNWRITABLE], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    _one_line(proc.stderr, 'mx-lbsgd study: error: argument --out', UNWRITABLE)
    assert proc.stdout == ''


def test_bench_writes_no_plot_unasked(tmp_path, monkeypatch, capsys):
    """bench's sweep section draws a plot only with --plot (it wrote ./docs/ before)."""
    drawn = []
    monkeypatch.setattr(bench_shapes, 'plot', lambda rows, path: drawn.append(path))
    monkeypatch.chdir(tmp_path)
    assert main(['bench', '--quick', '--rounds', '1', '--only', 'sweep',
                 '--dtypes', 'float32']) == 0
    assert drawn == [] and list(tmp_path.iterdir()) == []
    assert main(['bench', '--quick', '--rounds', '1', '--only', 'sweep', '--dtypes',
                 'float32', '--plot', str(tmp_path / 'p.png')]) == 0
    assert drawn == [str(tmp_path / 'p.png')]


@pytest.mark.parametrize('module', ['bench_lamb', 'bench_norms', 'bench_noise_scale',
                                    'bench_sparse', 'bench_dist', 'bench_amp'])
@pytest.mark.parametrize('argv, words', [(['--rounds', '0'], ['--rounds', '>= 1']),
                                         (['--json', UNWRITABLE], ['--json', UNWRITABLE])])
def test_benchmark_scripts_check_their_arguments_first(module, argv, words, capsys):
    """The benchmarks run as scripts (python benchmarks/X.py): the same one-line errors
    before any work (--rounds 0 divided by zero or took a median of nothing)."""
    import importlib
    main_ = importlib.import_module('mx_lbsgd_bench.' + module).main
    with pytest.raises(SystemExit) as exit_:
        main_(argv)
    assert exit_.value.code == 2
    _one_line(capsys.readouterr().err, *words)
