"""study.png: steps to target against batch size (log-log) per method, with McCandlish's
fitted curve, the perfect-scaling line, B_crit per method and the measured B_simple; the
adascale-auto run as a star at its mean batch. matplotlib is imported when the figure is
drawn."""
import numpy as np

from .study_fit import predicted_steps

__all__ = ['plot_study']


def plot_study(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    batches = np.array(result['batch_sizes'], dtype=float)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    dense = np.geomspace(batches.min(), batches.max(), 200)
    reached_all = []
    for i, (name, m) in enumerate(result['methods'].items()):
        color = 'C%d' % i
        steps = m['steps_to_target']
        hit = [(b, s) for b, s in zip(batches, steps) if s is not None]
        reached_all += [s for _, s in hit]
        if hit:
            ax.plot(*zip(*hit), 'o-', color=color, label=_label(name, result))
        missed = [b for b, s in zip(batches, steps) if s is None]
        if missed:
            cap = result['settings']['max_steps']
            ax.plot(missed, [cap] * len(missed), 'x', color=color, ms=9,
                    label='%s: not reached by %d' % (name, cap))
        if m['fit']:
            ax.plot(dense, predicted_steps(dense, m['s_min'], m['b_crit']), '--',
                    color=color, lw=1)
            ax.axvline(m['b_crit'], color=color, ls=':', lw=1.2)
            ax.annotate('B_crit %.0f' % m['b_crit'], (m['b_crit'], 0.97),
                        xycoords=('data', 'axes fraction'), rotation=90, va='top',
                        ha='right', fontsize=7, color=color)
    if reached_all:
        first = next((s for s in (m['steps_to_target'][0]
                                  for m in result['methods'].values()) if s), None)
        if first:
            ax.plot(dense, first * batches[0] / dense, color='gray', lw=1,
                    label='perfect scaling (S ∝ 1/B)')
    _plot_auto(ax, result.get('auto'))
    summary = result['b_simple']['summary']
    if summary:
        ax.axvline(summary, color='black', lw=2, alpha=0.5,
                   label='B_simple %.0f (median of all runs)' % summary)
    ax.set(xscale='log', yscale='log', xlabel='batch size B',
           ylabel='steps to %.2f validation accuracy' % result['target'],
           title='Steps to target vs batch size (%s; dashed: S_min (1 + B_crit / B))'
                 % result['settings']['dataset'])
    ax.set_xticks(batches)
    ax.set_xticklabels(['%d' % b for b in batches])
    ax.legend(fontsize=8, loc='upper right')
    ax.grid(True, which='both', alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(name, result):
    if name == 'adascale':
        return 'adascale (the lr of B = %d at every B)' % result['batch_sizes'][0]
    return name


def _plot_auto(ax, auto):
    """The adascale-auto run: a star at (mean batch, steps), a line over the batches taken."""
    if not auto or auto['steps_to_target'] is None:
        return
    steps, taken = auto['steps_to_target'], auto['batches_taken'] or [auto['mean_batch']]
    ax.plot([min(taken), max(taken)], [steps, steps], '-', color='black', lw=1, alpha=0.6)
    ax.plot([auto['mean_batch']], [steps], '*', color='black', ms=13,
            label='adascale-auto: %d steps, mean batch %.0f (line: batches taken)'
                  % (steps, auto['mean_batch']))
