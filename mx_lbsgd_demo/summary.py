"""What ``mx-lbsgd train`` writes: metrics.csv, steps.csv (and their baseline- twins),
summary.json and training.png.

summary.json holds the result of :func:`mx_lbsgd_demo.train.train` without its history
(one name per quantity), plus ``args`` (the run's TrainConfig, lr and loss_scale
resolved), ``argv``, ``versions``, ``plots``, ``files``, the noise scale's account
(:func:`noise_scale_account`: NOISE_ACCOUNT_KEYS) and, with a baseline run, ``baseline``
(BASELINE_KEYS of its result and its ``args``).
"""
import csv
import json
import os
import platform

import numpy as np

from .plots import plot_training
from .train import NOISE_SCALE_KEYS, OVERFLOW_KEYS

__all__ = ['EPOCH_FIELDS', 'STEP_FIELDS', 'SCALING_FIELDS', 'BASELINE_KEYS', 'PLOT_FILES',
           'NOISE_ACCOUNT_KEYS', 'noise_scale_account', 'usable_b_simple', 'versions',
           'write_outputs']

#: With lr_scaling, epoch and step rows also hold the last gain, the window length and the
#: scale-invariant progress.
SCALING_FIELDS = ('gain', 'window', 'progress')
EPOCH_FIELDS = ('epoch', 'train_loss', 'train_acc', 'val_acc', 'test_acc', 'lr',
                'loss_scale', 'skipped_steps', 'seconds', 'underflow_fraction') \
    + NOISE_SCALE_KEYS + SCALING_FIELDS
STEP_FIELDS = ('step', 'epoch', 'loss', 'lr', 'loss_scale', 'skipped',
               'zero_grad_fraction', 'grad_norm') + OVERFLOW_KEYS
#: What summary.json's ``baseline`` keeps of the baseline's result.
BASELINE_KEYS = ('optimizer', 'batch_size', 'batch_scale', 'effective_batch_size', 'dtype',
                 'warmup_strategy', 'final_loss_scale', 'skipped_steps', 'final_test_acc',
                 'best_test_acc', 'best_epoch', 'epochs_to_target', 'wall_time_s',
                 'total_steps', 'updates', 'steps_per_epoch', 'final_b_simple',
                 'noise_scale_interval', 'noise_scale_not_measured')
PLOT_FILES = ('training.png',)
#: What summary.json adds on the noise scale (noise_scale_account).
NOISE_ACCOUNT_KEYS = ('last_b_simple', 'last_b_simple_epoch', 'noise_scale_left_out',
                      'noise_scale_unusable')


def usable_b_simple(row):
    """The epoch row's B_simple if it is usable (a positive number), else None."""
    value = row.get('b_simple')
    return value if value is not None and value > 0 else None


def noise_scale_account(result):
    """The noise scale of the run in terms that agree with its per-epoch rows and its
    ``updates``: a dict of

    - ``last_b_simple``, ``last_b_simple_epoch``: the last usable (positive) per-epoch
      B_simple and its epoch, None if no epoch had one;
    - ``noise_scale_left_out``: the applied updates that did not enter the estimate, by
      why: ``window_1`` (batch_scale auto: a window of 1 micro-batch has one batch size,
      nothing to compare it with), ``other`` (gradient norms the monitor could not use);
      empty when every applied update entered, or without a monitor;
    - ``noise_scale_unusable``: why the last epoch has no usable estimate, None when it has
      one or the run had no monitor (``noise_scale_not_measured`` says why)."""
    epochs = result['epochs']
    usable = [(r['epoch'], usable_b_simple(r)) for r in epochs if usable_b_simple(r)]
    last_epoch, last = usable[-1] if usable else (None, None)
    account = dict(last_b_simple=last, last_b_simple_epoch=last_epoch,
                   noise_scale_left_out={}, noise_scale_unusable=None)
    if result['noise_scale_interval'] is None:
        return account
    window_1 = _window_1_updates(result)
    other = result['updates'] - result['noise_scale_updates'] - window_1
    account['noise_scale_left_out'] = {k: n for k, n in (('window_1', window_1),
                                                         ('other', other)) if n > 0}
    if not epochs or usable_b_simple(epochs[-1]) is None:
        account['noise_scale_unusable'] = _why_unusable(result, window_1)
    return account


