"""mx-lbsgd study (mx_lbsgd.demo.study): the tiny configuration runs end to end and writes
its outputs; benchmarks/study.py wraps it."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd.demo.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ['sgd', 'sgd-warmup', 'lbsgd-linear', 'lbsgd-sqrt', 'lbsgd-power2', 'lbsgd-lars',
           'fp16-scaled', 'fp16-unscaled']


def test_study_tiny_writes_table_json_and_plot(tmp_path, capsys):
    assert main(['study', '--tiny', '--quiet', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert '| method | batch 64 | batch 128 |' in printed
    assert 'Largest batch whose mean test accuracy is within 1 point' in printed
    data = json.loads((tmp_path / 'study.json').read_text())
    settings = data['settings']
    assert settings['batch_sizes'] == [64, 128] and settings['dataset'] == 'digits'
    assert settings['epochs'] == 2 and settings['seeds'] == 1
    assert settings['grid'] == [0.05, 0.1] and settings['lars_grid'] == [1.0, 2.0]
    assert {(r['method'], r['batch']) for r in data['summary']} == {
        (m, b) for m in METHODS for b in (64, 128)}
    assert set(data['largest_batch']) == set(METHODS)
    # at batch 64 the five fp32 non-LARS methods are one training, trained once
    assert data['distinct_trainings'] == 2 * (4 + 8)
    for run in data['grid_runs'] + data['runs']:
        cfg = run['config']
        assert 0.0 <= run['final_test_acc'] <= 1.0 and len(run['test_acc']) == 2
        assert 0.0 <= run['final_val_acc'] <= 1.0 and len(run['val_acc']) == 2
        assert cfg['val_fraction'] == 0.15 and cfg['lr_decay'] == 'cosine'
        assert cfg['batch_size'] * cfg['batch_scale'] == run['batch']
        lb = cfg['optimizer'] == 'lbsgd'
        assert cfg['batch_size'] == (64 if lb else run['batch'])
        if run['method'].startswith('fp16'):
            assert 0.0 <= run['underflow_fraction'] <= 1.0 and cfg['dtype'] == 'float16'
    runs = {(r['method'], r['batch']): r for r in data['runs']}
    # the linear scaling rule: sgd at 128 trains with 2 g; lbsgd warms g up to 2 g
    g = runs[('sgd', 128)]['g']
    assert runs[('sgd', 128)]['config']['lr'] == pytest.approx(2 * g)
    assert runs[('sgd-warmup', 128)]['config']['warmup_from'] == runs[('sgd-warmup', 128)]['g']
    assert runs[('lbsgd-linear', 128)]['config']['lr'] == runs[('lbsgd-linear', 128)]['g']
    assert runs[('lbsgd-lars', 128)]['config']['lr'] == pytest.approx(
        runs[('lbsgd-lars', 128)]['g'] * 2 ** 0.5)
    # the lr is the grid value with the best validation accuracy (seed 0)
    for key, run in runs.items():
        grid = [r for r in data['grid_runs'] if (r['method'], r['batch']) == key]
        assert len(grid) == 2
        assert run['final_val_acc'] == max(r['final_val_acc'] for r in grid)
    # at batch 64 every fp32 non-LARS method is the same run as sgd
    assert runs[('lbsgd-sqrt', 64)]['final_test_acc'] == runs[('sgd', 64)]['final_test_acc']
    reference = data['reference_acc']
    assert reference == runs[('sgd', 64)]['final_test_acc']
    for method, batch in data['largest_batch'].items():
        if batch is not None:
            assert runs[(method, batch)]['final_test_acc'] >= reference - 0.01
    assert (tmp_path / 'study.png').read_bytes()[:4] == b'\x89PNG'
    assert (tmp_path / 'study.md').read_text().startswith('Final test accuracy')


@pytest.mark.parametrize('argv, words', [(['--batch-sizes', '96'], 'multiple of 64'),
                                         (['--batch-sizes', '20480'], '<= 10314'),
                                         (['--grid', '0'], '--grid'),
                                         (['--seeds', '0'], '--seeds'),
                                         (['--methods', 'adam'], 'adam')])
def test_study_bad_arguments_exit_2_with_one_line(argv, words, tmp_path, capsys):
    assert main(['study', '--out', str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith('mx-lbsgd study: error: ') and words in err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err
    assert not list(tmp_path.iterdir())


def test_study_script_runs_directly_in_two_processes(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'study.py'),
                           '--tiny', '--methods', 'sgd', 'lbsgd-sqrt', '--batch-sizes', '128',
                           '--jobs', '2', '--quiet', '--out', str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '| sgd |' in proc.stdout and '| lbsgd-sqrt |' in proc.stdout
    data = json.loads((tmp_path / 'study.json').read_text())
    assert data['settings']['batch_sizes'] == [128] and data['settings']['jobs'] == 2
    assert [r['method'] for r in data['runs']] == ['sgd', 'lbsgd-sqrt']    # in order


def test_study_extends_the_grid_past_its_best_end(tmp_path):
    # a 2-value grid always has its best at an end: one extension each way at most
    assert main(['study', '--tiny', '--quiet', '--methods', 'sgd', '--batch-sizes', '128',
                 '--grid-extend', '1', '--out', str(tmp_path)]) == 0
    data = json.loads((tmp_path / 'study.json').read_text())
    tried = sorted(r['g'] for r in data['grid_runs'])
    assert len(tried) == 3 and tried in ([0.025, 0.05, 0.1], [0.05, 0.1, 0.2])
    best = max(data['grid_runs'], key=lambda r: r['final_val_acc'])
    assert data['runs'][0]['g'] == best['g']
    assert data['summary'][0]['grid_val_acc'] == [[r['g'], r['final_val_acc']] for r in
                                                  sorted(data['grid_runs'],
                                                         key=lambda r: r['g'])]


def test_pool_workers_exit_when_the_study_is_killed():
    """run_many's spawned workers watch their parent: a SIGKILLed study leaves none behind
    (before, its workers trained on, reparented)."""
    import time
    code = (
        'import multiprocessing, os, signal, time\n'
        'from concurrent.futures import ProcessPoolExecutor\n'
        'from mx_lbsgd.demo.study import _exit_with_parent\n'
        'if __name__ == "__main__":\n'
        '    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),\n'
        '                               initializer=_exit_with_parent,\n'
        '                               initargs=(os.getpid(),))\n'
        '    print(pool.submit(os.getpid).result(), flush=True)\n'
        '    pool.submit(time.sleep, 120)\n'
        '    os.kill(os.getpid(), signal.SIGKILL)\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True,
                          timeout=120, cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == -9
    worker = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists('/proc/%d' % worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists('/proc/%d' % worker)
