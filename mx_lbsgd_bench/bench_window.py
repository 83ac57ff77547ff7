"""The accumulation window's cost: 'lblamb' (batch_scale=4) against the GluonNLP-style loop.

'lblamb' with batch_scale=4 under a gluon Trainer against the GluonNLP-style loop, on a small
and a BERT-like model.

Both loops train float16 parameters with fp32 master copies and a dynamic loss scale, four
micro-batches per update, in this one process, on the same weights and gradients:

- ``lblamb``: ``Trainer(params, 'lblamb', batch_scale=4, multi_precision=True,
  loss_scaler=DynamicLossScaler(...))``, ``grad_req='write'``, ``trainer.step(b)`` after
  every micro-batch (the BERT recipe of the docs): the Trainer keeps the window, the
  optimizer checks for overflow and unscales.
- GluonNLP's ``run_pretraining.py`` loop: ``grad_req='add'``, MXNet's own ``'lamb'`` with
  ``multi_precision=True``, one step per window: an overflow check (``multi_all_finite``,
  one host read), with or without clipping to a global norm (GluonNLP's on-device
  ``clip_grad_global_norm``: float32 sums of squares per array, no host read), then
  ``trainer.update`` and zeroed gradients (``reset_arrays``).

A micro-batch's forward and backward is ``loss = sum_i sum(w_i * c_i)`` (scaled), whose
backward writes or adds ``c_i`` into every gradient: the same work in both loops except
the gradient request. The loops take turns round after round; each window is timed with the
engine drained after it, and each ratio is the median over rounds of the ratio within a
round. Afterwards the window's own cost per micro-batch (a ``trainer.step`` that does not
close the window: the finite flag the loss scaler keeps per micro-batch and the
accumulation) is timed alone and set against the floor of reading the gradients once
(their bytes over the read bandwidth a plain float32 sum, or MXNet's copy, reaches here).

    python -m mx_lbsgd_bench.bench_window [--rounds 5] [--models small bert] [--json F]
    python benchmarks/bench_window.py ...
    mx-lbsgd bench --window ...
"""
import os
import statistics
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from mx_lbsgd_demo.args import Parser, check_output_option, number
from . import bench_step
from .bench_lamb import bert_shapes

__all__ = ['small_shapes', 'run', 'main']

B = 4                  # micro-batches per update
BATCH = 8              # samples per micro-batch (sets rescale_grad only)
INIT_SCALE = 2.0 ** 10
MAX_NORM = 1.0


def small_shapes(layers=10, units=48, inputs=40):
    """(name, shape) of a small MLP: 20 tensors, 19,680 parameters."""
    out = []
    for i in range(layers):
        out += [('fc%d_weight' % i, (units, inputs)), ('fc%d_bias' % i, (units,))]
    return out


MODELS = {'small': small_shapes, 'bert': bert_shapes}


class _Loop:
    """One training loop on its own float16 parameters; `window()` runs B micro-batches
    and one update."""

    def __init__(self, name, shapes, rng, consts):
        self.name = name
        self.params = [gluon.Parameter(n, shape=s, dtype='float16',
                                       grad_req=self.grad_req) for n, s in shapes]
        for p in self.params:
            p.initialize(mx.init.Uniform(0.05))
        self.consts = consts
        self.times, self.syncs = [], []

    def backward(self, scale):
        with autograd.record():
            loss = nd.add_n(*[(p.data() * c).sum() for p, c in zip(self.params, self.consts)])
            loss = loss.astype('float32') * scale
        loss.backward()

    def timed_window(self):
        mx.nd.waitall()
        with count_host_syncs(include_waitall=False) as syncs:
            start = time.perf_counter()
            self.window()
            mx.nd.waitall()
            self.times.append(time.perf_counter() - start)
        self.syncs.append(len(syncs))


class _Ours(_Loop):
    grad_req = 'write'

    def __init__(self, *args):
        super().__init__(*args)
        self.scaler = mx_lbsgd.DynamicLossScaler(init_scale=INIT_SCALE)
        self.trainer = gluon.Trainer(self.params, 'lblamb', dict(
            learning_rate=1e-4, wd=0.01, batch_scale=B, multi_precision=True,
            loss_scaler=self.scaler), kvstore=None)

    def micro_batch(self):
        self.backward(self.scaler.scale)
        self.trainer.step(BATCH)

    def window(self):
        for _ in range(B):
            self.micro_batch()


class _GluonNLP(_Loop):
    grad_req = 'add'

    def __init__(self, name, shapes, rng, consts, clip):
        super().__init__(name, shapes, rng, consts)
        self.clip = clip
        self.scale = INIT_SCALE
        self.trainer = gluon.Trainer(self.params, 'lamb', dict(
            learning_rate=1e-4, wd=0.01, multi_precision=True), kvstore=None,
            update_on_kvstore=False)

    def window(self):
        for _ in range(B):
            self.backward(self.scale)
        grads = [p.grad() for p in self.params]
        finite = nd.ones((1,))
        for start in range(0, len(grads), 200):
            part = grads[start:start + 200]
            nd.multi_all_finite(*part, num_arrays=len(part), init_output=False, out=finite)
        if finite.asscalar() == 1.0:                       # one host read per window
            if self.clip:
                _clip_grad_global_norm(grads, MAX_NORM * self.scale)
            self.trainer.update(BATCH * B * self.scale)
        nd.reset_arrays(*grads, num_arrays=len(grads))


def _clip_grad_global_norm(grads, max_norm):
    """GluonNLP 0.10's clip_grad_global_norm(check_isfinite=False): on the device."""
    squares = [nd.dot(g.reshape((-1,)).astype('float32'), g.reshape((-1,)).astype('float32'))
               for g in grads]
    norm = nd.sqrt(nd.add_n(*squares))
    ratio = nd.minimum(max_norm / (norm + 1e-8), nd.ones((1,)))
    for g in grads:
        g *= ratio.astype(g.dtype)


