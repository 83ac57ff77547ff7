"""Optimizer step time on ResNet-50's parameter shapes, against MXNet's own optimizers.

Every optimizer runs in this one process through MXNet's Updater (as Gluon and Module call
it) on the same weights and gradients. Each step is timed with the engine drained
after it. The optimizers take turns, round after round, and every ratio is the median over
rounds of the ratio within a round, so that the drift of a shared machine cancels out.
Host syncs and operator calls (kernel launches on a GPU) are counted per step.

    mx-lbsgd bench --step [--dtypes float32 float16] [--rounds 8] [--json out.json]
    python -m mx_lbsgd_bench.bench_step ...     (or python benchmarks/bench_step.py ...)
"""
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import mxnet as mx

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from mx_lbsgd_demo.args import Parser, UsageError, check_output_option, number, write_or_keep

__all__ = ['resnet50_shapes', 'set_gradients', 'machine', 'save_json', 'run', 'main']


def resnet50_shapes():
    net = mx.gluon.model_zoo.vision.resnet50_v1()
    net.initialize()
    net(mx.nd.zeros((1, 3, 224, 224)))
    return [(p.name, p.shape) for p in net.collect_params().values() if p.grad_req != 'null']


def set_gradients(params, grads):
    """Make each Parameter's gradient equal `grads[i]` (NDArrays, dense or the (indices,
    values) of a row_sparse gradient) through a backward pass, which marks it fresh for
    Trainer.step as a training step's backward would."""
    with mx.autograd.record():
        terms = []
        for p, g in zip(params, grads):
            if isinstance(g, tuple):       # row_sparse: an Embedding lookup of those rows
                rows, values = g
                looked_up = mx.nd.Embedding(rows, p.data(), input_dim=p.shape[0],
                                            output_dim=p.shape[1], sparse_grad=True)
                terms.append((looked_up * values).sum())
            else:
                terms.append((p.data() * g).sum())
        total = mx.nd.add_n(*terms) if len(terms) > 1 else terms[0]
    total.backward()


SGD_PATHS = ['mxnet SGD (per-tensor)', 'mxnet SGD (aggregate 4)']


def candidates(momentum=0.9):
    common = dict(learning_rate=0.1, momentum=momentum, wd=1e-4)
    lb = dict(common, warmup_epochs=1, updates_per_epoch=100)

    def sgd(aggregate):
        def make(mp):
            opt = mx.optimizer.SGD(multi_precision=mp, **common)
            opt.aggregate_num = aggregate
            return opt
        return make

    def mxnet_lars(mp):
        opt = mx.optimizer.LARS(multi_precision=mp, momentum_correction=False, **common)
        opt.aggregate_num = 4
        return opt

    def ours(strategy, fused=False, batch_scale=1):
        return lambda mp: mx_lbsgd.LBSGD(warmup_strategy=strategy, multi_precision=mp,
                                         fused=fused, batch_scale=batch_scale, **lb)

    def builtin(strategy, batch_scale=1):
        return lambda mp: mx_lbsgd.MXNET_LBSGD(warmup_strategy=strategy, multi_precision=mp,
                                               batch_scale=batch_scale, **lb)
    return {
        'mxnet SGD (per-tensor)': sgd(0),
        'mxnet SGD (aggregate 4)': sgd(4),
        'mxnet LBSGD linear': builtin('linear'),
        'mxnet LBSGD lars': builtin('lars'),
        'mxnet LARS': mxnet_lars,
        'lbsgd linear': ours('linear'),
        'lbsgd power2': ours('power2'),
        'lbsgd sqrt': ours('sqrt'),
        'lbsgd lars': ours('lars'),
        'lbsgd linear (fused)': ours('linear', fused=True),
        'lbsgd lars (fused)': ours('lars', fused=True),
        'lbsgd linear B=4': ours('linear', batch_scale=4),
        'mxnet LBSGD linear B=4': builtin('linear', batch_scale=4),
    }


