"""Optimizer step time against tensor count and shape, and the cost of loss scaling (CPU).

    mx-lbsgd bench [--rounds 5] [--quick] [--dtypes float32 float16]
                   [--json F] [--plot F.png] [--only sweep|resnet|loss-scale]
    python -m mx_lbsgd_bench.bench_shapes ...  (or python benchmarks/bench_shapes.py ...)

Three sections, each timed on mx.cpu() with the engine drained (mx.nd.waitall) after every
step. Within a section the candidates take turns, round after round, in rotating order;
each round keeps the median of its steps, and every ratio is the median over rounds of
the ratio within a round, so that the drift of a shared machine cancels out. Host syncs
(asnumpy/asscalar/wait_to_read, not counting the timing's waitall) and operator calls
(mx.nd engine pushes; kernel launches on a GPU) are counted per step.

1. sweep: 4M parameters split into N equal tensors, N in {10, 100, 1000, 3000}, momentum
   0.9, wd 1e-4, driven by MXNet's Updater (as Gluon and Module call it), as in
   bench_step.py: mx.optimizer.SGD as created (aggregate_num from
   $MXNET_OPTIMIZER_AGGREGATION_SIZE, default 4), SGD per-tensor (aggregate_num=0), and
   mx_lbsgd's LBSGD linear with fused=None (routed by size), True
   (multi-tensor kernels only) and False (per-tensor kernels only). Targets at every N:
   lbsgd routed / MXNet SGD default <= 0.5, and routed / the faster of lbsgd's fused=True
   and fused=False <= 1.05. float16 runs with multi_precision=True.
2. resnet: ResNet-50 v1's trainable shapes (bench_step.resnet50_shapes). Each candidate
   updates its own copy of the weights, as an optimizer does in training, but for
   'lbsgd lars, weights written by another': its weights are lbsgd linear's, which writes
   them between its steps, so its every step reads the weights' norms (the others take
   |w|^2 from the update that wrote the weights). An untimed run of every candidate comes
   first: in a fresh process one candidate or another ran up to 2.5x slower through the
   whole first run, inside its kernel, and not with MALLOC_MMAP_THRESHOLD_=1000000000
   (memory new to the process). Targets: lbsgd
   linear / fastest MXNet SGD path <= 0.6; lbsgd lars / lbsgd linear <= 1.6; faster of
   mx.optimizer.LARS(momentum_correction=False, aggregate 4) and MXNet's built-in LBSGD
   lars, divided by lbsgd lars, >= 10 in each of 3 independent runs (fresh optimizers and
   states, their own rounds). The table pools the rounds of the three runs. Clipping:
   lbsgd linear with max_grad_norm=1.0 / lbsgd linear <= 1.15, without and with a loss
   scaler (static scale 1: the norm's pass is then the finite check), against the GluonNLP recipe
   (gluon.utils.clip_global_norm(grads, 1.0) on its own copy of the gradients, then
   MXNet's SGD, aggregate 4; float32 only: clip_global_norm squares with dot, which has no
   float16 kernel on CPU). 'the norm alone (GlobalNormClip.measure)' times the clipping
   norm of the gradients and nothing else (mx_lbsgd.pipeline.GlobalNormClip(1.0).measure),
   what the unscaled clipped step adds: a note sets it beside clipped / unclipped - 1.
3. loss-scale: gluon.Trainer steps (update_on_kvstore=False, SGD momentum 0.9, wd 1e-4) on a
   small model (20 float32 tensors, 96,960 parameters) and on ResNet-50's shapes: plain
   'sgd'; 'lssgd' with loss_scaler=1024.0; 'sgd' + mx_lbsgd.LossScaling(trainer, 1024.0,
   force=True). Gradients are set once (the scaled candidates get them times 1024, exact)
   and marked fresh before every step, as backward would. One untimed step checks that the
   scaled candidates' weights match plain's. Targets on the small model, float32: 'lssgd'
   <= 1.1x plain, the LossScaling hook <= 1.15x plain.
"""
import functools
import os
import statistics
import sys
import time
import types

import numpy as np
import mxnet as mx
from mxnet import gluon

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from mx_lbsgd.pipeline import GlobalNormClip
from mx_lbsgd_demo.args import (Parser, UsageError, check_output_option, number, require_demo,
                                require_plot_file)
