"""``mx-lbsgd train``: train the digits MLP (main run and baseline), write metrics, summary
and plots (see the command's --help)."""
import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time

from mx_lbsgd import schedules

from . import config
from .train import NOISE_SCALE_INTERVAL
from .args import (SEED_MAX, Parser, UsageError, number, require_demo,
                   require_writable_dir)

__all__ = ['main']


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


def _batch_scale(text):
    if text == 'auto':
        return text
    return number(int, 1)(text)


def _hidden(text):
    try:
        sizes = tuple(int(s) for s in text.split(','))
    except ValueError:
        raise argparse.ArgumentTypeError('expected comma-separated integers, got %r'
                                         % text) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError('layer sizes must be >= 1, got %r' % text)
    return sizes


def _parser():
    demo = config.DEMO_DEFAULTS
    p = Parser(prog='mx-lbsgd train', description=(
        "Train an MLP on scikit-learn's bundled 8x8 digits with Gluon, twice: the main run "
        '(default: lbsgd, micro-batches of 32 accumulated %d at a time into an effective '
        'batch of %d, linear warmup over %g epochs, float16 weights with fp32 master '
        'copies and dynamic loss scaling, %d epochs) and a baseline (sgd, batch 32, '
        'float32, no warmup, no loss scaling, the same epochs and seed). Writes '
        'metrics.csv (one row per epoch), steps.csv (one row per step, with the lr and '
        'the loss scale), baseline-metrics.csv, baseline-steps.csv, summary.json and '
        'training.png (both runs: test accuracy, learning rate, loss scale with the '
        'skipped steps, train loss; and, for a main run the gradient noise scale monitor '
        'watches, a fifth panel: B_simple per epoch, log scale, with the effective batch '
        'as a horizontal line; with --lr-scaling, two more: the lr gain per update, and '
        'the window length and batch per step) to --out. --single trains one run with the former '
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
        % (', '.join('%s %g' % kv for kv in config.DEFAULT_LR.items()),
           config.DEFAULT_LARS_LR)))
    d = config.TrainConfig()
    p.add_argument('--optimizer', choices=config.OPTIMIZERS, default=d.optimizer,
                   help='lbsgd (mx_lbsgd.LBSGD, default), lssgd (mx_lbsgd.LossScaledSGD), '
                        "sgd (mx SGD with momentum), mxnet-lbsgd (MXNet's own LBSGD), "
                        'lars (mx.optimizer.LARS), lblamb (mx_lbsgd.LAMB: LayerNorm and '
                        'biases left out of the trust ratio; --momentum does not apply)')
    p.add_argument('--warmup-strategy', choices=tuple(schedules.WARMUP_STRATEGIES),
                   help='lbsgd / mxnet-lbsgd only (default %s)' % d.warmup_strategy)
    p.add_argument('--warmup-epochs', type=number(float, 0),
                   help='lbsgd / mxnet-lbsgd only (default %g; --single: %g)'
                        % (demo['warmup_epochs'], d.warmup_epochs))
    p.add_argument('--batch-size', type=number(int, 1), default=d.batch_size,
                   help='micro-batch size (default %(default)s)')
    p.add_argument('--batch-scale', type=_batch_scale, metavar='{N,auto}',
                   help='micro-batches per update, also the final warmup multiplier '
                        '(lbsgd / mxnet-lbsgd / lblamb; default %d; --single or another '
                        'optimizer: %d). auto (lbsgd, lblamb, with --lr-scaling): the '
                        'window with the most goodput, chosen within --batch-scale-bounds '
                        'while training' % (demo['batch_scale'], d.batch_scale))
    p.add_argument('--batch-scale-bounds', type=number(int, 1), nargs=2, metavar=('LO', 'HI'),
                   help='the window lengths --batch-scale auto may choose (default %d %d)'
                        % config.AUTO_BOUNDS)
    p.add_argument('--lr-scaling', choices=config.LR_SCALING_RULES,
                   help='lbsgd / lssgd / lblamb: --lr is the one for one micro-batch on one '
                        'worker, multiplied each update by the rule\'s gain at S = window x '
                        'workers (adascale: AdaScale\'s measured gain); the warmup, unless '
                        'given, is then 0 epochs. The plot and summary.json get the gain, '
                        'the window and the batch over training')
    p.add_argument('--epochs', type=number(int, 1),
                   help='default %d (--single: %d)' % (demo['epochs'], d.epochs))
    p.add_argument('--lr', type=number(float, 0, open_low=True),
                   help='base learning rate (default: per optimizer, see below)')
    p.add_argument('--momentum', type=number(float, 0, 1, open_high=True),
                   default=d.momentum, help='default %(default)s')
    p.add_argument('--wd', type=number(float, 0), default=d.wd, help='default %(default)s')
    p.add_argument('--dtype', choices=('float32', 'float16'),
                   help='default %s (--single: %s)' % (demo['dtype'], d.dtype))
    p.add_argument('--loss-scale', type=_loss_scale, metavar='{dynamic,none,SCALE}',
                   help='default: dynamic for float16, none for float32; a number is a '
                        'static scale (overflow steps are still skipped)')
    p.add_argument('--growth-interval', type=number(int, 1),
                   help='finite steps before a dynamic loss scale doubles (default %d; '
                        '--single: %d)' % (demo['growth_interval'], d.growth_interval))
    p.add_argument('--max-grad-norm', type=number(float, 0, open_low=True), metavar='NORM',
                   help='clip the applied gradient (the window\'s mean, unscaled) to this '
                        'global L2 norm: inside lbsgd, lssgd and lblamb, through '
                        'mx_lbsgd.LossScaling for the others (default: no clipping; '
                        'steps.csv then has its norm in grad_norm)')
    p.add_argument('--single', action='store_true',
                   help='one run, no baseline, with the former defaults (batch 32 x 1, '
                        'float32, 15 epochs, warmup 1 epoch, growth interval 100); the '
                        'other flags apply as given')
    p.add_argument('--no-baseline', action='store_true',
                   help='skip the baseline run (keeps the defaults of the main run)')
    p.add_argument('--kvstore', choices=('local', 'device', 'dist_sync', 'horovod'),
                   help='default: none. dist_sync: run under "mx-lbsgd launch" (whose '
                        'output label [worker R] is the kvstore rank R); horovod: run under '
                        '"horovodrun --gloo -np 2 -H localhost:2"; each worker trains on '
                        'its shard (by kv.rank / hvd.rank), and only rank 0 prints the '
                        'results and writes --out')
    p.add_argument('--hidden', type=_hidden, default=d.hidden, metavar='N[,N...]',
                   help='hidden layer sizes (default 64,64)')
    p.add_argument('--target', type=number(float, 0, 1), default=d.target,
                   help='test accuracy for epochs_to_target (default %(default)s)')
    p.add_argument('--seed', type=number(int, 0, SEED_MAX), default=d.seed,
                   help='data split, initialization and shuffling, 0 .. %d (default '
                        '%%(default)s)' % SEED_MAX)
    p.add_argument('--noise-scale-interval', type=number(int, 0),
                   default=NOISE_SCALE_INTERVAL, metavar='N',
                   help='updates between the host reads of the gradient noise scale '
                        'monitor (mx_lbsgd.GradientNoiseScale), which records B_simple per '
                        'epoch for runs with two batch sizes (lbsgd, lssgd or lblamb with '
                        '--batch-scale > 1 or several workers); 0 turns it off '
                        '(default %(default)s)')
    p.add_argument('--no-steps', action='store_true',
                   help='do not record steps.csv (saves one host read per step)')
    p.add_argument('--out', help='output folder (default runs/<timestamp>)')
    p.add_argument('--quiet', action='store_true', help='no progress output')
    return p


