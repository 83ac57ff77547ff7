"""The study's results: per method the tuned cells, McCandlish's fit and B_simple, AdaScale's
gains and the goodput-chosen batch's run (:func:`summarize`, what study.json holds), and
the markdown tables it prints (:func:`tables`)."""
import math

from .study_fit import fit_tradeoff

__all__ = ['summarize', 'tables']


def _median(values):
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def _scaling_limit(batches, steps, efficiency=0.5):
    """The largest batch up to which each doubling of B still cut the steps by at least
    `efficiency` of the ideal halving (steps ratio <= 2 ** -efficiency per doubling,
    measured between consecutive batch sizes); None if the first step already fails."""
    last = None
    for (b0, s0), (b1, s1) in zip(zip(batches, steps), zip(batches[1:], steps[1:])):
        if s0 is None or s1 is None:
            break
        if math.log(s0 / s1) / math.log(b1 / b0) < efficiency:
            break
        last = b1
    return last


def summarize(cells_by_method, settings, auto=None):
    """study.json's content: batch_sizes, methods -> {steps_to_target, lr, examples,
    fit, b_crit, s_min, e_min, b_simple, ...; adascale: batch_scale, gain_mean, ...},
    b_simple (per method and batch, summary), auto (the adascale-auto run, with `auto`)."""
    batches = settings['batch_sizes']
    methods, b_simple = {}, {}
    trainings = 0
    for name, cells in cells_by_method.items():
        steps = [c['steps'] for c in cells]
        fit = fit_tradeoff(batches, steps)
        trainings += sum(len(c['grid']) for c in cells)
        per_batch = [c['b_simple'] for c in cells]
        methods[name] = dict(
            steps_to_target=steps, lr=[c['lr'] for c in cells],
            examples_to_target=[s * b if s is not None else None
                                for s, b in zip(steps, batches)],
            b_crit=fit['b_crit'] if fit else None, s_min=fit['s_min'] if fit else None,
            e_min=fit['e_min'] if fit else None, fit=fit,
            scales_up_to=_scaling_limit(batches, steps),
            b_simple=per_batch, b_simple_at_target=[c['b_simple_at_target'] for c in cells],
            b_simple_median=_median(per_batch),
            skipped_steps=[c['skipped'] for c in cells],
            grids=[c['grid'] for c in cells], seconds=sum(c['seconds'] for c in cells))
        if name == 'adascale':
            methods[name].update(_adascale_keys(cells, batches))
        b_simple[name] = dict(per_batch=per_batch, median=_median(per_batch))
    everything = [v for entry in b_simple.values() for v in entry['per_batch']]
    b_simple['summary'] = _median(everything)
    out = dict(batch_sizes=batches, methods=methods, b_simple=b_simple,
               trainings=trainings, target=settings['target'])
    if auto is not None:
        out['auto'] = _auto_summary(auto, methods.get('adascale'), batches)
        out['trainings'] += 1
    return out


