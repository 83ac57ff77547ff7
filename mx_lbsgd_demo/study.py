"""Large-batch study: steps to a target validation accuracy against batch size, per method.

    mx-lbsgd study [--out DIR] [--target 0.92] [--batch-sizes 16 32 ... 1024] [--tiny]
                   [--methods M ...]       (adascale, adascale-auto: not in the default)
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

Every run is `mx_lbsgd.LBSGD` under a gluon Trainer; momentum 0.9, wd 1e-4. The four
tuned methods accumulate k = B / b micro-batches of b = min(B / 2, --micro-batch) per
update (``batch_scale = k``), so the monitor sees two batch sizes, b and B, and LBSGD's
warmup (which rises from lr / k to lr) starts from the micro-batch's lr as in Goyal et
al. (2017): k = 2 up to B = 256, 8 at B = 1024. The learning rate is constant after any
warmup. Methods:

  sgd           no warmup: exactly momentum SGD on batches of B at lr (LBSGD's multiplier
                is k from the start, and the accumulated gradient is the mean over B)
  lbsgd-linear  LBSGD's linear warmup: lr / k rising to lr over --warmup-updates updates
  lbsgd-lars    the same warmup times the LARS trust ratio per layer (eta 0.001), biases
                included (excluded, they would take the LARS-sized lr itself)
  fp16-scaled   lbsgd-linear with float16 weights, fp32 master copies (multi_precision)
                and a DynamicLossScaler in the optimizer (growth_interval 100)

These four are the default --methods. Two more test AdaScale's promise, that the lr
tuned at one batch serves every batch (Johnson et al., "AdaScale SGD", ICML 2020), and
the window that the optimizer chooses for goodput (Qiao et al., "Pollux", OSDI 2021):

  adascale       lr_scaling='adascale', no warmup, micro-batches of b = the smallest
                 batch size (the base batch, the same at every B), batch_scale = B / b.
                 The lr is tuned at the smallest batch only (the grid below); every larger
                 B runs that lr unchanged, once, and each update multiplies it by
                 AdaScale's gain r in [1, B / b]. At B = b the gain is 1: momentum SGD on
                 batches of b. Every batch size must be a multiple of the smallest.
  adascale-auto  one run (of --seed) with batch_scale='auto', batch_scale_bounds = (1,
                 max(B) / b), batch_scale_interval = --auto-interval, micro-batches of b
                 and adascale's lr: the optimizer sets the window length. It stops at the
                 target, after --max-steps updates or after --max-epochs epochs of
                 examples. It runs after adascale, in the same process, and needs it.

They are not in the default set: their lr is not tuned at every batch, the question the
default study answers, and the default's output stays that of the four. --micro-batch,
--warmup-updates and --lars-lr do not apply to them.

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

The fit includes adascale. Its gain r = (1 + B_noise / b) / (1 + B_noise / B), with
B_noise the noise scale it estimates (what B_simple measures), has the form of
McCandlish's optimal lr; so if AdaScale keeps its promise (progress to the target, the sum
of the gains, the same at every B) and B_noise holds still, the updates follow S = S_min
(1 + B_crit / B) with B_crit = B_noise. The fit shows how far the rule's trade-off lies
from the tuned methods', and B_crit / B_simple near 1 is the promise kept.
adascale-auto is not fitted: its batch changes during the run, so it has no B.

For adascale the tables add, per B: S = B / b, the mean gain (the sum of the gains over
the updates to the target: `scale_invariant_steps` / steps) and the last gain, and that
sum, the progress to the target in steps of batch b (near the steps at B = b if AdaScale
keeps its promise). In the lr table adascale's row is the lr given (times the gain per
update). Its B_simple at B = b is none: one micro-batch per update is one batch size,
which GradientNoiseScale refuses; so is adascale-auto's, whose window starts at one
micro-batch. For adascale-auto a row of its own: the updates and examples to the target,
the mean batch (examples / updates), the final batch (b x the window of the update that
reached the target), the mean and last gain, and the window lengths taken
(`window_history`, [update, micro-batches from then on]); then where its updates and
its examples fall among the fixed-batch adascale rows'. In study.png, a star at its
mean batch and a line over the batches it took.

Writes study.json, study.md (the printed tables) and study.png into --out. study.json:
batch_sizes; methods -> {steps_to_target, lr, examples_to_target, fit, b_crit, s_min,
e_min, b_simple, grids, ...; adascale also lr_scaling, micro_batch, batch_scale,
gain_mean, gain_last, progress_to_target}; b_simple; with adascale-auto, auto ->
{steps_to_target, examples_to_target, mean_batch, window_history, final_window,
final_batch, batches_taken, gain_mean, gain_last, progress_to_target, lr, micro_batch,
batch_scale_bounds, batch_scale_interval, against_fixed: {steps, examples} -> {above,
below: [B, value] of the fixed-batch rows around it}}.
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

__all__ = ['METHODS', 'ADASCALE_METHODS', 'ALL_METHODS', 'micro_batches', 'train_to_target',
           'tune_method', 'tune_adascale', 'run_many', 'main']

#: the methods whose lr is tuned at every batch size: the default --methods
METHODS = ('sgd', 'lbsgd-linear', 'lbsgd-lars', 'fp16-scaled')
#: AdaScale's rows: the lr tuned at the smallest batch only
ADASCALE_METHODS = ('adascale', 'adascale-auto')
ALL_METHODS = METHODS + ADASCALE_METHODS
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


def _window(spec):
    """(micro-batch size, batch_scale) of a run: adascale's micro-batch is the base batch."""
    if spec['method'] == 'adascale-auto':
        return spec['base_batch'], 'auto'
    if spec['method'] == 'adascale':
        return spec['base_batch'], spec['batch'] // spec['base_batch']
    m = micro_batches(spec['batch'], spec['micro_batch'])
    return spec['batch'] // m, m


