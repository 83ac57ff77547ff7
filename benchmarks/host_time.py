"""The host time of the update path, for comparing two checkouts side by side.

``python benchmarks/host_time.py [--checkout DIR] [--steps N]`` times, in one process:

- ``'lbsgd'`` (linear warmup, the routed path) on 4,000,000 float32 parameters in 3,000
  tensors through MXNet's Updater: the host time of the call (until it returns; the
  operators it pushed run on MXNet's engine) and the wall time with the engine drained;
- the loss-scaled Trainer step of `mx_lbsgd_bench.bench_shapes`' small model (20 tensors,
  97k parameters): plain ``'sgd'``, ``'lssgd'`` and ``'sgd'`` under ``LossScaling``,
  interleaved step by step, median wall and host times.

It prints one JSON line. ``--checkout DIR`` measures the package in DIR (another clone or
worktree, e.g. the previous commit) instead of this one; run the two alternately, a few
times each, on a quiet machine.
"""
import argparse
import json
import os
import statistics
import sys
import time


def _sweep_n3000(mx, np, steps):
    n = 3000
    rng = np.random.RandomState(0)
    size = 4000000 // n
    weights = [mx.nd.array(rng.uniform(-0.1, 0.1, size).astype('float32')) for _ in range(n)]
    grads = [mx.nd.array((rng.standard_normal(size) * 1e-3).astype('float32'))
             for _ in range(n)]
    opt = mx.optimizer.create('lbsgd', learning_rate=0.1, momentum=0.9, wd=1e-4,
                              warmup_strategy='linear', warmup_epochs=5,
                              updates_per_epoch=100)
    opt.idx2name = {i: 't%d_weight' % i for i in range(n)}
    updater = mx.optimizer.get_updater(opt)
    index = list(range(n))
    for _ in range(10):
        updater(index, grads, weights)
        mx.nd.waitall()
    host, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        updater(index, grads, weights)
        returned = time.perf_counter()
        mx.nd.waitall()
        host.append(1e3 * (returned - start))
        wall.append(1e3 * (time.perf_counter() - start))
    return {'n3000 host ms': statistics.median(host), 'n3000 wall ms': statistics.median(wall)}


def _small_model(mx, np, steps):
    from mx_lbsgd_bench import bench_shapes
    rng = np.random.RandomState(0)
    shapes = bench_shapes.SMALL_MODEL
    w0 = [rng.uniform(-0.1, 0.1, s).astype('float32') for _, s in shapes]
    g0 = [(rng.standard_normal(s) * 1e-3).astype('float32') for _, s in shapes]
    scale = bench_shapes.LOSS_SCALE
    names = ['plain sgd', 'lssgd (loss_scaler=%g)' % scale,
             'sgd + LossScaling(%g, force=True)' % scale]
    cands = [bench_shapes.TrainerStep(name, shapes, w0, g0, 'float32') for name in names]
    for c in cands:
        for _ in range(50):
            c.fresh()
            c.step()
            mx.nd.waitall()
    wall = {c.name: [] for c in cands}
    host = {c.name: [] for c in cands}
    for _ in range(steps):
        for c in cands:
            c.fresh()
            mx.nd.waitall()
            start = time.perf_counter()
            c.step()
            returned = time.perf_counter()
            mx.nd.waitall()
            host[c.name].append(1e3 * (returned - start))
            wall[c.name].append(1e3 * (time.perf_counter() - start))
    out = {}
    for name in names:
        out['small %s wall ms' % name] = statistics.median(wall[name])
        out['small %s host ms' % name] = statistics.median(host[name])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--checkout', help='the checkout to measure (default: this one)')
    parser.add_argument('--steps', type=int, default=1500,
                        help='small-model steps of each candidate (default 1500; the '
                             'N = 3000 step runs a tenth, at least 30)')
    args = parser.parse_args(argv)
    root = args.checkout or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.abspath(root))
    import numpy as np
    import mxnet as mx
    import mx_lbsgd
    result = {'checkout': os.path.abspath(root),
              'package': os.path.dirname(os.path.abspath(mx_lbsgd.__file__))}
    result.update(_sweep_n3000(mx, np, max(30, args.steps // 10)))
    result.update(_small_model(mx, np, args.steps))
    print(json.dumps(result))


if __name__ == '__main__':
    main()
