"""Time to a target accuracy on 2 Horovod ranks: ``batch_scale='auto'`` against every fixed
window length in {1, 2, 4, 8, 16}, in the same run.

Each configuration is one ``horovodrun --gloo -np 2 -H localhost:2`` job running this
module with ``--worker``. Each rank trains the (64, 64) MLP on its half of
'digits-shifted' (no download) with 'lbsgd': micro-batches of 32, lr 0.05, momentum 0.9,
wd 1e-4, no warmup, ``lr_scaling='adascale'`` (the lr tuned at batch 32 on one worker,
multiplied by AdaScale's gain at S = window x 2). Every 64 base iterations of progress
(``scale_invariant_steps``) both ranks wait for their work and take the test accuracy,
with the clock stopped; the run ends at the first reading at or above the target. The
weights are the same on both ranks, so both stop at the same update. Reported per
configuration and seed: training seconds to the target (rank 0's clock), updates,
examples, and the window lengths taken (with 'auto', on both ranks: they must agree).

    python -m mx_lbsgd_bench.bench_batch_choice [--target 0.95] [--seeds 3] [--json F]
    python benchmarks/bench_batch_choice.py ...
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mx_lbsgd_demo.args import Parser, check_output_option, number

__all__ = ['FIXED', 'main']

FIXED = (1, 2, 4, 8, 16)
BATCH = 32
EVAL_EVERY = 64          # base iterations of progress between two accuracy readings


def _worker(args):
    import numpy as np
    import mxnet as mx
    import horovod.mxnet as hvd
    import mx_lbsgd
    from mx_lbsgd_demo.data import load_data
    from mx_lbsgd_demo.models import mlp
    hvd.init()
    rank = hvd.rank()
    x, y, _, _, xt, yt = load_data(0, 0.25, 0.0, 'digits-shifted')
    x, y = x[rank::2], y[rank::2]
    net = mlp((64, 64), seed=args.seed)
    net.hybridize(static_alloc=True)
    window = args.window
    extra = (dict(batch_scale='auto', batch_scale_bounds=(1, 16)) if window == 'auto'
             else dict(batch_scale=int(window)))
    trainer = hvd.DistributedTrainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.05, momentum=0.9, wd=1e-4, warmup_epochs=0, lr_scaling='adascale',
        **extra))
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    opt = trainer.optimizer
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    x_all, y_all, x_test = mx.nd.array(x), mx.nd.array(y), mx.nd.array(xt)
    rng = np.random.RandomState(args.seed + 1 + rank)
    order, pos = rng.permutation(len(x)), 0
    seconds, next_eval, acc, windows = 0.0, EVAL_EVERY, 0.0, []
    mx.nd.waitall()
    start = time.perf_counter()
    while acc < args.target and opt.applied_updates < args.max_updates:
        if pos + BATCH > len(order):
            order, pos = rng.permutation(len(x)), 0
        idx = mx.nd.array(order[pos:pos + BATCH], dtype='int64')
        pos += BATCH
        with mx.autograd.record():
            loss = loss_fn(net(x_all.take(idx)), y_all.take(idx))
        loss.backward()
        trainer.step(BATCH)
        if opt.window_position == 0:
            windows.append(opt.batch_scale)
            if opt.scale_invariant_steps >= next_eval:
                next_eval += EVAL_EVERY
                mx.nd.waitall()
                seconds += time.perf_counter() - start
                acc = float(np.mean(net(x_test).argmax(axis=1).asnumpy() == yt))
                start = time.perf_counter()
    mx.nd.waitall()
    result = dict(window=window, seed=args.seed, rank=rank, seconds=seconds, test_acc=acc,
                  reached=acc >= args.target, updates=opt.applied_updates,
                  examples=2 * BATCH * opt.micro_batches,
                  progress=opt.scale_invariant_steps, windows=windows,
                  history=opt.window_history)
    with open(os.path.join(args.out, 'rank%d.json' % rank), 'w') as f:
        json.dump(result, f)


def _horovodrun():
    here = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
    return here if os.path.exists(here) else shutil.which('horovodrun') or 'horovodrun'


def run(window, seed, target, max_updates):
    """One configuration on 2 ranks: both ranks' results."""
    with tempfile.TemporaryDirectory() as out:
        argv = [_horovodrun(), '--gloo', '-np', '2', '-H', 'localhost:2', sys.executable,
                '-m', 'mx_lbsgd_bench.bench_batch_choice', '--worker', '--out', out,
                '--window', str(window), '--seed', str(seed), '--target', str(target),
                '--max-updates', str(max_updates)]
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit('bench_batch_choice: the job (window %s, seed %d) failed:\n%s'
                             % (window, seed, proc.stdout[-4000:]))
        ranks = []
        for rank in range(2):
            with open(os.path.join(out, 'rank%d.json' % rank)) as f:
                ranks.append(json.load(f))
        return ranks


