"""Large-batch study on the 8x8 digits: accuracy vs batch size under a fixed epoch budget.

    python benchmarks/study.py [--out DIR] [--seeds 3] [--epochs 20] [--tiny]
    mx-lbsgd study ...

Every method trains ``mx_lbsgd._models.mlp`` (64, 64) for the same number of epochs, so a
batch k times larger gets k times fewer updates. Batch sizes are multiples of the base
batch 32; 'full' is the whole training set rounded down to a multiple of 32 (1344 of 1348).

  sgd            mx SGD, momentum 0.9, real batches, linear scaling rule
                 lr = base_lr * batch / 32, no warmup
  lbsgd-linear   mx_lbsgd LBSGD: micro-batches of 32, batch_scale = batch / 32 summed per
  lbsgd-sqrt     update, lr warmed up from base_lr to base_lr * batch / 32 (the same
  lbsgd-power2   final lr as sgd) over --warmup-epochs with that shape
  lbsgd-lars     LBSGD with LARS trust ratios (eta 0.001), micro-batches of 32 summed as
                 above, lr = --lars-lr at every batch size: the trust ratio normalizes
                 each layer's step, and lars_lr * batch / 32 diverged at batch >= 512
                 (accuracy 0.08-0.16 for lars_lr 0.5, 1, 2; 3 seeds, 20 epochs)
  fp16-scaled    lbsgd-linear in float16 (fp32 master weights), dynamic loss scaling
  fp16-unscaled  the same without loss scaling

float16 runs also report the gradient underflow: at the end of each epoch, the fraction
of the gradient entries of one micro-batch that are non-zero with the loss scaled by the
largest power of two that keeps them finite but zero at the run's loss scale (1 when
unscaled). Writes study.json, study.png (accuracy and epochs-to-target vs batch size) and
study.md (the printed tables) into --out.
"""
import json
import math
import os
import sys
import time

import numpy as np

try:
    from mx_lbsgd import _train
except ImportError:           # run from a checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mx_lbsgd import _train
from mx_lbsgd.cli import _Parser, _number, demo_error, demo_missing

BASE_BATCH = 32
METHODS = ('sgd', 'lbsgd-linear', 'lbsgd-sqrt', 'lbsgd-power2', 'lbsgd-lars',
           'fp16-scaled', 'fp16-unscaled')


def run_config(method, batch, seed, args):
    """The TrainConfig of one cell of the study."""
    scale = batch // BASE_BATCH
    common = dict(epochs=args.epochs, seed=seed, momentum=0.9, wd=1e-4, target=args.target,
                  record_steps=False)
    if method == 'sgd':
        return _train.TrainConfig(optimizer='sgd', batch_size=batch,
                                  lr=args.base_lr * scale, **common)
    lb = dict(optimizer='lbsgd', batch_size=BASE_BATCH, batch_scale=scale,
              warmup_epochs=args.warmup_epochs, **common)
    if method == 'lbsgd-lars':
        return _train.TrainConfig(warmup_strategy='lars', lr=args.lars_lr, **lb)
    if method.startswith('lbsgd-'):
        return _train.TrainConfig(warmup_strategy=method[6:], lr=args.base_lr, **lb)
    return _train.TrainConfig(warmup_strategy='linear', lr=args.base_lr, dtype='float16',
                              loss_scale='dynamic' if method == 'fp16-scaled' else 'none',
                              **lb)