def _config(args, parser):
    lbsgd_like = args.optimizer in config.WARMUP_OPTIMIZERS
    for flag, value in (('--warmup-strategy', args.warmup_strategy),
                        ('--warmup-epochs', args.warmup_epochs)):
        if value is not None and not lbsgd_like:
            parser.error('argument %s: applies to lbsgd and mxnet-lbsgd only, not %s'
                         % (flag, args.optimizer))
    accumulating = args.optimizer in config.ACCUMULATING_OPTIMIZERS
    if args.batch_scale not in (None, 1) and not accumulating:
        parser.error('argument --batch-scale: applies to lbsgd, mxnet-lbsgd and lblamb only, '
                     'not %s' % args.optimizer)
    if args.lr_scaling and args.optimizer not in config.LR_SCALING_OPTIMIZERS:
        parser.error('argument --lr-scaling: applies to lbsgd, lssgd and lblamb only, not %s'
                     % args.optimizer)
    if args.batch_scale == 'auto':
        if args.optimizer not in config.AUTO_OPTIMIZERS:
            parser.error('argument --batch-scale: auto applies to lbsgd and lblamb only, '
                         'not %s' % args.optimizer)
        if not args.lr_scaling:
            parser.error('argument --batch-scale: auto needs --lr-scaling (%s)'
                         % ', '.join(config.LR_SCALING_RULES))
    if args.batch_scale_bounds is not None:
        if args.batch_scale != 'auto':
            parser.error('argument --batch-scale-bounds: needs --batch-scale auto')
        if args.batch_scale_bounds[0] > args.batch_scale_bounds[1]:
            parser.error('argument --batch-scale-bounds: LO must be <= HI, got %d %d'
                         % tuple(args.batch_scale_bounds))
    d = dict(dataclasses.asdict(config.TrainConfig()))
    if not args.single:
        d.update(config.DEMO_DEFAULTS)
        if not accumulating:
            d['batch_scale'] = 1

    if args.lr_scaling:
        d['warmup_epochs'] = 0.0            # the gain replaces the warmup unless one is given

    def pick(name):
        value = getattr(args, name)
        return d[name] if value is None else value
    return config.TrainConfig(
        lr_scaling=args.lr_scaling,
        batch_scale_bounds=(None if args.batch_scale_bounds is None
                            else tuple(args.batch_scale_bounds)),
        optimizer=args.optimizer, warmup_strategy=args.warmup_strategy or d['warmup_strategy'],
        warmup_epochs=pick('warmup_epochs'), batch_size=args.batch_size,
        batch_scale=pick('batch_scale'), epochs=pick('epochs'), lr=args.lr,
        momentum=args.momentum, wd=args.wd, dtype=pick('dtype'),
        loss_scale=args.loss_scale, growth_interval=pick('growth_interval'),
        kvstore=args.kvstore, seed=args.seed, hidden=args.hidden, target=args.target,
        record_steps=not args.no_steps, max_grad_norm=args.max_grad_norm)


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
                      row['train_acc'], row['test_acc'], row['lr'], row['loss_scale'],
                      row['skipped_steps'], row['seconds'])
                  + _b_simple_field(row)
                  + ('  gain %.3g  window %d' % (row['gain'], row['window'])
                     if row.get('gain') is not None else ''),
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _b_simple_field(row):
    """'  B_simple X' for an epoch with a usable (positive) estimate, '  B_simple n/a' for
    one whose smoothed |G|^2 or tr(Sigma) is not positive, '' before any estimate."""
    from .summary import usable_b_simple
    if usable_b_simple(row) is not None:
        return '  B_simple %.3g' % row['b_simple']
    return '  B_simple n/a' if row.get('gradient_sq') is not None else ''


