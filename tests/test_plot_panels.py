"""training.png's panels come from one table, mx_lbsgd_demo.plots.TRAINING_PANELS: the
figure ``mx-lbsgd train`` draws has each panel where the table says, with its title, and
docs/getting-started.md describes the default run's picture panel by panel in the same
terms (position and title), so neither can drift from the other."""
import json
import os
import re

import pytest

from mx_lbsgd_demo import plots
from mx_lbsgd_demo.cli import main
from test_train_overflow import _keep_figures

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, 'docs', 'getting-started.md')
SECTION = '### What the picture shows'
#: a panel's bullet: "- **Position: title.** ..." or "- **Position: title** ..."
BULLET = re.compile(r'^- \*\*([A-Z][^:*]*): ([^*]+?)\.?\*\*', re.M)


def _section():
    with open(PAGE, encoding='utf-8') as f:
        text = f.read()
    start = text.index(SECTION) + len(SECTION)
    return text[start:text.index('\n#', start)]


def test_the_page_describes_the_default_picture_panel_by_panel():
    """The default run (a noise scale monitor, no --lr-scaling): one bullet per panel,
    naming its position and its title as the table gives them, and no other bullet."""
    section = _section()
    described = BULLET.findall(section)
    columns, layout = plots.training_layout(noise=True, scaling=False)
    expected = [(where[0].upper() + where[1:], panel.title) for panel, _, where in layout]
    assert sorted(described) == sorted(expected), (described, expected)
    assert len(re.findall(r'^- ', section, re.M)) == len(layout)
    count = {4: 'Four', 5: 'Five', 6: 'Six', 7: 'Seven'}[len(layout)]
    names = {2: 'two', 3: 'three', 4: 'four'}
    assert '%s panels in %s columns' % (count, names[columns]) in section


def test_the_layout_names_every_cell_once():
    for noise in (False, True):
        for scaling in (False, True):
            columns, layout = plots.training_layout(noise, scaling)
            cells = set()
            for panel, column, _ in layout:
                rows = (0, 1) if panel.row is None else (panel.row,)
                cells.update((r, column) for r in rows)
            assert len(cells) == 2 * columns            # the grid is full
            assert len({where for _, _, where in layout}) == len(layout)
            assert len(layout) == 4 + noise + 2 * scaling


RUNS = [
    pytest.param(['--epochs', '1'], True, False, id='default'),
    pytest.param(['--single', '--epochs', '1', '--max-grad-norm', '1'], False, False,
                 id='single-clipped'),
    pytest.param(['--no-baseline', '--epochs', '1', '--lr-scaling', 'linear',
                  '--batch-scale', '4', '--noise-scale-interval', '0'], False, True,
                 id='lr-scaling-without-monitor'),
    pytest.param(['--no-baseline', '--epochs', '1', '--lr-scaling', 'adascale',
                  '--batch-scale', 'auto'], True, True, id='adascale-auto'),
]


@pytest.mark.parametrize('argv, noise, scaling', RUNS)
def test_the_drawn_panels_sit_where_the_table_says(argv, noise, scaling, tmp_path,
                                                   monkeypatch):
    figures = _keep_figures(monkeypatch)
    out = tmp_path / 'run'
    assert main(['train', '--quiet', '--out', str(out)] + argv) == 0
    fig, = figures
    columns, layout = plots.training_layout(noise, scaling)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert len(titled) == len(layout)
    for panel, column, where in layout:
        ax, = [ax for ax in titled if ax.get_title().startswith(panel.title)]
        spec = ax.get_subplotspec()
        assert spec.get_gridspec().get_geometry() == (2, columns), where
        rows = range(0, 2) if panel.row is None else range(panel.row, panel.row + 1)
        assert (spec.rowspan, spec.colspan) == (rows, range(column, column + 1)), \
            (panel.key, where, spec.rowspan, spec.colspan)
    # the twin axes (gradient norm, batch) share a titled panel's cell
    cells = {(ax.get_subplotspec().rowspan, ax.get_subplotspec().colspan) for ax in titled}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        assert (spec.rowspan, spec.colspan) in cells
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['plots']['training.png'].startswith('one figure, %d panels: ' % len(layout))
    if noise and not scaling:                          # the picture the page describes
        phrases = {where for _, _, where in layout}
        assert phrases == {'top left', 'top middle', 'right column', 'bottom left',
                           'bottom middle'}
