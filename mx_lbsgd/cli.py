"""The ``mx-lbsgd`` command: train, schedule, bench, study, launch.

    mx-lbsgd train [--optimizer lbsgd] [--dtype float16] [--out DIR] ...
    mx-lbsgd schedule --warmup-steps 100 --batch-scale 8 [--plot FILE.png]
    mx-lbsgd bench [--loss-scale] [ARGS of benchmarks/bench_step.py ...]
    mx-lbsgd study [--tiny] [--out DIR]
    mx-lbsgd launch -n 2 -- python train.py

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (one line on
stderr, ``mx-lbsgd CMD: error: ...``, never a traceback).

``import mx_lbsgd.cli`` needs only what ``mx_lbsgd`` needs (MXNet, NumPy): scikit-learn,
tqdm and matplotlib (the ``demo`` extra) are imported where used. ``train``, ``study`` and
``schedule --plot`` check for them after parsing their arguments and, when missing, print
one line naming the install command and exit 2.
"""
import argparse
import dataclasses
import os
import sys
import tempfile
import time

from . import schedules

_COMMANDS = (
    ('train', 'train an MLP on the 8x8 digits; write metrics, summary and plots'),
    ('schedule', 'print (and plot) the warmup learning-rate multiplier of each strategy'),
    ('bench', 'run benchmarks/bench_step.py (or --loss-scale: bench_loss_scale.py)'),
    ('study', 'run benchmarks/study.py: accuracy vs batch size per method'),
    ('launch', 'run a local dist_sync job (mx_lbsgd.launch)'),
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: 'PROG: error: MESSAGE'."""

    def error(self, message):
        self.exit(2, '%s: error: %s (see %s --help)\n' % (self.prog, message, self.prog))


class _UsageError(Exception):
    """A bad argument found after parsing; main() prints it as one line, exit status 2."""


#: The ``demo`` extra: module imported -> distribution that provides it.
DEMO_MODULES = {'sklearn.datasets': 'scikit-learn', 'matplotlib': 'matplotlib', 'tqdm': 'tqdm'}
DEMO_INSTALL = "pip install 'mx_lbsgd[demo]'"


def demo_missing(modules=tuple(DEMO_MODULES)):
    """The distributions (of DEMO_MODULES) whose module in `modules` fails to import."""
    missing = []
    for name in modules:
        try:
            __import__(name)        # looked up at call time: honours a patched __import__
        except ImportError:
            missing.append(DEMO_MODULES[name])
    return missing


def demo_error(prog, missing, what='this command'):
    """The one-line message for `what` of `prog`, which needs the (missing) demo extra."""
    return ('%s: error: %s needs the demo extra (missing: %s): %s (in a source checkout: '
            "pip install '.[demo]')" % (prog, what, ', '.join(missing), DEMO_INSTALL))


def _require_demo(prog, modules=tuple(DEMO_MODULES), what='this command'):
    """_UsageError (one line, exit status 2) if a module of the demo extra is missing."""
    missing = demo_missing(modules)
    if missing:
        raise _UsageError(demo_error(prog, missing, what))


def _writable_dir(prog, path):
    """_UsageError unless `path` is (or can be created as) a folder we can write into.

    Probes by creating and removing a temporary folder in `path` or, if it does not exist
    yet, in its nearest existing ancestor, so nothing is left behind. (os.access is no
    test: root passes it for read-only permissions, and /proc refuses anyway.)"""
    target = os.path.abspath(path)
    probe = target
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    try:
        if os.path.isdir(probe):
            os.rmdir(tempfile.mkdtemp(prefix='.mx-lbsgd-probe-', dir=probe))
            return
        reason = ('it exists and is not a folder' if probe == target
                  else '%s is not a folder' % probe)
    except OSError as err:
        reason = 'cannot create a folder in %s (%s)' % (probe, err.strerror or err)
    raise _UsageError('%s: error: argument --out: %s is not writable: %s'
                      % (prog, path, reason))


def _number(kind, low=None, high=None, open_low=False, open_high=False):
    """An argparse type: `kind` (int or float) within the given bounds."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                'invalid %s %r' % ('integer' if kind is int else 'number', text)) from None
        if value != value:
            raise argparse.ArgumentTypeError('invalid number %r' % text)
        if low is not None and (value <= low if open_low else value < low):
            raise argparse.ArgumentTypeError('must be %s %g, got %s'
                                             % ('>' if open_low else '>=', low, text))
        if high is not None and (value >= high if open_high else value > high):
            raise argparse.ArgumentTypeError('must be %s %g, got %s'
                                             % ('<' if open_high else '<=', high, text))
        return value
    return parse


def _loss_scale(text):
    if text in ('dynamic', 'none'):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected 'dynamic', 'none' or a number > 0, got %r" % text) from None
    if not 0 < value < float('inf'):
        raise argparse.ArgumentTypeError('a static scale must be a finite number > 0, got %s'
                                         % text)
    return value


def _hidden(text):
    try:
        sizes = tuple(int(s) for s in text.split(','))
    except ValueError:
        raise argparse.ArgumentTypeError('expected comma-separated integers, got %r'
                                         % text) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError('layer sizes must be >= 1, got %r' % text)
    return sizes


# -- train ---------------------------------------------------------------------------------
def _train_parser():
    from . import _train
    demo = _train.DEMO_DEFAULTS
    p = _Parser(prog='mx-lbsgd train', description=(
        "Train an MLP on scikit-learn's bundled 8x8 digits with Gluon, twice: the main run "
        '(default: lbsgd, micro-batches of 32 accumulated %d at a time into an effective '
        'batch of %d, linear warmup over %g epochs, float16 weights with fp32 master '
        'copies and dynamic loss scaling, %d epochs) and a baseline (sgd, batch 32, '
        'float32, no warmup, no loss scaling, the same epochs and seed). Writes '
        'metrics.csv (one row per epoch), steps.csv (one row per step, with the lr and '
        'the loss scale), baseline-metrics.csv, baseline-steps.csv, summary.json and '
        'training.png (both runs: test accuracy, learning rate, loss scale with the '
        'skipped steps, train loss) to --out. --single trains one run with the former '
        'defaults (batch 32 x 1, float32, 15 epochs, warmup 1 epoch), as before.'
        % (demo['batch_scale'], 32 * demo['batch_scale'], demo['warmup_epochs'],
           demo['epochs'])),
        epilog=(
        'Conventions: --batch-size is the micro-batch of one forward/backward (per worker '
        'with dist_sync). lbsgd and mxnet-lbsgd sum --batch-scale micro-batches per update '
        'and warm the learning rate up from --lr to --lr * --batch-scale over '
        '--warmup-epochs; --batch-scale > 1 and --warmup-* are rejected for the other '
        "optimizers. --warmup-strategy lars makes lbsgd use LARS trust ratios instead of a "
        "warmup. float16: float16 parameters and activations, fp32 master weights "
        '(multi_precision) and, by default, dynamic loss scaling: inside the optimizer for '
        'lbsgd and lssgd (loss_scaler=...), through mx_lbsgd.LossScaling for sgd, lars and '
        "mxnet-lbsgd. --loss-scale none shows the gradient underflow (summary.json: "
        "final_underflow_fraction). Default --lr: %s; lbsgd with --warmup-strategy lars: %g."
        % (', '.join('%s %g' % kv for kv in _train.DEFAULT_LR.items()),
           _train.DEFAULT_LARS_LR)))
    d = _train.TrainConfig()
    p.add_argument('--optimizer', choices=_train.OPTIMIZERS, default=d.optimizer,
                   help='lbsgd (mx_lbsgd.LBSGD, default), lssgd (mx_lbsgd.LossScaledSGD), '
                        "sgd (mx SGD with momentum), mxnet-lbsgd (MXNet's own LBSGD), "
                        'lars (mx.optimizer.LARS)')
    p.add_argument('--warmup-strategy', choices=tuple(schedules.WARMUP_STRATEGIES),
                   help='lbsgd / mxnet-lbsgd only (default %s)' % d.warmup_strategy)
    p.add_argument('--warmup-epochs', type=_number(float, 0),
                   help='lbsgd / mxnet-lbsgd only (default %g; --single: %g)'
                        % (demo['warmup_epochs'], d.warmup_epochs))
    p.add_argument('--batch-size', type=_number(int, 1), default=d.batch_size,
                   help='micro-batch size (default %(default)s)')
    p.add_argument('--batch-scale', type=_number(int, 1),
                   help='micro-batches per update, also the final warmup multiplier '
                        '(lbsgd / mxnet-lbsgd; default %d; --single or another '
                        'optimizer: %d)' % (demo['batch_scale'], d.batch_scale))
    p.add_argument('--epochs', type=_number(int, 1),
                   help='default %d (--single: %d)' % (demo['epochs'], d.epochs))
    p.add_argument('--lr', type=_number(float, 0, open_low=True),
                   help='base learning rate (default: per optimizer, see below)')
    p.add_argument('--momentum', type=_number(float, 0, 1, open_high=True),
                   default=d.momentum, help='default %(default)s')
    p.add_argument('--wd', type=_number(float, 0), default=d.wd, help='default %(default)s')
    p.add_argument('--dtype', choices=('float32', 'float16'),
                   help='default %s (--single: %s)' % (demo['dtype'], d.dtype))
    p.add_argument('--loss-scale', type=_loss_scale, metavar='{dynamic,none,SCALE}',
                   help='default: dynamic for float16, none for float32; a number is a '
                        'static scale (overflow steps are still skipped)')
    p.add_argument('--growth-interval', type=_number(int, 1),
                   help='finite steps before a dynamic loss scale doubles (default %d; '
                        '--single: %d)' % (demo['growth_interval'], d.growth_interval))
    p.add_argument('--single', action='store_true',
                   help='one run, no baseline, with the former defaults (batch 32 x 1, '
                        'float32, 15 epochs, warmup 1 epoch, growth interval 100); the '
                        'other flags apply as given')
    p.add_argument('--no-baseline', action='store_true',
                   help='skip the baseline run (keeps the defaults of the main run)')
    p.add_argument('--kvstore', choices=('local', 'device', 'dist_sync', 'horovod'),
                   help='default: none. dist_sync: run under "mx-lbsgd launch"; horovod: '
                        'run under "horovodrun --gloo -np 2 -H localhost:2"; each worker '
                        'trains on its shard (by rank), only rank 0 writes --out')
    p.add_argument('--hidden', type=_hidden, default=d.hidden, metavar='N[,N...]',
                   help='hidden layer sizes (default 64,64)')
    p.add_argument('--target', type=_number(float, 0, 1), default=d.target,
                   help='test accuracy for epochs_to_target (default %(default)s)')
    p.add_argument('--seed', type=int, default=d.seed,
                   help='data split, initialization and shuffling (default %(default)s)')
    p.add_argument('--no-steps', action='store_true',
                   help='do not record steps.csv (saves one host read per step)')
    p.add_argument('--out', help='output folder (default runs/<timestamp>)')
    p.add_argument('--quiet', action='store_true', help='no progress output')
    return p


def _train_config(args, parser):
    from . import _train
    lbsgd_like = args.optimizer in _train.WARMUP_OPTIMIZERS
    for flag, value in (('--warmup-strategy', args.warmup_strategy),
                        ('--warmup-epochs', args.warmup_epochs)):
        if value is not None and not lbsgd_like:
            parser.error('argument %s: applies to lbsgd and mxnet-lbsgd only, not %s'
                         % (flag, args.optimizer))
    if args.batch_scale not in (None, 1) and not lbsgd_like:
        parser.error('argument --batch-scale: applies to lbsgd and mxnet-lbsgd only, not %s'
                     % args.optimizer)
    d = dict(dataclasses.asdict(_train.TrainConfig()))
    if not args.single:
        d.update(_train.DEMO_DEFAULTS)
        if not lbsgd_like:
            d['batch_scale'] = 1

    def pick(name):
        value = getattr(args, name)
        return d[name] if value is None else value
    return _train.TrainConfig(
        optimizer=args.optimizer, warmup_strategy=args.warmup_strategy or d['warmup_strategy'],
        warmup_epochs=pick('warmup_epochs'), batch_size=args.batch_size,
        batch_scale=pick('batch_scale'), epochs=pick('epochs'), lr=args.lr,
        momentum=args.momentum, wd=args.wd, dtype=pick('dtype'),
        loss_scale=args.loss_scale, growth_interval=pick('growth_interval'),
        kvstore=args.kvstore, seed=args.seed, hidden=args.hidden, target=args.target,
        record_steps=not args.no_steps)


def _wants_baseline(args):
    """The baseline runs unless --single / --no-baseline, or a multi-process job (each
    worker would train it alone)."""
    return not (args.single or args.no_baseline or args.kvstore in ('dist_sync', 'horovod'))


class _Progress:
    """A tqdm bar over steps on a terminal; otherwise one line per epoch (unless quiet).
    Workers other than rank 0 stay silent."""

    def __init__(self, cfg, quiet, label=''):
        self.cfg, self.quiet, self.bar, self.label = cfg, quiet, None, label

    def start(self, info):
        self.quiet = self.quiet or info['rank'] != 0
        if not self.quiet and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=info['steps_per_epoch'] * info['epochs'], unit='step',
                            dynamic_ncols=True, leave=True,
                            desc='%s%s %s' % (self.label and self.label + ': ',
                                              self.cfg.optimizer, self.cfg.dtype))

    def step(self, row):
        if self.bar is not None:
            self.bar.update(1)

    def epoch(self, row):
        if self.bar is not None:
            self.bar.set_postfix(loss='%.4f' % row['train_loss'], acc='%.3f' % row['test_acc'],
                                 lr='%.3g' % row['lr'], scale='%g' % row['loss_scale'])
        elif not self.quiet:
            print('%sepoch %3d  train loss %.4f  train acc %.3f  test acc %.3f  lr %.4g  '
                  'loss scale %g  skipped %d  %.1f s' % (
                      self.label and self.label + ' ', row['epoch'], row['train_loss'],
                      row['train_acc'], row['test_acc'], row['lr'], row['loss_scale'], row['skipped_steps'], row['seconds']),
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _cmd_train(argv):
    from . import _train
    parser = _train_parser()
    args = parser.parse_args(argv)
    cfg = _train_config(args, parser)
    _require_demo(parser.prog)
    out = args.out or os.path.join('runs', time.strftime('%Y%m%d-%H%M%S'))
    _writable_dir(parser.prog, out)          # before training, not after it
    runs = [('main' if _wants_baseline(args) else '', cfg)]
    if _wants_baseline(args):
        runs.append(('baseline', _train.baseline_config(cfg)))
    results = []
    for label, run_cfg in runs:
        progress = _Progress(run_cfg, args.quiet, label)
        try:
            results.append(_train.train(run_cfg, on_start=progress.start,
                                        on_step=progress.step, on_epoch=progress.epoch))
        except _train.ConfigError as err:
            raise _UsageError('%s: error: %s' % (parser.prog, err)) from None
        finally:
            progress.close()
        if results[0]['rank'] != 0:
            return 0
    result, baseline = results[0], (results[1] if len(results) > 1 else None)
    paths = _train.write_outputs(result, out, argv=list(argv), baseline=baseline)
    for (label, _), res in zip(runs, results):
        print((label + ': ' if label else '') + _result_line(res))
    print('wrote %s' % ', '.join(paths))
    return 0


def _result_line(result):
    reach = result['epochs_to_target']
    line = ('test accuracy %.4f (best %.4f at epoch %d; %s %.2f %s) in %.1f s, '
            '%d of %d steps skipped' % (
                result['final_test_acc'], result['best_test_acc'], result['best_epoch'],
                'target', result['target_acc'],
                'reached at epoch %d' % reach if reach else 'not reached',
                result['wall_time_s'], result['skipped_steps'], result['total_steps']))
    if result['effective_batch_size'] != result['batch_size']:
        line += ', effective batch %d' % result['effective_batch_size']
    if result['loss_scale'] != 1.0 or result['config']['loss_scale'] != 'none':
        line += ', final loss scale %g' % result['loss_scale']
    if 'final_underflow_fraction' in result:
        line += ', gradient underflow %.2f%%' % (100 * result['final_underflow_fraction'])
    return line


# -- schedule ------------------------------------------------------------------------------
_SHAPES = tuple(schedules.WARMUP_SHAPES)     # the strategies that are a schedule


def _schedule_parser():
    p = _Parser(prog='mx-lbsgd schedule', description=(
        "Print the learning-rate multiplier of LBSGD's warmup strategies "
        '(mx_lbsgd.schedules.warmup_multiplier): it rises from 1 to --batch-scale over '
        '--warmup-steps micro-batches and stays there. The learning rate is lr times it. '
        "('lars' has no schedule: its multiplier is a per-layer trust ratio.)"))
    p.add_argument('--warmup-steps', type=_number(int, 0), default=100,
                   help='warmup length W in micro-batches (warmup_epochs * '
                        'updates_per_epoch; default %(default)s)')
    p.add_argument('--batch-scale', type=_number(float, 1), default=8.0,
                   help='the final multiplier B (default %(default)g)')
    p.add_argument('--steps', type=_number(int, 0),
                   help='last step shown (default: 1.25 * warmup steps)')
    p.add_argument('--every', type=_number(int, 1),
                   help='print every Kth step (default: about 20 rows)')
    p.add_argument('--strategies', nargs='+', choices=_SHAPES, default=list(_SHAPES),
                   metavar='S', help='subset of %s (default: all)' % ', '.join(_SHAPES))
    p.add_argument('--mxnet', action='store_true',
                   help="add columns with MXNet 1.9.1's own LBSGD multiplier (_get_lbmult)")
    p.add_argument('--plot', metavar='FILE.png', help='also plot the curves into FILE.png')
    return p


def schedule_table(warmup_steps, batch_scale, steps, every, strategies=_SHAPES,
                   mxnet=False):
    """(header, rows): rows of [step, multiplier per strategy (, MXNet's per strategy)]."""
    from .schedules import warmup_multiplier
    header = ['step'] + list(strategies)
    mx_opts = []
    if mxnet:
        from . import MXNET_LBSGD
        for s in strategies:
            mx_opts.append(MXNET_LBSGD(warmup_strategy=s, warmup_epochs=warmup_steps,
                                       updates_per_epoch=1, batch_scale=batch_scale))
        header += ['mxnet:' + s for s in strategies]
    rows = []
    for n in range(0, steps + 1, every):
        rows.append([n] + [warmup_multiplier(n, warmup_steps, batch_scale, s)
                           for s in strategies] + [o._get_lbmult(n) for o in mx_opts])
    return header, rows


def _cmd_schedule(argv):
    parser = _schedule_parser()
    args = parser.parse_args(argv)
    if args.plot:
        _require_demo(parser.prog, ('matplotlib',), what='--plot')
    steps = args.steps if args.steps is not None else max(1, (args.warmup_steps * 5) // 4)
    every = args.every or max(1, steps // 20)
    header, rows = schedule_table(args.warmup_steps, args.batch_scale, steps, every,
                                  args.strategies, args.mxnet)
    print('warmup multiplier: W = %d warmup steps, B = %g' % (args.warmup_steps,
                                                               args.batch_scale))
    widths = [max(10, len(h)) for h in header]
    print(' '.join('%*s' % (w, h) for w, h in zip(widths, header)))
    for row in rows:
        print('%*d ' % (widths[0], row[0])
              + ' '.join('%*.6f' % (w, v) for w, v in zip(widths[1:], row[1:])))
    if args.plot:
        _plot_schedule(args, steps, header)
        print('wrote %s' % args.plot)
    return 0


def _plot_schedule(args, steps, header):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    _, rows = schedule_table(args.warmup_steps, args.batch_scale, steps, 1,
                             args.strategies, args.mxnet)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r[0] for r in rows]
    for j, name in enumerate(header[1:], start=1):
        ax.plot(x, [r[j] for r in rows], ls='--' if name.startswith('mxnet:') else '-',
                label=name)
    ax.axvline(args.warmup_steps, color='gray', ls=':', label='end of warmup')
    ax.set(xlabel='micro-batch (step)', ylabel='learning-rate multiplier',
           title='LBSGD warmup, B = %g' % args.batch_scale)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=80)
    plt.close(fig)


# -- bench, study, launch ------------------------------------------------------------------
def _benchmarks_dir():
    """The checkout's benchmarks/ folder next to this package, or None."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, 'benchmarks')
    return path if os.path.isdir(path) else None


def _script(prog, name):
    folder = _benchmarks_dir()
    path = os.path.join(folder, name) if folder else None
    if path is None or not os.path.isfile(path):
        raise _UsageError('%s: error: benchmarks/%s not found: this command runs the '
                          "scripts of mx_lbsgd's source checkout, which this installation "
                          '(%s) lacks' % (prog, name, os.path.dirname(os.path.abspath(
                              __file__))))
    return path


def _run_script(path, argv):
    """Run a script as __main__ with sys.argv = [path] + argv and its folder on sys.path."""
    import runpy
    folder = os.path.dirname(path)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path] + list(argv)
    sys.path.insert(0, folder)
    try:
        runpy.run_path(path, run_name='__main__')
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _cmd_bench(argv):
    p = _Parser(prog='mx-lbsgd bench', description=(
        "Run benchmarks/bench_step.py (optimizer step time on ResNet-50's shapes against "
        "MXNet's optimizers) from the source checkout; arguments it does not know go to "
        'the script, e.g. --rounds 4 --dtypes float32 --only "lbsgd linear" --json F. '
        "'mx-lbsgd bench -- --help' shows the script's own options."))
    which = p.add_mutually_exclusive_group()
    which.add_argument('--loss-scale', action='store_true',
                       help='run benchmarks/bench_loss_scale.py instead (it has --quick)')
    which.add_argument('--shapes', action='store_true',
                       help='run benchmarks/bench_shapes.py instead: step time vs tensor '
                            'count, ResNet-50 shapes and loss-scaled steps (it has --quick, '
                            '--only SECTION and --plot F)')
    args, rest = p.parse_known_args(argv)
    if rest[:1] == ['--']:
        rest = rest[1:]
    name = ('bench_loss_scale.py' if args.loss_scale else
            'bench_shapes.py' if args.shapes else 'bench_step.py')
    return _run_script(_script(p.prog, name), rest)


def _cmd_study(argv):
    import importlib.util
    path = _script('mx-lbsgd study', 'study.py')
    spec = importlib.util.spec_from_file_location('_mx_lbsgd_study', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, prog='mx-lbsgd study')


def _cmd_launch(argv):
    from .launch import main as launch_main
    return launch_main(argv)


# -- main ----------------------------------------------------------------------------------
_HANDLERS = {'train': _cmd_train, 'schedule': _cmd_schedule, 'bench': _cmd_bench,
             'study': _cmd_study, 'launch': _cmd_launch}


def _top_parser():
    from . import __version__
    p = _Parser(prog='mx-lbsgd', description=(
        'Large-batch SGD and dynamic loss scaling for MXNet 1.9.1: demos and tools.'),
        epilog='Commands:\n' + '\n'.join('  %-9s %s' % c for c in _COMMANDS)
        + "\n\nRun 'mx-lbsgd COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--version', action='version', version='mx_lbsgd %s' % __version__)
    p.add_argument('command', choices=[c for c, _ in _COMMANDS], metavar='COMMAND',
                   help='one of: %s' % ', '.join(c for c, _ in _COMMANDS))
    return p


def _exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv=None):
    """Run ``mx-lbsgd`` with `argv` (default sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0].startswith('-'):
            _top_parser().parse_args(argv)            # --help / --version / error
            return 2
        if argv[0] not in _HANDLERS:
            _top_parser().parse_args(argv[:1])        # one-line 'invalid choice' error
        return _HANDLERS[argv[0]](argv[1:])
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130