def _window_1_updates(result):
    """Applied updates with a window of 1 micro-batch (batch_scale auto; batch_history
    gives each window length from the applied update it started at)."""
    history = result.get('batch_history') or []
    ends = [h['update'] for h in history[1:]] + [result['updates']]
    return sum(max(0, min(end, result['updates']) - h['update'])
               for h, end in zip(history, ends) if h['batch_scale'] == 1)


def _why_unusable(result, window_1):
    """Why the last epoch's B_simple is missing or not positive."""
    epochs = result['epochs']
    if result['noise_scale_updates'] == 0:
        if window_1 and window_1 == result['updates']:
            return ('no update entered the estimate: every window was 1 micro-batch, one '
                    'batch size, nothing to compare')
        return 'no update entered the estimate'
    first = len(epochs)
    while first > 0 and usable_b_simple(epochs[first - 1]) is None:
        first -= 1
    since = ('at the last epoch' if first == len(epochs) - 1
             else 'from epoch %d on' % epochs[first]['epoch'])
    last = epochs[-1]
    if last.get('gradient_sq') is not None and last['gradient_sq'] <= 0:
        return ('the smoothed |G|^2 is not positive %s: the mean gradient is too small '
                'against its noise for the two batch sizes to resolve' % since)
    if last.get('trace_sigma') is not None and last['trace_sigma'] <= 0:
        return ('the smoothed tr(Sigma) is not positive %s: the noise is too small against '
                'the mean gradient for the two batch sizes to resolve' % since)
    return 'no estimate yet %s' % since


def versions():
    """Versions of what the run depends on."""
    import matplotlib
    import mxnet as mx
    import sklearn
    import mx_lbsgd
    return dict(python=platform.python_version(), mxnet=mx.__version__,
                numpy=np.__version__, scikit_learn=sklearn.__version__,
                matplotlib=matplotlib.__version__, mx_lbsgd=mx_lbsgd.__version__,
                platform=platform.platform())


def _write_csv(path, fields, rows):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ('' if row.get(k) is None else row.get(k)) for k in fields})


def _write_history(result, out_dir, prefix, paths):
    fields = [f for f in EPOCH_FIELDS if f in result['epochs'][0]]
    path = os.path.join(out_dir, prefix + 'metrics.csv')
    _write_csv(path, fields, result['epochs'])
    paths.append(path)
    if result['steps']:
        path = os.path.join(out_dir, prefix + 'steps.csv')
        _write_csv(path, STEP_FIELDS + tuple(f for f in SCALING_FIELDS
                                             if f in result['steps'][0]), result['steps'])
        paths.append(path)


def write_outputs(result, out_dir, argv=None, baseline=None):
    """Write metrics.csv, steps.csv (if recorded), summary.json and training.png into
    out_dir (created), and baseline-metrics.csv / baseline-steps.csv when `baseline` (the
    baseline run's result) is given; returns the list of paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    _write_history(result, out_dir, '', paths)
    if baseline is not None:
        _write_history(baseline, out_dir, 'baseline-', paths)
    panels = []
    for name in PLOT_FILES:
        path = os.path.join(out_dir, name)
        panels = plot_training(result, path, baseline)
        paths.append(path)
    summary = {k: v for k, v in result.items() if k not in ('epochs', 'steps')}
    summary.update(args=summary.pop('config'), argv=argv, versions=versions(),
                   plots={'training.png': 'one figure, %d panels: %s%s' % (
                       len(panels), ', '.join(panels),
                       ' (main run and baseline)' if baseline else '')},
                   files=[os.path.basename(p) for p in paths] + ['summary.json'],
                   **noise_scale_account(result))
    if baseline is not None:
        summary['baseline'] = dict({k: baseline[k] for k in BASELINE_KEYS},
                                   args=baseline['config'])
    path = os.path.join(out_dir, 'summary.json')
    with open(path, 'w') as f:
        json.dump(summary, f, indent=1, default=_jsonable)
    paths.append(path)
    return paths


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError('not JSON serializable: %r' % (value,))