from . import bench_step

__all__ = ['SECTIONS', 'sweep', 'resnet', 'loss_scale', 'report', 'main']

SECTIONS = ('sweep', 'resnet', 'loss-scale')
SWEEP_PARAMS = 4000000
SWEEP_COUNTS = (10, 100, 1000, 3000)
COMMON = dict(learning_rate=0.1, momentum=0.9, wd=1e-4)
WARMUP = dict(warmup_epochs=1, updates_per_epoch=100)
LOSS_SCALE = 1024.0
SMALL_MODEL = [(n, s) for i in range(10)
               for n, s in (('dense%d_weight' % i, (96, 100)), ('dense%d_bias' % i, (96,)))]
LARS_RUNS = 3
SGD_DEFAULT = 'mxnet SGD (default)'
# the small model (each step well under 1 ms): SMALL_STEPS times the rounds, each of the
# section's steps, so the candidates alternate every few steps and a drift of the machine
# (here +-30% between runs) falls on all of them alike
SMALL_STEPS = 10
SGD_PER_TENSOR = 'mxnet SGD (per-tensor)'
LARS_SHARED = 'lbsgd lars, weights written by another'


@functools.lru_cache()
def resnet50_shapes():
    return bench_step.resnet50_shapes()


# -- candidates ----------------------------------------------------------------------------
def mxnet_sgd(aggregate=None):
    """mx.optimizer.SGD; aggregate=None keeps the aggregate_num it was created with."""
    def make(mp):
        opt = mx.optimizer.SGD(multi_precision=mp, **COMMON)
        if aggregate is not None:
            opt.aggregate_num = aggregate
        return opt
    return make


def lbsgd(strategy='linear', fused=None, **extra):
    return lambda mp: mx_lbsgd.LBSGD(warmup_strategy=strategy, multi_precision=mp,
                                     fused=fused, **dict(COMMON, **WARMUP, **extra))


def mxnet_lars(mp):
    opt = mx.optimizer.LARS(multi_precision=mp, momentum_correction=False, **COMMON)
    opt.aggregate_num = 4
    return opt


def mxnet_lbsgd_lars(mp):
    return mx_lbsgd.MXNET_LBSGD(warmup_strategy='lars', multi_precision=mp,
                                **dict(COMMON, **WARMUP))


SWEEP_CANDIDATES = {
    SGD_DEFAULT: mxnet_sgd(),
    SGD_PER_TENSOR: mxnet_sgd(0),
    'lbsgd linear (routed)': lbsgd(),
    'lbsgd linear fused=True': lbsgd(fused=True),
    'lbsgd linear fused=False': lbsgd(fused=False),
}
RESNET_CANDIDATES = {
    SGD_PER_TENSOR: mxnet_sgd(0),
    'mxnet SGD (aggregate 4)': mxnet_sgd(4),
    'lbsgd linear': lbsgd(),
    'lbsgd lars': lbsgd('lars'),
    LARS_SHARED: lbsgd('lars'),
    'mxnet LARS': mxnet_lars,
    'mxnet LBSGD lars': mxnet_lbsgd_lars,
    'lbsgd linear + clip 1.0': lbsgd(max_grad_norm=1.0),
    'lbsgd linear + loss scaler': lbsgd(loss_scaler=1.0),
    'lbsgd linear + loss scaler + clip 1.0': lbsgd(loss_scaler=1.0, max_grad_norm=1.0),
    'GluonNLP clip + mxnet SGD (aggregate 4)': mxnet_sgd(4),
    'the norm alone (GlobalNormClip.measure)': lbsgd(),
}
GLUONNLP = 'GluonNLP clip + mxnet SGD (aggregate 4)'
NORM_ALONE = 'the norm alone (GlobalNormClip.measure)'


def _clipping_first(cand, grads):
    """Make `cand` (a bench_step.Timed) clip its own copy of `grads` before each update, as
    GluonNLP's recipe does."""
    own = [g.copy() for g in grads]
    updater = cand.updater

    def step(index, _grads, weights):
        gluon.utils.clip_global_norm(own, 1.0)
        updater(index, own, weights)
    cand.updater = step
    return cand