def _bandwidth(nbytes, repeats=5):
    """Bytes per second read from memory: the best of a plain float32 sum (numpy's, one
    core: MXNet's CPU ``nd.sum`` reads far slower) and MXNet's copy (bytes read, of 2x
    moved), over at least 64 MB."""
    size = max(nbytes, 64 << 20) // 4
    host = np.ones(size, dtype=np.float32)
    x, y = nd.ones((size,), dtype='float32'), nd.zeros((size,), dtype='float32')

    def numpy_sum():
        host.sum()

    def mxnet_copy():
        x.copyto(y)
        y.wait_to_read()
    best = 0.0
    for fn in (numpy_sum, mxnet_copy):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best = max(best, size * 4 / statistics.median(times))
    return best


def _accumulate_cost(loop, repeats):
    """Median seconds and operator calls of a `trainer.step` that does not close the
    window, with its backward outside the timing."""
    times, calls = [], []
    for k in range(repeats * B):
        loop.backward(loop.scaler.scale)
        mx.nd.waitall()
        closes = loop.trainer.optimizer.window_position == B - 1
        with count_kernel_launches() as launched:
            start = time.perf_counter()
            loop.trainer.step(BATCH)
            mx.nd.waitall()
            elapsed = time.perf_counter() - start
        if not closes and k >= B:
            times.append(elapsed)
            calls.append(len(launched))
    return statistics.median(times), statistics.median(calls)


def run(models=('small', 'bert'), rounds=5, windows=2, seed=0):
    out = []
    for model in models:
        shapes = MODELS[model]()
        rng = np.random.RandomState(seed)
        consts = [nd.array(rng.uniform(-1e-3, 1e-3, s), dtype='float16') for _, s in shapes]
        loops = [_Ours('lblamb B=4 (Trainer window)', shapes, rng, consts),
                 _GluonNLP('GluonNLP loop: lamb, clip', shapes, rng, consts, clip=True),
                 _GluonNLP('GluonNLP loop: lamb, no clip', shapes, rng, consts, clip=False)]
        for loop in loops:                   # states created outside the timing
            loop.window()
        mx.nd.waitall()
        for r in range(rounds):
            for loop in (loops if r % 2 == 0 else loops[::-1]):
                for _ in range(windows):
                    loop.timed_window()
        ours = loops[0]

        def ratio(other):
            per_round = []
            for r in range(rounds):
                part = slice(r * windows, (r + 1) * windows)
                per_round.append(statistics.median(ours.times[part])
                                 / statistics.median(other.times[part]))
            return statistics.median(per_round)
        params = int(sum(np.prod(s) for _, s in shapes))
        grad_bytes = 2 * params
        bandwidth = _bandwidth(grad_bytes)
        step_s, step_calls = _accumulate_cost(ours, repeats=3)
        floor_s = grad_bytes / bandwidth
        out.append(dict(
            model=model, tensors=len(shapes), parameters=params,
            loops=[dict(name=l.name, ms_per_window=1e3 * statistics.median(l.times),
                        host_syncs_per_window=statistics.mean(l.syncs)) for l in loops],
            lblamb_vs_gluonnlp_clip=ratio(loops[1]),
            lblamb_vs_gluonnlp_no_clip=ratio(loops[2]),
            micro_batch_step_ms=1e3 * step_s, micro_batch_step_operator_calls=step_calls,
            bandwidth_gb_s=bandwidth / 1e9, gradient_read_floor_ms=1e3 * floor_s,
            micro_batch_step_vs_floor=step_s / floor_s))
        del loops, ours
    return out


def main(argv=None, prog=None):
    parser = Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument('--models', nargs='+', default=['small', 'bert'], choices=list(MODELS))
    parser.add_argument('--rounds', type=number(int, 1), default=5)
    parser.add_argument('--windows', type=number(int, 1), default=2,
                        help='timed windows per loop and round')
    parser.add_argument('--json', help='write the results here')
    args = parser.parse_args(argv)
    check_output_option(parser, '--json', args.json)
    load = os.getloadavg()[0]
    results = run(args.models, args.rounds, args.windows)
    machine = bench_step.machine(loadavg_1min_start_end=[load, os.getloadavg()[0]])
    print('machine: %s' % machine)
    print('batch_scale %d, float16 + master copies + dynamic loss scale; median of %d '
          'interleaved rounds of %d windows' % (B, args.rounds, args.windows))
    for r in results:
        print('\n%s: %d tensors, %d parameters' % (r['model'], r['tensors'], r['parameters']))
        for l in r['loops']:
            print('  %-32s %10.2f ms/window %5.1f host syncs/window'
                  % (l['name'], l['ms_per_window'], l['host_syncs_per_window']))
        print('  lblamb / GluonNLP loop with clipping:    %.2fx' % r['lblamb_vs_gluonnlp_clip'])
        print('  lblamb / GluonNLP loop without clipping: %.2fx'
              % r['lblamb_vs_gluonnlp_no_clip'])
        print('  a micro-batch step inside the window: %.3f ms, %g operator calls; reading '
              'the float16 gradients once: %.3f ms at %.1f GB/s -> %.1fx the floor'
              % (r['micro_batch_step_ms'], r['micro_batch_step_operator_calls'],
                 r['gradient_read_floor_ms'], r['bandwidth_gb_s'],
                 r['micro_batch_step_vs_floor']))
    out = dict(machine=machine, batch_scale=B, rounds=args.rounds, windows=args.windows,
               results=results)
    bench_step.save_json(args.json, out, parser.prog)
    return out


if __name__ == '__main__':
    main()
