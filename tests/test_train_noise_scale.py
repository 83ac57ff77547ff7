"""``mx-lbsgd train`` records the gradient noise scale B_simple (mx_lbsgd.GradientNoiseScale)
per epoch where the run has two batch sizes, and null elsewhere; the monitor changes no
training number."""
import csv
import json
import re
import struct

import numpy as np
import pytest

from mx_lbsgd_demo import train as train_module
from mx_lbsgd_demo.cli import main
from mx_lbsgd_demo.config import DEMO_DEFAULTS, ConfigError, TrainConfig
from mx_lbsgd_demo.train_command import _noise_scale_line

pytestmark = pytest.mark.cli

NOISE_COLUMNS = ('b_simple', 'gradient_sq', 'trace_sigma')
MEASURED_LINE = re.compile(r'^gradient noise scale B_simple ~ \S+ \(last epoch\); '
                           r'effective batch (\d+) is \S+x it: ', re.M)


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _png_width(path):
    with open(path, 'rb') as f:
        head = f.read(24)
    assert head[:8] == b'\x89PNG\r\n\x1a\n'
    return struct.unpack('>I', head[16:20])[0]


@pytest.mark.parametrize('argv, batch', [
    pytest.param(['--epochs', '2'], 256, id='default-main-run-and-baseline'),
    pytest.param(['--optimizer', 'lblamb', '--epochs', '2', '--no-baseline', '--no-steps'],
                 256, id='lblamb'),
])
def test_measured_run_writes_b_simple_everywhere(argv, batch, tmp_path, capsys):
    out = tmp_path / 'run'
    assert main(['train', '--quiet', '--out', str(out)] + argv) == 0
    printed = capsys.readouterr().out
    rows = _rows(out / 'metrics.csv')
    for row in rows:
        for key in NOISE_COLUMNS:
            float(row[key])                     # present in every epoch, a number
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['final_b_simple'] == pytest.approx(float(rows[-1]['b_simple']))
    assert summary['final_b_simple'] > 0
    assert summary['final_trace_sigma'] == pytest.approx(
        summary['final_b_simple'] * summary['final_gradient_sq'])
    assert summary['noise_scale_interval'] == 10
    assert summary['noise_scale_not_measured'] is None
    # every applied update entered the estimate (the skipped ones are not applied)
    assert summary['noise_scale_updates'] == summary['updates'] > 0
    assert '5 panels' in summary['plots']['training.png']
    assert 'B_simple' in summary['plots']['training.png']
    assert _png_width(out / 'training.png') > 1000     # the third column of panels
    match = MEASURED_LINE.search(printed)
    assert match and int(match.group(1)) == batch, printed
    if 'baseline' in summary:
        base = summary['baseline']
        assert base['final_b_simple'] is None and base['noise_scale_interval'] is None
        assert 'sgd' in base['noise_scale_not_measured']
        assert {r['b_simple'] for r in _rows(out / 'baseline-metrics.csv')} == {''}


@pytest.mark.parametrize('argv, reason', [
    pytest.param(['--epochs', '1', '--no-baseline', '--noise-scale-interval', '0'],
                 'off', id='interval-0'),
    pytest.param(['--single', '--epochs', '1'], 'one batch size', id='single-batch-scale-1'),
    pytest.param(['--optimizer', 'lssgd', '--no-baseline', '--epochs', '1'],
                 'one batch size', id='lssgd-one-batch-size'),
    pytest.param(['--optimizer', 'mxnet-lbsgd', '--no-baseline', '--epochs', '1'],
                 "not one of mx_lbsgd's optimizers", id='mxnet-optimizer'),
])
def test_unmeasured_run_records_null(argv, reason, tmp_path, capsys):
    out = tmp_path / 'run'
    assert main(['train', '--quiet', '--no-steps', '--out', str(out)] + argv) == 0
    printed = capsys.readouterr().out
    assert {r['b_simple'] for r in _rows(out / 'metrics.csv')} == {''}
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['final_b_simple'], summary['final_gradient_sq'],
            summary['final_trace_sigma'], summary['noise_scale_interval'],
            summary['noise_scale_updates']) == (None, None, None, None, 0)
    assert reason in summary['noise_scale_not_measured']
    assert '4 panels' in summary['plots']['training.png']
    line = [l for l in printed.splitlines() if l.startswith('gradient noise scale')]
    assert len(line) == 1 and line[0].startswith('gradient noise scale: not measured, ')
    assert reason in line[0]
    assert not MEASURED_LINE.search(printed)


