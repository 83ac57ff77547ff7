"""Sharded optimizer state (`mx_lbsgd.ShardedTrainer`) against Horovod's DistributedTrainer
on the 52M-parameter BERT-like shapes of bench_lamb: memory per rank, bytes per update and
time per update.

* memory (every --ranks N): float16 weights, ``'lblamb'`` with ``multi_precision=True``,
  ``batch_scale=8``, a dynamic loss scaler and ``max_grad_norm=1.0``, after one window:
  ``optimizer_state_bytes()`` and ``accumulator_bytes()`` of each rank, against the
  unsharded total (every parameter's state, the sum over the ranks);
* bytes per update (``exchange_bytes()``): what each rank sends (the reduce-scatter of the
  gradients, the allgather of the weights, the norms) against a ring allreduce of the
  gradients;
* time (2 ranks): float32 ``'lblamb'``, one update per step, the two trainers taking turns
  round after round in one job; a round's time is the slowest rank's, and the ratio is the
  median over rounds of sharded / unsharded.

    python -m mx_lbsgd_bench.bench_shard [--ranks 2 4] [--rounds 5] [--json F]
    python -m mx_lbsgd_bench.bench_shard --paper      # the model for N = 2 .. 1024

The top level starts ``horovodrun --gloo -np N -H localhost:N`` running this module with
``--worker`` and collects what rank 0 writes.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from mx_lbsgd_demo.args import Parser, check_output_option, number
from .bench_lamb import bert_shapes
from .bench_step import machine, save_json

__all__ = ['paper_model', 'main']

#: BERT-large: parameters, and its largest tensor (the word embedding, 30522 x 1024)
BERT_LARGE = 340_000_000
BERT_LARGE_LARGEST = 30522 * 1024
LINK_GBITS = 25.0


def paper_model(ranks=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), params=BERT_LARGE,
                largest=BERT_LARGE_LARGEST, gbits=LINK_GBITS):
    """Per rank, for LAMB with float16 weights, fp32 master copies and two fp32 moments
    (12 bytes of state a parameter) and an fp32 window accumulator (4 bytes): the state
    unsharded, sharded by whole tensors (the owner of the largest tensor holds at least
    its state: the floor of that layout) and in even slices (P / N, plus at most 16
    elements of padding), and the bytes and seconds per update of the exchange over
    `gbits` links, each direction at full rate: a ring allreduce of the float16 gradients
    (2 (N-1)/N x 2P bytes per rank, ``hvd.DistributedTrainer``), the whole-tensor exchange
    (two such allreduces, the gradients and the weights gathered from their owners) and
    the even-slice exchange (a reduce-scatter and an allgather: (N-1)/N x 2P each)."""
    rows = []
    for n in ranks:
        ring = 2 * (n - 1) / n * 2 * params
        rows.append(dict(
            ranks=n, state_unsharded_gb=12 * params / 1e9,
            state_whole_tensors_gb=12 * max(params / n, largest) / 1e9,
            state_even_slices_gb=12 * (params / n + 16) / 1e9,
            accumulator_gb=4 * params / 1e9,
            ring_allreduce_gb=ring / 1e9, whole_tensors_gb=2 * ring / 1e9,
            even_slices_gb=ring / 1e9,
            ring_allreduce_s=ring * 8 / (gbits * 1e9),
            whole_tensors_s=2 * ring * 8 / (gbits * 1e9),
            even_slices_s=ring * 8 / (gbits * 1e9)))
    return rows


def print_paper_model():
    """The table of `paper_model` (markdown)."""
    print('| ranks | state per rank: unsharded | whole tensors (largest owner) | even slices '
          '| sent per update and rank: ring allreduce | whole tensors | even slices |')
    print('|---|---|---|---|---|---|---|')
    for r in paper_model():
        print('| %d | %.2f GB | %.3f GB | %.3f GB | %.2f GB (%.3f s) | %.2f GB (%.3f s) | '
              '%.2f GB (%.3f s) |' % (
                  r['ranks'], r['state_unsharded_gb'], r['state_whole_tensors_gb'],
                  r['state_even_slices_gb'], r['ring_allreduce_gb'], r['ring_allreduce_s'],
                  r['whole_tensors_gb'], r['whole_tensors_s'], r['even_slices_gb'],
                  r['even_slices_s']))


def _params(shapes, dtype, ctx):
    import mxnet as mx
    params = []
    rng = np.random.RandomState(0)
    for name, shape in shapes:
        p = mx.gluon.Parameter(name, shape=shape, dtype=dtype)
        p.initialize(mx.init.Zero(), ctx=ctx)
        p.set_data(mx.nd.array(rng.uniform(-0.1, 0.1, shape), dtype=dtype))
        params.append(p)
    return params


def _grads(shapes, dtype, seed):
    import mxnet as mx
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.uniform(-1e-3, 1e-3, s), dtype=dtype) for _, s in shapes]


def _worker(args):
    import mxnet as mx
    import horovod.mxnet as hvd
    import mx_lbsgd
    from .bench_step import set_gradients
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shapes = bert_shapes()
    out = {'ranks': size, 'parameters': int(sum(np.prod(s) for _, s in shapes))}
    # memory and bytes: the BERT recipe's configuration, one window
    params = _params(shapes, 'float16', mx.cpu())
    grads = _grads(shapes, 'float16', 1 + rank)
    trainer = mx_lbsgd.ShardedTrainer(params, 'lblamb', dict(
        learning_rate=1e-3, wd=0.01, multi_precision=True, batch_scale=8, max_grad_norm=1.0,
        loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=1.0)))
    for _ in range(8):
        set_gradients(params, grads)
        trainer.step(1)
    mx.nd.waitall()
    mine = np.array([trainer.optimizer_state_bytes(), trainer.accumulator_bytes()],
                    dtype=np.float64)
    every = hvd.allgather(mx.nd.array(mine[None], dtype='float64'), name='bytes').asnumpy()
    out['state_bytes_per_rank'] = every[:, 0].astype(int).tolist()
    out['accumulator_bytes_per_rank'] = every[:, 1].astype(int).tolist()
    out['state_bytes_unsharded'] = int(every[:, 0].sum())
    largest = max(int(np.prod(s)) for _, s in shapes)
    out['largest_tensor_state_bytes'] = out['state_bytes_unsharded'] * largest // \
        out['parameters']
    exchange = [json.dumps(trainer.exchange_bytes())]
    out['exchange_per_rank'] = _gather_json(hvd, exchange[0], size)
    out['split_tensors'] = sorted(n for n, ranks in trainer.holders().items()
                                  if len(ranks) > 1)
    del trainer, params, grads
    if size == 2 and args.rounds:
        out['time'] = _time(args, hvd, set_gradients)
    if rank == 0:
        with open(os.path.join(args.out, 'result.json'), 'w') as f:
            json.dump(out, f)


def _gather_json(hvd, text, size):
    import mxnet as mx
    blob = np.frombuffer(text.encode().ljust(512), dtype=np.uint8).astype(np.int32)
    every = hvd.allgather(mx.nd.array(blob[None], dtype='int32'), name='json').asnumpy()
    return [json.loads(bytes(row.astype(np.uint8).tolist()).decode().strip())
            for row in every]


def _time(args, hvd, set_gradients):
    import mxnet as mx
    import mx_lbsgd
    shapes = bert_shapes()
    opt = dict(learning_rate=1e-3, wd=0.01)
    trainers = {}
    for name in ('unsharded (hvd.DistributedTrainer)', 'sharded (mx_lbsgd.ShardedTrainer)'):
        params = _params(shapes, 'float32', mx.cpu())
        grads = _grads(shapes, 'float32', 1 + hvd.rank())
        make = (mx_lbsgd.ShardedTrainer if name.startswith('sharded')
                else hvd.DistributedTrainer)
        # a dict: horovod's DistributedTrainer sorts a list, and Parameters do not compare
        trainer = make({p.name: p for p in params}, 'lblamb', dict(opt))
        set_gradients(params, grads)
        trainer.step(1)                          # states created outside the timing
        trainers[name] = (trainer, params, grads)
    mx.nd.waitall()
    times = {name: [] for name in trainers}
    for r in range(args.rounds):
        names = list(trainers) if r % 2 == 0 else list(trainers)[::-1]
        for name in names:
            trainer, params, grads = trainers[name]
            steps = []
            for _ in range(args.steps):
                set_gradients(params, grads)
                mx.nd.waitall()
                hvd.allreduce(mx.nd.zeros((1,)), name='start').asnumpy()   # aligned start
                start = time.perf_counter()
                trainer.step(1)
                mx.nd.waitall()
                took = mx.nd.array([time.perf_counter() - start])
                steps.append(float(hvd.allreduce(took, op=hvd.Max, name='took').asscalar()))
            times[name].append(statistics.median(steps))
    base = times['unsharded (hvd.DistributedTrainer)']
    return {'ms': {k: 1e3 * statistics.median(v) for k, v in times.items()},
            'sharded_over_unsharded': statistics.median(
                a / b for a, b in zip(times['sharded (mx_lbsgd.ShardedTrainer)'], base)),
            'rounds': args.rounds, 'steps_per_round': args.steps}


def _horovodrun():
    here = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
    return here if os.path.exists(here) else 'horovodrun'


def _run(ranks, args):
    with tempfile.TemporaryDirectory() as out:
        argv = [_horovodrun(), '--gloo', '-np', str(ranks), '-H', 'localhost:%d' % ranks,
                sys.executable, '-m', 'mx_lbsgd_bench.bench_shard', '--worker', '--out', out,
                '--rounds', str(args.rounds if ranks == 2 else 0), '--steps', str(args.steps)]
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit('bench_shard: the %d-rank job failed:\n%s' % (ranks, proc.stdout))
        with open(os.path.join(out, 'result.json')) as f:
            return json.load(f)


def _report(results):
    print('| ranks | state bytes per rank | / unsharded | even split 1/N | '
          'accumulator bytes per rank | sent per update / ring allreduce (mean, max rank) |')
    print('|---|---|---|---|---|---|')
    for r in results:
        n, total = r['ranks'], r['state_bytes_unsharded']
        ratios = [(e['reduce'] + e['gather'] + e['norm']) / e['ring_allreduce']
                  for e in r['exchange_per_rank']]
        print('| %d | %s | %s | %.2f | %s | %.2f, %.2f |' % (
            n, ', '.join('%.0f MB' % (b / 1e6) for b in r['state_bytes_per_rank']),
            ', '.join('%.2f' % (b / total) for b in r['state_bytes_per_rank']),
            1 / n,
            ', '.join('%.0f MB' % (b / 1e6) for b in r['accumulator_bytes_per_rank']),
            statistics.mean(ratios), max(ratios)))
    for r in results:
        if 'time' in r:
            t = r['time']
            print('time per update, 2 ranks, fp32 lblamb (median of %d rounds of %d steps): '
                  '%s; sharded / unsharded %.2f' % (
                      t['rounds'], t['steps_per_round'],
                      ', '.join('%s %.1f ms' % kv for kv in t['ms'].items()),
                      t['sharded_over_unsharded']))


def main(argv=None, prog='bench_shard'):
    p = Parser(prog=prog, description=__doc__.split('\n')[0])
    p.add_argument('--ranks', type=number(int, 1), nargs='+', default=[2, 4])
    p.add_argument('--rounds', type=number(int, 0), default=5)
    p.add_argument('--steps', type=number(int, 1), default=3)
    p.add_argument('--paper', action='store_true', help='print the model for N = 2..1024')
    p.add_argument('--json', help='write the results here')
    p.add_argument('--worker', action='store_true', help='(internal) one rank of the job')
    p.add_argument('--out', help='(internal) where the worker writes')
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.paper:
        print_paper_model()
        return 0
    check_output_option(p, '--json', args.json)
    results = [_run(n, args) for n in args.ranks]
    print(machine())
    _report(results)
    if args.json:
        save_json(args.json, dict(machine=machine(), results=results, paper=paper_model()))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
