"""Checkpoint files kept under tests/data/checkpoints: what they hold, how they were written,
and the check that today's code loads them and resumes bit for bit
(tests/test_checkpoint_files.py).

    python tests/checkpoint_files.py write tests/data/checkpoints   # once, by the commit
                                                                   # named in manifest.json
    python tests/checkpoint_files.py check tests/data/checkpoints   # prints JSON results

Run with OMP_NUM_THREADS=1 (the test does): norms are summed in a fixed order for a given
thread count. Each case trains a few parameters whose gradient is exactly a value drawn
from a seeded RandomState (the loss is sum(w * g), whose gradient in w is g, bit for bit on
any CPU), so the files and the runs after them do not depend on the CPU's kernels. A case
trains `SAVE` steps (inside an accumulation window where it has one), saves, trains `MORE`
steps and keeps the weights; the check loads the file into fresh objects set to the saved
weights, trains the same `MORE` steps and compares. Files are written once per route (the
native operators, MXNet's own: their norms may differ in the last bits), in
``<route>/``.
"""
import json
import os
import subprocess
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import checkpoint

SAVE, MORE = 5, 6
SHAPES = {'dense0_weight': (8, 6), 'dense0_bias': (8,), 'dense1_weight': (3, 8),
          'dense1_bias': (3,)}


def _scaler(init_scale, growth_interval):
    return mx_lbsgd.DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval)


# name -> (kind, optimizer, its params (a function: fresh objects), step with an inf or None)
CASES = {
    'lbsgd-lars-warmup-B2-scaled-clip': ('trainer', 'lbsgd', lambda: dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, warmup_strategy='lars', warmup_epochs=1,
        updates_per_epoch=4, batch_scale=2, loss_scaler=_scaler(2.0 ** 8, 3),
        max_grad_norm=1.0), 3),
    'lbsgd-adascale-B2': ('trainer', 'lbsgd', lambda: dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, batch_scale=2, lr_scaling='adascale',
        warmup_epochs=1, updates_per_epoch=4), None),
    'lblamb-sqrt-B2': ('trainer', 'lblamb', lambda: dict(
        learning_rate=0.01, wd=0.01, batch_scale=2, lr_scaling='sqrt'), None),
    'lbsgd-nesterov-hook': ('hook', 'lbsgd', lambda: dict(
        learning_rate=0.1, momentum=0.9, nesterov=True, wd=1e-4, warmup_strategy='power2',
        warmup_epochs=1, updates_per_epoch=4), 2),
    'lssgd-mxnet-save-states': ('mxnet', 'lssgd', lambda: dict(
        learning_rate=0.1, momentum=0.9, loss_scaler=_scaler(2.0 ** 6, 2)), 1),
    'lbsgd-module-adascale-B2': ('module', 'lbsgd', lambda: dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, batch_scale=2, lr_scaling='adascale',
        warmup_epochs=1, updates_per_epoch=4, rescale_grad=0.25), None),
}


def gradient(step, name, poisoned):
    g = np.random.RandomState(1000 * step + sorted(SHAPES).index(name)).standard_normal(
        SHAPES[name]).astype(np.float32)
    if poisoned == step and name == 'dense1_weight':
        g[1, 2] = np.inf
    return g


def initial():
    rng = np.random.RandomState(7)
    return {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in SHAPES.items()}


class Trainer:
    """A Trainer over `SHAPES` (with a `LossScaling` hook for kind 'hook')."""

    def __init__(self, case, weights):
        self.kind, name, params, self.poisoned = CASES[case]
        self.params = gluon.ParameterDict()
        for n, shape in SHAPES.items():
            p = self.params.get(n, shape=shape)
            p.initialize(mx.init.Zero(), ctx=mx.cpu())
            p.set_data(nd.array(weights[n]))
        self.trainer = gluon.Trainer(self.params, name, params(), kvstore=None)
        self.hook = (mx_lbsgd.LossScaling(self.trainer, _scaler(2.0 ** 10, 2), force=True)
                     if self.kind == 'hook' else None)

    def scale(self):
        if self.hook is not None:
            return self.hook.scale
        scaler = getattr(self.trainer.optimizer, 'loss_scaler', None)
        return scaler.scale if scaler is not None else 1.0

    def steps(self, begin, end):
        for step in range(begin, end):
            scale = np.float32(self.scale())
            with autograd.record():
                loss = sum((p.data() * nd.array(gradient(step, n, self.poisoned) * scale))
                           .sum() for n, p in self.params.items())
            loss.backward()
            if self.hook is not None:
                self.hook.step(4)
            else:
                self.trainer.step(4)

    def weights(self):
        return {n: p.data().asnumpy() for n, p in self.params.items()}

    def save(self, path):
        if self.kind == 'mxnet':
            self.trainer.save_states(path)
        else:
            checkpoint.save_states(self.trainer, path)

    def load(self, path):
        if self.kind == 'mxnet':
            self.trainer.load_states(path)
        else:
            checkpoint.load_states(self.trainer, path)


