"""The study's report: per (method, batch) aggregates over seeds, the largest batch within
tolerance of the small-batch reference, and the markdown tables ``mx-lbsgd study`` prints."""
import math

import numpy as np

__all__ = ['aggregate', 'largest_batch', 'tables']


def _mean_std(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


def aggregate(runs, grid_runs, lr_for):
    """Per (method, batch): the chosen g (and its lr, `lr_for(method, batch, g)`), mean/std
    of final test accuracy, epochs to target."""
    cells = {}
    for r in runs:
        cells.setdefault((r['method'], r['batch']), []).append(r)
    out = []
    for (method, batch), group in cells.items():
        reach = [r['epochs_to_target'] for r in group if r['epochs_to_target'] is not None]
        acc, acc_std = _mean_std([r['final_test_acc'] for r in group])
        grid = sorted((r['g'], r['final_val_acc']) for r in grid_runs
                      if (r['method'], r['batch']) == (method, batch))
        row = dict(method=method, batch=batch, seeds=len(group), g=group[0]['g'],
                   lr=lr_for(method, batch, group[0]['g']), grid_val_acc=grid,
                   final_acc=acc, final_acc_std=acc_std, reached=len(reach),
                   epochs_to_target=_mean_std(reach)[0], updates=group[0]['updates'],
                   seconds=_mean_std([r['wall_time_s'] for r in group])[0])
        if 'underflow_fraction' in group[0]:
            row['underflow_fraction'] = _mean_std([r['underflow_fraction']
                                                   for r in group])[0]
            row['skipped_steps'] = _mean_std([r['skipped_steps'] for r in group])[0]
        out.append(row)
    return out


def largest_batch(summary, batches, methods, reference, tolerance):
    """method -> the largest batch whose mean accuracy is >= reference - tolerance (None
    if none is), checked at every batch up to it."""
    cell = {(r['method'], r['batch']): r for r in summary}
    out = {}
    for m in methods:
        best = None
        for b in batches:
            acc = cell[(m, b)]['final_acc']
            if acc is None or acc < reference - tolerance:
                break
            best = b
        out[m] = best
    return out


def _fmt_acc(row):
    if row['final_acc'] is None:
        return 'nan'
    return '%.3f ± %.3f' % (row['final_acc'], row['final_acc_std'])


def _fmt_reach(row):
    if not row['reached']:
        return '—'
    text = '%.1f' % row['epochs_to_target']
    return text if row['reached'] == row['seeds'] else '%s (%d/%d)' % (
        text, row['reached'], row['seeds'])


def _fmt_lr(row):
    tried = [g for g, _ in row['grid_val_acc']]
    edge = ' (edge)' if len(tried) > 1 and row['g'] in (min(tried), max(tried)) else ''
    return '%.3g%s' % (row['lr'], edge)


def tables(summary, batches, methods, args, reference, largest, tolerance):
    """Markdown tables: accuracy, largest batch, chosen lr, epochs to target, float16."""
    cell = {(r['method'], r['batch']): r for r in summary}
    head = '| method | ' + ' | '.join('batch %d' % b for b in batches) + ' |'
    rule = '|---|' + '---:|' * len(batches)
    updates = '| updates per run | ' + ' | '.join(' / '.join(
        str(u) for u in sorted({cell[(m, b)]['updates'] for m in methods})) for b in batches
    ) + ' |'
    lines = ['Final test accuracy after %d epochs of %s (mean ± std over %d seeds, at the '
             'lr chosen on the validation split):' % (args.epochs, args.dataset, args.seeds),
             '', head, rule, updates]
    for m in methods:
        lines.append('| %s | %s |' % (m, ' | '.join(_fmt_acc(cell[(m, b)]) for b in batches)))
    lines += ['', 'Largest batch whose mean test accuracy is within %g point of sgd at batch '
                  '%d (%.3f), and the accuracy there:' % (100 * tolerance, batches[0],
                                                         reference),
              '', '| method | largest batch | accuracy |', '|---|---:|---:|']
    for m in methods:
        b = largest[m]
        lines.append('| %s | %s | %s |' % (m, b if b else 'none',
                                           _fmt_acc(cell[(m, b)]) if b else '—'))
    lines += ['', 'Peak learning rate chosen on the validation split (grid g = %s, lars %s, '
                  'scaled as in the docstring, extended up to %d times each way; (edge): '
                  'the best was still at an end of the grid; [n]: n values of g tried):'
                  % ('/'.join('%g' % g for g in args.grid),
                     '/'.join('%g' % g for g in args.lars_grid), args.grid_extend),
              '', head, rule]
    for m in methods:
        lines.append('| %s | %s |' % (m, ' | '.join(
            '%s [%d]' % (_fmt_lr(cell[(m, b)]), len(cell[(m, b)]['grid_val_acc']))
            for b in batches)))
    lines += ['', 'Epochs to reach test accuracy %.2f (mean over the seeds that reach it; '
                  '(k/n): only k of n seeds did; —: none):' % args.target, '', head, rule]
    for m in methods:
        lines.append('| %s | %s |' % (m, ' | '.join(_fmt_reach(cell[(m, b)])
                                                     for b in batches)))
    fp16 = [m for m in methods if m.startswith('fp16')]
    if fp16:
        lines += ['', 'float16: gradient underflow at the last epoch (% of non-zero entries '
                      'lost) / skipped steps per run:', '', head, rule]
        for m in fp16:
            lines.append('| %s | %s |' % (m, ' | '.join(
                '%.2f%% / %.1f' % (100 * cell[(m, b)]['underflow_fraction'],
                                   cell[(m, b)]['skipped_steps']) for b in batches)))
    return '\n'.join(lines)
