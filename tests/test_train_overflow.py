"""``mx-lbsgd train`` tells which parameters overflowed: steps.csv's overflow columns, the
summary's top offenders, the skip markers and their legend, the log and the falling-scale
warning. The tallies are recounted here from steps.csv, independently of the library's."""
import collections
import csv
import json
import re

import matplotlib.figure
import numpy as np
import pytest

from mx_lbsgd_demo import train as train_module
from mx_lbsgd_demo.cli import main
from mx_lbsgd_demo.config import DEMO_DEFAULTS, TrainConfig
from mx_lbsgd_demo.plots import plot_training

pytestmark = pytest.mark.cli

PARAMETER = re.compile(r'^hybridsequential\d+_dense[0-2]_(weight|bias)$')
KINDS = {'inf', 'nan', 'inf+nan'}

RUNS = [
    pytest.param(['--optimizer', 'lbsgd', '--dtype', 'float16', '--batch-scale', '4',
                  '--epochs', '2'], 4, id='lbsgd-fp16-window4-optimizer'),
    pytest.param(['--optimizer', 'sgd', '--dtype', 'float16', '--epochs', '2'], 1,
                 id='sgd-fp16-hook'),
    pytest.param(['--optimizer', 'lssgd', '--dtype', 'float16', '--lr', '50', '--epochs', '1'],
                 1, id='lssgd-fp16-diverging'),
]


def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _train(tmp_path, flags, quiet=True):
    out = tmp_path / 'run'
    argv = ['train', '--no-baseline', '--out', str(out)] + flags + (['--quiet'] if quiet else [])
    assert main(argv) == 0
    return out, json.loads((out / 'summary.json').read_text()), _rows(out / 'steps.csv')


def _parse(field):
    """[(name, kind, count)] of an overflow_parameters cell."""
    return [(n, k, int(c)) for n, k, c in (item.split(':') for item in field.split(';'))]


@pytest.mark.parametrize('flags, window', RUNS)
def test_skipped_steps_name_their_parameters(tmp_path, capsys, flags, window):
    _, summary, steps = _train(tmp_path, flags)
    skipped = [r for r in steps if r['skipped'] == '1']
    assert len(skipped) == summary['skipped_steps'] >= 1
    tally = collections.Counter()
    for r in steps:
        cells = [r[k] for k in ('overflow_parameters', 'overflow_micro_batch', 'overflow_rank',
                                'overflow_originated_here')]
        if r['skipped'] == '0':
            assert cells == ['', '', '', '']
            continue
        found = _parse(r['overflow_parameters'])
        assert found, r
        for name, kind, count in found:
            assert PARAMETER.match(name) and kind in KINDS and count >= 1, found
        assert [c for _, _, c in found] == sorted((c for _, _, c in found), reverse=True)
        tally.update(name for name, _, _ in found)
        assert r['overflow_rank'] == ''                 # one process: no rank
        assert r['overflow_originated_here'] == 'True'
        if window > 1:
            assert int(r['step']) % window == 0         # a window's last micro-batch
            assert 1 <= int(r['overflow_micro_batch']) <= window
        else:
            assert r['overflow_micro_batch'] == ''
    top = summary['overflow_top_offenders']
    assert 1 <= len(top) <= 3
    assert all(tally[name] == n for name, n in top)
    assert [n for _, n in top] == sorted(tally.values(), reverse=True)[:len(top)]
    printed = capsys.readouterr().out
    assert 'overflowed most in the %d skipped steps: %s in %d' % (
        len(skipped), top[0][0], top[0][1]) in printed


def test_a_falling_scale_warns_with_its_offenders(tmp_path, capsys):
    flags = ['--optimizer', 'lssgd', '--dtype', 'float16', '--lr', '50', '--epochs', '1']
    _, summary, steps = _train(tmp_path, flags)
    warned = summary['loss_scale_warnings']
    assert len(warned) >= 1
    first = warned[0]
    assert first['message'].startswith('loss scale falling: 8 backoffs without a growth')
    # the 8th skipped step without a finite step long enough to grow the scale in between
    skips_so_far = sum(r['skipped'] == '1' for r in steps[:first['step']])
    assert steps[first['step'] - 1]['skipped'] == '1' and skips_so_far >= 8
    tally = collections.Counter(name for r in steps[:first['step']] if r['skipped'] == '1'
                                for name, _, _ in _parse(r['overflow_parameters']))
    assert first['offenders'] and all(tally[name] == n for name, n in first['offenders'])
    assert 'loss scale warning at step %d' % first['step'] in capsys.readouterr().out


