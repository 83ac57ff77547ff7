"""The demo's figures: training.png (``mx-lbsgd train``), the warmup curves
(``mx-lbsgd schedule --plot``) and study.png (``mx-lbsgd study``). matplotlib is imported
when a figure is drawn."""
import re

import numpy as np

__all__ = ['TRAINING_PANELS', 'NOISE_SCALE_PANEL', 'SCALING_PANEL', 'describe', 'plot_training',
           'plot_schedule', 'plot_study']


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


#: What each panel of training.png shows (plot_training returns those it drew).
TRAINING_PANELS = ('test accuracy per epoch', 'learning rate per step',
                   'loss scale per step (skipped steps: red x, labelled with the parameter '
                   'that overflowed most)', 'train loss per epoch')
GRAD_NORM_PANEL = ('gradient norm per step before clipping (right axis of the train loss '
                   'panel; the clip threshold dotted)')
NOISE_SCALE_PANEL = ('gradient noise scale B_simple per epoch (log scale; the effective '
                     'batch as a horizontal line)')
SCALING_PANEL = ('lr_scaling: the lr gain per update, and the window length and the batch '
                 'of each update (batch_scale auto) per step')


def plot_training(result, path, baseline=None):
    """One PNG with four panels: test accuracy, learning rate, loss scale, train loss;
    with `baseline`, both runs in the accuracy, learning rate and loss panels; a fifth,
    B_simple per epoch, when the main run had a noise scale monitor. Returns what the
    panels show (TRAINING_PANELS, then NOISE_SCALE_PANEL if drawn)."""
    plt = _pyplot()
    runs = [(result, 'main: ' + describe(result), 'C0')]
    if baseline is not None:
        runs.append((baseline, 'baseline: ' + describe(baseline), 'C1'))
    cfg = result['config']
    panels = list(TRAINING_PANELS)
    noise = result.get('noise_scale_interval') is not None
    scaling = bool(result.get('lr_scaling')) and bool(result['steps'])
    columns = 2 + noise + scaling
    fig = plt.figure(figsize=(11 + 4.5 * (columns - 2), 7.5))
    grid = fig.add_gridspec(2, columns)
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(2)] for r in range(2)])
    if noise:
        _plot_noise_scale(fig.add_subplot(grid[:, 2]), result)
        panels.append(NOISE_SCALE_PANEL)
    if scaling:
        _plot_scaling(fig.add_subplot(grid[0, columns - 1]),
                      fig.add_subplot(grid[1, columns - 1]), result)
        panels.append(SCALING_PANEL)
    ax = axes[0, 0]
    for res, label, color in runs:
        e = [r['epoch'] for r in res['epochs']]
        ax.plot(e, [r['test_acc'] for r in res['epochs']], 'o-', ms=3, color=color,
                label='%s (%.3f)' % (label.split(':')[0], res['final_test_acc']))
    if baseline is None:
        ax.plot(e, [r['train_acc'] for r in result['epochs']], '--', color='C2',
                label='train')
    ax.axhline(cfg['target'], color='gray', ls=':', label='target %.2f' % cfg['target'])
    low = min(min(r['test_acc'] for r in res['epochs']) for res, _, _ in runs)
    ax.set(title='test accuracy per epoch', xlabel='epoch', ylim=(max(0, min(low, 0.8)), 1.0))
    ax.legend(loc='lower right', fontsize=8)
    ax = axes[0, 1]
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
    ax.set(title='learning rate per update (scheduled)', xlabel='epoch', ylim=(0, None))
    ax.legend(loc='lower right', fontsize=8)
    ax = axes[1, 0]
    st = result['steps']
    if st:
        x = _per_epoch(result)
        ax.plot(x, [r['loss_scale'] for r in st], color='C0', label='loss scale (main)')
        bad = [(xi, r['loss_scale'], _top_parameter(r)) for xi, r in zip(x, st)
               if r['skipped']]
        if bad:
            top = result.get('overflow_top_offenders') or ()
            ax.plot([b[0] for b in bad], [b[1] for b in bad], 'rx', ms=8,
                    label='skipped step (%d)%s' % (len(bad), ''.join(
                        '\n%s in %d' % (_short(name), n) for name, n in top[:2])))
            _label_skips(ax, bad)
    else:
        ax.plot([r['epoch'] for r in result['epochs']],
                [r['loss_scale'] for r in result['epochs']], 'o-', label='loss scale (main)')
    ax.set_yscale('log', base=2)
    title = 'loss scale (%s)' % cfg['loss_scale']
    if 'final_underflow_fraction' in result:
        title += ', fp16 gradient underflow %.2f%%' % (100 * result['final_underflow_fraction'])
    ax.set(title=title, xlabel='epoch')
    ax.legend(loc='best', fontsize=8)
    ax = axes[1, 1]
    for res, label, color in runs:
        ax.plot([r['epoch'] for r in res['epochs']], [r['train_loss'] for r in res['epochs']],
                'o-', ms=3, color=color, label=label.split(':')[0])
    ax.set_yscale('log')
    ax.set(title='train loss per epoch', xlabel='epoch')
    ax.legend(loc='upper right', fontsize=8)
    if cfg.get('max_grad_norm') and st:
        _plot_grad_norm(ax.twinx(), _per_epoch(result), st, cfg['max_grad_norm'])
        ax.set_title('train loss per epoch; gradient norm per step (right)')
        panels.append(GRAD_NORM_PANEL)
    lines = ['%s: test acc %.3f' % (label, res['final_test_acc']) for res, label, _ in runs]
    fig.suptitle('\n'.join(lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return panels


def _plot_scaling(top, bottom, result):
    """The lr gain per step (top); the window length and the batch per step (bottom)."""
    x = _per_epoch(result)
    steps = result['steps']
    top.plot(x, [r['gain'] for r in steps], color='C3')
    top.set(title='lr gain (%s) per update' % result['lr_scaling'], xlabel='epoch',
            ylim=(0, None))
    windows = [r['window'] for r in steps]
    bottom.step(x, windows, where='post', color='C4', label='window (micro-batches)')
    bottom.set(title='window length per step (final batch %d)'
               % result['effective_batch_size'], xlabel='epoch', ylim=(0, None))
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


#: Skip markers labelled at most.
_MAX_SKIP_LABELS = 8


def _label_skips(ax, bad):
    """Write the top parameter next to each skip marker; with more than _MAX_SKIP_LABELS
    skips, next to the first of each run of one top parameter, up to that many."""
    shown, previous, every = 0, None, len(bad) <= _MAX_SKIP_LABELS
    for x, y, name in bad:
        if name and (every or name != previous) and shown < _MAX_SKIP_LABELS:
            ax.annotate(name, (x, y), xytext=(7, 0), textcoords='offset points',
                        fontsize=7, color='red', va='center')
            shown += 1
        previous = name


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
    ax.set(title='gradient noise scale B_simple = tr(\u03a3)/|G|\u00b2'
                 + (', last %.0f' % last if last else ''),
           xlabel='epoch', xlim=(0, len(result['epochs']) + 1))
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