def _adascale_keys(cells, batches):
    """adascale's keys: one lr (tuned at the smallest batch) times the gain per update."""
    return dict(lr_scaling='adascale', micro_batch=batches[0],
                batch_scale=[b // batches[0] for b in batches],
                gain_mean=[c['gain_mean'] for c in cells],
                gain_last=[c['gain_last'] for c in cells],
                progress_to_target=[c['progress'] if c['steps'] is not None else None
                                    for c in cells])


def _auto_summary(run, fixed, batches):
    """study.json's auto: the adascale-auto run, and where its updates and examples fall
    among the fixed-batch adascale rows'."""
    steps, base = run['steps'], batches[0]
    examples = run['examples'] if steps is not None else None
    windows = run['window_history'] or []
    out = dict(method='adascale-auto', lr=run['lr'], micro_batch=base,
               batch_scale_bounds=run['bounds'], batch_scale_interval=run['interval'],
               steps_to_target=steps, examples_to_target=examples,
               mean_batch=examples / steps if steps else None,
               window_history=windows, final_window=run['window'],
               final_batch=base * run['window'] if run['window'] else None,
               batches_taken=sorted({base * k for _, k in windows}),
               progress_to_target=run['progress'] if steps is not None else None,
               gain_mean=run['gain_mean'], gain_last=run['gain_last'],
               last_step=run['last_step'], cap=run['cap'], seconds=run['wall_time_s'])
    if fixed is not None and steps is not None:
        out['against_fixed'] = dict(
            steps=_between(batches, fixed['steps_to_target'], steps),
            examples=_between(batches, fixed['examples_to_target'], examples))
    return out


def _between(batches, values, x):
    """The fixed-batch rows around `x`: above, the (B, value) with the least value >= x;
    below, the one with the largest value <= x (None where there is none)."""
    pairs = [(b, v) for b, v in zip(batches, values) if v is not None]
    above = min((p for p in pairs if p[1] >= x), key=lambda p: (p[1], p[0]), default=None)
    below = max((p for p in pairs if p[1] <= x), key=lambda p: (p[1], -p[0]), default=None)
    return dict(above=list(above) if above else None, below=list(below) if below else None)


def _fmt(value, spec='%.0f'):
    return '—' if value is None else spec % value


def tables(result):
    """Markdown: steps to target (and lr), the fit against B_simple, B_simple per batch."""
    batches, methods = result['batch_sizes'], result['methods']
    s = result['settings']
    head = '| method | ' + ' | '.join('%d' % b for b in batches) + ' |'
    rule = '|---|' + '---:|' * len(batches)
    untuned = ('; adascale: at the lr tuned at B = %d only' % batches[0]
               if 'adascale' in methods else '')
    lines = ['Steps to %.2f validation accuracy on %s (at the lr with the fewest steps%s; '
             '—: not reached within %d steps at any lr tried):' % (
                 s['target'], s['dataset'], untuned, s['max_steps']), '', head, rule]
    for name, m in methods.items():
        lines.append('| %s | %s |' % (name, ' | '.join(_fmt(v) for v in m['steps_to_target'])))
    lines += ['', 'Learning rate chosen (peak, after warmup%s):' % (
        '; adascale: the lr given, which each update multiplies by its gain'
        if untuned else ''), '', head, rule]
    for name, m in methods.items():
        lines.append('| %s | %s |' % (name, ' | '.join('%.3g' % v for v in m['lr'])))
    lines += ['', "McCandlish's fit S = S_min (1 + B_crit / B) against the noise scale "
                  '(B_simple: median over the batch sizes of the run-averaged value; '
                  'scales up to: the largest B before a doubling cut the steps by less '
                  'than a factor 1.41):', '',
              '| method | S_min | E_min | B_crit | rms log residual | B_simple | '
              'B_crit / B_simple | scales up to |', '|---|---:|---:|---:|---:|---:|---:|---:|']
    for name, m in methods.items():
        fit = m['fit']
        ratio = (m['b_crit'] / m['b_simple_median']
                 if m['b_crit'] and m['b_simple_median'] else None)
        lines.append('| %s | %s | %s | %s | %s | %s | %s | %s |' % (
            name, _fmt(m['s_min']), _fmt(m['e_min']), _fmt(m['b_crit']),
            _fmt(fit and fit['rms_log_residual'], '%.3f'), _fmt(m['b_simple_median']),
            _fmt(ratio, '%.2f'), _fmt(m['scales_up_to'], '%d')))
    lines += ['', 'B_simple (GradientNoiseScale, run average up to the target / smoothed '
                  'value at the target) at the chosen lr; summary (median of all): %s:'
              % _fmt(result['b_simple']['summary']), '', head, rule]
    for name, m in methods.items():
        lines.append('| %s | %s |' % (name, ' | '.join(
            '%s / %s' % (_fmt(a), _fmt(t)) for a, t in zip(m['b_simple'],
                                                           m['b_simple_at_target']))))
    if 'adascale' in methods:
        lines += _adascale_lines(batches, methods['adascale'])
    if 'auto' in result:
        lines += _auto_lines(result['auto'])
    return '\n'.join(lines)


def _adascale_lines(batches, m):
    """The adascale rows' scale S, gains and progress, per batch."""
    b = m['micro_batch']
    return [
        '', 'AdaScale (adascale: S = B / %d micro-batches of %d per update, lr %.3g tuned at '
        'B = %d only, times the gain r in [1, S] per update): mean gain (the sum of the gains '
        'over the updates to the target) / last gain, and that sum, the progress to the '
        'target in steps of batch %d (AdaScale keeps it near the steps at B = %d):'
        % (b, b, m['lr'][0], b, b, b), '',
        '| adascale | ' + ' | '.join('%d' % x for x in batches) + ' |',
        '|---|' + '---:|' * len(batches),
        '| S | %s |' % ' | '.join('%d' % k for k in m['batch_scale']),
        '| mean / last gain | %s |' % ' | '.join(
            '%s / %s' % (_fmt(a, '%.2f'), _fmt(z, '%.2f'))
            for a, z in zip(m['gain_mean'], m['gain_last'])),
        '| progress to target | %s |' % ' | '.join(_fmt(v) for v in m['progress_to_target'])]


def _windows_text(windows, shown=12):
    """'update: length' of each window length taken, the first `shown` of them."""
    text = ', '.join('%d: %d' % (u, k) for u, k in windows[:shown])
    return text + (', ... (%d in all)' % len(windows) if len(windows) > shown else '')


def _auto_lines(a):
    """The adascale-auto run's row and where it falls among the fixed-batch rows."""
    b, (low, high) = a['micro_batch'], a['batch_scale_bounds']
    lines = [
        '', "Goodput-chosen batch (adascale-auto: batch_scale='auto', windows of %d to %d "
        'micro-batches of %d chosen every %d updates, lr %.3g as adascale; mean batch: '
        'examples / steps; final batch: the window of the update at the target x %d; '
        'windows: update: micro-batches from then on):'
        % (low, high, b, a['batch_scale_interval'], a['lr'], b), '',
        '| run | steps | examples | mean batch | final batch | mean / last gain | windows |',
        '|---|---:|---:|---:|---:|---|---|',
        '| adascale-auto | %s | %s | %s | %s | %s / %s | %s |' % (
            _fmt(a['steps_to_target']), _fmt(a['examples_to_target']), _fmt(a['mean_batch']),
            _fmt(a['final_batch']), _fmt(a['gain_mean'], '%.2f'),
            _fmt(a['gain_last'], '%.2f'), _windows_text(a['window_history']))]
    if 'against_fixed' in a:
        around = a['against_fixed']
        lines += ['', 'Against the fixed-batch adascale rows: steps %s; examples %s.' % (
            _between_text(around['steps']), _between_text(around['examples']))]
    return lines


def _between_text(around):
    above, below = around['above'], around['below']
    if above and below:
        if above == below:
            return 'as at B = %d (%.0f)' % tuple(above)
        return 'between B = %d (%.0f) and B = %d (%.0f)' % tuple(min(above, below) +
                                                                  max(above, below))
    if above:
        return 'fewer than at every B (nearest: B = %d, %.0f)' % tuple(above)
    return 'more than at every B (nearest: B = %d, %.0f)' % tuple(below)
