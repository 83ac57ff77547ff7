"""The reductions of an optimizer step on CPU: sums of squares (the norms LARS, LAMB and
the noise-scale monitor need), the package's native operator against MXNet's
``multi_sum_sq`` and ``norm``; and the finite check of a loss-scaled step with its one host
read, the native ``mx_lbsgd_all_finite`` against MXNet's ``multi_all_finite`` and
``all_finite``, and the package's loss-scale decision (``mx_lbsgd.loss_scaling.decide``:
with the native library the check runs on the calling thread, with no operator).

ResNet-50 v1's 193 trainable tensors (25.6M parameters), float32 and float16, and for the
finite check also the 20-tensor small model of bench_shapes (96,960 parameters); the
candidates take turns round after round, each call timed with the engine drained after it;
medians.

    python -m mx_lbsgd_bench.bench_norms [--rounds 10] [--json F]
    python benchmarks/bench_norms.py ...
"""
import statistics
import time

import numpy as np
import mxnet as mx

import mx_lbsgd
from mx_lbsgd.loss_scaling import decide
from mx_lbsgd_demo.args import Parser, check_output_option, number
from .bench_shapes import SMALL_MODEL
from .bench_step import machine, resnet50_shapes, save_json

__all__ = ['run', 'main']


def _native_functions():
    """The native operators as ``mx.nd`` functions, or False when the library is not built.
    The package keeps its operator functions to itself (so ``contrib.amp`` keeps its
    wrappers); this benchmark calls them directly, so it registers them in ``mx.nd`` with
    MXNet's public ``mx.library.load`` (which regenerates ``mx.nd``: fine in a benchmark)."""
    path = mx_lbsgd.native_library()
    if path is None:
        return False
    if not hasattr(mx.nd, 'mx_lbsgd_sum_sq'):
        mx.library.load(path, verbose=False)
    return True


def _sums_of_squares(arrays):
    n = len(arrays)
    cands = {'mxnet multi_sum_sq': lambda: [mx.nd.multi_sum_sq(*arrays[i:i + 60],
                                                               num_arrays=len(arrays[i:i + 60]))
                                            for i in range(0, n, 60)],
             'mxnet norm (per tensor)': lambda: [a.norm() for a in arrays]}
    if _native_functions():
        cands['native mx_lbsgd_sum_sq'] = lambda: mx.nd.mx_lbsgd_sum_sq(*arrays, num_arrays=n)
    return cands


def _finite_checks(arrays):
    """Each candidate ends with the host read a loss-scaled step makes of its flag."""
    n = len(arrays)

    def multi():
        flag = mx.nd.empty((1,))
        for i in range(0, n, 200):
            chunk = arrays[i:i + 200]
            mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=i == 0, out=flag)
        return flag.asnumpy()

    def single():
        flag = mx.nd.empty((1,))
        for i, a in enumerate(arrays):
            mx.nd.all_finite(a, init_output=i == 0, out=flag)
        return flag.asnumpy()

    cands = {'mxnet multi_all_finite + read': multi, 'mxnet all_finite (per tensor) + read':
             single}
    if _native_functions():
        cands['native mx_lbsgd_all_finite + read'] = \
            lambda: mx.nd.mx_lbsgd_all_finite(*arrays, num_arrays=n).asnumpy()
    # the loss-scale decision as the optimizers and the hook make it: with the native
    # library, the check on the host thread once the arrays are written (no operator)
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=1.0, growth_interval=10 ** 9)
    cands['mx_lbsgd decide (check + read)'] = lambda: decide(scaler, arrays, None)
    return cands


def _time(cands, rounds):
    times = {name: [] for name in cands}
    for _ in range(rounds + 1):              # the first round warms up
        for name, call in cands.items():
            start = time.perf_counter()
            call()
            mx.nd.waitall()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(ts[1:]) for name, ts in times.items()}


def run(rounds, seed=0):
    rng = np.random.RandomState(seed)
    models = [('resnet50', [s for _, s in resnet50_shapes()]),
              ('small', [s for _, s in SMALL_MODEL])]
    results = []
    for model, shapes in models:
        for dtype in ('float32', 'float16'):
            arrays = [mx.nd.array(rng.uniform(-1, 1, s), dtype=dtype) for s in shapes]
            nbytes = sum(a.size for a in arrays) * np.dtype(dtype).itemsize
            work = [('finite check', _finite_checks(arrays))]
            if model == 'resnet50':
                work.insert(0, ('sum of squares', _sums_of_squares(arrays)))
            for what, cands in work:
                for name, ms in _time(cands, rounds).items():
                    results.append(dict(model=model, tensors=len(shapes), dtype=dtype,
                                        what=what, name=name, ms=ms,
                                        gb_per_s=nbytes / ms / 1e6))
    return dict(machine=machine(), models={m: dict(tensors=len(s), parameters=int(
        sum(np.prod(x) for x in s))) for m, s in models}, results=results)


def main(argv=None):
    p = Parser(prog='bench_norms', description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=number(int, 1), default=10)
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    if args.rounds < 1:
        p.error('argument --rounds: must be >= 1, got %d' % args.rounds)
    out = run(args.rounds)
    print(out['machine'])
    for model, size in out['models'].items():
        print('%s: %d tensors, %d parameters' % (model, size['tensors'], size['parameters']))
    print('median of %d rounds' % args.rounds)
    print('%-9s %-8s %-15s %-38s %9s %8s' % ('model', 'dtype', 'what', 'candidate', 'ms',
                                             'GB/s'))
    for r in out['results']:
        print('%-9s %-8s %-15s %-38s %9.2f %8.2f' % (r['model'], r['dtype'], r['what'],
                                                    r['name'], r['ms'], r['gb_per_s']))
    save_json(args.json, out)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
