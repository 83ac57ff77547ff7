"""The demo's figures: training.png (``mx-lbsgd train``), the warmup curves
(``mx-lbsgd schedule --plot``) and study.png (``mx-lbsgd study``). matplotlib is imported
when a figure is drawn."""
import collections
import re

import numpy as np

__all__ = ['Panel', 'TRAINING_PANELS', 'GRAD_NORM_SHOWS', 'describe', 'training_layout',
           'plot_training', 'plot_schedule', 'plot_study']


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def describe(result):
    """One line: optimizer, dtype, batch (micro x scale), warmup, loss scaling."""
    cfg = result['config']
    text = '%s %s, batch %d' % (cfg['optimizer'], cfg['dtype'], cfg['batch_size'])
    auto = cfg['batch_scale'] == 'auto'
    if auto:
        text += ' x auto %d..%d (last %d = %d)' % (
            cfg['batch_scale_bounds'][0], cfg['batch_scale_bounds'][1],
            result['final_batch_scale'], result['effective_batch_size'])
    elif cfg['batch_scale'] > 1:
        text += ' x %d = %d' % (cfg['batch_scale'], result['effective_batch_size'])
    if result.get('warmup_strategy') == 'lars':
        text += ', LARS'
    elif result.get('warmup_strategy') and cfg['warmup_epochs'] and (
            auto or cfg['batch_scale'] > 1 or cfg.get('warmup_from') is not None):
        text += ', %s warmup %g ep' % (result['warmup_strategy'], cfg['warmup_epochs'])
    if cfg.get('lr_scaling'):
        text += ', lr_scaling %s' % cfg['lr_scaling']
    if cfg['loss_scale'] != 'none':
        text += ', loss scale %s' % cfg['loss_scale']
    return text + ', lr %g' % cfg['lr']


def _per_epoch(result):
    """x of each step in epochs (step k of an epoch of n ends at epoch - 1 + k / n)."""
    n = result['steps_per_epoch']
    return [r['step'] / n for r in result['steps']]


#: One panel of training.png: `key`; `title`, which its drawn title starts with; its cell in
#: the grid of two rows: `row` 0 (top), 1 (bottom) or None (both rows), `column` from the
#: left (-1: the last); `when` it is drawn (None: always, 'noise': the main run had a noise
#: scale monitor, 'scaling': --lr-scaling); and what it `shows` (summary.json's ``plots``).
Panel = collections.namedtuple('Panel', 'key title row column when shows')

#: training.png's panels: plot_training draws each where this table says, with this title;
#: docs/getting-started.md describes the default run's by these positions and titles.
TRAINING_PANELS = (
    Panel('accuracy', 'test accuracy per epoch', 0, 0, None, 'test accuracy per epoch'),
    Panel('lr', 'learning rate per update (scheduled)', 0, 1, None,
          'learning rate per update (scheduled)'),
    Panel('loss_scale', 'loss scale', 1, 0, None,
          'loss scale per step (skipped steps marked by the parameter that overflowed most)'),
    Panel('loss', 'train loss per epoch', 1, 1, None, 'train loss per epoch'),
    Panel('noise', 'gradient noise scale B_simple', None, 2, 'noise',
          'gradient noise scale B_simple per epoch (log scale; the effective batch as a '
          'horizontal line)'),
    Panel('gain', 'lr gain per update', 0, -1, 'scaling', 'lr_scaling: the lr gain per update'),
    Panel('window', 'window length per step', 1, -1, 'scaling',
          'the window length and the batch of each update, per step'),
)
#: What the loss panel also shows with --max-grad-norm (a right axis).
GRAD_NORM_SHOWS = ('gradient norm per step before clipping (right axis of the train loss '
                   'panel; the clip threshold dotted)')
_COLUMN_NAMES = {2: ('left', 'right'), 3: ('left', 'middle', 'right'),
                 4: ('left', 'second', 'third', 'right')}


def training_layout(noise, scaling):
    """(columns, [(panel, column, position)]) of the panels training.png draws for a run
    with a noise scale monitor (`noise`) and with --lr-scaling (`scaling`): their grid
    column (from the left) and where they are in words ('top left', 'right column',
    'bottom, third column')."""
    shown = [p for p in TRAINING_PANELS
             if p.when is None or (p.when == 'noise' and noise)
             or (p.when == 'scaling' and scaling)]
    columns = max(p.column for p in shown) + 1 + any(p.column < 0 for p in shown)
    names = _COLUMN_NAMES[columns]
    layout = []
    for p in shown:
        column = p.column % columns
        name = names[column]
        if p.row is None:
            where = '%s column' % name
        elif name in ('left', 'middle', 'right'):
            where = '%s %s' % (('top', 'bottom')[p.row], name)
        else:
            where = '%s, %s column' % (('top', 'bottom')[p.row], name)
        layout.append((p, column, where))
    return columns, layout