class Timed:
    """One optimizer with its own Updater (states) on the shared weights and gradients."""

    def __init__(self, name, make, shapes, weights, grads):
        self.name = name
        self.window = 4 if 'B=4' in name else 1
        opt = make(weights[0].dtype == np.float16)
        opt.idx2name = {i: n for i, (n, _) in enumerate(shapes)}
        opt.set_wd_mult({})
        self.updater = mx.optimizer.get_updater(opt)
        self.args = (list(range(len(shapes))), grads, weights)
        self.updater(*self.args)            # creates the states: micro-step 1, not timed
        mx.nd.waitall()
        self.rounds, self.syncs, self.launches, self.steps = [], 0, 0, 0

    def round(self, steps):
        """Time `steps` steps (B=4: micro-steps 2..5 of a window, so update at index 2)."""
        times = []
        for _ in range(4 if self.window == 4 else steps):
            with count_host_syncs(include_waitall=False) as calls, \
                    count_kernel_launches() as launches:
                start = time.perf_counter()
                self.updater(*self.args)
                mx.nd.waitall()
                times.append(1e3 * (time.perf_counter() - start))
            self.syncs += len(calls)
            self.launches += len(launches)
            self.steps += 1
        if self.window == 4:
            self.rounds.append({'ms': times[2], 'accumulate_ms': statistics.median(
                [t for i, t in enumerate(times) if i != 2])})
        else:
            self.rounds.append({'ms': statistics.median(times)})

    def row(self, dtype):
        row = {'dtype': dtype, 'optimizer': self.name,
               'host_syncs_per_step': self.syncs / self.steps,
               'launches_per_step': self.launches / self.steps, 'rounds': self.rounds}
        for key in self.rounds[0]:
            row[key] = statistics.median(r[key] for r in self.rounds)
        return row


def run(dtypes, rounds, names=None, steps_per_round=2, seed=0):
    """Candidates take turns, round after round, so that drift hits them all alike."""
    shapes = resnet50_shapes()
    results = {'tensors': len(shapes), 'parameters': sum(int(np.prod(s)) for _, s in shapes),
               'rounds': rounds, 'rows': []}
    rng = np.random.RandomState(seed)
    for dtype in dtypes:
        weights = [mx.nd.array(rng.uniform(-0.1, 0.1, s), dtype=dtype) for _, s in shapes]
        grads = [mx.nd.array(rng.uniform(-1e-3, 1e-3, s), dtype=dtype) for _, s in shapes]
        timed = [Timed(name, make, shapes, weights, grads)
                 for name, make in candidates().items() if not names or name in names]
        for _ in range(rounds):
            for t in timed:
                t.round(steps_per_round)
        for t in timed:
            row = t.row(dtype)
            results['rows'].append(row)
            print('%-8s %-26s %8.1f ms  syncs/step %5.1f  ops/step %6.1f%s' % (
                dtype, t.name, row['ms'], row['host_syncs_per_step'], row['launches_per_step'],
                '  accumulate %.1f ms' % row['accumulate_ms'] if 'accumulate_ms' in row
                else ''), file=sys.stderr, flush=True)
        del timed
    return results


RATIOS = [  # (label, numerator(s), denominator(s)); several names: the fastest that round
    ('linear / fastest mxnet SGD', ['lbsgd linear'], SGD_PATHS),
    ('power2 / fastest mxnet SGD', ['lbsgd power2'], SGD_PATHS),
    ('sqrt / fastest mxnet SGD', ['lbsgd sqrt'], SGD_PATHS),
    ('faster mxnet lars / lbsgd lars', ['mxnet LARS', 'mxnet LBSGD lars'], ['lbsgd lars']),
    ('B=4 accumulate step / full step', ['lbsgd linear B=4:accumulate_ms'], ['lbsgd linear']),
    ('mxnet LBSGD B=4 accumulate / lbsgd B=4 accumulate',
     ['mxnet LBSGD linear B=4:accumulate_ms'], ['lbsgd linear B=4:accumulate_ms']),
]