def _norm_alone(cand, grads):
    """Make `cand` (a bench_step.Timed) measure the clipping norm of `grads` and nothing
    else: what a clipped step adds to an unclipped one when nothing earlier reads the
    gradients (no loss scaler, no window)."""
    clip = GlobalNormClip(1.0)
    cand.updater = lambda index, _grads, weights: clip.measure(grads, 1.0)
    return cand


class TrainerStep:
    """One gluon.Trainer candidate of the loss-scale section, with its own parameters;
    the same interface as bench_step.Timed (round, rounds, syncs, launches, steps)."""

    def __init__(self, name, shapes, w0, g0, dtype):
        self.name = name
        scaled = name != 'plain sgd'
        self.params = [gluon.Parameter(n, shape=s, dtype=dtype) for n, s in shapes]
        for p, w in zip(self.params, w0):
            p.initialize(mx.init.Zero(), ctx=mx.cpu())
            p.set_data(mx.nd.array(w, dtype=dtype))
        self.grads = [mx.nd.array(g * LOSS_SCALE if scaled else g, dtype=dtype) for g in g0]
        opt = dict(COMMON, multi_precision=dtype == 'float16')
        if name.startswith('lssgd'):
            opt['loss_scaler'] = LOSS_SCALE
        self.trainer = gluon.Trainer(self.params, 'lssgd' if name.startswith('lssgd') else
                                     'sgd', opt, update_on_kvstore=False)
        self.scaling = (mx_lbsgd.LossScaling(self.trainer, LOSS_SCALE, force=True)
                        if name.startswith('sgd + LossScaling') else None)
        self.rounds, self.syncs, self.launches, self.steps = [], 0, 0, 0

    def step(self):
        if self.scaling is not None:
            assert self.scaling.step(1), '%s skipped a step' % self.name
        else:
            self.trainer.step(1)

    def fresh(self):
        """The same gradients again, fresh as backward leaves them (else: 'stale
        gradient')."""
        bench_step.set_gradients(self.params, self.grads)

    def round(self, steps):
        times = []
        for _ in range(steps):
            self.fresh()
            mx.nd.waitall()
            with count_host_syncs(include_waitall=False) as calls, \
                    count_kernel_launches() as launches:
                start = time.perf_counter()
                self.step()
                mx.nd.waitall()
                times.append(1e3 * (time.perf_counter() - start))
            self.syncs += len(calls)
            self.launches += len(launches)
            self.steps += 1
        self.rounds.append({'ms': statistics.median(times)})

    def weights(self):
        return [p.data().asnumpy() for p in self.params]


# -- timing --------------------------------------------------------------------------------
def interleave_round(cands, r, steps):
    """Round `r`: every candidate times `steps` steps, the order rotated by r."""
    k = r % len(cands)
    for c in cands[k:] + cands[:k]:
        c.round(steps)


def interleave(cands, rounds, steps):
    for r in range(rounds):
        interleave_round(cands, r, steps)


def row(c, **fields):
    ms = [r['ms'] for r in c.rounds]
    return dict(fields, optimizer=c.name, ms=statistics.median(ms),
                host_syncs_per_step=c.syncs / c.steps, ops_per_step=c.launches / c.steps,
                rounds_ms=ms)


def ratio(num, dens):
    """Median over rounds of num / (fastest of dens), each a list of per-round ms."""
    return statistics.median(a / min(d[i] for d in dens) for i, a in enumerate(num))


def tensors(shapes, dtype, rng, scale=0.1):
    return [mx.nd.array(rng.uniform(-scale, scale, s), dtype=dtype) for _, s in shapes]


def log(text):
    print(text, file=sys.stderr, flush=True)


