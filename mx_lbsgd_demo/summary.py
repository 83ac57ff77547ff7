"""What ``mx-lbsgd train`` writes: metrics.csv, steps.csv (and their baseline- twins),
summary.json and training.png.

summary.json holds the result of :func:`mx_lbsgd_demo.train.train` without its history
(one name per quantity), plus ``args`` (the run's TrainConfig, lr and loss_scale
resolved), ``argv``, ``versions``, ``plots``, ``files`` and, with a baseline run,
``baseline`` (BASELINE_KEYS of its result and its ``args``).
"""
import csv
import json
import os
import platform

import numpy as np

from .plots import plot_training
from .train import NOISE_SCALE_KEYS, OVERFLOW_KEYS

__all__ = ['EPOCH_FIELDS', 'STEP_FIELDS', 'SCALING_FIELDS', 'BASELINE_KEYS', 'PLOT_FILES', 'versions',
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
                   files=[os.path.basename(p) for p in paths] + ['summary.json'])
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