def test_no_loss_scaling_no_reports(tmp_path):
    _, summary, steps = _train(tmp_path, ['--single', '--epochs', '1'])
    assert summary['overflow_top_offenders'] is None and summary['loss_scale_warnings'] == []
    assert {r['overflow_parameters'] for r in steps} == {''}


def _keep_figures(monkeypatch):
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', keep)
    return figures


def _check_skip_markers(fig, tops):
    """The loss scale panel of `fig` marks the skipped steps whose top parameters (without
    the net's prefix, with their kind) are `tops`: no text on the axes; a legend entry per
    parameter, most skipped steps first (ties: first seen), up to three, then the rest
    together; and the legend covers no point of the panel."""
    ax, = [ax for ax in fig.axes if ax.get_title().startswith('loss scale')]
    assert not ax.texts                     # labels only in the legend: none can overlap
    legend = ax.get_legend()
    assert legend.get_title().get_text().startswith('skipped (%d), ' % len(tops))
    ranked = collections.Counter(tops).most_common()
    expected = ['%s (%d)' % kv for kv in ranked[:3]]
    rest = ranked[3:]
    if len(rest) == 1:
        expected.append('%s (%d)' % rest[0])
    elif rest:
        expected.append('%d others (%d)' % (len(rest), sum(n for _, n in rest)))
    assert [t.get_text() for t in legend.get_texts()] == expected
    box = legend.get_window_extent()
    for line in ax.lines:
        points = ax.transData.transform(np.column_stack(line.get_data()))
        assert not any(box.contains(x, y) for x, y in points), line.get_label()


def test_the_skip_markers_carry_the_parameter(tmp_path, monkeypatch):
    figures = _keep_figures(monkeypatch)
    _, summary, steps = _train(tmp_path, ['--optimizer', 'sgd', '--dtype', 'float16',
                                          '--epochs', '2'])
    tops = []
    for r in steps:
        if r['skipped'] == '1':
            name, kind, _ = _parse(r['overflow_parameters'])[0]
            tops.append('%s %s' % (name.split('_', 1)[1], kind))   # without the net prefix
    assert len(tops) == summary['skipped_steps'] >= 1
    _check_skip_markers(figures[0], tops)


def test_many_skips_stay_readable(tmp_path, monkeypatch):
    """Every step of a run skipped, with seven different top parameters: still at most
    four legend entries, above the markers, and no text on the axes."""
    figures = _keep_figures(monkeypatch)
    result = train_module.train(TrainConfig(**dict(DEMO_DEFAULTS, epochs=2)),
                                noise_scale_interval=0)
    names = ['hybridsequential0_dense%d_%s' % (i % 3, ('weight', 'bias')[i // 3 % 2])
             for i in range(6)]
    tops = []
    for i, row in enumerate(result['steps']):
        name, kind = names[(i * i) % 6] if i % 5 else 'hybridsequential0_dense9_weight', \
            ('inf', 'nan', 'inf+nan')[i % 3]
        row.update(skipped=1, overflow_parameters='%s:%s:%d' % (name, kind, 100 - i),
                   loss_scale=2.0 ** (10 + i % 7))
        tops.append('%s %s' % (name.split('_', 1)[1], kind))
    assert len(tops) == 84 and len(set(tops)) > 6
    plot_training(result, str(tmp_path / 'training.png'))
    _check_skip_markers(figures[0], tops)


@pytest.mark.parametrize('quiet', [pytest.param(False, id='verbose'),
                                   pytest.param(True, id='quiet')])
def test_the_reports_reach_the_log(tmp_path, capsys, quiet):
    _train(tmp_path, ['--optimizer', 'sgd', '--dtype', 'float16', '--epochs', '1'], quiet)
    err = capsys.readouterr().err
    logged = re.findall(r'^mx_lbsgd INFO: step (\d+) skipped .*$', err, re.M)
    assert (len(logged) == 1) != quiet, err       # rate-limited: one per 30 s
    assert 'finite steps)' not in err           # the scale's growths are not shown