@pytest.mark.parametrize('value, words', [
    pytest.param('-1', ['must be >= 0, got -1'], id='negative'),
    pytest.param('1.5', ["invalid integer '1.5'"], id='not-an-integer'),
    pytest.param('ten', ["invalid integer 'ten'"], id='not-a-number'),
])
def test_bad_interval_exits_2_naming_the_option(value, words, tmp_path, capsys):
    assert main(['train', '--noise-scale-interval', value, '--out', str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'Traceback' not in err
    assert 'mx-lbsgd train: error: argument --noise-scale-interval: ' in err
    for word in words:
        assert word in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('value', [pytest.param(-1, id='negative'),
                                   pytest.param(2.0, id='float'),
                                   pytest.param(True, id='bool')])
def test_train_refuses_a_bad_interval(value):
    with pytest.raises(ConfigError, match='noise_scale_interval must be an int >= 0'):
        train_module.train(TrainConfig(), noise_scale_interval=value)


def _train_keeping_the_net(monkeypatch, cfg, interval):
    runs = []
    real = train_module._Run

    def keep(*args):
        runs.append(real(*args))
        return runs[-1]
    monkeypatch.setattr(train_module, '_Run', keep)
    result = train_module.train(cfg, noise_scale_interval=interval)
    weights = [p.data().asnumpy() for p in runs[0].net.collect_params().values()]
    return result, weights


def test_monitor_changes_no_training_number(monkeypatch):
    """The default main run (2 epochs) trained without the monitor, and with it reading at
    every update and every 10th: the same weights, losses, accuracies and skips, bit for
    bit; and the per-epoch estimates do not depend on the interval."""
    cfg = TrainConfig(**dict(DEMO_DEFAULTS, epochs=2))
    plain, plain_weights = _train_keeping_the_net(monkeypatch, cfg, 0)
    per_epoch = []
    for interval in (1, 10):
        watched, weights = _train_keeping_the_net(monkeypatch, cfg, interval)
        for a, b in zip(plain_weights, weights):
            np.testing.assert_array_equal(a, b)
        assert [s['loss'] for s in watched['steps']] == [s['loss'] for s in plain['steps']]
        for key in ('final_test_acc', 'skipped_steps', 'updates', 'final_loss_scale'):
            assert watched[key] == plain[key], key
        per_epoch.append([r['b_simple'] for r in watched['epochs']])
    assert plain['skipped_steps'] >= 1           # the loss scaler did skip windows
    assert per_epoch[0] == per_epoch[1] and None not in per_epoch[0]


def _result(b_simple, batch=256, interval=10, updates=150, missing=None):
    return dict(final_b_simple=b_simple, effective_batch_size=batch,
                noise_scale_interval=interval, noise_scale_updates=updates,
                noise_scale_not_measured=missing)


@pytest.mark.parametrize('result, words', [
    pytest.param(_result(2048.0), ['0.12x it', 'well below B_simple', 'steps ~ 9x',
                                   'examples ~ 1.1x'], id='well-below'),
    pytest.param(_result(200.0), ['1.3x it', 'near B_simple', 'saturate'], id='near'),
    pytest.param(_result(72.0), ['3.6x it', 'beyond B_simple', 'fewer steps per example',
                                 'examples ~ 4.6x'], id='beyond'),
    pytest.param(_result(None), ['no usable estimate after 150 updates'], id='no-estimate'),
    pytest.param(_result(-3.0), ['no usable estimate'], id='negative-estimate'),
    pytest.param(_result(None, interval=None, missing='off (noise_scale_interval 0)'),
                 ['not measured, off'], id='not-measured'),
])
def test_final_line_says_where_the_batch_stands(result, words):
    line = _noise_scale_line(result)
    assert '\n' not in line
    for word in words:
        assert word in line, line