def plot_training(result, path, baseline=None):
    """One PNG of the panels TRAINING_PANELS names, where it places them: test accuracy,
    learning rate, loss scale, train loss (the main run and, with `baseline`, the baseline
    in the accuracy, learning rate and loss panels); B_simple per epoch when the main run
    had a noise scale monitor; the lr gain and the window length with --lr-scaling.
    Returns what the panels drawn show (their `shows`)."""
    plt = _pyplot()
    runs = [(result, 'main: ' + describe(result), 'C0')]
    if baseline is not None:
        runs.append((baseline, 'baseline: ' + describe(baseline), 'C1'))
    noise = result.get('noise_scale_interval') is not None
    scaling = bool(result.get('lr_scaling')) and bool(result['steps'])
    columns, layout = training_layout(noise, scaling)
    fig = plt.figure(figsize=(11 + 4.5 * (columns - 2), 7.5))
    grid = fig.add_gridspec(2, columns)
    axes = {p.key: fig.add_subplot(grid[:, c] if p.row is None else grid[p.row, c])
            for p, c, _ in layout}
    _plot_accuracy(axes['accuracy'], runs, result['config'])
    _plot_lr(axes['lr'], runs, result)
    skips = _plot_loss_scale(axes['loss_scale'], result)
    shows = {p.key: p.shows for p, _, _ in layout}
    if _plot_loss(axes['loss'], runs, result):
        shows['loss'] += '; ' + GRAD_NORM_SHOWS
    if noise:
        _plot_noise_scale(axes['noise'], result)
    if scaling:
        _plot_scaling(axes['gain'], axes['window'], result)
    lines = ['%s: test acc %.3f' % (label, res['final_test_acc']) for res, label, _ in runs]
    fig.suptitle('\n'.join(lines), fontsize=10)
    fig.tight_layout()
    if skips is not None:
        _room_above(axes['loss_scale'], skips)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [shows[p.key] for p, _, _ in layout]


def _title(ax, key, more=''):
    """The panel's title: its TRAINING_PANELS title, then `more`."""
    ax.set_title(next(p.title for p in TRAINING_PANELS if p.key == key) + more)


def _plot_accuracy(ax, runs, cfg):
    result = runs[0][0]
    for res, label, color in runs:
        e = [r['epoch'] for r in res['epochs']]
        ax.plot(e, [r['test_acc'] for r in res['epochs']], 'o-', ms=3, color=color,
                label='%s (%.3f)' % (label.split(':')[0], res['final_test_acc']))
    if len(runs) == 1:
        ax.plot(e, [r['train_acc'] for r in result['epochs']], '--', color='C2',
                label='train')
    ax.axhline(cfg['target'], color='gray', ls=':', label='target %.2f' % cfg['target'])
    low = min(min(r['test_acc'] for r in res['epochs']) for res, _, _ in runs)
    _title(ax, 'accuracy')
    ax.set(xlabel='epoch', ylim=(max(0, min(low, 0.8)), 1.0))
    ax.legend(loc='lower right', fontsize=8)


def _plot_lr(ax, runs, result):
    cfg = result['config']
    for res, label, color in runs:
        if res['steps']:
            ax.plot(_per_epoch(res), [r['lr'] for r in res['steps']], color=color,
                    label=label.split(':')[0])
        else:
            ax.plot([r['epoch'] for r in res['epochs']], [r['lr'] for r in res['epochs']],
                    'o-', color=color, label=label.split(':')[0])
    if (result['batch_scale'] == 'auto' or result['batch_scale'] > 1) \
            and cfg['warmup_strategy'] != 'lars' and cfg['warmup_epochs']:
        ax.axvline(cfg['warmup_epochs'], color='gray', ls=':', label='end of warmup')
    _title(ax, 'lr')
    ax.set(xlabel='epoch', ylim=(0, None))
    ax.legend(loc='lower right', fontsize=8)