class Module:
    """A Module whose loss is sum(w * data) per parameter: each data batch is the
    gradient."""

    def __init__(self, case, weights):
        _, name, params, self.poisoned = CASES[case]
        data, loss, begin = mx.sym.Variable('g'), None, 0
        for n, shape in SHAPES.items():
            size = int(np.prod(shape))
            g = mx.sym.reshape(mx.sym.slice_axis(data, axis=1, begin=begin, end=begin + size),
                               shape=shape)
            term = mx.sym.sum(mx.sym.Variable(n, shape=shape) * g)
            loss, begin = (term if loss is None else loss + term), begin + size
        self.mod = mx.mod.Module(mx.sym.MakeLoss(loss), data_names=['g'], label_names=None,
                                 context=mx.cpu())
        self.mod.bind([('g', (1, begin))])
        self.mod.init_params(arg_params={n: nd.array(w) for n, w in weights.items()})
        self.mod.init_optimizer(optimizer=name, optimizer_params=params())

    def steps(self, begin, end):
        for step in range(begin, end):
            flat = np.concatenate([gradient(step, n, self.poisoned).ravel() for n in SHAPES])
            self.mod.forward_backward(mx.io.DataBatch([nd.array(flat[None])]))
            self.mod.update()

    def weights(self):
        return {n: a.asnumpy() for n, a in self.mod.get_params()[0].items()}

    def save(self, path):
        checkpoint.save_states(self.mod, path)

    def load(self, path):
        checkpoint.load_states(self.mod, path)


def build(case, weights):
    return (Module if CASES[case][0] == 'module' else Trainer)(case, weights)


def route():
    return 'native' if mx_lbsgd.native_library() else 'mxnet'


def write(folder):
    """Write every case's file and weights into folder/<route>/."""
    out = os.path.join(folder, route())
    os.makedirs(out, exist_ok=True)
    for case in CASES:
        run = build(case, initial())
        run.steps(0, SAVE)
        saved = run.weights()
        run.save(os.path.join(out, case + '.states'))
        run.steps(SAVE, SAVE + MORE)
        np.savez(os.path.join(out, case + '.npz'),
                 **{'saved_' + n: w for n, w in saved.items()},
                 **{'after_' + n: w for n, w in run.weights().items()})
        resumed = check_case(out, case)
        assert resumed['equal'], (case, resumed)
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    manifest_path = os.path.join(folder, 'manifest.json')
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    manifest[route()] = dict(commit=commit.stdout.strip(), mx_lbsgd=mx_lbsgd.__version__,
                             mxnet=mx.__version__, save=SAVE, more=MORE,
                             cases=sorted(CASES))
    with open(manifest_path, 'w') as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write('\n')


def check_case(folder, case):
    """Load folder/<case>.states into fresh objects at the saved weights, train MORE steps:
    {'equal': bool, 'max_abs_diff': float}."""
    kept = np.load(os.path.join(folder, case + '.npz'))
    run = build(case, {n: kept['saved_' + n] for n in SHAPES})
    run.load(os.path.join(folder, case + '.states'))
    run.steps(SAVE, SAVE + MORE)
    got = run.weights()
    diffs = [float(np.max(np.abs(got[n] - kept['after_' + n]))) for n in SHAPES]
    return dict(equal=all(np.array_equal(got[n], kept['after_' + n]) for n in SHAPES),
                max_abs_diff=max(diffs))


def check(folder):
    out = os.path.join(folder, route())
    results = {case: check_case(out, case) for case in CASES}
    print(json.dumps(dict(route=route(), results=results)))


if __name__ == '__main__':
    {'write': write, 'check': check}[sys.argv[1]](sys.argv[2])