def ratios(results):
    """The issue's targets as medians over rounds of within-round ratios."""
    out = {}
    for dtype in sorted({r['dtype'] for r in results['rows']}):
        rows = {r['optimizer']: r for r in results['rows'] if r['dtype'] == dtype}

        def fastest(names, i):
            values = []
            for spec in names:
                name, _, key = spec.partition(':')
                if name in rows:
                    values.append(rows[name]['rounds'][i][key or 'ms'])
            return min(values) if values else float('nan')
        n_rounds = min(len(r['rounds']) for r in rows.values())
        out[dtype] = {label: statistics.median(fastest(num, i) / fastest(den, i)
                                               for i in range(n_rounds))
                      for label, num, den in RATIOS}
    return out


def table(results, targets):
    lines = ['| dtype | optimizer | ms / step | host syncs / step | op calls / step |',
             '|---|---|---:|---:|---:|']
    for r in results['rows']:
        extra = (' (accumulate-only step: %.1f ms)' % r['accumulate_ms']
                 if 'accumulate_ms' in r else '')
        lines.append('| %s | %s | %.1f%s | %g | %g |' % (
            r['dtype'], r['optimizer'], r['ms'], extra, r['host_syncs_per_step'],
            r.get('launches_per_step', float('nan'))))
    lines += ['', '| dtype | ratio | measured |', '|---|---|---:|']
    for dtype, values in targets.items():
        for key, value in values.items():
            lines.append('| %s | %s | %.2f |' % (dtype, key, value))
    return '\n'.join(lines)


def main(argv=None, prog=None):
    parser = Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument('--dtypes', nargs='+', default=['float32', 'float16'],
                        choices=['float32', 'float16'])
    parser.add_argument('--rounds', type=number(int, 1), default=8,
                        help='rounds; each optimizer times 2 steps (B=4: 4) per round')
    parser.add_argument('--only', nargs='+', choices=list(candidates()), metavar='NAME',
                        help='optimizer names to run (default: all): %s'
                             % ', '.join(repr(n) for n in candidates()))
    parser.add_argument('--json', help='write the results here')
    args = parser.parse_args(argv)
    check_output_option(parser, '--json', args.json)
    results = run(args.dtypes, args.rounds, args.only)
    results['ratios'] = ratios(results)
    results['machine'] = machine()
    print('machine: %s' % results['machine'])
    print('ResNet-50 v1: %d tensors, %d parameters' % (results['tensors'],
                                                       results['parameters']))
    print(table(results, results['ratios']))
    save_json(args.json, results, parser.prog)
    return results


def machine(**extra):
    """What the numbers were measured on: CPU model and cores, Python, the MXNet build and
    whether mx_lbsgd's native CPU operators are in use."""
    features = mx.runtime.Features()
    build = 'MXNet %s %s wheel' % (mx.__version__,
                                  'CUDA' if features.is_enabled('CUDA') else 'CPU')
    return dict({'cpu': cpu_model(), 'cpus': os.cpu_count(), 'python': platform.python_version(),
                 'mxnet': mx.__version__, 'build': build,
                 'native_operators': mx_lbsgd.native_library() is not None,
                 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS')}, **extra)


def cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            return next(line.split(':', 1)[1].strip() for line in f
                        if line.startswith('model name'))
    except (OSError, StopIteration):
        return platform.processor() or 'unknown CPU'


def save_json(path, results, prog='benchmark'):
    """Write `results` to `path` (if given). If that fails after all (--json is checked
    before the benchmark runs), the results go to a temporary file and the benchmark exits
    with status 2 and one line naming both files."""
    if not path:
        return

    def write(target):
        with open(target, 'w') as f:
            json.dump(results, f, indent=1)
    try:
        write_or_keep(prog, '--json', path, write, '.json')
    except UsageError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == '__main__':
    main()
