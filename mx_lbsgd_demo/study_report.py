"""The study's results: per method the tuned cells, McCandlish's fit and B_simple
(:func:`summarize`, what study.json holds), and the markdown tables it prints
(:func:`tables`)."""
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


def summarize(cells_by_method, settings):
    """study.json's content: batch_sizes, methods -> {steps_to_target, lr, examples,
    fit, b_crit, s_min, e_min, b_simple, ...}, b_simple (per method and batch, summary)."""
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
        b_simple[name] = dict(per_batch=per_batch, median=_median(per_batch))
    everything = [v for entry in b_simple.values() for v in entry['per_batch']]
    b_simple['summary'] = _median(everything)
    return dict(batch_sizes=batches, methods=methods, b_simple=b_simple,
                trainings=trainings, target=settings['target'])


def _fmt(value, spec='%.0f'):
    return '—' if value is None else spec % value


def tables(result):
    """Markdown: steps to target (and lr), the fit against B_simple, B_simple per batch."""
    batches, methods = result['batch_sizes'], result['methods']
    s = result['settings']
    head = '| method | ' + ' | '.join('%d' % b for b in batches) + ' |'
    rule = '|---|' + '---:|' * len(batches)
    lines = ['Steps to %.2f validation accuracy on %s (at the lr with the fewest steps; '
             '—: not reached within %d steps at any lr tried):' % (
                 s['target'], s['dataset'], s['max_steps']), '', head, rule]
    for name, m in methods.items():
        lines.append('| %s | %s |' % (name, ' | '.join(_fmt(v) for v in m['steps_to_target'])))
    lines += ['', 'Learning rate chosen (peak, after warmup):', '', head, rule]
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
    return '\n'.join(lines)
