"""Loss-scaled optimizer step vs plain step on ResNet-50's parameter shapes (gluon.Trainer).

    mx-lbsgd bench --loss-scale [--dtypes float32 float16] [--rounds 8]
                                [--json out.json] [--quick]
    python -m mx_lbsgd_bench.bench_loss_scale ...  (or python benchmarks/bench_loss_scale.py)

No network: one gluon Parameter per ResNet-50 v1 trainable tensor on mx.cpu(), gradients
filled once with normal * 1e-3 (the loss-scaled candidates get the same draw times the
loss scale 2**16, as a scaled backward would give; the power of two is exact), step(1). Every
candidate has its own Trainer and its own copy of the weights; all run SGD with momentum
0.9, wd 1e-4, lr 0.01, update_on_kvstore=False (float16: fp32 master copies):

  plain        trainer.step(batch) with 'sgd'
  ours-hook    mx_lbsgd.LossScaling(trainer, DynamicLossScaler(), force=True).step(batch)
  ours-lssgd   gluon.Trainer(params, 'lssgd', loss_scaler=DynamicLossScaler()) (skipped
               if mx_lbsgd has no LossScaledSGD yet)
  contrib.amp  amp.init(); amp.init_trainer(trainer); amp.scale_loss; trainer.step(batch)

How amp's step works in MXNet 1.9.1: amp patches no Trainer method. init_trainer only
sets trainer._amp_loss_scaler (a LossScaler, 2**16) and _amp_original_scale; scale_loss
sets trainer._scale = original / loss_scale, so trainer.step's rescale_grad unscales in
the update kernel. Trainer._update itself (gluon/trainer.py) asks
_amp_loss_scaler.has_overflow(params): multi_all_finite over p._grad[0] in chunks of 200,
one asnumpy() read, then skips the whole update or runs the updaters. init_trainer
asserts amp.init() ran; amp.init() works on CPU but wraps many mx.nd ops for fp16 casts
(Convolution, FullyConnected, ...), so it runs after the ResNet shapes are collected and
the script asserts that none of the ops of the step path was wrapped.

Each step is timed with the engine drained (mx.nd.waitall) after it; host syncs are
counted around the step call only (the counter counts asscalar() once, not its asnumpy()).
Candidates take turns in rotating order; ratios are medians over rounds of within-round
ratios. Before timing, one untimed step checks every candidate against plain's weights and
optimizer states (fp16: the fp32 master copies too); after every step a probe tensor must
have moved (no step skipped for overflow).
"""
import functools
import os
import pickle
import tempfile
import statistics
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import gluon

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from mx_lbsgd_demo.args import Parser, check_output_option, number
from . import bench_step

__all__ = ['NAMES', 'run', 'targets', 'table', 'main']

SCALE = 2.0 ** 16          # initial scale of DynamicLossScaler and of amp's LossScaler
BATCH = 1                  # step(1): loss = mean(loss); fp16 updates stay visible
SGD = dict(learning_rate=0.01, momentum=0.9, wd=1e-4)
STEP_OPS = ['sgd_update', 'sgd_mom_update', 'mp_sgd_update', 'mp_sgd_mom_update',
            'multi_sgd_mom_update', 'multi_mp_sgd_mom_update', 'Cast', 'all_finite',
            'multi_all_finite', 'ones']
NAMES = ['plain', 'ours-hook', 'ours-lssgd', 'contrib.amp']


@functools.lru_cache()
def resnet50_shapes():     # before amp.init(): afterwards CPU Convolution fails (fp16 gemm)
    return bench_step.resnet50_shapes()


def amp_module():
    from mxnet.contrib import amp
    before = {op: getattr(mx.nd, op) for op in STEP_OPS}
    amp.init()             # no-op after the first call
    wrapped = [op for op in STEP_OPS if getattr(mx.nd, op) is not before[op]]
    assert not wrapped, 'amp.init() wrapped ops of the step path: %s' % wrapped
    return amp


