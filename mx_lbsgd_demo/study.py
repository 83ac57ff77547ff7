"""Large-batch study: steps to a target validation accuracy against batch size, per method.

    mx-lbsgd study [--out DIR] [--target 0.92] [--batch-sizes 16 32 ... 1024] [--tiny]
    python -m mx_lbsgd_demo.study ...      (or python benchmarks/study.py ...)

After Shallue et al., "Measuring the Effects of Data Parallelism on Neural Network
Training" (2018), https://arxiv.org/abs/1811.03600: for every method and batch size B,
the learning rate is tuned on the validation split for the fewest steps S to reach
--target validation accuracy; S against B is then fitted with McCandlish et al.'s
trade-off S = S_min (1 + B_crit / B) (``study_fit``), and B_crit = E_min / S_min is put
next to the gradient noise scale B_simple that `mx_lbsgd.GradientNoiseScale` measures
during the same runs.

Data: 'digits-shifted' (``mx_lbsgd_demo.data.load_data``, made on the spot, no
download): 10,314 training and 1,818 validation images. Model: the (64, 64) MLP.

Every run is `mx_lbsgd.LBSGD` under a gluon Trainer accumulating k = B / b micro-batches
of b = min(B / 2, --micro-batch) per update (``batch_scale = k``), so the monitor sees two
batch sizes, b and B, and LBSGD's warmup (which rises from lr / k to lr) starts from the
micro-batch's lr as in Goyal et al. (2017): k = 2 up to B = 256, 8 at B = 1024. The
learning rate is constant after any warmup; momentum 0.9, wd 1e-4. Methods:

  sgd           no warmup: exactly momentum SGD on batches of B at lr (LBSGD's multiplier
                is k from the start, and the accumulated gradient is the mean over B)
  lbsgd-linear  LBSGD's linear warmup: lr / k rising to lr over --warmup-updates updates
  lbsgd-lars    the same warmup times the LARS trust ratio per layer (eta 0.001), biases
                included (excluded, they would take the LARS-sized lr itself)
  fp16-scaled   lbsgd-linear with float16 weights, fp32 master copies (multi_precision)
                and a DynamicLossScaler in the optimizer (growth_interval 100)

Learning rate, per method: at the smallest batch a grid of --grid-points values spaced
by factors of 2 around --lr (--lars-lr for LARS); at every next batch the grid is centred
on twice the lr chosen at the previous one (the linear scaling rule). Each grid is
extended past an end by a factor of 2 (at most --grid-extend times each way) while the
fewest steps sit there. The grid centre runs first; the other values stop as soon as
they pass the fewest steps so far (they cannot win), or after --max-steps. Validation
accuracy is read at steps 1, 2, ... rising by at most 3 % (so S is exact to 3 %).
The target counts as reached at the first read >= target that the next read confirms
(one read of 1,818 images fluctuates by ~0.6 points); a run that never reaches it is
recorded as not reached (null). A run stops after --max-steps updates or --max-epochs
epochs, whichever comes first, or once its best accuracy is older than half its steps
(after 200 steps: a dead or stuck run).

B_simple: the monitor (interval 10) over every update of the run at the chosen lr, up
to the target: |G|^2 and tr(Sigma) are averaged over the run and divided (``b_simple``,
the summary value: S integrates the whole run), and the monitor's smoothed value when the
target is reached is kept too (``b_simple_at_target``).

Writes study.json, study.md (the printed tables) and study.png into --out.
"""
import json
import math
import os
import sys
import tempfile
import time

from .args import (SEED_MAX, Parser, UsageError, demo_error, demo_missing, number,
                   require_writable_dir)
from .data import DATASETS

__all__ = ['METHODS', 'micro_batches', 'train_to_target', 'tune_method', 'run_many', 'main']

METHODS = ('sgd', 'lbsgd-linear', 'lbsgd-lars', 'fp16-scaled')
DEFAULT_BATCHES = (16, 32, 64, 128, 256, 512, 1024)
VAL_FRACTION = 0.15
EVAL_GROWTH = 1.03


