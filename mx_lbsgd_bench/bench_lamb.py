"""LAMB step time on BERT-like shapes, against MXNet's own LAMB, Adam and SGD.

52 tensors shaped like a 4-layer BERT (hidden 768, vocabulary 30522; 52M parameters). Every
optimizer runs in this one process through MXNet's Updater on the same weights and
gradients; the optimizers take turns round after round, each step is timed with the engine
drained after it, and every ratio is the median over rounds of the ratio within a round.
Host syncs are counted per step. `'lblamb'` at its defaults runs the package's native CPU
operator when ``pip install`` built it (``native`` in the output says whether it did);
``fused=True``/``False`` force MXNet's multi-tensor and per-tensor LAMB operators.

Clipping: each ``+ clip 1.0`` candidate is the one before it with ``max_grad_norm=1.0``
(``/ unclipped`` is its ratio to that one; goal <= 1.10), and ``GluonNLP clip + mxnet LAMB``
is the GluonNLP recipe: ``gluon.utils.clip_global_norm(grads, 1.0)`` (its own copy of the
gradients), then MXNet's LAMB; float32 only (clip_global_norm squares with ``dot``, which
has no float16 kernel on CPU).

    python -m mx_lbsgd_bench.bench_lamb [--rounds 5] [--dtypes float32 float16] [--json F]
    python benchmarks/bench_lamb.py ...
"""
import statistics
import time

import numpy as np
import mxnet as mx

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from mxnet import gluon

from mx_lbsgd_demo.args import Parser, check_output_option, number
from .bench_step import machine, save_json

__all__ = ['bert_shapes', 'run', 'main']


def bert_shapes(layers=4, hidden=768, vocab=30522, ffn=3072, positions=512):
    """(name, shape) of a BERT encoder's big tensors: the embeddings, then per layer the
    attention and feed-forward weights and biases (LayerNorms left out: 52 tensors)."""
    shapes = [('word_embed_weight', (vocab, hidden)), ('pos_embed_weight', (positions, hidden)),
              ('type_embed_weight', (2, hidden)), ('embed_ln_gamma', (hidden,))]
    for i in range(layers):
        for name, shape in (('q', (hidden, hidden)), ('k', (hidden, hidden)),
                            ('v', (hidden, hidden)), ('o', (hidden, hidden)),
                            ('ffn1', (ffn, hidden)), ('ffn2', (hidden, ffn))):
            shapes.append(('l%d_%s_weight' % (i, name), shape))
            shapes.append(('l%d_%s_bias' % (i, name), (shape[0],)))
    return shapes


def _candidates():
    common = dict(learning_rate=1e-3, wd=0.01)

    def mxnet_lamb(aggregate):
        def make(mp):
            opt = mx.optimizer.LAMB(multi_precision=mp, **common)
            if aggregate == 1:
                opt.aggregate_num = 1
            return opt
        return make
    return {
        'mxnet LAMB (multi_lamb_update)': mxnet_lamb(None),
        'mxnet LAMB (aggregate_num=1)': mxnet_lamb(1),
        'mxnet Adam': lambda mp: mx.optimizer.Adam(multi_precision=mp, **common),
        'mxnet SGD momentum': lambda mp: mx.optimizer.SGD(momentum=0.9, multi_precision=mp,
                                                          **common),
        'lblamb (default: native)': lambda mp: mx_lbsgd.LAMB(multi_precision=mp, **common),
        'lblamb (default: native)' + CLIP: lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, max_grad_norm=1.0, **common),
        'lblamb + loss scaler': lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, loss_scaler=mx_lbsgd.DynamicLossScaler(), **common),
        'lblamb + loss scaler' + CLIP: lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, loss_scaler=mx_lbsgd.DynamicLossScaler(), max_grad_norm=1.0,
            **common),
        'lblamb fused=True (MXNet ops)': lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, fused=True, **common),
        'lblamb fused=True (MXNet ops)' + CLIP: lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, fused=True, max_grad_norm=1.0, **common),
        GLUONNLP: mxnet_lamb(None),
        'lblamb fused=False (MXNet ops)': lambda mp: mx_lbsgd.LAMB(
            multi_precision=mp, fused=False, **common),
    }


CLIP = ' + clip 1.0'
GLUONNLP = 'GluonNLP clip + mxnet LAMB'


class _Candidate:
    def __init__(self, name, make, shapes, dtype, rng):
        self.name = name
        self.updater = mx.optimizer.get_updater(make(dtype == 'float16'))
        self.weights = [mx.nd.array(rng.uniform(-0.1, 0.1, s), dtype=dtype) for _, s in shapes]
        self.grads = [mx.nd.array(rng.uniform(-0.1, 0.1, s), dtype=dtype) for _, s in shapes]
        self.index = list(range(len(shapes)))
        self.times, self.syncs = [], []
        self.step()                        # states created outside the timing
        mx.nd.waitall()

    def step(self):
        if self.name == GLUONNLP:
            gluon.utils.clip_global_norm(self.grads, 1.0)
        self.updater(self.index, self.grads, self.weights)

    def round(self, steps):
        for _ in range(steps):
            with count_host_syncs(include_waitall=False) as syncs:
                start = time.perf_counter()
                self.step()
                mx.nd.waitall()
                self.times.append(time.perf_counter() - start)
            self.syncs.append(len(syncs))


def run(dtypes, rounds, steps=1, seed=0):
    shapes = bert_shapes()
    results = []
    for dtype in dtypes:
        rng = np.random.RandomState(seed)
        # MXNet's clip_global_norm squares with dot, which has no float16 kernel on CPU
        cands = [_Candidate(n, m, shapes, dtype, rng) for n, m in _candidates().items()
                 if not (n == GLUONNLP and dtype == 'float16')]
        for r in range(rounds):
            for c in (cands if r % 2 == 0 else cands[::-1]):
                c.round(steps)
        base = {c.name: c for c in cands}
        for c in cands:
            def ratio(other):
                return statistics.median(a / b for a, b in zip(c.times, base[other].times))
            results.append(dict(
                dtype=dtype, name=c.name, ms=1e3 * statistics.median(c.times),
                syncs_per_step=statistics.mean(c.syncs),
                vs_mxnet_lamb=ratio('mxnet LAMB (multi_lamb_update)'),
                vs_adam=ratio('mxnet Adam'),
                vs_unclipped=ratio(c.name[:-len(CLIP)]) if c.name.endswith(CLIP) else None))
    return dict(machine=machine(), shapes=len(shapes),
                parameters=int(sum(np.prod(s) for _, s in shapes)), results=results)


def main(argv=None):
    p = Parser(prog='bench_lamb', description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=number(int, 1), default=5)
    p.add_argument('--dtypes', nargs='+', default=['float32', 'float16'],
                   choices=['float32', 'float16'])
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    out = run(args.dtypes, args.rounds)
    print(out['machine'])
    print('%d tensors, %d parameters; median of %d interleaved rounds; native operators: %s'
          % (out['shapes'], out['parameters'], args.rounds, out['machine']['native_operators']))
    print('%-8s %-43s %10s %8s %14s %9s %12s' % ('dtype', 'optimizer', 'ms/step', 'syncs',
                                                  '/ mxnet LAMB', '/ Adam', '/ unclipped'))
    for r in out['results']:
        print('%-8s %-43s %10.1f %8.1f %14.2f %9.2f %12s' % (
            r['dtype'], r['name'], r['ms'], r['syncs_per_step'], r['vs_mxnet_lamb'],
            r['vs_adam'], '' if r['vs_unclipped'] is None else '%.3f' % r['vs_unclipped']))
    if args.json:
        save_json(args.json, out)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