def main(argv):
    """Run ``mx-lbsgd train`` with `argv`; returns the exit status (UsageError and
    SystemExit as the command's main turns them into one)."""
    from . import train, summary
    parser = _parser()
    args = parser.parse_args(argv)
    cfg = _config(args, parser)
    require_demo(parser.prog)
    out = args.out or os.path.join('runs', time.strftime('%Y%m%d-%H%M%S'))
    require_writable_dir(parser.prog, out)          # before training, not after it
    runs = [('main' if _wants_baseline(args) else '', cfg)]
    if _wants_baseline(args):
        runs.append(('baseline', config.baseline_config(cfg)))
    results = []
    for label, run_cfg in runs:
        progress = _Progress(run_cfg, args.quiet, label)
        try:
            with _library_log(args.quiet):
                results.append(train.train(run_cfg, on_start=progress.start,
                                            on_step=progress.step, on_epoch=progress.epoch,
                                            noise_scale_interval=args.noise_scale_interval))
        except config.ConfigError as err:
            raise UsageError('%s: error: %s' % (parser.prog, err)) from None
        finally:
            progress.close()
        if results[0]['rank'] != 0:
            return 0
    result, baseline = results[0], (results[1] if len(results) > 1 else None)
    paths = summary.write_outputs(result, out, argv=list(argv), baseline=baseline)
    for (label, _), res in zip(runs, results):
        print((label + ': ' if label else '') + _result_line(res))
    print(_noise_scale_line(result))
    for line in _overflow_lines(result):
        print(line)
    print('wrote %s' % ', '.join(paths))
    return 0


