"""benchmarks/study.py: the tiny configuration runs end to end and writes its outputs."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ['sgd', 'lbsgd-linear', 'lbsgd-sqrt', 'lbsgd-power2', 'lbsgd-lars', 'fp16-scaled',
           'fp16-unscaled']


def test_study_tiny_writes_table_json_and_plot(tmp_path, capsys):
    assert main(['study', '--tiny', '--quiet', '--out', str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert '| method | batch 32 | batch 128 |' in printed
    data = json.loads((tmp_path / 'study.json').read_text())
    assert data['settings']['batch_sizes'] == [32, 128]
    assert data['settings']['epochs'] == 2 and data['settings']['seeds'] == 1
    assert {(r['method'], r['batch']) for r in data['summary']} == {
        (m, b) for m in METHODS for b in (32, 128)}
    for run in data['runs']:
        assert 0.0 <= run['final_test_acc'] <= 1.0 and len(run['test_acc']) == 2
        lb = run['config']['optimizer'] == 'lbsgd'
        assert run['config']['batch_size'] * run['config']['batch_scale'] == run['batch']
        assert run['config']['batch_size'] == (32 if lb else run['batch'])
        if run['method'].startswith('fp16'):
            assert 0.0 <= run['underflow_fraction'] <= 1.0
            assert run['config']['dtype'] == 'float16'
    runs = {(r['method'], r['batch']): r for r in data['runs']}
    # linear scaling rule: the same final lr for sgd and the warmed-up lbsgd
    base = data['settings']['base_lr']
    assert runs[('sgd', 128)]['config']['lr'] == pytest.approx(4 * base)
    assert runs[('lbsgd-sqrt', 128)]['config']['lr'] == pytest.approx(base)
    assert runs[('lbsgd-sqrt', 128)]['config']['batch_scale'] == 4
    assert runs[('fp16-unscaled', 32)]['skipped_steps'] == 0
    # at batch 32 lbsgd has nothing to warm up: it is sgd
    assert runs[('lbsgd-linear', 32)]['final_test_acc'] == pytest.approx(
        runs[('sgd', 32)]['final_test_acc'], abs=0.01)
    assert (tmp_path / 'study.png').read_bytes()[:4] == b'\x89PNG'
    assert (tmp_path / 'study.md').read_text().startswith('Final test accuracy')


@pytest.mark.parametrize('argv, words', [(['--batch-sizes', '48'], 'multiple of 32'),
                                         (['--batch-sizes', '2048'], '<= 1344'),
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
                           '--tiny', '--methods', 'sgd', 'lbsgd-sqrt', '--batch-sizes', '64',
                           '--jobs', '2', '--quiet', '--out', str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '| sgd |' in proc.stdout and '| lbsgd-sqrt |' in proc.stdout
    data = json.loads((tmp_path / 'study.json').read_text())
    assert data['settings']['batch_sizes'] == [64] and data['settings']['jobs'] == 2
    assert [r['method'] for r in data['runs']] == ['sgd', 'lbsgd-sqrt']    # in order