class Candidate:
    def __init__(self, name, shapes, w0, g0, dtype):
        self.name, self.ms, self.syncs, self.calls = name, [], [], set()
        self.params = [gluon.Parameter(n, shape=s, dtype=dtype) for n, s in shapes]
        for p, w in zip(self.params, w0):
            p.initialize(mx.init.Zero(), ctx=mx.cpu())
            p.set_data(mx.nd.array(w, dtype=dtype))
        self.grads = g0[name != 'plain']      # (plain, scaled) NDArrays shared by all
        opt = dict(SGD, multi_precision=dtype == 'float16')
        if name == 'ours-lssgd':
            opt['loss_scaler'] = mx_lbsgd.DynamicLossScaler()
        self.trainer = gluon.Trainer(self.params, 'lssgd' if name == 'ours-lssgd' else 'sgd',
                                     opt, update_on_kvstore=False)
        self.amp = self.scaling = None
        if name == 'ours-hook':
            self.scaling = mx_lbsgd.LossScaling(
                self.trainer, scaler=mx_lbsgd.DynamicLossScaler(), force=True)
            assert self.scaling.scale == SCALE
        elif name == 'contrib.amp':
            self.amp = amp_module()
            self.amp.init_trainer(self.trainer)
            self.dummy_loss = mx.nd.ones((1,))
        elif name == 'ours-lssgd':
            assert self.trainer.optimizer.loss_scaler.scale == SCALE

    def step(self):
        if self.scaling is not None:
            self.scaling.step(BATCH)
        else:
            self.trainer.step(BATCH)

    def timed_step(self):
        # untimed: the gradients again, fresh as backward leaves them (else 'stale gradient')
        bench_step.set_gradients(self.params, self.grads)
        if self.amp is not None:   # untimed: amp.scale_loss sets trainer._scale = 1 / scale
            with self.amp.scale_loss(self.dummy_loss, self.trainer):
                pass
        probe = self.params[-1].data().asnumpy()
        mx.nd.waitall()
        with count_host_syncs(include_waitall=False) as calls:
            start = time.perf_counter()
            self.step()
            mx.nd.waitall()
            ms = 1e3 * (time.perf_counter() - start)
        changed = (self.params[-1].data().asnumpy() != probe).mean()
        assert changed > 0.5, '%s: step skipped or no-op (%.2f changed)' % (self.name, changed)
        self.calls.update(calls)
        self.syncs.append(len(calls))
        return ms

    def weights(self):
        return [p.data().asnumpy() for p in self.params]

    def states(self):
        """Optimizer state arrays (momentum; fp16: and the fp32 master copy), flattened."""
        def arrays(state):
            if isinstance(state, (list, tuple)):
                return [a for s in state for a in arrays(s)]
            return [state.asnumpy()] if isinstance(state, mx.nd.NDArray) else []
        with tempfile.TemporaryDirectory() as folder:      # through the public save_states
            path = os.path.join(folder, 'trainer.states')
            self.trainer.save_states(path)
            with open(path, 'rb') as f:
                states = pickle.load(f)            # our own file, just written
        states = states[0] if isinstance(states, tuple) else states   # (states, optimizer)
        return [a for i in sorted(states) for a in arrays(states[i])]


def make_candidates(shapes, dtype, rng, notes):
    w0 = [rng.uniform(-0.1, 0.1, s).astype(dtype) for _, s in shapes]
    w0[-1][:] = 0          # the probe tensor: an applied step always moves it, even in fp16
    draw = [(rng.standard_normal(s) * 1e-3).astype(dtype) for _, s in shapes]
    g0 = ([mx.nd.array(g, dtype=dtype) for g in draw],
          [mx.nd.array(g * SCALE, dtype=dtype) for g in draw])
    if not hasattr(mx_lbsgd, 'LossScaledSGD'):
        notes.append('ours-lssgd skipped: mx_lbsgd has no LossScaledSGD yet')
    return [Candidate(name, shapes, w0, g0, dtype) for name in NAMES
            if name != 'ours-lssgd' or hasattr(mx_lbsgd, 'LossScaledSGD')], w0


def verify(cands, w0, dtype, notes):
    """One untimed step each: weights and (where laid out alike) optimizer states must
    match plain's; the fp32 states also check the fp16 candidates' master copies."""
    tol = dict(rtol=1e-5, atol=1e-8) if dtype == 'float32' else dict(rtol=2e-3, atol=1e-6)
    for c in cands:
        c.timed_step()
    ref, ref_states = cands[0].weights(), cands[0].states()
    moved = float(np.mean([(a != b).mean() for a, b in zip(ref, w0)]))
    assert moved > 0, 'plain did not change the weights'
    layout = lambda arrays: [(a.shape, a.dtype) for a in arrays]   # noqa: E731
    for c in cands[1:]:
        for i, (a, b) in enumerate(zip(c.weights(), ref)):
            np.testing.assert_allclose(a, b, err_msg='%s tensor %d' % (c.name, i), **tol)
        states = c.states()
        if layout(states) != layout(ref_states):
            notes.append("%s: states laid out unlike plain's; weights checked only" % c.name)
            continue
        for i, (a, b) in enumerate(zip(states, ref_states)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8,
                                       err_msg='%s state %d' % (c.name, i))
    for c in cands:
        c.syncs, c.calls = [], set()
    return moved