@contextlib.contextmanager
def _library_log(quiet):
    """mx_lbsgd's overflow reports (a skipped step's, at most one per 30 s) and warnings
    on stderr while a run trains, unless quiet."""
    if quiet:
        yield
        return
    log = logging.getLogger('mx_lbsgd')
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter('mx_lbsgd %(levelname)s: %(message)s'))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING
                      or hasattr(record, 'overflow_report'))    # not the scale's growths
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _overflow_lines(result):
    """Which parameters overflowed in the skipped steps, and the falling-scale warnings."""
    top = result['overflow_top_offenders']
    if not top:
        return []
    lines = ['overflowed most in the %d skipped steps: %s (steps.csv: overflow_parameters, '
             'overflow_micro_batch)' % (result['skipped_steps'], ', '.join(
                 '%s in %d' % (name, n) for name, n in top))]
    for w in result['loss_scale_warnings']:
        lines.append('loss scale warning at step %d: %s' % (w['step'], w['message']))
    return lines


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
    if result.get('lr_scaling'):
        line += ', lr_scaling %s: final gain %.3g, progress %.0f base iterations in %d updates' % (
            result['lr_scaling'], result['final_gain'], result['progress'], result['updates'])
    if result.get('batch_history'):
        line += ', windows %s' % ' -> '.join(
            '%d (update %d)' % (h['batch_scale'], h['update']) for h in result['batch_history'])
    if result['final_loss_scale'] != 1.0 or result['config']['loss_scale'] != 'none':
        line += ', final loss scale %g' % result['final_loss_scale']
    if 'final_underflow_fraction' in result:
        line += ', gradient underflow %.2f%%' % (100 * result['final_underflow_fraction'])
    return line


def _noise_scale_line(result):
    """One line on the main run's gradient noise scale, in the terms of its per-epoch lines
    and its update count (summary.noise_scale_account): the effective batch against the
    last epoch's B_simple, read with McCandlish et al. (2018): steps to a given loss ~
    S_min (1 + B_noise / B), examples ~ E_min (1 + B / B_noise), so the speed-up from a
    larger batch saturates around B_crit ~ B_simple; or, when the last epoch has no usable
    estimate, why, and the last epoch that had one."""
    from .summary import noise_scale_account
    if result['noise_scale_interval'] is None:
        return 'gradient noise scale: not measured, %s' % result['noise_scale_not_measured']
    account = noise_scale_account(result)
    counted = _counted_updates(result, account['noise_scale_left_out'])
    if account['noise_scale_unusable'] is not None:
        line = 'gradient noise scale: no usable estimate at the last epoch (%s)' \
            % account['noise_scale_unusable']
        if account['last_b_simple'] is not None:
            line += '; the last usable one: B_simple ~ %s at epoch %d' % (
                _rounded(account['last_b_simple'], 3), account['last_b_simple_epoch'])
        if counted or result['noise_scale_updates']:
            line += '; estimated from %s' % (counted or 'all %d updates' % result['updates'])
        return line
    b_simple, batch = account['last_b_simple'], result['effective_batch_size']
    ratio = batch / b_simple
    if ratio < 0.5:
        verdict = ('well below B_simple, larger batches still cut the steps almost in '
                   'proportion')
    elif ratio <= 2:
        verdict = ('near B_simple (the critical batch), where the speed-up from larger '
                   'batches starts to saturate')
    else:
        verdict = 'beyond B_simple, larger batches buy fewer steps per example'
    return ('gradient noise scale B_simple ~ %s (last epoch)%s; effective batch %d is %sx '
            'it: %s (steps ~ %sx the fewest, examples ~ %sx the fewest, McCandlish et al. '
            '2018)' % (_rounded(b_simple, 3), counted and ', from ' + counted, batch,
                       _rounded(ratio, 2), verdict, _rounded(1 + 1 / ratio, 2),
                       _rounded(1 + ratio, 2)))


def _counted_updates(result, left_out):
    """'N of the M updates (why the others are left out)', or '' when all M entered."""
    if not left_out:
        return ''
    why = []
    if left_out.get('window_1'):
        why.append('%d had a window of 1 micro-batch: one batch size, nothing to compare'
                   % left_out['window_1'])
    if left_out.get('other'):
        why.append('%d had gradient norms the monitor could not use' % left_out['other'])
    return '%d of the %d updates (%s)' % (result['noise_scale_updates'], result['updates'],
                                          '; '.join(why))


def _rounded(value, digits):
    """`digits` significant digits, but no exponent and no decimals from 10**digits on."""
    return '%.*g' % (digits, value) if value < 10 ** digits else '%.0f' % value