def _plot_loss_scale(ax, result):
    """The loss scale per step (per epoch without steps.csv), each skipped step marked by
    the parameter with the most non-finite elements (_mark_skips). Returns the legend of
    the markers (None without a skip: the legend names the line)."""
    st, bad = result['steps'], []
    if st:
        x = _per_epoch(result)
        ax.plot(x, [r['loss_scale'] for r in st], color='C0', label='loss scale (main)')
        bad = [(xi, r['loss_scale'], _top_parameter(r)) for xi, r in zip(x, st)
               if r['skipped']]
    else:
        ax.plot([r['epoch'] for r in result['epochs']],
                [r['loss_scale'] for r in result['epochs']], 'o-', label='loss scale (main)')
    ax.set_yscale('log', base=2)
    more = ' (%s)' % result['config']['loss_scale']
    if 'final_underflow_fraction' in result:
        more += ', fp16 gradient underflow %.2f%%' % (100 * result['final_underflow_fraction'])
    _title(ax, 'loss_scale', more)
    ax.set(xlabel='epoch')
    if not bad:
        ax.legend(loc='best', fontsize=8)
        return None
    return ax.legend(handles=_mark_skips(ax, bad), loc='upper left', fontsize=7,
                     title_fontsize=7, title='skipped (%d), by the parameter most inf/NaN'
                     % len(bad))


def _room_above(ax, legend):
    """Raise the top of the log2 axes `ax` so that `legend` (upper left) sits above the
    data, covering no marker (no tick above the data's)."""
    renderer = ax.figure.canvas.get_renderer()
    share = (legend.get_window_extent(renderer).height + 8) / \
        ax.get_window_extent(renderer).height
    if share < 0.6:
        low, high = np.log2(ax.get_ylim())
        ticks = [t for t in ax.get_yticks() if 2 ** low <= t <= 2 ** high]
        ax.set_ylim(top=2 ** (low + (high - low) / (1 - share)))
        ax.set_yticks(ticks)


def _plot_loss(ax, runs, result):
    """Train loss per epoch; with clipping, the gradient norm per step on a right axis.
    Returns whether it drew that axis."""
    for res, label, color in runs:
        ax.plot([r['epoch'] for r in res['epochs']], [r['train_loss'] for r in res['epochs']],
                'o-', ms=3, color=color, label=label.split(':')[0])
    ax.set_yscale('log')
    ax.set(xlabel='epoch')
    ax.legend(loc='upper right', fontsize=8)
    clip = result['config'].get('max_grad_norm') and result['steps']
    if clip:
        _plot_grad_norm(ax.twinx(), _per_epoch(result), result['steps'],
                        result['config']['max_grad_norm'])
    _title(ax, 'loss', '; gradient norm per step (right)' if clip else '')
    return bool(clip)


def _plot_scaling(top, bottom, result):
    """The lr gain per step (top); the window length and the batch per step (bottom)."""
    x = _per_epoch(result)
    steps = result['steps']
    top.plot(x, [r['gain'] for r in steps], color='C3')
    _title(top, 'gain', ' (%s)' % result['lr_scaling'])
    top.set(xlabel='epoch', ylim=(0, None))
    windows = [r['window'] for r in steps]
    bottom.step(x, windows, where='post', color='C4', label='window (micro-batches)')
    _title(bottom, 'window', ' (final batch %d)' % result['effective_batch_size'])
    bottom.set(xlabel='epoch', ylim=(0, None))
    batch = bottom.twinx()
    per_window = result['effective_batch_size'] / max(result['final_batch_scale'], 1)
    batch.step(x, [w * per_window for w in windows], where='post', color='C4', alpha=0)
    batch.set(ylabel='batch (examples)', ylim=(0, bottom.get_ylim()[1] * per_window))
    bottom.legend(loc='lower right', fontsize=8)


def _plot_grad_norm(ax, x, steps, max_norm):
    norms = [r['grad_norm'] if r.get('grad_norm') is not None else float('nan')
             for r in steps]
    ax.plot(x, norms, color='C3', lw=0.8, alpha=0.7, label='gradient norm (main)')
    ax.axhline(max_norm, color='C3', ls=':', label='clip at %g' % max_norm)
    ax.set_ylabel('gradient norm')
    ax.legend(loc='center right', fontsize=8)


def _short(name):
    """A Gluon parameter name without its outer block's prefix
    ('hybridsequential0_dense2_weight' -> 'dense2_weight')."""
    return re.sub(r'^[A-Za-z]+\d+_(?=.*_)', '', name)


def _top_parameter(step_row):
    """'name kind' of the parameter with the most non-finite elements in a skipped step's
    row ('' when the row has no overflow report)."""
    first = (step_row.get('overflow_parameters') or '').split(';')[0]
    if not first:
        return ''
    name, kind = first.split(':')[:2]
    return '%s %s' % (_short(name), kind)


#: The markers of the skipped steps: one per parameter that overflowed most in them, the
#: parameters with the most skipped steps first; the steps of any further ones share
#: _OTHER_SKIPS.
_SKIP_MARKERS = (dict(marker='x', color='red', ms=8),
                 dict(marker='+', color='darkviolet', ms=9, mew=2),
                 dict(marker='^', color='darkorange', ms=7, mfc='none'))
