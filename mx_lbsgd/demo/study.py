"""Large-batch study: which batch size can each method use, at a fixed, generous budget?

    mx-lbsgd study [--out DIR] [--seeds 3] [--epochs 10] [--tiny]
    python -m mx_lbsgd.demo.study ...      (or python benchmarks/study.py ...)

Data: 'digits-shifted' (``mx_lbsgd.demo.data.load_data``): scikit-learn's 1,797 8x8 digits,
split by source image into test (25%), validation (15% of the rest) and train, then every
image of every split also shifted by one pixel in the 8 directions. That gives 10,314
training, 1,818 validation and 4,041 test images, made on the spot with no download; no
source image is in two splits. The plain digits (1,347 training images) cannot hold this
study: a batch of 1,024 is the whole set, and 100 updates at it would be 100 epochs.

Budget: every run trains ``mx_lbsgd.demo.models.mlp`` (64, 64) for the same --epochs (default
10), so the largest batch (1,024: 10 updates an epoch) still gets 100 updates and the
small batch (64) 1,610. Every method's lr follows a cosine decay to 0 over the run.

Methods (batch B, base batch b = 64, k = B / b):

  sgd            mx SGD, momentum 0.9, real batches of B, linear scaling rule lr = g * k
  sgd-warmup     the same, lr warmed up linearly from g to g * k over --warmup-epochs
                 (Goyal et al. 2017), then the cosine decay
  lbsgd-linear   mx_lbsgd LBSGD: micro-batches of b, batch_scale = k accumulated per
  lbsgd-sqrt     update, lr warmed from g to g * k over --warmup-epochs with that shape
  lbsgd-power2   (the same final lr as sgd), times the cosine decay
  lbsgd-lars     LBSGD with LARS trust ratios (eta 0.001), micro-batches of b as above,
                 lr = g * sqrt(k) (linear scaling diverged at B >= 512 in this
                 study's previous version), no warmup
  fp16-scaled    lbsgd-linear in float16 (fp32 master weights), dynamic loss scaling
  fp16-unscaled  the same without loss scaling

At B = b the five fp32 non-LARS methods are one and the same run (no accumulation, no
warmup left); it is trained once and reported for each.

Learning rate: a grid of 3 values of g per method (--grid, --lars-grid), each trained with
seed 0. While the best final validation accuracy of a (method, batch) is at an end of its
grid, the grid is extended past that end by a factor of 2, at most --grid-extend (2)
times each way. The g with the best validation accuracy is then trained with the other
seeds, and the tables report test accuracy over all seeds at that g (the chosen lr is in
the tables too; one still at an end of the grid says so).

Reported: final test accuracy (mean +- std over seeds), epochs to --target test accuracy,
per method the largest batch whose mean accuracy is within 1 point of the small-batch sgd
accuracy, and for float16 the gradient underflow (as in ``mx-lbsgd train``) and skipped
steps. Writes study.json, study.md (the printed tables) and study.png (accuracy and epochs
to target against batch size) into --out.
"""
import json
import math
import os
import sys
import time

from .args import Parser, demo_error, demo_missing, number
from .config import TrainConfig
from .data import DATASETS, load_data
from .plots import plot_study
from .study_report import aggregate, largest_batch, tables
from .summary import versions
from .train import train

__all__ = ['METHODS', 'BASE_BATCH', 'run_config', 'run_many', 'main']

BASE_BATCH = 64
METHODS = ('sgd', 'sgd-warmup', 'lbsgd-linear', 'lbsgd-sqrt', 'lbsgd-power2', 'lbsgd-lars',
           'fp16-scaled', 'fp16-unscaled')
#: At the base batch these are all plain fp32 SGD with lr g: trained once, as 'sgd'.
SAME_AS_SGD_AT_BASE = ('sgd', 'sgd-warmup', 'lbsgd-linear', 'lbsgd-sqrt', 'lbsgd-power2')
DATASET = 'digits-shifted'
VAL_FRACTION = 0.15
GRID = (0.05, 0.1, 0.2)          # g: lr at the base batch (sgd and the lbsgd warmups)
LARS_GRID = (1.0, 2.0, 4.0)      # g: lbsgd-lars lr at the base batch
TOLERANCE = 0.01                 # "within 1 point"