def _eval_steps():
    """The steps at which validation accuracy is read: 1, 2, ... rising by <= 3 %."""
    s = 1
    while True:
        yield s
        s = max(s + 1, int(math.ceil(s * EVAL_GROWTH)))


def micro_batches(batch, largest_micro):
    """k, the micro-batches per update of batch B: B / min(B / 2, largest_micro)."""
    return max(2, batch // largest_micro)


def _optimizer(spec, micro_per_epoch):
    import mx_lbsgd
    m = micro_batches(spec['batch'], spec['micro_batch'])
    warm = spec['warmup_updates'] if spec['method'] != 'sgd' else 0
    opt = dict(learning_rate=spec['lr'] / m, momentum=0.9, wd=1e-4, batch_scale=m,
               warmup_strategy='linear', updates_per_epoch=micro_per_epoch,
               warmup_epochs=warm * m / micro_per_epoch)
    if spec['method'] == 'lbsgd-lars':
        # the trust ratio on the biases too: excluded, they take the LARS-sized lr itself,
        # which kills this MLP's ReLUs (the old study's LARS result at batch 64)
        opt.update(lars=True, lars_exclude=())
    if spec['method'] == 'fp16-scaled':
        opt.update(multi_precision=True,
                   loss_scaler=mx_lbsgd.DynamicLossScaler(growth_interval=100))
    return mx_lbsgd.LBSGD(**opt)


def _pooled_b_simple(history):
    """tr(Sigma) and |G|^2 averaged over the raw per-update estimates, then divided."""
    g2 = tr = 0.0
    for h in history:
        b_s, b_b = h['b_small'], h['b_big']
        g2 += (b_b * h['big_sq'] - b_s * h['small_sq']) / (b_b - b_s)
        tr += (h['small_sq'] - h['big_sq']) / (1.0 / b_s - 1.0 / b_b)
    return tr / g2 if history and g2 > 0 else None


def train_to_target(spec):
    """Train until validation accuracy >= spec['target'] or spec['cap'] updates.

    spec: method, batch, lr, seed, target, cap, micro_batch, warmup_updates, dataset.
    Returns dict(steps: the first confirmed read at the target or None, last_step, diverged,
    b_simple, b_simple_at_target, skipped, wall_time_s, curve [(step, val_acc)])."""
    import mxnet as mx
    import numpy as np
    import mx_lbsgd
    from .data import load_data
    from .models import mlp
    start = time.perf_counter()
    x, y, xv, yv, _, _ = load_data(0, 0.25, VAL_FRACTION, spec['dataset'])
    batch = spec['batch']
    m = micro_batches(batch, spec['micro_batch'])
    micro = batch // m
    net = mlp((64, 64), dtype='float16' if spec['method'] == 'fp16-scaled' else 'float32',
              seed=spec['seed'])
    net.hybridize(static_alloc=True)
    opt = _optimizer(spec, (len(x) // batch) * m)
    trainer = mx.gluon.Trainer(net.collect_params(), opt)
    monitor = mx_lbsgd.GradientNoiseScale(trainer, interval=10)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    scaler = opt.loss_scaler
    x_all, y_all, x_val = mx.nd.array(x), mx.nd.array(y), mx.nd.array(xv)
    rng = np.random.RandomState(spec['seed'] + 1)
    order, pos = rng.permutation(len(x)), 0
    reads = _eval_steps()
    next_read = next(reads)
    out = dict(steps=None, diverged=False, b_simple_at_target=None, curve=[])
    step, first_hit = 0, None
    # a read at the target must be confirmed by the next one (past the cap if need be):
    # one lucky read of 1,818 images is not a reached target
    while step < spec['cap'] or first_hit is not None:
        for _ in range(m):
            if pos + micro > len(order):
                order, pos = rng.permutation(len(x)), 0
            idx = mx.nd.array(order[pos:pos + micro], dtype='int64')
            pos += micro
            scale = scaler.scale if scaler is not None else 1.0
            with mx.autograd.record():
                loss = loss_fn(net(x_all.take(idx)).astype('float32'), y_all.take(idx))
                scaled = loss * scale if scale != 1.0 else loss
            scaled.backward()
            trainer.step(micro)
        step += 1
        if step == next_read:
            next_read = next(reads)
            if not math.isfinite(float(loss.mean().asscalar())) and scaler is None:
                out['diverged'] = True
                break
            pred = net(x_val).astype('float32').argmax(axis=1).asnumpy()
            acc = float(np.mean(pred == yv))
            out['curve'].append((step, acc))
            best_step = max(out['curve'], key=lambda r: r[1])[0]
            if step >= 200 and best_step < step / 2 and first_hit is None:
                break        # no progress in the second half of the run: dead or stuck
            if acc < spec['target']:
                first_hit = None
            elif first_hit is not None:
                out['steps'] = first_hit
                break
            elif step <= spec['cap']:
                first_hit = step
    monitor.flush()
    monitor.close()
    if out['steps'] is not None:
        out['b_simple_at_target'] = monitor.b_simple
    out.update(last_step=step, b_simple=_pooled_b_simple(monitor.history),
               skipped=scaler.total_skipped if scaler is not None else 0,
               wall_time_s=time.perf_counter() - start)
    return out


def _grid(center, points):
    """`points` values spaced by factors of 2 around `center`, the centre first."""
    offsets = sorted(range(-(points // 2), points - points // 2), key=abs)
    return [center * 2.0 ** k for k in offsets]


def _fewest(runs):
    """The run with the fewest steps (ties: the smaller lr), or None if none reached."""
    reached = [r for r in runs if r['steps'] is not None]
    return min(reached, key=lambda r: (r['steps'], r['lr'])) if reached else None


def tune_method(method, batches, settings, log=None):
    """Per batch size, the lr search described in the module docstring. Returns one cell
    per batch: dict(batch, lr, steps, runs=[every run, in order], ...the chosen run)."""
    center = settings['lars_lr'] if method == 'lbsgd-lars' else settings['lr']
    cells = []
    for batch in batches:
        runs = []

        def run(lr):
            best = _fewest(runs)
            budget = min(settings['max_steps'],
                         -(-settings['max_epochs'] * settings['train_samples'] // batch))
            cap = budget if best is None else min(budget, best['steps'])
            spec = dict(method=method, batch=batch, lr=lr, cap=cap, **{
                k: settings[k] for k in ('seed', 'target', 'micro_batch',
                                         'warmup_updates', 'dataset')})
            result = dict(train_to_target(spec), lr=lr, cap=cap)
            runs.append(result)
            if log is not None:
                log('%-12s batch %4d lr %-8.4g %s (%.1f s)' % (
                    method, batch, lr, 'steps %d' % result['steps'] if result['steps']
                    else 'not reached by %d (cap %d)' % (result['last_step'], cap),
                    result['wall_time_s']))

        for lr in _grid(center, settings['grid_points']):
            run(lr)
        for _ in range(settings['grid_extend']):
            best, tried = _fewest(runs), sorted(r['lr'] for r in runs)
            if best is None or len(tried) < 2 or tried[0] < best['lr'] < tried[-1]:
                break
            run(best['lr'] / 2.0 if best['lr'] == tried[0] else best['lr'] * 2.0)
        best = _fewest(runs)
        chosen = best or max(runs, key=lambda r: (r['curve'] or [(0, 0.0)])[-1][1])
        cells.append(dict(batch=batch, lr=chosen['lr'], steps=chosen['steps'],
                          reached=best is not None, b_simple=chosen['b_simple'],
                          b_simple_at_target=chosen['b_simple_at_target'],
                          skipped=chosen['skipped'],
                          grid=[[r['lr'], r['steps'], r['last_step']] for r in runs],
                          seconds=sum(r['wall_time_s'] for r in runs)))
        center = 2.0 * chosen['lr']
    return cells


def _tune_job(job):
    method, batches, settings, quiet = job
    log = None if quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    return tune_method(method, batches, settings, log)


def _exit_with_parent(parent):
    """Pool worker initializer: exit once the parent is gone (a killed study would
    otherwise leave its workers training on, reparented)."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def run_many(func, jobs_list, jobs=1):
    """[func(job) for job in jobs_list], in `jobs` spawned processes with OMP_NUM_THREADS=1
    when jobs > 1 (MXNet's OpenMP threads spin and crawl on oversubscribed cores)."""
    if jobs <= 1:
        return [func(job) for job in jobs_list]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    saved = os.environ.get('OMP_NUM_THREADS')
    os.environ['OMP_NUM_THREADS'] = '1'
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context('spawn'),
                                 initializer=_exit_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            return list(pool.map(func, jobs_list))
    finally:
        if saved is None:
            del os.environ['OMP_NUM_THREADS']
        else:
            os.environ['OMP_NUM_THREADS'] = saved


def _parser(prog):
    p = Parser(prog=prog, description=__doc__.splitlines()[0],
               epilog='Methods: ' + ', '.join(METHODS) + '. See the module docstring.')
    p.add_argument('--out', default='study', help='output folder (default %(default)s)')
    p.add_argument('--batch-sizes', type=number(int, 2), nargs='+', metavar='B',
                   help='default %s (--tiny: 16 64 256)' % ' '.join(map(str, DEFAULT_BATCHES)))
    p.add_argument('--methods', nargs='+', choices=METHODS, metavar='M',
                   help='subset of: %s (default: all)' % ', '.join(METHODS))
    p.add_argument('--target', type=number(float, 0, 1, open_low=True),
                   help='validation accuracy to reach (default 0.92; --tiny: 0.8)')
    p.add_argument('--max-steps', type=number(int, 1),
                   help='updates after which a run counts as not reached (default 3000; '
                        '--tiny: 120)')
    p.add_argument('--max-epochs', type=number(int, 1),
                   help='and after this many epochs (default 20; --tiny: 100)')
    p.add_argument('--micro-batch', type=number(int, 1), default=128,
                   help='largest micro-batch b: B / min(B / 2, b) micro-batches per update '
                        '(batch_scale); the monitor\'s small batch (default %(default)s)')
    p.add_argument('--warmup-updates', type=number(int, 0), default=20,
                   help='linear warmup of lbsgd-linear, lbsgd-lars and fp16-scaled '
                        '(default %(default)s)')
    p.add_argument('--lr', type=number(float, 0, open_low=True), default=0.025,
                   help='grid centre at the smallest batch (default %(default)g)')
    p.add_argument('--lars-lr', type=number(float, 0, open_low=True), default=2.0,
                   help='lbsgd-lars grid centre at the smallest batch (default %(default)g)')
    p.add_argument('--grid-points', type=number(int, 1),
                   help='lrs tried per batch before extending (default 3; --tiny: 1)')
    p.add_argument('--grid-extend', type=number(int, 0),
                   help='extensions by a factor 2 past an end, each way (default 2; '
                        '--tiny: 0)')
    p.add_argument('--seed', type=number(int, 0, SEED_MAX), default=0,
                   help='0 .. %d (default %%(default)s)' % SEED_MAX)
    p.add_argument('--dataset', choices=DATASETS,
                   help='default digits-shifted (--tiny: digits)')
    p.add_argument('--jobs', type=number(int, 1),
                   help='methods tuned in parallel processes (default: min(2, CPUs); '
                        '--tiny: 1)')
    p.add_argument('--tiny', action='store_true',
                   help='seconds-long configuration for tests: plain digits, batches '
                        '16 64 256, target 0.8, one lr per batch')
    p.add_argument('--quiet', action='store_true', help='print only the tables')
    return p


def _settings(args, parser):
    """The resolved settings (defaults depend on --tiny); exits 2 on a bad combination."""
    from .data import load_data
    tiny = args.tiny
    s = dict(dataset=args.dataset or ('digits' if tiny else 'digits-shifted'),
             target=args.target or (0.8 if tiny else 0.92),
             max_steps=args.max_steps or (120 if tiny else 3000),
             max_epochs=args.max_epochs or (100 if tiny else 20),
             grid_points=args.grid_points or (1 if tiny else 3),
             grid_extend=args.grid_extend if args.grid_extend is not None else (0 if tiny
                                                                               else 2),
             micro_batch=args.micro_batch, warmup_updates=args.warmup_updates,
             lr=args.lr, lars_lr=args.lars_lr, seed=args.seed,
             jobs=args.jobs or (1 if tiny else min(2, os.cpu_count() or 1)))
    n_train = len(load_data(0, 0.25, VAL_FRACTION, s['dataset'])[0])
    batches = sorted(set(args.batch_sizes or ((16, 64, 256) if tiny else DEFAULT_BATCHES)))
    bad = [b for b in batches if b % micro_batches(b, s['micro_batch']) or b > n_train]
    if bad:
        parser.error('argument --batch-sizes: %s: each must be even, a multiple of '
                     '--micro-batch (%d) if larger than twice it, and <= %d (the training '
                     'images of %s)' % (bad, s['micro_batch'], n_train, s['dataset']))
    s.update(batch_sizes=batches, methods=list(args.methods or METHODS),
             train_samples=n_train, val_fraction=VAL_FRACTION, eval_growth=EVAL_GROWTH)
    return s


def main(argv=None, prog='mx-lbsgd study'):
    """Run the study; returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    missing = demo_missing(('sklearn.datasets', 'matplotlib'))   # the digits, study.png
    if missing:
        parser.exit(2, demo_error(prog, missing) + '\n')
    settings = _settings(args, parser)
    try:
        require_writable_dir(prog, args.out)        # before the trainings, not after them
    except UsageError as err:
        parser.exit(2, '%s\n' % err)
    from .study_plot import plot_study
    from .study_report import summarize, tables
    from .summary import versions
    start = time.perf_counter()
    # the slowest methods first, so that two workers finish together
    order = sorted(settings['methods'], key=lambda m: m != 'fp16-scaled')
    cells = run_many(_tune_job, [(m, settings['batch_sizes'], settings, args.quiet)
                                 for m in order], settings['jobs'])
    by_method = dict(zip(order, cells))
    wall = time.perf_counter() - start
    result = summarize({m: by_method[m] for m in settings['methods']}, settings)
    result.update(settings=settings, wall_time_s=wall, versions=versions())
    text = tables(result)
    print(text)
    print('\n%d trainings in %.0f s' % (result['trainings'], wall))
    out = _write_results(prog, args.out, result, text, plot_study)
    print('wrote %s' % ', '.join(os.path.join(out, n)
                                 for n in ('study.md', 'study.json', 'study.png')))
    return 0 if out == args.out else 2


def _write_results(prog, out, result, text, plot_study):
    """Write study.md, study.json and study.png into `out`; if that fails after all (the
    folder was checked before the trainings), into a new temporary folder, named on stderr
    in one line. Returns the folder written."""
    for folder in (out, None):
        try:
            if folder is None:
                folder = tempfile.mkdtemp(prefix='mx-lbsgd-study-')
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, 'study.json'), 'w') as f:
                json.dump(result, f, indent=1)
            with open(os.path.join(folder, 'study.md'), 'w') as f:
                f.write(text + '\n')
            plot_study(result, os.path.join(folder, 'study.png'))
            return folder
        except OSError as err:
            if folder != out:
                raise
            print('%s: error: argument --out: could not write into %s (%s); writing the '
                  'results into a temporary folder instead' % (prog, out, err.strerror or err),
                  file=sys.stderr)


if __name__ == '__main__':
    sys.exit(main())