def _mean_std(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


def aggregate(runs, target):
    """Per (method, batch): mean/std of final and best accuracy, epochs to target, ..."""
    cells = {}
    for r in runs:
        cells.setdefault((r['method'], r['batch']), []).append(r)
    out = []
    for (method, batch), group in cells.items():
        reach = [r['epochs_to_target'] for r in group if r['epochs_to_target'] is not None]
        acc, acc_std = _mean_std([r['final_test_acc'] for r in group])
        best, best_std = _mean_std([r['best_test_acc'] for r in group])
        row = dict(method=method, batch=batch, seeds=len(group), final_acc=acc,
                   final_acc_std=acc_std, best_acc=best, best_acc_std=best_std,
                   reached=len(reach), epochs_to_target=_mean_std(reach)[0],
                   updates=group[0]['updates'], seconds=_mean_std([r['wall_time_s']
                                                                   for r in group])[0])
        if 'underflow_fraction' in group[0]:
            row['underflow_fraction'] = _mean_std([r['underflow_fraction']
                                                   for r in group])[0]
            row['skipped_steps'] = _mean_std([r['skipped_steps'] for r in group])[0]
        out.append(row)
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


def tables(summary, batches, methods, target, epochs):
    """Markdown tables: final accuracy, epochs to target, float16 details."""
    cell = {(r['method'], r['batch']): r for r in summary}
    head = '| method | ' + ' | '.join('batch %d' % b for b in batches) + ' |'
    rule = '|---|' + '---:|' * len(batches)
    updates = '| updates per run | ' + ' | '.join(' / '.join(
        str(u) for u in sorted({cell[(m, b)]['updates'] for m in methods})) for b in batches
    ) + ' |'
    lines = ['Final test accuracy after %d epochs (mean ± std over seeds):' % epochs, '',
             head, rule, updates]
    for m in methods:
        lines.append('| %s | %s |' % (m, ' | '.join(_fmt_acc(cell[(m, b)]) for b in batches)))
    lines += ['', 'Epochs to reach test accuracy %.2f (mean over the seeds that reach it; '
                  '(k/n): only k of n seeds did; —: none):' % target, '', head, rule]
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


def plot(summary, batches, methods, path, target):
    """study.png: final accuracy and epochs to target vs batch size, one line per method."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cell = {(r['method'], r['batch']): r for r in summary}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in methods:
        rows = [cell[(m, b)] for b in batches]
        style = '--' if m.startswith('fp16') else '-'
        left.errorbar(batches, [r['final_acc'] if r['final_acc'] is not None else np.nan
                                for r in rows],
                      yerr=[r['final_acc_std'] or 0 for r in rows], ls=style, marker='o',
                      capsize=3, label=m)
        right.plot(batches, [r['epochs_to_target'] if r['reached'] else np.nan
                             for r in rows], ls=style, marker='o', label=m)
    for ax in (left, right):
        ax.set_xscale('log', base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel('batch size (samples per update)')
    left.set(ylabel='final test accuracy', ylim=(0, 1.02),
             title='accuracy after a fixed epoch budget')
    right.set(ylabel='epochs', title='epochs to test accuracy %.2f' % target)
    left.legend(loc='lower left', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _parser(prog):
    p = _Parser(prog=prog, description=__doc__.splitlines()[0],
                epilog='Methods: ' + ', '.join(METHODS) + '. See the module docstring.')
    p.add_argument('--out', default='study', help='output folder (default %(default)s)')
    p.add_argument('--batch-sizes', type=_number(int, BASE_BATCH), nargs='+',
                   help='multiples of 32 (default 32 128 512 full)')
    p.add_argument('--methods', nargs='+', choices=METHODS, metavar='M',
                   help='subset of: %s (default: all)' % ', '.join(METHODS))
    p.add_argument('--seeds', type=_number(int, 1), default=3,
                   help='seeds 0..N-1 (default %(default)s)')
    p.add_argument('--epochs', type=_number(int, 1), default=20,
                   help='epoch budget of every run (default %(default)s)')
    p.add_argument('--warmup-epochs', type=_number(float, 0), default=5.0,
                   help='lbsgd warmup length (default %(default)g)')
    p.add_argument('--base-lr', type=_number(float, 0, open_low=True), default=0.01,
                   help='lr at batch 32, scaled linearly with the batch (default %(default)g;'
                        ' 0.4 at the full batch is already at the edge of divergence)')
    p.add_argument('--lars-lr', type=_number(float, 0, open_low=True), default=2.0,
                   help='lbsgd-lars lr, the same at every batch size (default %(default)g)')
    p.add_argument('--target', type=_number(float, 0, 1), default=0.95,
                   help='accuracy for epochs-to-target (default %(default)g)')
    p.add_argument('--jobs', type=_number(int, 1),
                   help='runs in parallel, each in a process with OMP_NUM_THREADS=1; 1 runs '
                        'them in this process (default: min(2, CPUs); 1 with --tiny)')
    p.add_argument('--tiny', action='store_true',
                   help='tiny configuration for tests: batches 32 128, 1 seed, 2 epochs')
    p.add_argument('--quiet', action='store_true', help='print only the tables')
    return p


def main(argv=None, prog='study.py'):
    """Run the study; returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    missing = demo_missing(('sklearn.datasets', 'matplotlib'))   # the digits, study.png
    if missing:
        parser.exit(2, demo_error(prog, missing) + '\n')
    n_train = len(_train.load_digits()[0])
    full = (n_train // BASE_BATCH) * BASE_BATCH
    if args.tiny:
        args.seeds, args.epochs = 1, 2
        args.batch_sizes = args.batch_sizes or [32, 128]
    if args.jobs is None:
        args.jobs = 1 if args.tiny else min(2, os.cpu_count() or 1)
    batches = sorted(set(args.batch_sizes or [32, 128, 512, full]))
    bad = [b for b in batches if b % BASE_BATCH or b > full]
    if bad:
        parser.error('argument --batch-sizes: %s: each must be a multiple of %d and <= %d'
                     % (bad, BASE_BATCH, full))
    methods = list(args.methods or METHODS)
    cells = [(m, b, seed) for m in methods for b in batches for seed in range(args.seeds)]
    configs = [run_config(m, b, seed, args) for m, b, seed in cells]
    runs = [None] * len(cells)
    start = time.perf_counter()

    def collect(i, result):
        (method, batch, seed), cfg = cells[i], configs[i]
        run = dict(method=method, batch=batch, seed=seed,
                   updates=result['total_steps'] // cfg.batch_scale,
                   test_acc=[r['test_acc'] for r in result['epochs']],
                   config=result['config'],
                   **{k: result[k] for k in ('final_test_acc', 'best_test_acc',
                                             'epochs_to_target', 'wall_time_s',
                                             'skipped_steps')})
        if 'final_underflow_fraction' in result:
            run['underflow_fraction'] = result['final_underflow_fraction']
        runs[i] = run
        if not args.quiet:
            done = sum(r is not None for r in runs)
            print('[%3d/%d] %-14s batch %4d seed %d: test acc %.3f, %d updates, %.1f s'
                  % (done, len(cells), method, batch, seed, run['final_test_acc'],
                     run['updates'], run['wall_time_s']), file=sys.stderr, flush=True)
    _train.run_many(configs, args.jobs, collect)
    wall = time.perf_counter() - start
    summary = aggregate(runs, args.target)
    text = tables(summary, batches, methods, args.target, args.epochs)
    print(text)
    print('\n%d runs in %.0f s' % (len(runs), wall))
    os.makedirs(args.out, exist_ok=True)
    plot(summary, batches, methods, os.path.join(args.out, 'study.png'), args.target)
    with open(os.path.join(args.out, 'study.md'), 'w') as f:
        f.write(text + '\n')
    settings = {k: v for k, v in vars(args).items() if k not in ('out', 'quiet')}
    settings.update(batch_sizes=batches, methods=methods, base_batch=BASE_BATCH,
                    train_samples=n_train)
    with open(os.path.join(args.out, 'study.json'), 'w') as f:
        json.dump(dict(settings=settings, wall_time_s=wall, versions=_train.versions(),
                       summary=summary, runs=runs), f, indent=1)
    print('wrote %s' % ', '.join(os.path.join(args.out, n)
                                 for n in ('study.md', 'study.json', 'study.png')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