_OTHER_SKIPS = dict(marker='o', color='gray', mfc='none', ms=5)


def _mark_skips(ax, bad):
    """Mark the skipped steps `bad` ([(x, loss scale, parameter)]) with one marker per
    parameter (the one with the most non-finite elements of each step, _top_parameter),
    up to len(_SKIP_MARKERS) parameters, most skipped steps first; the others share one.
    Returns the lines drawn, labelled 'parameter kind (steps)', for the legend: the axes
    get no text, so no label can overlap another at any number of skips."""
    groups = collections.OrderedDict()
    for x, y, name in bad:
        groups.setdefault(name or 'no overflow report', []).append((x, y))
    ranked = sorted(groups.items(), key=lambda item: -len(item[1]))     # ties: first seen
    shown, rest = ranked[:len(_SKIP_MARKERS)], ranked[len(_SKIP_MARKERS):]
    lines = [ax.plot(*zip(*points), ls='none', label='%s (%d)' % (name, len(points)),
                     **style)[0] for (name, points), style in zip(shown, _SKIP_MARKERS)]
    if rest:
        points = [p for _, group in rest for p in group]
        label = rest[0][0] if len(rest) == 1 else '%d others' % len(rest)
        lines += ax.plot(*zip(*points), ls='none', label='%s (%d)' % (label, len(points)),
                         **_OTHER_SKIPS)
    return lines


def _plot_noise_scale(ax, result):
    """B_simple per epoch (positive estimates; log2 y) against the effective batch and the
    micro-batch."""
    points = [(r['epoch'], r['b_simple']) for r in result['epochs']
              if r.get('b_simple') is not None and r['b_simple'] > 0]
    if points:
        ax.plot(*zip(*points), 'o-', ms=3, color='C0', label='B_simple (main, smoothed)')
    else:
        ax.text(0.5, 0.5, 'no positive estimate', transform=ax.transAxes, ha='center')
    ax.axhline(result['effective_batch_size'], color='gray', ls='--',
               label='effective batch %d' % result['effective_batch_size'])
    ax.axhline(result['batch_size'], color='gray', ls=':',
               label='micro-batch %d' % result['batch_size'])
    from matplotlib.ticker import FuncFormatter
    ax.set_yscale('log', base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: '%g' % v))  # sizes, not 2^k
    last = result.get('final_b_simple')
    _title(ax, 'noise', ' = tr(\u03a3)/|G|\u00b2' + (', last %.0f' % last if last else ''))
    ax.set(xlabel='epoch', xlim=(0, len(result['epochs']) + 1))
    ax.legend(loc='best', fontsize=8)


def plot_schedule(header, rows, warmup_steps, batch_scale, path):
    """The warmup multipliers of `rows` (schedule_table's, every step) into `path`: one
    curve per column of `header` after the first, MXNet's own ('mxnet:...') dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r[0] for r in rows]
    for j, name in enumerate(header[1:], start=1):
        ax.plot(x, [r[j] for r in rows], ls='--' if name.startswith('mxnet:') else '-',
                label=name)
    ax.axvline(warmup_steps, color='gray', ls=':', label='end of warmup')
    ax.set(xlabel='micro-batch (step)', ylabel='learning-rate multiplier',
           title='LBSGD warmup, B = %g' % batch_scale)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_study(summary, batches, methods, path, target, reference, tolerance):
    """study.png: final accuracy and epochs to target vs batch size, one line per method."""
    plt = _pyplot()
    cell = {(r['method'], r['batch']): r for r in summary}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in methods:
        rows = [cell[(m, b)] for b in batches]
        style = '--' if m.startswith('fp16') else ':' if m == 'lbsgd-lars' else '-'
        left.errorbar(batches, [r['final_acc'] if r['final_acc'] is not None else np.nan
                                for r in rows],
                      yerr=[r['final_acc_std'] or 0 for r in rows], ls=style, marker='o',
                      capsize=3, label=m)
        right.plot(batches, [r['epochs_to_target'] if r['reached'] else np.nan
                             for r in rows], ls=style, marker='o', label=m)
    left.axhspan(reference - tolerance, reference, color='gray', alpha=0.15,
                 label='within %g point of sgd@%d' % (100 * tolerance, batches[0]))
    for ax in (left, right):
        ax.set_xscale('log', base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel('batch size (samples per update)')
    low = min([r['final_acc'] for r in summary if r['final_acc'] is not None] + [reference])
    left.set(ylabel='final test accuracy', ylim=(max(0.0, min(low - 0.02, 0.9)), 1.0),
             title='test accuracy at the validation-chosen lr')
    right.set(ylabel='epochs', title='epochs to test accuracy %.2f' % target)
    left.legend(loc='lower left', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