def sweep(dtypes, rounds, steps, seed=0):
    rng = np.random.RandomState(seed)
    out = {'parameters': SWEEP_PARAMS, 'counts': list(SWEEP_COUNTS), 'rows': [],
           'targets': [], 'notes': []}
    probe = mx.optimizer.SGD()
    out['notes'].append('MXNet SGD as created: aggregate_num=%d ($MXNET_OPTIMIZER_AGGREGATION_'
                        'SIZE=%s)' % (probe.aggregate_num,
                                      os.environ.get('MXNET_OPTIMIZER_AGGREGATION_SIZE')))
    if os.environ.get('MX_LBSGD_FUSED'):
        out['notes'].append('$MX_LBSGD_FUSED=%s forces the routed lbsgd path'
                            % os.environ['MX_LBSGD_FUSED'])
    for dtype in dtypes:
        groups = {}
        for n in SWEEP_COUNTS:
            shapes = [('t%d_weight' % i, (SWEEP_PARAMS // n,)) for i in range(n)]
            weights = tensors(shapes, dtype, rng)
            grads = tensors(shapes, dtype, rng, 1e-3)
            groups[n] = [bench_step.Timed(name, make, shapes, weights, grads)
                         for name, make in SWEEP_CANDIDATES.items()]
        for r in range(rounds):        # every N in every round: the curves share the drift
            for n, cands in groups.items():
                interleave_round(cands, r, steps)
        for n, cands in groups.items():
            by_name = {}
            for c in cands:
                r = row(c, dtype=dtype, tensors=n, elements_per_tensor=SWEEP_PARAMS // n)
                out['rows'].append(r)
                by_name[c.name] = r['rounds_ms']
                log('%-8s N=%-5d %-26s %8.2f ms  syncs/step %4.1f  ops/step %7.1f' % (
                    dtype, n, c.name, r['ms'], r['host_syncs_per_step'], r['ops_per_step']))
            value = ratio(by_name['lbsgd linear (routed)'], [by_name[SGD_DEFAULT]])
            out['targets'].append(dict(dtype=dtype, what='N=%d: lbsgd routed / mxnet SGD '
                                       'default' % n, value=value, target='<= 0.5',
                                       met=value <= 0.5))
            value = ratio(by_name['lbsgd linear (routed)'],
                          [by_name['lbsgd linear fused=True'], by_name['lbsgd linear fused=False']])
            out['targets'].append(dict(dtype=dtype, what='N=%d: lbsgd routed / faster lbsgd '
                                       'fused=True/False' % n, value=value, target='<= 1.05',
                                       met=value <= 1.05))
        del groups
    return out


def _resnet_run(shapes, weights, grads, dtype, rounds, steps):
    """One run of the resnet candidates, each on its own copy of `weights` (LARS_SHARED and
    NORM_ALONE on lbsgd linear's): their timings alone, so that the candidates' memory goes
    with the run."""
    own = {name: [w.copy() for w in weights] for name in RESNET_CANDIDATES
           if name not in (LARS_SHARED, NORM_ALONE)}
    own[LARS_SHARED] = own[NORM_ALONE] = own['lbsgd linear']     # (the norm reads no weight)
    cands = [bench_step.Timed(name, make, shapes, own[name], grads)
             for name, make in RESNET_CANDIDATES.items()
             if not (name == GLUONNLP and dtype == 'float16')]
    for c in cands:
        if c.name == GLUONNLP:
            _clipping_first(c, grads)
        elif c.name == NORM_ALONE:
            _norm_alone(c, grads)
    interleave(cands, rounds, steps)
    return [types.SimpleNamespace(name=c.name, rounds=c.rounds, syncs=c.syncs,
                                  launches=c.launches, steps=c.steps) for c in cands]


def resnet(dtypes, rounds, steps, lars_runs=LARS_RUNS, seed=0):
    shapes = resnet50_shapes()
    rng = np.random.RandomState(seed)
    out = {'tensors': len(shapes), 'parameters': sum(int(np.prod(s)) for _, s in shapes),
           'lars_runs': lars_runs, 'rows': [], 'targets': [], 'notes': []}
    if lars_runs < LARS_RUNS:
        out['notes'].append('--quick: %d LARS run(s), not %d' % (lars_runs, LARS_RUNS))
    for dtype in dtypes:
        weights = tensors(shapes, dtype, rng)
        grads = tensors(shapes, dtype, rng, 1e-3)
        runs = []
        _resnet_run(shapes, weights, grads, dtype, 1, steps)     # the untimed warm-up
        for run in range(lars_runs):
            runs.append(_resnet_run(shapes, weights, grads, dtype, rounds, steps))
            ms = {c.name: [r['ms'] for r in c.rounds] for c in runs[-1]}
            log('%-8s run %d: %s' % (dtype, run + 1, '  '.join(
                '%s %.1f' % (k, statistics.median(v)) for k, v in ms.items())))
        pooled = {}
        for name in RESNET_CANDIDATES:
            cs = [c for cands in runs for c in cands if c.name == name]
            if not cs:
                continue
            c = cs[0]
            c.rounds = [r for x in cs for r in x.rounds]
            c.syncs, c.launches, c.steps = (sum(x.syncs for x in cs),
                                            sum(x.launches for x in cs),
                                            sum(x.steps for x in cs))
            r = row(c, dtype=dtype)
            out['rows'].append(r)
            pooled[name] = r['rounds_ms']
        value = ratio(pooled['lbsgd linear'], [pooled[SGD_PER_TENSOR],
                                               pooled['mxnet SGD (aggregate 4)']])
        out['targets'].append(dict(dtype=dtype, what='lbsgd linear / fastest mxnet SGD',
                                   value=value, target='<= 0.6', met=value <= 0.6))
        value = ratio(pooled['lbsgd lars'], [pooled['lbsgd linear']])
        out['targets'].append(dict(dtype=dtype, what='lbsgd lars / lbsgd linear',
                                   value=value, target='<= 1.6', met=value <= 1.6))
        out['notes'].append('%s: %s / lbsgd linear = %.2f' % (
            dtype, LARS_SHARED, ratio(pooled[LARS_SHARED], [pooled['lbsgd linear']])))
        for base in ('lbsgd linear', 'lbsgd linear + loss scaler'):
            value = ratio(pooled[base + ' + clip 1.0'], [pooled[base]])
            out['targets'].append(dict(dtype=dtype, what='%s + clip 1.0 / %s' % (base, base),
                                       value=value, target='<= 1.15', met=value <= 1.15))
        linear = [pooled['lbsgd linear']]
        out['notes'].append('%s: %s / lbsgd linear = %.2f (lbsgd linear + clip 1.0 / lbsgd '
                            'linear = 1 + %.2f)' % (
                                dtype, NORM_ALONE, ratio(pooled[NORM_ALONE], linear),
                                ratio(pooled['lbsgd linear + clip 1.0'], linear) - 1))
        if GLUONNLP in pooled:
            value = ratio(pooled['lbsgd linear + clip 1.0'], [pooled[GLUONNLP]])
            out['notes'].append('%s: lbsgd linear + clip 1.0 / %s = %.2f'
                                % (dtype, GLUONNLP, value))
        for run in range(lars_runs):      # the pooled rounds are in run order
            ms = {name: pooled[name][run * rounds:(run + 1) * rounds] for name in pooled}
            faster = [min(a, b) for a, b in zip(ms['mxnet LARS'], ms['mxnet LBSGD lars'])]
            value = ratio(faster, [ms['lbsgd lars']])
            out['targets'].append(dict(dtype=dtype, what='run %d: faster mxnet lars / lbsgd '
                                       'lars' % (run + 1), value=value, target='>= 10',
                                       met=value >= 10))
        del runs, weights, grads
    return out


def loss_scale(dtypes, rounds, steps, quick, seed=0):
    models = [('small', SMALL_MODEL)]
    if not quick:
        models.append(('resnet50', resnet50_shapes()))
    names = ['plain sgd', 'lssgd (loss_scaler=%g)' % LOSS_SCALE,
             'sgd + LossScaling(%g, force=True)' % LOSS_SCALE]
    rng = np.random.RandomState(seed)
    out = {'loss_scale': LOSS_SCALE, 'rows': [], 'targets': [], 'notes': []}
    if quick:
        out['notes'].append('--quick: small model only')
    for dtype in dtypes:
        for model, shapes in models:
            w0 = [rng.uniform(-0.1, 0.1, s).astype(dtype) for _, s in shapes]
            g0 = [(rng.standard_normal(s) * 1e-3).astype(dtype) for _, s in shapes]
            cands = [TrainerStep(name, shapes, w0, g0, dtype) for name in names]
            for c in cands:                                 # untimed: states, and a check
                c.fresh()
                c.step()
            ref = cands[0].weights()
            tol = dict(rtol=1e-5, atol=1e-7) if dtype == 'float32' else dict(rtol=2e-3,
                                                                            atol=1e-5)
            for c in cands[1:]:
                for a, b in zip(c.weights(), ref):
                    np.testing.assert_allclose(a, b, err_msg=c.name, **tol)
            interleave(cands, rounds * SMALL_STEPS if model == 'small' else rounds, steps)
            by_name = {}
            for c in cands:
                r = row(c, dtype=dtype, model=model,
                        parameters=sum(int(np.prod(s)) for _, s in shapes),
                        tensors=len(shapes))
                out['rows'].append(r)
                by_name[c.name] = r['rounds_ms']
                log('%-8s %-8s %-34s %8.2f ms  syncs/step %4.1f  ops/step %6.1f' % (
                    dtype, model, c.name, r['ms'], r['host_syncs_per_step'],
                    r['ops_per_step']))
            for name, goal in zip(names[1:], (1.1, 1.15)):
                value = ratio(by_name[name], [by_name['plain sgd']])
                binding = model == 'small' and dtype == 'float32'
                out['targets'].append(dict(
                    dtype=dtype, what='%s: %s / plain sgd' % (model, name), value=value,
                    target='<= %g' % goal if binding else '-',
                    met=value <= goal if binding else None))
            del cands
    return out


# -- report --------------------------------------------------------------------------------
def _targets_table(targets):
    lines = ['', '| dtype | quantity | measured | target | met |', '|---|---|---:|---|---|']
    for t in targets:
        lines.append('| %s | %s | %.2f | %s | %s |' % (
            t['dtype'], t['what'], t['value'], t['target'],
            '-' if t['met'] is None else 'met' if t['met'] else 'NOT met'))
    return lines


def report(results):
    out = []
    s = results['sections']
    if 'sweep' in s:
        out += ['### 1. Tensor-count sweep: %d parameters in N equal tensors' % SWEEP_PARAMS,
                '', '| dtype | N | elements / tensor | optimizer | ms / step | host syncs / step'
                ' | op calls / step |', '|---|---:|---:|---|---:|---:|---:|']
        for r in s['sweep']['rows']:
            out.append('| %s | %d | %d | %s | %.2f | %g | %g |' % (
                r['dtype'], r['tensors'], r['elements_per_tensor'], r['optimizer'], r['ms'],
                r['host_syncs_per_step'], r['ops_per_step']))
        out += _targets_table(s['sweep']['targets'])
        out += ['Note: %s' % n for n in s['sweep']['notes']] + ['']
    if 'resnet' in s:
        r0 = s['resnet']
        out += ['### 2. ResNet-50 v1 shapes: %d tensors, %d parameters (rounds of %d run(s) pooled)'
                % (r0['tensors'], r0['parameters'], r0['lars_runs']), '',
                '| dtype | optimizer | ms / step | host syncs / step | op calls / step |',
                '|---|---|---:|---:|---:|']
        for r in r0['rows']:
            out.append('| %s | %s | %.1f | %g | %g |' % (
                r['dtype'], r['optimizer'], r['ms'], r['host_syncs_per_step'],
                r['ops_per_step']))
        out += _targets_table(r0['targets'])
        out += ['Note: %s' % n for n in r0['notes']] + ['']
    if 'loss-scale' in s:
        out += ['### 3. Loss-scaled gluon.Trainer step (loss scale %g)' % LOSS_SCALE, '',
                '| dtype | model | candidate | ms / step | host syncs / step | op calls / step |',
                '|---|---|---|---:|---:|---:|']
        for r in s['loss-scale']['rows']:
            out.append('| %s | %s (%d tensors, %d params) | %s | %.2f | %g | %g |' % (
                r['dtype'], r['model'], r['tensors'], r['parameters'], r['optimizer'],
                r['ms'], r['host_syncs_per_step'], r['ops_per_step']))
        out += _targets_table(s['loss-scale']['targets'])
        out += ['Note: %s' % n for n in s['loss-scale']['notes']] + ['']
    return '\n'.join(out)


def plot(sweep_results, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    dtypes = list(dict.fromkeys(r['dtype'] for r in sweep_results['rows']))
    colors = dict(zip(SWEEP_CANDIDATES, ['C0', 'C1', 'C3', 'C2', 'C4']))
    for dtype, style in zip(dtypes, ['-', '--']):
        for name in SWEEP_CANDIDATES:
            rows = [r for r in sweep_results['rows']
                    if r['dtype'] == dtype and r['optimizer'] == name]
            ax.plot([r['tensors'] for r in rows], [r['ms'] for r in rows], style, marker='o',
                    color=colors[name], label='%s, %s' % (name, dtype))
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('tensors (%d parameters split evenly)' % SWEEP_PARAMS)
    ax.set_ylabel('ms / step (median of interleaved rounds)')
    ax.set_title('Optimizer step time vs tensor count (CPU, momentum 0.9, wd 1e-4)')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None, prog=None):
    parser = Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=number(int, 1), default=5,
                        help='interleaved rounds per measurement (sweep: 2 steps each; '
                             'resnet: 1 step, in each of the 3 LARS runs; loss-scale: 2 '
                             'steps, and 10x the rounds on the small model)')
    parser.add_argument('--quick', action='store_true',
                        help='float32 unless --dtypes is given; at most 2 rounds of 1 step '
                             '(resnet: 1 round, 1 LARS run); loss-scale on the small model '
                             'only')
    parser.add_argument('--dtypes', nargs='+', choices=['float32', 'float16'],
                        help='default: float32 float16 (--quick: float32)')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--plot', metavar='FILE.png',
                        help='also plot ms/step vs tensor count into FILE.png (needs the '
                             'sweep section and matplotlib; default: no plot)')
    parser.add_argument('--only', choices=SECTIONS, help='run one section only')
    args = parser.parse_args(argv)
    if args.plot:
        if args.only not in (None, 'sweep'):
            parser.error('argument --plot: needs the sweep section, but --only is %s'
                         % args.only)
        try:
            require_demo(parser.prog, ('matplotlib',), what='--plot')
            require_plot_file(parser.prog, '--plot', args.plot)
        except UsageError as err:
            parser.exit(2, '%s\n' % err)
    check_output_option(parser, '--json', args.json)
    dtypes = args.dtypes or (['float32'] if args.quick else ['float32', 'float16'])
    # (rounds, steps per round) by section; resnet: rounds per LARS run, 1 step each
    quick = min(args.rounds, 2)
    plan = {'sweep': (quick, 1) if args.quick else (args.rounds, 2),
            'resnet': (1, 1) if args.quick else (args.rounds, 1),
            'loss-scale': (quick, 1) if args.quick else (args.rounds, 2)}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    results = {'dtypes': dtypes, 'quick': args.quick,
               'argv': sys.argv[1:] if argv is None else list(argv),
               'plan': {k: {'rounds': r, 'steps_per_round': n} for k, (r, n) in plan.items()},
               'sections': {}, 'seconds': {}}
    results['plan']['loss-scale']['rounds_small_model'] = \
        plan['loss-scale'][0] * SMALL_STEPS
    for section in [args.only] if args.only else SECTIONS:
        begin = time.perf_counter()
        rounds, steps = plan[section]
        if section == 'sweep':
            results['sections'][section] = sweep(dtypes, rounds, steps)
        elif section == 'resnet':
            results['sections'][section] = resnet(dtypes, rounds, steps,
                                                  1 if args.quick else LARS_RUNS)
        else:
            results['sections'][section] = loss_scale(dtypes, rounds, steps, args.quick)
        results['seconds'][section] = round(time.perf_counter() - begin, 1)
    results['machine'] = bench_step.machine(
        loadavg_1min_start_end=[load, os.getloadavg()[0]],
        seconds=round(time.perf_counter() - start, 1))
    print(report(results))
    print('machine: %s; seconds by section: %s' % (results['machine'], results['seconds']))
    bench_step.save_json(args.json, results, parser.prog)     # the numbers first
    if args.plot and 'sweep' in results['sections']:
        try:
            plot(results['sections']['sweep'], args.plot)
        except OSError as err:
            parser.exit(2, '%s: error: argument --plot: could not write %s (%s); the '
                        'tables above%s have the numbers\n' % (
                            parser.prog, args.plot, err.strerror or err,
                            ' and %s' % args.json if args.json else ''))
        print('plot: %s' % args.plot)
    return results


if __name__ == '__main__':
    main()
