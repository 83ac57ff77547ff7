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
from mx_lbsgd_demo.summary import NOISE_ACCOUNT_KEYS, noise_scale_account
from mx_lbsgd_demo.train_command import _noise_scale_line

pytestmark = pytest.mark.cli

NOISE_COLUMNS = ('b_simple', 'gradient_sq', 'trace_sigma')
MEASURED_LINE = re.compile(r'^gradient noise scale B_simple ~ \S+ \(last epoch\)'
                           r'(?:, from \d+ of the \d+ updates \([^)]*\))?; '
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


def _result(b_simple, batch=256, interval=10, updates=150, missing=None, epochs=None,
            entered=None, history=None):
    """A result with what the closing line reads; `epochs`: [(B_simple, |G|^2, tr(Sigma))]
    per epoch (default: one epoch of `b_simple`)."""
    if epochs is None:
        epochs = [(b_simple, None, None) if b_simple is None
                  else (b_simple, 1.0, b_simple)]
    rows = [dict(epoch=e, b_simple=b, gradient_sq=g, trace_sigma=t)
            for e, (b, g, t) in enumerate(epochs, 1)]
    if entered is None:
        entered = updates if interval is not None and rows[-1]['gradient_sq'] is not None \
            else 0
    return dict(final_b_simple=rows[-1]['b_simple'], effective_batch_size=batch,
                noise_scale_interval=interval, noise_scale_updates=entered,
                noise_scale_not_measured=missing, epochs=rows, updates=updates,
                batch_history=history)


#: The run of the issue: B_simple 254 at epoch 2 (of 4), then the smoothed |G|^2 below 0;
#: 224 of its 602 updates had a window of 1 micro-batch.
CONVERGED = _result(None, batch=64, updates=602, entered=378, epochs=[
    (50.0, 1.0, 50.0), (254.0, 0.1, 25.4), (None, -0.01, 0.4), (None, -0.02, 0.3)],
    history=[dict(update=0, batch_scale=1), dict(update=16, batch_scale=2),
             dict(update=64, batch_scale=1), dict(update=272, batch_scale=2)])


@pytest.mark.parametrize('result, words', [
    pytest.param(_result(2048.0), ['0.12x it', 'well below B_simple', 'steps ~ 9x',
                                   'examples ~ 1.1x'], id='well-below'),
    pytest.param(_result(200.0), ['1.3x it', 'near B_simple', 'saturate'], id='near'),
    pytest.param(_result(72.0), ['3.6x it', 'beyond B_simple', 'fewer steps per example',
                                 'examples ~ 4.6x'], id='beyond'),
    pytest.param(_result(None), ['no usable estimate at the last epoch (no update entered '
                                 'the estimate)'], id='no-estimate'),
    pytest.param(_result(None, epochs=[(-3.0, 1.0, -3.0)]),
                 ['no usable estimate at the last epoch (the smoothed tr(Sigma) is not '
                  'positive at the last epoch', 'estimated from all 150 updates'],
                 id='negative-estimate'),
    pytest.param(CONVERGED, ['no usable estimate at the last epoch (the smoothed |G|^2 is '
                             'not positive from epoch 3 on', 'B_simple ~ 254 at epoch 2',
                             'estimated from 378 of the 602 updates (224 had a window of '
                             '1 micro-batch'], id='converged'),
    pytest.param(_result(80.0, batch=64, updates=100, entered=84,
                         history=[dict(update=0, batch_scale=1),
                                  dict(update=16, batch_scale=2)]),
                 ['B_simple ~ 80 (last epoch), from 84 of the 100 updates (16 had a window '
                  'of 1 micro-batch', '0.8x it'], id='auto-measured'),
    pytest.param(_result(None, interval=None, missing='off (noise_scale_interval 0)'),
                 ['not measured, off'], id='not-measured'),
])
def test_final_line_says_where_the_batch_stands(result, words):
    line = _noise_scale_line(result)
    assert '\n' not in line
    for word in words:
        assert word in line, line


def test_the_account_of_a_converged_run():
    assert noise_scale_account(CONVERGED) == dict(
        last_b_simple=254.0, last_b_simple_epoch=2, noise_scale_left_out={'window_1': 224},
        noise_scale_unusable='the smoothed |G|^2 is not positive from epoch 3 on: the mean '
                             'gradient is too small against its noise for the two batch '
                             'sizes to resolve')


EPOCH_LINE = re.compile(r'^epoch +(\d+) .*$', re.M)


def test_adascale_auto_run_gives_one_account(tmp_path, capsys):
    """--lr-scaling adascale --batch-scale auto (whose windows, chosen from measured
    times, differ from run to run): the per-epoch lines show the usable B_simple values
    (n/a for the others), and the closing line reports the last one shown, or why the last
    epoch has none, with the update count of the results line; summary.json says the same,
    and every update the estimate left out had a window of 1 micro-batch."""
    out = tmp_path / 'run'
    assert main(['train', '--no-baseline', '--epochs', '5', '--lr-scaling', 'adascale',
                 '--batch-scale', 'auto', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / 'summary.json').read_text())
    assert set(NOISE_ACCOUNT_KEYS) <= set(summary)
    rows = _rows(out / 'metrics.csv')
    lines = list(EPOCH_LINE.finditer(printed))
    assert len(lines) == len(rows) == 5
    shown = []
    for row, match in zip(rows, lines):
        value = re.search(r'  B_simple (\S+)', match.group(0))
        if row['b_simple'] and float(row['b_simple']) > 0:
            assert float(value.group(1)) == pytest.approx(float(row['b_simple']), rel=5e-3)
            shown.append((int(row['epoch']), float(row['b_simple'])))
        elif row['gradient_sq']:
            assert value.group(1) == 'n/a', match.group(0)
        else:
            assert value is None, match.group(0)
    assert shown
    updates = int(re.search(r' in (\d+) updates', printed).group(1))
    assert updates == summary['updates']
    left = summary['noise_scale_left_out']
    assert set(left) == {'window_1'} and left['window_1'] >= 16       # auto starts at 1
    assert summary['noise_scale_updates'] + left['window_1'] == updates
    closing, = [l for l in printed.splitlines() if l.startswith('gradient noise scale')]
    assert '%d of the %d updates (%d had a window of 1 micro-batch' % (
        summary['noise_scale_updates'], updates, left['window_1']) in closing, closing
    epoch, value = shown[-1]
    assert (summary['last_b_simple_epoch'], summary['last_b_simple']) == \
        (epoch, pytest.approx(value))
    said = re.search(r'B_simple ~ (\S+) (?:\(last epoch\)|at epoch (\d+))', closing)
    assert float(said.group(1)) == pytest.approx(value, rel=5e-3), closing
    if epoch == len(rows):
        assert MEASURED_LINE.search(closing) and said.group(2) is None
        assert summary['noise_scale_unusable'] is None
    else:
        assert closing.startswith('gradient noise scale: no usable estimate at the last '
                                  'epoch (%s)' % summary['noise_scale_unusable'])
        assert int(said.group(2)) == epoch