def run(dtypes, rounds, warmup, quick, steps_per_round=2, seed=0):
    shapes = resnet50_shapes()[:20 if quick else None]
    results = {'tensors': len(shapes), 'parameters': sum(int(np.prod(s)) for _, s in shapes),
               'rounds': rounds, 'batch': BATCH, 'loss_scale': SCALE, 'notes': [], 'rows': []}
    rng = np.random.RandomState(seed)
    for dtype in dtypes:
        cands, w0 = make_candidates(shapes, dtype, rng, results['notes'])
        moved = verify(cands, w0, dtype, results['notes'])
        for c in cands:
            for _ in range(warmup):
                c.timed_step()
            c.syncs = []
        for r in range(rounds):
            k = r % len(cands)
            for c in cands[k:] + cands[:k]:
                c.ms.append(statistics.median(c.timed_step() for _ in range(steps_per_round)))
        for c in cands:
            row = {'dtype': dtype, 'candidate': c.name, 'ms': statistics.median(c.ms),
                   'host_syncs_per_step': statistics.mean(c.syncs),
                   'sync_calls': sorted(c.calls), 'rounds_ms': c.ms,
                   'verified_vs_plain': True, 'fraction_moved_step1': moved}
            results['rows'].append(row)
            print('%-8s %-12s %8.1f ms  syncs/step %.2f' % (dtype, c.name, row['ms'],
                  row['host_syncs_per_step']), file=sys.stderr, flush=True)
        del cands
    return results


def ratio(rows, num, den):
    if num not in rows or den not in rows:
        return None
    return statistics.median(a / b for a, b in zip(rows[num]['rounds_ms'],
                                                   rows[den]['rounds_ms']))


def targets(results):
    """(dtype, quantity, measured, target, met) for the issue's targets."""
    out = []
    for dtype in dict.fromkeys(r['dtype'] for r in results['rows']):
        rows = {r['candidate']: r for r in results['rows'] if r['dtype'] == dtype}
        for name in ('ours-hook', 'ours-lssgd', 'contrib.amp'):
            syncs = rows[name]['host_syncs_per_step'] if name in rows else None
            amp = name == 'contrib.amp'
            out.append((dtype, 'host syncs / %s step' % name, syncs, '-' if amp else '== 1',
                        None if syncs is None or amp else syncs == 1))
        for name in ('ours-hook', 'ours-lssgd'):
            value = ratio(rows, name, 'plain')
            out.append((dtype, '%s / plain' % name, value,
                        '<= 1.5' if dtype == 'float32' else '-',
                        None if value is None or dtype != 'float32' else value <= 1.5))
        for name in ('ours-hook', 'ours-lssgd'):
            value = ratio(rows, 'contrib.amp', name)
            out.append((dtype, 'speedup contrib.amp / %s' % name, value, '>= 1.5',
                        None if value is None else value >= 1.5))
    return out


def table(results):
    lines = ['| dtype | candidate | ms / step (median) | host syncs / step |',
             '|---|---|---:|---:|']
    for r in results['rows']:
        lines.append('| %s | %s | %.1f | %g |' % (r['dtype'], r['candidate'], r['ms'],
                                                  r['host_syncs_per_step']))
    lines += ['', '| dtype | quantity | measured | target | met |', '|---|---|---:|---|---|']
    for dtype, what, value, target, met in results['targets']:
        lines.append('| %s | %s | %s | %s | %s |' % (
            dtype, what, 'skipped' if value is None else '%.2f' % value, target,
            'not measured' if value is None and target != '-' else
            '-' if met is None else 'met' if met else 'NOT met'))
    return '\n'.join(lines + [''] + ['Note: %s' % n for n in sorted(set(results['notes']))])


def main(argv=None, prog=None):
    parser = Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'float16'],
                        choices=['float32', 'float16'])
    parser.add_argument('--rounds', type=number(int, 1), default=8,
                        help='rounds; each candidate times 2 steps per round')
    parser.add_argument('--warmup', type=number(int, 0), default=2,
                        help='untimed steps per candidate')
    parser.add_argument('--quick', action='store_true', help='first 20 tensors only')
    parser.add_argument('--json', help='write the results here')
    args = parser.parse_args(argv)
    check_output_option(parser, '--json', args.json)
    load = os.getloadavg()[0]
    results = run(args.dtypes, args.rounds, args.warmup, args.quick)
    results['targets'] = targets(results)
    results['machine'] = bench_step.machine(
        loadavg_1min_start_end=[load, os.getloadavg()[0]])
    print('machine: %s' % results['machine'])
    print('ResNet-50 v1: %d tensors, %d parameters, batch %d, loss scale %g' % (
        results['tensors'], results['parameters'], BATCH, SCALE))
    print(table(results))
    bench_step.save_json(args.json, results, parser.prog)
    return results


if __name__ == '__main__':
    main()