def lr_for(method, batch, g):
    k = batch // BASE_BATCH
    return g * math.sqrt(k) if method == 'lbsgd-lars' else g * k


def run_config(method, batch, g, seed, args):
    """The TrainConfig of one run of the study."""
    if batch == BASE_BATCH and method in SAME_AS_SGD_AT_BASE:
        method = 'sgd'
    scale = batch // BASE_BATCH
    common = dict(epochs=args.epochs, seed=seed, momentum=0.9, wd=1e-4, target=args.target,
                  record_steps=False, dataset=args.dataset, val_fraction=VAL_FRACTION,
                  lr_decay='cosine', lr=lr_for(method, batch, g))
    if method not in ('sgd', 'sgd-warmup', 'lbsgd-lars'):
        common['lr'] = g          # LBSGD's warmup multiplies it up to g * k
    if method == 'sgd':
        return TrainConfig(optimizer='sgd', batch_size=batch, **common)
    if method == 'sgd-warmup':
        return TrainConfig(optimizer='sgd', batch_size=batch, warmup_from=g,
                                  warmup_epochs=args.warmup_epochs, **common)
    lb = dict(optimizer='lbsgd', batch_size=BASE_BATCH, batch_scale=scale,
              warmup_epochs=args.warmup_epochs, **common)
    if method == 'lbsgd-lars':
        return TrainConfig(warmup_strategy='lars', **lb)
    if method.startswith('lbsgd-'):
        return TrainConfig(warmup_strategy=method[6:], **lb)
    return TrainConfig(warmup_strategy='linear', dtype='float16',
                              loss_scale='dynamic' if method == 'fp16-scaled' else 'none',
                              **lb)


def _choose(grid_runs):
    """(method, batch) -> (g, validation accuracy) of the best run of the grid."""
    chosen = {}
    for r in grid_runs:
        key = (r['method'], r['batch'])
        val = r['final_val_acc'] if not math.isnan(r['final_val_acc']) else -1.0
        if key not in chosen or val > chosen[key][1]:
            chosen[key] = (r['g'], val)
    return chosen


def _key(cfg):
    return tuple(sorted((k, str(v)) for k, v in vars(cfg).items()))


def _parser(prog):
    p = Parser(prog=prog, description=__doc__.splitlines()[0],
                epilog='Methods: ' + ', '.join(METHODS) + '. See the module docstring.')
    p.add_argument('--out', default='study', help='output folder (default %(default)s)')
    p.add_argument('--batch-sizes', type=number(int, BASE_BATCH), nargs='+',
                   help='multiples of %d (default 64 256 1024)' % BASE_BATCH)
    p.add_argument('--methods', nargs='+', choices=METHODS, metavar='M',
                   help='subset of: %s (default: all)' % ', '.join(METHODS))
    p.add_argument('--seeds', type=number(int, 1), default=3,
                   help='seeds 0..N-1 (default %(default)s)')
    p.add_argument('--epochs', type=number(int, 1), default=10,
                   help='epoch budget of every run (default %(default)s)')
    p.add_argument('--warmup-epochs', type=number(float, 0), default=2.0,
                   help='warmup length of sgd-warmup and lbsgd (default %(default)g)')
    p.add_argument('--grid', type=number(float, 0, open_low=True), nargs='+',
                   default=list(GRID), metavar='G',
                   help='lr grid at batch 64, scaled by batch / 64 (default %s)'
                        % ' '.join('%g' % g for g in GRID))
    p.add_argument('--lars-grid', type=number(float, 0, open_low=True), nargs='+',
                   default=list(LARS_GRID), metavar='G',
                   help='lbsgd-lars lr grid at batch 64, scaled by sqrt(batch / 64) '
                        '(default %s)' % ' '.join('%g' % g for g in LARS_GRID))
    p.add_argument('--grid-extend', type=number(int, 0),
                   help='times the grid may be extended by a factor 2 beyond its end '
                        'when the best lr is there, each way (default 2; --tiny: 0)')
    p.add_argument('--dataset', choices=DATASETS, default=DATASET,
                   help='default %(default)s (--tiny: digits)')
    p.add_argument('--target', type=number(float, 0, 1), default=0.95,
                   help='accuracy for epochs-to-target (default %(default)g)')
    p.add_argument('--jobs', type=number(int, 1),
                   help='runs in parallel, each in a process with OMP_NUM_THREADS=1; 1 runs '
                        'them in this process (default: min(2, CPUs); 1 with --tiny)')
    p.add_argument('--tiny', action='store_true',
                   help='tiny configuration for tests: plain digits, batches 64 128, '
                        '1 seed, 2 epochs, 2 grid values')
    p.add_argument('--quiet', action='store_true', help='print only the tables')
    return p