def _optimizer(spec, train_samples):
    import mx_lbsgd
    if spec['method'] in ADASCALE_METHODS:
        return _adascale_optimizer(spec)
    m = micro_batches(spec['batch'], spec['micro_batch'])
    micro_per_epoch = (train_samples // spec['batch']) * m
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


def _adascale_optimizer(spec):
    """spec['lr'] is the base batch's: AdaScale's gain scales it, with no warmup."""
    import mx_lbsgd
    window = _window(spec)[1]
    opt = dict(learning_rate=spec['lr'], momentum=0.9, wd=1e-4, batch_scale=window,
               warmup_epochs=0, lr_scaling='adascale')
    if window == 'auto':
        opt.update(batch_scale_bounds=tuple(spec['bounds']),
                   batch_scale_interval=spec['interval'])
    return mx_lbsgd.LBSGD(**opt)


def _noise_monitor(trainer):
    import mx_lbsgd
    try:
        return mx_lbsgd.GradientNoiseScale(trainer, interval=10)
    except ValueError:      # one batch size: a window of one micro-batch (adascale at b)
        return None


def _pooled_b_simple(history):
    """tr(Sigma) and |G|^2 averaged over the raw per-update estimates, then divided."""
    g2 = tr = 0.0
    for h in history:
        b_s, b_b = h['b_small'], h['b_big']
        g2 += (b_b * h['big_sq'] - b_s * h['small_sq']) / (b_b - b_s)
        tr += (h['small_sq'] - h['big_sq']) / (1.0 / b_s - 1.0 / b_b)
    return tr / g2 if history and g2 > 0 else None


class _Training:
    """One run's network, Trainer, noise monitor and order of the training examples."""

    def __init__(self, spec):
        import mxnet as mx
        import numpy as np
        from .data import load_data
        from .models import mlp
        x, y, xv, self.y_val, _, _ = load_data(0, 0.25, VAL_FRACTION, spec['dataset'])
        self.micro = _window(spec)[0]
        self.net = mlp((64, 64), seed=spec['seed'],
                       dtype='float16' if spec['method'] == 'fp16-scaled' else 'float32')
        self.net.hybridize(static_alloc=True)
        self.opt = _optimizer(spec, len(x))
        self.trainer = mx.gluon.Trainer(self.net.collect_params(), self.opt)
        self.monitor = _noise_monitor(self.trainer)
        self.loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        self.x, self.y, self.x_val = mx.nd.array(x), mx.nd.array(y), mx.nd.array(xv)
        self.rng = np.random.RandomState(spec['seed'] + 1)
        self.order, self.pos = self.rng.permutation(len(x)), 0

    def update(self):
        """Micro-batches until the optimizer's window closes: one update. Returns the last
        micro-batch's losses."""
        import mxnet as mx
        scaler = self.opt.loss_scaler
        while True:
            if self.pos + self.micro > len(self.order):
                self.order, self.pos = self.rng.permutation(len(self.order)), 0
            idx = mx.nd.array(self.order[self.pos:self.pos + self.micro], dtype='int64')
            self.pos += self.micro
            scale = scaler.scale if scaler is not None else 1.0
            with mx.autograd.record():
                loss = self.loss_fn(self.net(self.x.take(idx)).astype('float32'),
                                    self.y.take(idx))
                scaled = loss * scale if scale != 1.0 else loss
            scaled.backward()
            self.trainer.step(self.micro)
            if self.opt.window_position == 0:
                return loss

    def accuracy(self):
        import numpy as np
        pred = self.net(self.x_val).astype('float32').argmax(axis=1).asnumpy()
        return float(np.mean(pred == self.y_val))

    def examples(self):
        return self.opt.micro_batches * self.micro

    def progress(self):
        """What the optimizer reports at this update (gains: None without lr_scaling)."""
        opt = self.opt
        return dict(progress=opt.scale_invariant_steps, gain_last=opt.last_gain,
                    examples=self.examples(), windows=opt.window_history)

    def noise_scale(self, reached):
        """(b_simple run-averaged, smoothed at the target), None without a monitor."""
        if self.monitor is None:
            return None, None
        self.monitor.flush()
        self.monitor.close()
        return (_pooled_b_simple(self.monitor.history),
                self.monitor.b_simple if reached else None)


class _TargetWatch:
    """The validation reads of a run and when it reaches the target: at the first read
    >= target that the next read confirms (one lucky read of 1,818 images is not a reached
    target)."""

    def __init__(self, target):
        self.target, self.curve = target, []
        self.first_hit = self.steps = self.at_hit = None

    def read(self, step, acc, counts, progress):
        """Record a read; True when the run is over. counts: a hit here may count (within
        the caps); progress(): the optimizer's counters, kept at a hit."""
        self.curve.append((step, acc))
        best_step = max(self.curve, key=lambda r: r[1])[0]
        if step >= 200 and best_step < step / 2 and self.first_hit is None:
            return True       # no progress in the second half of the run: dead or stuck
        if acc < self.target:
            self.first_hit = None
        elif self.first_hit is not None:
            self.steps = self.first_hit
            return True
        elif counts:
            self.first_hit, self.at_hit = step, progress()
        return False


def _within_caps(spec, step, examples, strict=True):
    """Whether `step` updates and `examples` examples are within the run's caps: spec's
    cap on updates and, for the auto run, max_examples (strict: room for one more)."""
    limit = spec.get('max_examples')
    if strict:
        return step < spec['cap'] and (limit is None or examples < limit)
    return step <= spec['cap'] and (limit is None or examples <= limit)


def _gains(at, steps):
    """The optimizer's counters up to `steps` updates: sum and mean of the gains, the last
    gain, the examples and the window lengths taken (auto)."""
    windows = at['windows']
    if windows is not None:
        windows = [[u, k] for u, k in windows if u < steps]
    progress = at['progress']
    return dict(progress=progress, gain_last=at['gain_last'], examples=at['examples'],
                gain_mean=progress / steps if progress is not None and steps else None,
                window_history=windows, window=windows[-1][1] if windows else None)


def train_to_target(spec):
    """Train until validation accuracy >= spec['target'] or spec['cap'] updates.

    spec: method, batch, lr, seed, target, cap, micro_batch, warmup_updates, dataset;
    adascale methods: base_batch (their micro-batch); the auto run: bounds, interval,
    max_examples. Returns dict(steps: the first confirmed read at the target or None,
    last_step, diverged, b_simple, b_simple_at_target, skipped, wall_time_s,
    curve [(step, val_acc)], and up to the target (or the run's end): examples, progress,
    gain_mean, gain_last, window_history [[update, length]], window)."""
    start = time.perf_counter()
    run = _Training(spec)
    watch = _TargetWatch(spec['target'])
    out = dict(diverged=False)
    reads = _eval_steps()
    next_read, step = next(reads), 0
    # a read at the target must be confirmed by the next one, past the caps if need be
    while _within_caps(spec, step, run.examples()) or watch.first_hit is not None:
        loss = run.update()
        step += 1
        if step != next_read:
            continue
        next_read = next(reads)
        if not math.isfinite(float(loss.mean().asscalar())) and run.opt.loss_scaler is None:
            out['diverged'] = True
            break
        if watch.read(step, run.accuracy(),
                      _within_caps(spec, step, run.examples(), strict=False), run.progress):
            break
    reached = watch.steps is not None
    b_simple, at_target = run.noise_scale(reached)
    scaler = run.opt.loss_scaler
    out.update(_gains(watch.at_hit if reached else run.progress(), watch.steps or step),
               steps=watch.steps, curve=watch.curve, last_step=step, b_simple=b_simple,
               b_simple_at_target=at_target,
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


def _budget(batch, settings):
    """The updates a run of batch B may take: --max-steps, or --max-epochs if fewer."""
    return min(settings['max_steps'],
               -(-settings['max_epochs'] * settings['train_samples'] // batch))


def _run(method, batch, lr, cap, settings, log, **extra):
    """train_to_target for one cell's run (extra: spec entries of the auto run); logged."""
    spec = dict(method=method, batch=batch, lr=lr, cap=cap, **{
        k: settings[k] for k in ('seed', 'target', 'micro_batch', 'warmup_updates',
                                 'dataset')})
    if method in ADASCALE_METHODS:
        spec['base_batch'] = settings['batch_sizes'][0]
    spec.update(extra)
    result = dict(train_to_target(spec), lr=lr, cap=cap)
    if log is not None:
        log('%-12s batch %4d lr %-8.4g %s (%.1f s)' % (
            method, batch, lr, 'steps %d' % result['steps'] if result['steps']
            else 'not reached by %d (cap %d)' % (result['last_step'], cap),
            result['wall_time_s']))
    return result


def _cell(batch, runs):
    """The cell of batch B from its runs: the fewest steps (none reached: the best last
    accuracy)."""
    best = _fewest(runs)
    chosen = best or max(runs, key=lambda r: (r['curve'] or [(0, 0.0)])[-1][1])
    return dict(batch=batch, lr=chosen['lr'], steps=chosen['steps'],
                reached=best is not None, b_simple=chosen['b_simple'],
                b_simple_at_target=chosen['b_simple_at_target'], skipped=chosen['skipped'],
                grid=[[r['lr'], r['steps'], r['last_step']] for r in runs],
                seconds=sum(r['wall_time_s'] for r in runs),
                **{k: chosen.get(k) for k in ('progress', 'gain_mean', 'gain_last')})


def tune_method(method, batches, settings, log=None):
    """Per batch size, the lr search described in the module docstring. Returns one cell
    per batch: dict(batch, lr, steps, runs=[every run, in order], ...the chosen run)."""
    center = settings['lars_lr'] if method == 'lbsgd-lars' else settings['lr']
    cells = []
    for batch in batches:
        runs = []

        def run(lr):
            best = _fewest(runs)
            budget = _budget(batch, settings)
            cap = budget if best is None else min(budget, best['steps'])
            runs.append(_run(method, batch, lr, cap, settings, log))

        for lr in _grid(center, settings['grid_points']):
            run(lr)
        for _ in range(settings['grid_extend']):
            best, tried = _fewest(runs), sorted(r['lr'] for r in runs)
            if best is None or len(tried) < 2 or tried[0] < best['lr'] < tried[-1]:
                break
            run(best['lr'] / 2.0 if best['lr'] == tried[0] else best['lr'] * 2.0)
        cells.append(_cell(batch, runs))
        center = 2.0 * cells[-1]['lr']
    return cells


def tune_adascale(batches, settings, log=None, auto=False):
    """The adascale cells: the lr search at the smallest batch only, then that lr
    unchanged at every larger batch (one run each). With `auto`, the adascale-auto run at
    that lr too. Returns dict(cells, auto: the auto run or None)."""
    cells = tune_method('adascale', batches[:1], settings, log)
    lr = cells[0]['lr']
    cells += [_cell(batch, [_run('adascale', batch, lr, _budget(batch, settings), settings,
                                 log)])
              for batch in batches[1:]]
    return dict(cells=cells, auto=_auto_run(batches, lr, settings, log) if auto else None)


def _auto_run(batches, lr, settings, log):
    """adascale-auto: windows of 1 to max(B) / b micro-batches of b = min(B), chosen by
    the optimizer for goodput, until the target, --max-steps or --max-epochs' examples."""
    base = batches[0]
    bounds = [1, batches[-1] // base]
    result = _run('adascale-auto', base, lr, settings['max_steps'], settings, None,
                  bounds=bounds, interval=settings['auto_interval'],
                  max_examples=settings['max_epochs'] * settings['train_samples'])
    result.update(bounds=bounds, interval=settings['auto_interval'])
    if log is not None:
        log('%-12s batch %d-%d lr %-8.4g %s; windows %s (%.1f s)' % (
            'adascale-auto', base * bounds[0], base * bounds[1], lr,
            'steps %d' % result['steps'] if result['steps']
            else 'not reached by %d' % result['last_step'],
            ' '.join('%d:%d' % (u, k) for u, k in result['window_history'] or []),
            result['wall_time_s']))
    return result


def _tune_job(job):
    method, batches, settings, quiet = job
    log = None if quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    if method == 'adascale':
        return tune_adascale(batches, settings, log, 'adascale-auto' in settings['methods'])
    return dict(cells=tune_method(method, batches, settings, log), auto=None)


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
               epilog='Methods: ' + ', '.join(ALL_METHODS) + '. See the module docstring.')
    p.add_argument('--out', default='study', help='output folder (default %(default)s)')
    p.add_argument('--batch-sizes', type=number(int, 2), nargs='+', metavar='B',
                   help='default %s (--tiny: 16 64 256)' % ' '.join(map(str, DEFAULT_BATCHES)))
    p.add_argument('--methods', nargs='+', choices=ALL_METHODS, metavar='M',
                   help='subset of: %s (default: %s; adascale-auto needs adascale)'
                        % (', '.join(ALL_METHODS), ', '.join(METHODS)))
    p.add_argument('--target', type=number(float, 0, 1, open_low=True),
                   help='validation accuracy to reach (default 0.92; --tiny: 0.8)')
    p.add_argument('--max-steps', type=number(int, 1),
                   help='updates after which a run counts as not reached (default 3000; '
                        '--tiny: 120)')
    p.add_argument('--max-epochs', type=number(int, 1),
                   help='and after this many epochs (default 20; --tiny: 100)')
    p.add_argument('--micro-batch', type=number(int, 1), default=128,
                   help='largest micro-batch b: B / min(B / 2, b) micro-batches per update '
                        '(batch_scale); the monitor\'s small batch (default %(default)s; '
                        "adascale's micro-batch is the smallest batch size)")
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
    p.add_argument('--auto-interval', type=number(int, 1),
                   help="adascale-auto's batch_scale_interval: updates between two choices "
                        'of the window (default 16; --tiny: 4)')
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


def _tiny_or(value, tiny, small, full):
    """An option's value, or its default: `small` with --tiny, `full` without."""
    if value is not None:
        return value
    return small if tiny else full


def _settings(args, parser):
    """The resolved settings (defaults depend on --tiny); exits 2 on a bad combination."""
    from .data import load_data
    tiny = args.tiny
    s = dict(dataset=_tiny_or(args.dataset, tiny, 'digits', 'digits-shifted'),
             target=_tiny_or(args.target, tiny, 0.8, 0.92),
             max_steps=_tiny_or(args.max_steps, tiny, 120, 3000),
             max_epochs=_tiny_or(args.max_epochs, tiny, 100, 20),
             grid_points=_tiny_or(args.grid_points, tiny, 1, 3),
             grid_extend=_tiny_or(args.grid_extend, tiny, 0, 2),
             auto_interval=_tiny_or(args.auto_interval, tiny, 4, 16),
             micro_batch=args.micro_batch, warmup_updates=args.warmup_updates,
             lr=args.lr, lars_lr=args.lars_lr, seed=args.seed,
             jobs=_tiny_or(args.jobs, tiny, 1, min(2, os.cpu_count() or 1)))
    n_train = len(load_data(0, 0.25, VAL_FRACTION, s['dataset'])[0])
    batches = sorted(set(args.batch_sizes or ((16, 64, 256) if tiny else DEFAULT_BATCHES)))
    methods = list(args.methods or METHODS)
    _check_batches(parser, batches, methods, s['micro_batch'], n_train, s['dataset'])
    if 'adascale-auto' in methods and 'adascale' not in methods:
        parser.error("argument --methods: adascale-auto runs at adascale's lr, tuned at the "
                     'smallest batch: add adascale')
    s.update(batch_sizes=batches, methods=methods,
             train_samples=n_train, val_fraction=VAL_FRACTION, eval_growth=EVAL_GROWTH)
    return s


def _check_batches(parser, batches, methods, micro, n_train, dataset):
    """Exit 2 naming --batch-sizes if a batch cannot be split into micro-batches."""
    bad = [b for b in batches if b % micro_batches(b, micro) or b > n_train]
    if bad:
        parser.error('argument --batch-sizes: %s: each must be even, a multiple of '
                     '--micro-batch (%d) if larger than twice it, and <= %d (the training '
                     'images of %s)' % (bad, micro, n_train, dataset))
    uneven = [b for b in batches if b % batches[0]]
    if uneven and set(methods) & set(ADASCALE_METHODS):
        parser.error('argument --batch-sizes: %s: with adascale each must be a multiple of '
                     'the smallest, %d (its micro-batch)' % (uneven, batches[0]))


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
    # the slowest methods first, so that two workers finish together; adascale-auto
    # runs in adascale's job, after the lr it takes is tuned
    order = sorted((m for m in settings['methods'] if m != 'adascale-auto'),
                   key=lambda m: m != 'fp16-scaled')
    done = dict(zip(order, run_many(_tune_job, [(m, settings['batch_sizes'], settings,
                                                 args.quiet) for m in order],
                                    settings['jobs'])))
    wall = time.perf_counter() - start
    result = summarize({m: done[m]['cells'] for m in settings['methods'] if m in done},
                       settings, auto=done.get('adascale', {}).get('auto'))
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
