"""Optimizer step on a 1M x 64 embedding with 1% of the rows in a row_sparse gradient.

lbsgd (lazy) against mx.optimizer.SGD (lazy), and batch_scale=4 accumulation in a row_sparse
buffer (memory and time proportional to the rows touched) against a dense fp32 buffer (what
an accumulator of the weight's shape costs). Interleaved rounds; ratio = median over rounds
of the within-round ratio.

    python -m mx_lbsgd_bench.bench_sparse [--rounds 7] [--rows 1000000] [--json out.json]
    python benchmarks/bench_sparse.py ...
"""
import json
import statistics
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import gluon, nd

import mx_lbsgd  # noqa: F401  (registers 'lbsgd')
from mx_lbsgd_demo.args import Parser, check_output_option, number
from . import bench_step
from .bench_step import set_gradients

__all__ = ['main']


def make_grads(rows, dim, touched, count, seed=0):
    """`count` row_sparse gradients as (row indices, values): `touched` distinct rows."""
    rng = np.random.RandomState(seed)
    grads = []
    for _ in range(count):
        idx = np.sort(rng.choice(rows, touched, replace=False))
        vals = rng.uniform(-1, 1, (touched, dim)).astype(np.float32)
        grads.append((nd.array(idx), nd.array(vals)))
    return grads


class Variant:
    def __init__(self, name, optimizer, params, rows, dim, grad_stype):
        self.name = name
        param = gluon.Parameter('emb_weight', shape=(rows, dim), grad_stype=grad_stype)
        param.initialize(mx.init.Uniform(0.1))
        self.trainer = gluon.Trainer([param], optimizer, params, kvstore=None)
        self.param = param
        self.times = []

    def step(self, grad):
        set_gradients([self.param], [grad])      # untimed, as backward leaves it
        nd.waitall()
        start = time.perf_counter()
        self.trainer.step(1)
        nd.waitall()
        return 1e3 * (time.perf_counter() - start)


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument('--rows', type=number(int, 1), default=1000000)
    p.add_argument('--dim', type=number(int, 1), default=64)
    p.add_argument('--touched', type=number(float, 0, 1, open_low=True), default=0.01)
    p.add_argument('--rounds', type=number(int, 1), default=7)
    p.add_argument('--json')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    touched = int(args.rows * args.touched)
    grads = make_grads(args.rows, args.dim, touched, 8)
    lazy = dict(learning_rate=0.1, momentum=0.9, wd=1e-4)
    variants = [Variant('mxnet SGD lazy', 'sgd', lazy, args.rows, args.dim, 'row_sparse'),
                Variant('lbsgd lazy', 'lbsgd', lazy, args.rows, args.dim, 'row_sparse'),
                Variant('lbsgd B=4 row_sparse buffer', 'lbsgd', dict(lazy, batch_scale=4),
                        args.rows, args.dim, 'row_sparse')]
    dense_acc = nd.zeros((args.rows, args.dim))
    sparse = [nd.sparse.row_sparse_array((vals, idx.astype('int64')), shape=(args.rows, args.dim))
              for idx, vals in grads[:3]]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for v in variants:
            ms = [v.step(g) for g in grads[:4]]
            row[v.name] = statistics.median(ms)
            if 'B=4' in v.name:
                row[v.name + ' accumulate'] = statistics.median(ms[:3])
        start = time.perf_counter()            # the dense alternative: a dense fp32 buffer
        for g in sparse[:3]:
            nd.sgd_update(dense_acc, g, out=dense_acc, lr=-1.0, wd=0.0, lazy_update=True)
        nd.waitall()
        row['dense buffer accumulate'] = 1e3 * (time.perf_counter() - start) / 3
        rounds.append(row)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = statistics.median(r['lbsgd lazy'] / r['mxnet SGD lazy'] for r in rounds)
    acc_ratio = statistics.median(r['lbsgd B=4 row_sparse buffer accumulate']
                                  / r['dense buffer accumulate'] for r in rounds)
    mb_sparse = touched * 4 * args.dim * 4 / 1e6      # at most 4 micro-batches of rows
    mb_dense = args.rows * args.dim * 4 / 1e6
    machine = bench_step.machine()
    print('machine: %s' % machine)
    print('| variant | ms / step |')
    print('|---|---:|')
    for k, v in med.items():
        print('| %s | %.2f |' % (k, v))
    print('\nlbsgd lazy / mxnet SGD lazy: %.2f (target <= 1.1)' % ratio)
    print('B=4 accumulate, row_sparse buffer / dense buffer: %.2f; buffer memory %.1f MB '
          '(at most) vs %.1f MB' % (acc_ratio, mb_sparse, mb_dense))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'machine': machine, 'args': vars(args), 'median_ms': med, 'ratio_lazy': ratio,
                       'ratio_accumulate': acc_ratio, 'rounds': rounds}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