def _run_one(cfg):
    """train(cfg) without the per-step history (picklable worker for run_many)."""
    result = train(cfg)
    result['steps'] = []
    return result


def _exit_with_parent(parent):
    """Pool worker initializer: exit once the parent is gone (a SIGTERM to `mx-lbsgd study`
    would otherwise leave its workers training on, reparented, for as long as the run)."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def run_many(configs, jobs=1, on_result=None):
    """Results of train(cfg) for each config, in order. jobs > 1 runs them in that many
    spawned processes with OMP_NUM_THREADS=1 (MXNet's OpenMP threads spin and crawl when
    the cores are oversubscribed). on_result(index, result) is called as each finishes."""
    configs = list(configs)
    results = [None] * len(configs)
    if jobs <= 1:
        for i, cfg in enumerate(configs):
            results[i] = _run_one(cfg)
            if on_result is not None:
                on_result(i, results[i])
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    saved = os.environ.get('OMP_NUM_THREADS')
    os.environ['OMP_NUM_THREADS'] = '1'
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context('spawn'),
                                 initializer=_exit_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_run_one, cfg): i for i, cfg in enumerate(configs)}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if on_result is not None:
                    on_result(i, results[i])
    finally:
        if saved is None:
            del os.environ['OMP_NUM_THREADS']
        else:
            os.environ['OMP_NUM_THREADS'] = saved
    return results


def main(argv=None, prog='mx-lbsgd study'):
    """Run the study; returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    missing = demo_missing(('sklearn.datasets', 'matplotlib'))   # the digits, study.png
    if missing:
        parser.exit(2, demo_error(prog, missing) + '\n')
    if args.tiny:
        args.seeds, args.epochs, args.dataset = 1, 2, 'digits'
        args.grid, args.lars_grid = args.grid[:2], args.lars_grid[:2]
        args.batch_sizes = args.batch_sizes or [64, 128]
    if args.grid_extend is None:
        args.grid_extend = 0 if args.tiny else 2
    if args.jobs is None:
        args.jobs = 1 if args.tiny else min(2, os.cpu_count() or 1)
    n_train = len(load_data(val_fraction=VAL_FRACTION, dataset=args.dataset)[0])
    batches = sorted(set(args.batch_sizes or [64, 256, 1024]))
    bad = [b for b in batches if b % BASE_BATCH or b > n_train]
    if bad:
        parser.error('argument --batch-sizes: %s: each must be a multiple of %d and <= %d'
                     % (bad, BASE_BATCH, n_train))
    methods = list(args.methods or METHODS)
    start = time.perf_counter()
    done = {}          # config key -> result (identical configs are trained once)

    def train_all(cells):
        """cells: (method, batch, g, seed); returns their run dicts, in order."""
        configs = [run_config(m, b, g, s, args) for m, b, g, s in cells]
        todo, seen = [], set()
        for cfg in configs:
            if _key(cfg) not in done and _key(cfg) not in seen:
                seen.add(_key(cfg))
                todo.append(cfg)

        def collect(i, result):
            done[_key(todo[i])] = result
            if not args.quiet:
                cfg = todo[i]
                print('[%3d/%d] %-5s %s batch %4d x %d lr %-7.4g seed %d: val %.3f test %.3f,'
                      ' %.1f s' % (i + 1, len(todo), cfg.optimizer, cfg.dtype,
                                   cfg.batch_size, cfg.batch_scale, cfg.lr, cfg.seed,
                                   result['final_val_acc'], result['final_test_acc'],
                                   result['wall_time_s']), file=sys.stderr, flush=True)
        run_many(todo, args.jobs, collect)
        runs = []
        for (method, batch, g, seed), cfg in zip(cells, configs):
            result = done[_key(cfg)]
            run = dict(method=method, batch=batch, g=g, seed=seed,
                       updates=result['updates'],
                       test_acc=[r['test_acc'] for r in result['epochs']],
                       val_acc=[r['val_acc'] for r in result['epochs']],
                       config=result['config'],
                       **{k: result[k] for k in ('final_test_acc', 'final_val_acc',
                                                 'best_test_acc', 'epochs_to_target',
                                                 'wall_time_s', 'skipped_steps')})
            if 'final_underflow_fraction' in result:
                run['underflow_fraction'] = result['final_underflow_fraction']
            runs.append(run)
        return runs

    # 1. the grid, seed 0, extended by halving (doubling) g while the best validation
    #    accuracy is at its low (high) end, at most --grid-extend times each way;
    # 2. the other seeds at the g with the best validation accuracy
    grids = {(m, b): list(args.lars_grid if m == 'lbsgd-lars' else args.grid)
             for m in methods for b in batches}
    extended = {key: [0, 0] for key in grids}
    grid_runs, pending = [], [(m, b, g, 0) for (m, b), gs in grids.items() for g in gs]
    while pending:
        grid_runs += train_all(pending)
        pending = []
        chosen = _choose(grid_runs)
        for key, (g, _) in chosen.items():
            for end, factor, side in ((min(grids[key]), 0.5, 0), (max(grids[key]), 2.0, 1)):
                if g == end and extended[key][side] < args.grid_extend:
                    extended[key][side] += 1
                    grids[key].append(g * factor)
                    pending.append(key + (g * factor, 0))
    seed_cells = [(m, b, chosen[(m, b)][0], s) for m in methods for b in batches
                  for s in range(1, args.seeds)]
    runs = [r for r in grid_runs if r['g'] == chosen[(r['method'], r['batch'])][0]]
    runs += train_all(seed_cells)
    wall = time.perf_counter() - start
    summary = aggregate(runs, grid_runs, lr_for)
    cell = {(r['method'], r['batch']): r for r in summary}
    ref_row = cell.get(('sgd', batches[0]))
    if ref_row is None:          # sgd not studied: the first method's small batch
        ref_row = cell[(methods[0], batches[0])]
    reference = ref_row['final_acc']
    largest = largest_batch(summary, batches, methods, reference, TOLERANCE)
    text = tables(summary, batches, methods, args, reference, largest, TOLERANCE)
    print(text)
    print('\n%d runs (%d distinct trainings) in %.0f s'
          % (len(grid_runs) + len(seed_cells), len(done), wall))
    os.makedirs(args.out, exist_ok=True)
    plot_study(summary, batches, methods, os.path.join(args.out, 'study.png'), args.target,
               reference, TOLERANCE)
    with open(os.path.join(args.out, 'study.md'), 'w') as f:
        f.write(text + '\n')
    settings = {k: v for k, v in vars(args).items() if k not in ('out', 'quiet')}
    settings.update(batch_sizes=batches, methods=methods, base_batch=BASE_BATCH,
                    train_samples=n_train, val_fraction=VAL_FRACTION, tolerance=TOLERANCE)
    with open(os.path.join(args.out, 'study.json'), 'w') as f:
        json.dump(dict(settings=settings, wall_time_s=wall, distinct_trainings=len(done),
                       versions=versions(), reference_acc=reference,
                       largest_batch=largest, summary=summary, runs=runs,
                       grid_runs=grid_runs), f, indent=1)
    print('wrote %s' % ', '.join(os.path.join(args.out, n)
                                 for n in ('study.md', 'study.json', 'study.png')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