def summary(runs):
    """Per configuration: median seconds over seeds, and auto's ratio to the best fixed."""
    by = {}
    for ranks in runs:
        by.setdefault(str(ranks[0]['window']), []).append(ranks)
    rows = {}
    for window, jobs in by.items():
        rows[window] = dict(
            seconds=statistics.median(j[0]['seconds'] for j in jobs),
            updates=statistics.median(j[0]['updates'] for j in jobs),
            examples=statistics.median(j[0]['examples'] for j in jobs),
            reached=all(j[0]['reached'] for j in jobs),
            ranks_agree=all(j[0]['windows'] == j[1]['windows'] for j in jobs),
            final_windows=[j[0]['windows'][-1] for j in jobs])
    fixed = [rows[str(b)]['seconds'] for b in FIXED if str(b) in rows and rows[str(b)]['reached']]
    if fixed and 'auto' in rows:
        rows['auto']['over_best_fixed'] = rows['auto']['seconds'] / min(fixed)
    return rows


def table(rows):
    lines = ['| window | seconds to target (median) | updates | examples | '
             'final window | ranks agree |', '|---|---:|---:|---:|---|---|']
    for window in [str(b) for b in FIXED] + ['auto']:
        if window in rows:
            r = rows[window]
            lines.append('| %s | %.1f%s | %d | %d | %s | %s |' % (
                window, r['seconds'], '' if r['reached'] else ' (not reached)',
                r['updates'], r['examples'], ', '.join(map(str, r['final_windows'])),
                'yes' if r['ranks_agree'] else 'NO'))
    if 'auto' in rows and 'over_best_fixed' in rows['auto']:
        lines.append('\nauto / best fixed: %.2f' % rows['auto']['over_best_fixed'])
    return '\n'.join(lines)


def main(argv=None):
    p = Parser(prog='bench_batch_choice', description=__doc__.split('\n')[0])
    p.add_argument('--target', type=number(float, 0.0, 1.0), default=0.95,
                   help='test accuracy to reach (default %(default)s)')
    p.add_argument('--seeds', type=number(int, 1), default=3,
                   help='seeds per configuration (default %(default)s)')
    p.add_argument('--max-updates', type=number(int, 1), default=20000)
    p.add_argument('--json', help='write the results here')
    p.add_argument('--worker', action='store_true', help='(internal) one rank of a job')
    p.add_argument('--out', help='(internal) where the worker writes')
    p.add_argument('--window', help='(internal) a window length or auto')
    p.add_argument('--seed', type=int, default=0, help='(internal)')
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    check_output_option(p, '--json', args.json)
    from .bench_step import machine, save_json
    runs = []
    for seed in range(args.seeds):
        for window in FIXED + ('auto',):        # interleaved: drift hits every config
            runs.append(run(window, seed, args.target, args.max_updates))
    rows = summary(runs)
    print(table(rows))
    save_json(args.json, dict(machine=machine(), target=args.target, runs=runs,
                              summary=rows), 'bench_batch_choice')
    return 0 if all(r['ranks_agree'] for r in rows.values()) else 1


if __name__ == '__main__':
    sys.exit(main())
