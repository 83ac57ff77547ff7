"""Sums of squares (the norms LARS, LAMB and the noise-scale monitor need) on CPU: the
package's native operator against MXNet's ``multi_sum_sq`` and ``norm``.

ResNet-50 v1's 193 trainable tensors (25.6M parameters), float32 and float16; the candidates
take turns round after round, each call timed with the engine drained after it; medians.

    python -m mx_lbsgd.demo.bench_norms [--rounds 10] [--json F]
    python benchmarks/bench_norms.py ...
"""
import argparse
import statistics
import time

import numpy as np
import mxnet as mx

import mx_lbsgd
from mx_lbsgd.demo.bench_step import machine, resnet50_shapes, save_json

__all__ = ['run', 'main']


def _candidates(arrays):
    n = len(arrays)
    cands = {'mxnet multi_sum_sq': lambda: [mx.nd.multi_sum_sq(*arrays[i:i + 60],
                                                               num_arrays=len(arrays[i:i + 60]))
                                            for i in range(0, n, 60)],
             'mxnet norm (per tensor)': lambda: [a.norm() for a in arrays]}
    if mx_lbsgd.native_library() is not None:
        cands['native mx_lbsgd_sum_sq'] = lambda: mx.nd.mx_lbsgd_sum_sq(*arrays, num_arrays=n)
    return cands


def run(rounds, seed=0):
    rng = np.random.RandomState(seed)
    shapes = [s for _, s in resnet50_shapes()]
    results = []
    for dtype in ('float32', 'float16'):
        arrays = [mx.nd.array(rng.uniform(-1, 1, s), dtype=dtype) for s in shapes]
        nbytes = sum(a.size for a in arrays) * np.dtype(dtype).itemsize
        cands = _candidates(arrays)
        times = {name: [] for name in cands}
        for _ in range(rounds + 1):              # the first round warms up
            for name, call in cands.items():
                start = time.perf_counter()
                call()
                mx.nd.waitall()
                times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts[1:])
            results.append(dict(dtype=dtype, name=name, ms=ms, gb_per_s=nbytes / ms / 1e6))
    return dict(machine=machine(), tensors=len(shapes),
                parameters=int(sum(np.prod(s) for s in shapes)), results=results)


def main(argv=None):
    p = argparse.ArgumentParser(prog='bench_norms', description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=10)
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error('argument --rounds: must be >= 1, got %d' % args.rounds)
    out = run(args.rounds)
    print(out['machine'])
    print('%d tensors, %d parameters; median of %d rounds' % (out['tensors'], out['parameters'],
                                                              args.rounds))
    print('%-8s %-26s %9s %8s' % ('dtype', 'sum of squares', 'ms', 'GB/s'))
    for r in out['results']:
        print('%-8s %-26s %9.1f %8.1f' % (r['dtype'], r['name'], r['ms'], r['gb_per_s']))
    save_json(args.json, out)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
