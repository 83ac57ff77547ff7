"""ms per micro-batch of 2-worker data-parallel training with LBSGD(batch_scale=4), against
the ideal gradient-accumulation loop, on a dist_sync kvstore and on Horovod (gloo).

Variants (every one trains its own copy of the same MLP, >= 4M parameters, on random data,
a small per-worker batch so that communication matters):

* ``unchanged loop``: ``gluon.Trainer(params, 'lbsgd', dict(batch_scale=4, ...), kvstore=kv,
  update_on_kvstore=False)`` (Horovod: ``hvd.DistributedTrainer``), ``trainer.step`` after
  every micro-batch: mx_lbsgd sums micro-batches 1..3 locally and reduces the 4th only.
* ``every micro-batch``: the same with ``mx_lbsgd.bind(trainer, window=False)`` (the old
  behaviour: every micro-batch is reduced, the optimizer accumulates after the reduction).
* ``ideal (lbsgd B=1)`` / ``ideal (sgd)``: ``grad_req='add'``, ``trainer.step`` once per 4
  micro-batches, gradients zeroed after. Ratios are taken to the faster of the two, round by
  round.
* Horovod only, Module: ``hvd.DistributedOptimizer(mx.optimizer.create('lbsgd',
  batch_scale=4))`` with ``mod.update()`` after every micro-batch (it reduces every
  micro-batch), against a Module ideal (``grad_req='add'``, lbsgd B=1, update once per 4).

Every worker runs all variants of its engine in one process. A round times ``--windows``
windows of 4 micro-batches per variant, the variants taking turns window by window (order
reversed every other turn; the engine drained at the end of each window); a variant's round
value is the median of its windows, averaged over the workers, and every ratio is the
median over rounds of the ratio within a round. Worker CPU ms (process time of a worker,
all its threads, per micro-batch) are medians likewise: less at the mercy of other load on
the machine than wall time. The two ideal rows run the same loop with near-identical
optimizers: their ratio shows the noise floor of the machine. Reductions (``kv.pushpull`` /
``horovod.mxnet.allreduce_`` / ``grouped_allreduce_`` calls) and their payload (elements x
dtype size, one worker's gradients; the wire carries about twice that: push + pull on the
parameter server, reduce-scatter + all-gather in a ring) are counted per update, i.e. per
window of 4 micro-batches.

    python -m mx_lbsgd_bench.bench_dist [--quick] [--engines kvstore horovod] [--json F]
    python benchmarks/bench_dist.py ...

The top level starts one job per engine (``python -m mx_lbsgd.launch -n 2 -s 1`` and
``horovodrun --gloo -np 2 -H localhost:2``) running this module with ``--worker``; each
worker writes its JSON into a temporary folder, which the top level collects.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import mx_lbsgd
from mx_lbsgd_demo.args import Parser, check_output_option, number

__all__ = ['main']

#: The folders holding the mx_lbsgd_bench and mx_lbsgd packages, put on the workers'
#: PYTHONPATH (so that a source checkout that is not installed works too).
_PACKAGE_PARENTS = list(dict.fromkeys(
    os.path.dirname(os.path.dirname(os.path.abspath(module_file)))
    for module_file in (__file__, mx_lbsgd.__file__)))

B = 4              # batch_scale: micro-batches per update
UNCHANGED, EVERY, IDEAL, IDEAL_SGD = ('unchanged loop', 'every micro-batch',
                                      'ideal (lbsgd B=1)', 'ideal (sgd)')
MOD_EVERY, MOD_IDEAL = 'module, every micro-batch', 'module ideal'
IDEALS = {UNCHANGED: (IDEAL, IDEAL_SGD), EVERY: (IDEAL, IDEAL_SGD), IDEAL: (IDEAL, IDEAL_SGD),
          IDEAL_SGD: (IDEAL, IDEAL_SGD), MOD_EVERY: (MOD_IDEAL,), MOD_IDEAL: (MOD_IDEAL,)}
TARGET = 1.15      # unchanged loop / ideal


# --------------------------------------------------------------------------- worker side
def _worker(args):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon, nd

    if args.worker == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        kv, rank, size = None, hvd.rank(), hvd.size()
    else:
        kv = mx.kv.create('dist_sync')
        rank, size = kv.rank, kv.num_workers

    counters = {}            # variant -> [calls, bytes]
    current = [None]

    def count(arrays):
        c = counters.setdefault(current[0], [0, 0])
        for a in arrays:
            c[0] += 1
            c[1] += int(a.size) * np.dtype(a.dtype).itemsize

    if args.worker == 'horovod':
        for name in ('allreduce_', 'grouped_allreduce_'):
            original = getattr(hvd, name)

            def counting(*a, _original=original, _name=name, **kw):
                tensors = kw.get('tensors', kw.get('tensor', a[0] if a else None))
                count(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors])
                return _original(*a, **kw)
            setattr(hvd, name, counting)       # horovod.mxnet's trainer/optimizer look it up here

    opt_common = dict(learning_rate=0.01, momentum=0.9)
    lb = dict(opt_common, warmup_strategy='linear', warmup_epochs=1, updates_per_epoch=1000)
    batch = args.batch
    rng = np.random.RandomState(100 + rank)
    data = [(nd.array(rng.uniform(-1, 1, (batch, args.hidden))),
             nd.array(rng.randint(0, 10, batch))) for _ in range(B)]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def make_net(grad_req):
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        for _ in range(args.layers):
            net.add(gluon.nn.Dense(args.hidden, activation='relu', in_units=args.hidden))
        net.add(gluon.nn.Dense(10, in_units=args.hidden))
        net.initialize(mx.init.Xavier())
        net.collect_params().setattr('grad_req', grad_req)
        net.hybridize(static_alloc=True, static_shape=True)
        return net

    class Gluon:
        def __init__(self, name, index, optimizer, params, accumulate, disable=False):
            self.name, self.accumulate = name, accumulate
            self.net = make_net('add' if accumulate else 'write')
            pd = self.net.collect_params()
            if kv is None:
                self.trainer = hvd.DistributedTrainer(pd, optimizer, params,
                                                      prefix='v%d:' % index)
                self.batch = batch                      # horovod averages over workers
            else:
                self.trainer = gluon.Trainer(pd, optimizer, params, update_on_kvstore=False,
                                             kvstore=_offset_kvstore(mx, kv, 1000 * index,
                                                                     lambda a: count(a)))
                self.batch = batch * size
            if disable:
                mx_lbsgd.bind(self.trainer, window=False)
            if kv is not None:
                mx_lbsgd.init_kvstore(self.trainer, self.batch * (B if accumulate else 1))
            self.params = [p for p in pd.values() if p.grad_req != 'null']
            self.n_params = sum(int(np.prod(p.shape)) for p in self.params)

        def window(self):
            for x, y in data:
                with autograd.record():
                    loss = loss_fn(self.net(x), y)
                loss.backward()
                if not self.accumulate:
                    self.trainer.step(self.batch)
            if self.accumulate:
                self.trainer.step(self.batch * B)
                for p in self.params:
                    p.zero_grad()

    class Module:
        def __init__(self, name, index, optimizer, params, accumulate):
            self.name, self.accumulate = name, accumulate
            x = mx.sym.Variable('data')
            for i in range(args.layers):
                x = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=args.hidden,
                                                            name='fc%d' % i), 'relu')
            x = mx.sym.FullyConnected(x, num_hidden=10, name='out')
            self.mod = mx.mod.Module(mx.sym.SoftmaxOutput(x, name='softmax'),
                                     context=mx.cpu())
            self.mod.bind([('data', (batch, args.hidden))], [('softmax_label', (batch,))],
                          grad_req='add' if accumulate else 'write')
            mx.random.seed(0)
            self.mod.init_params(mx.init.Xavier())
            opt = mx.optimizer.create(optimizer, rescale_grad=1.0 / (batch * (
                B if accumulate else 1)), **params)
            # the ideal zeroes the gradients after each update: the optimizer sees them
            self.opt = (_keeping_gradients(hvd, opt) if accumulate
                        else hvd.DistributedOptimizer(opt))
            self.mod.init_optimizer(kvstore=None, optimizer=self.opt)
            self.batches = [mx.io.DataBatch([x_], [y_]) for x_, y_ in data]
            self.n_params = sum(int(np.prod(a.shape)) for a in self.mod.get_params()[0].values())

        def window(self):
            for b in self.batches:
                self.mod.forward_backward(b)
                if not self.accumulate:
                    self.mod.update()
            if self.accumulate:
                self.mod.update()
                for g in self.opt.seen.values():
                    g[:] = 0

    variants = [Gluon(UNCHANGED, 0, 'lbsgd', dict(lb, batch_scale=B), False),
                Gluon(EVERY, 1, 'lbsgd', dict(lb, batch_scale=B), False, disable=True),
                Gluon(IDEAL, 2, 'lbsgd', dict(lb, batch_scale=1), True),
                Gluon(IDEAL_SGD, 3, 'sgd', dict(opt_common), True)]
    if kv is None and not args.no_module:
        variants += [Module(MOD_EVERY, 4, 'lbsgd', dict(lb, batch_scale=B), False),
                     Module(MOD_IDEAL, 5, 'lbsgd', dict(lb, batch_scale=1), True)]

    def run_window(v):
        current[0] = v.name
        start, cpu = time.perf_counter(), time.process_time()
        v.window()
        mx.nd.waitall()
        return (1e3 * (time.perf_counter() - start) / B,
                1e3 * (time.process_time() - cpu) / B)

    for _ in range(args.warmup):                 # states, compiled graphs, the window hook
        for v in variants:
            run_window(v)
    counters.clear()
    rounds = {v.name: [] for v in variants}
    cpu_rounds = {v.name: [] for v in variants}
    windows = {v.name: 0 for v in variants}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        times = {v.name: [] for v in variants}
        cpu = {v.name: [] for v in variants}
        for w in range(args.windows):       # variants take turns window by window
            for v in (variants if (r * args.windows + w) % 2 == 0 else variants[::-1]):
                wall, used = run_window(v)
                times[v.name].append(wall)
                cpu[v.name].append(used)
                windows[v.name] += 1
        for v in variants:
            rounds[v.name].append(statistics.median(times[v.name]))
            cpu_rounds[v.name].append(statistics.median(cpu[v.name]))
        if rank == 0:
            print('round %d/%d: %s' % (r + 1, args.rounds, ', '.join(
                '%s %.1f' % (v.name, rounds[v.name][-1]) for v in variants)), flush=True)
    out = {'engine': args.worker, 'rank': rank, 'size': size,
           'seconds': time.perf_counter() - t0, 'variants': {}}
    for v in variants:
        calls, nbytes = counters.get(v.name, [0, 0])
        out['variants'][v.name] = {
            'rounds_ms': rounds[v.name], 'rounds_cpu_ms': cpu_rounds[v.name],
            'parameters': v.n_params,
            'reductions_per_update': calls / windows[v.name],
            'bytes_per_update': nbytes / windows[v.name]}
    path = os.path.join(args.out, '%s-%d.json' % (args.worker, rank))
    with open(path + '.tmp', 'w') as f:
        json.dump(out, f)
    os.replace(path + '.tmp', path)
    print('rank %d done' % rank, flush=True)
    if kv is None:
        hvd.shutdown()


def _keeping_gradients(hvd, optimizer):
    """``hvd.DistributedOptimizer(optimizer)`` that keeps the gradient arrays its `update`
    is given (in ``seen``, by index): Module has no public accessor of its parameter
    gradients, which grad_req='add' needs zeroed after each update, and passes its own
    arrays to the optimizer."""

    class SeesGradients(hvd.DistributedOptimizer):
        def __init__(self, optimizer):
            super().__init__(optimizer)
            self.seen = {}

        def _keep(self, index, grad):
            if isinstance(index, (list, tuple)):
                self.seen.update(zip(index, grad))
            else:
                self.seen[index] = grad

        def update(self, index, weight, grad, state):
            self._keep(index, grad)
            super().update(index, weight, grad, state)

        def update_multi_precision(self, index, weight, grad, state):
            self._keep(index, grad)
            super().update_multi_precision(index, weight, grad, state)

    return SeesGradients(optimizer)


def _offset_kvstore(mx, base, offset, on_reduce):
    """A view of the kvstore `base` whose keys are shifted by `offset`, so that several
    Trainers (which all number their parameters 0, 1, ...) share one dist kvstore (one
    ps-lite connection per process); `on_reduce(arrays)` sees every pushpull's gradients
    (one worker's payload: the first device's array of each key).

    A kvstore of MXNet's public interface for custom kvstores (``mx.kv.KVStoreBase``, which
    gluon.Trainer takes in place of a KVStore) that calls `base`'s public methods: what a
    Trainer with ``update_on_kvstore=False`` and dense gradients uses (broadcast of the
    initial weights, pushpull of the gradients, type, rank and num_workers)."""

    def shift(key):
        if isinstance(key, (list, tuple)):
            return [k + offset for k in key]
        return key + offset

    def first(value):
        return value[0] if isinstance(value, (list, tuple)) else value

    class OffsetKVStore(mx.kv.KVStoreBase):
        def broadcast(self, key, value, out, priority=0):
            return base.broadcast(shift(key), value, out, priority)

        def pushpull(self, key, value, out=None, priority=0):
            if isinstance(key, (list, tuple)):
                on_reduce([first(v) for v in value])
            else:
                on_reduce([first(value)])
            return base.pushpull(shift(key), value, out, priority)

        @staticmethod
        def is_capable(capability):
            return False        # no optimizer on the servers: the Trainers update

        def set_optimizer(self, optimizer):
            raise NotImplementedError('the Trainers update (update_on_kvstore=False)')

        def save_optimizer_states(self, fname, dump_optimizer=False):
            raise NotImplementedError('the Trainers hold the optimizer states')

        def load_optimizer_states(self, fname):
            raise NotImplementedError('the Trainers hold the optimizer states')

        @property
        def type(self):
            return base.type

        @property
        def rank(self):
            return base.rank

        @property
        def num_workers(self):
            return base.num_workers

    return OffsetKVStore()


# --------------------------------------------------------------------------- top level
def _worker_argv(args, engine, out):
    argv = [sys.executable, '-m', 'mx_lbsgd_bench.bench_dist', '--worker', engine, '--out', out,
            '--rounds', str(args.rounds), '--windows', str(args.windows),
            '--warmup', str(args.warmup), '--batch', str(args.batch),
            '--hidden', str(args.hidden), '--layers', str(args.layers)]
    return argv + (['--no-module'] if args.no_module else [])


def _horovodrun():
    here = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
    return here if os.path.exists(here) else shutil.which('horovodrun')


def _run_job(args, engine, out):
    env = dict(os.environ, PYTHONUNBUFFERED='1',
               PYTHONPATH=os.pathsep.join(filter(None, _PACKAGE_PARENTS
                                                 + [os.environ.get('PYTHONPATH')])))
    env.setdefault('OMP_NUM_THREADS', '1')
    if engine == 'kvstore':
        cmd = [sys.executable, '-m', 'mx_lbsgd.launch', '-n', '2', '-s', '1',
               '--timeout', str(args.timeout), '--'] + _worker_argv(args, engine, out)
    else:
        cmd = [_horovodrun(), '--gloo', '-np', '2', '-H', 'localhost:2'] + \
            _worker_argv(args, engine, out)
    print('$ ' + ' '.join(cmd), file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    tail = []
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if args.verbose or 'round' in line or 'done' in line or 'rror' in line:
                sys.stderr.write('  [%s] %s' % (engine, line))
        code = proc.wait(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = 124
    wall = time.perf_counter() - start
    workers = []
    for rank in range(2):
        path = os.path.join(out, '%s-%d.json' % (engine, rank))
        if os.path.exists(path):
            with open(path) as f:
                workers.append(json.load(f))
    if len(workers) != 2:
        sys.stderr.write(''.join(tail))
        raise SystemExit('%s job failed (exit %s): %d of 2 worker results'
                         % (engine, code, len(workers)))
    return {'exit_status': code, 'wall_s': wall, 'workers': workers}


def summarize(engine, job):
    workers = job['workers']
    names = list(workers[0]['variants'])
    n_rounds = min(len(w['variants'][n]['rounds_ms']) for w in workers for n in names)
    per_round = {n: [statistics.mean(w['variants'][n]['rounds_ms'][i] for w in workers)
                     for i in range(n_rounds)] for n in names}
    rows = []
    for n in names:
        ideals = [i for i in IDEALS[n] if i in per_round]
        ratio = statistics.median(per_round[n][i] / min(per_round[d][i] for d in ideals)
                                  for i in range(n_rounds))
        cpu = statistics.median(statistics.mean(w['variants'][n]['rounds_cpu_ms'][i]
                                                for w in workers) for i in range(n_rounds))
        v0 = workers[0]['variants'][n]
        rows.append({
            'engine': engine, 'variant': n, 'ms_per_micro_batch': statistics.median(
                per_round[n]), 'ratio_to_ideal': ratio, 'ideal': ' / '.join(ideals),
            'cpu_ms_per_micro_batch': cpu, 'parameters': v0['parameters'],
            'reductions_per_update': v0['reductions_per_update'],
            'bytes_per_update_per_worker': v0['bytes_per_update'],
            'per_worker_bytes_per_update': [w['variants'][n]['bytes_per_update']
                                            for w in workers],
            'rounds_ms': per_round[n]})
    return rows


def table(rows):
    lines = ['| engine | variant | ms / micro-batch | ratio to ideal | worker CPU ms / '
             'micro-batch | reductions / update | MB reduced / update / worker |',
             '|---|---|---:|---:|---:|---:|---:|']
    for r in rows:
        lines.append('| %s | %s | %.1f | %.2f | %.1f | %g | %.1f |' % (
            r['engine'], r['variant'], r['ms_per_micro_batch'], r['ratio_to_ideal'],
            r['cpu_ms_per_micro_batch'],
            r['reductions_per_update'], r['bytes_per_update_per_worker'] / 1e6))
    return '\n'.join(lines)


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument('--engines', nargs='+', default=['kvstore', 'horovod'],
                        choices=['kvstore', 'horovod'])
    parser.add_argument('--rounds', type=number(int, 1), default=12)
    parser.add_argument('--windows', type=number(int, 1), default=3,
                        help='windows of 4 micro-batches per variant per round')
    parser.add_argument('--warmup', type=number(int, 0), default=2,
                        help='untimed windows per variant')
    parser.add_argument('--batch', type=number(int, 1), default=16, help='per-worker micro-batch')
    parser.add_argument('--hidden', type=number(int, 1), default=1024)
    parser.add_argument('--layers', type=number(int, 1), default=4,
                        help='hidden Dense layers (hidden x hidden each) plus a 10-way output')
    parser.add_argument('--no-module', action='store_true', help='skip the Horovod Module rows')
    parser.add_argument('--quick', action='store_true', help='3 rounds of 2 windows, 1 warmup')
    parser.add_argument('--timeout', type=number(float, 0, open_low=True), default=600,
                        help='per job, seconds')
    parser.add_argument('--verbose', action='store_true', help="echo all the jobs' output")
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--worker', choices=['kvstore', 'horovod'], help=argparse.SUPPRESS)
    parser.add_argument('--out', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_output_option(parser, '--json', args.json)
    if args.quick:
        args.rounds, args.windows, args.warmup = 3, 2, 1
    if args.worker:
        return _worker(args)

    from .bench_step import machine, save_json
    params = args.layers * (args.hidden * args.hidden + args.hidden) + 10 * args.hidden + 10
    results = {'batch_scale': B, 'workers': 2, 'batch_per_worker': args.batch,
               'parameters': params, 'rounds': args.rounds, 'windows': args.windows,
               'target_unchanged_over_ideal': TARGET, 'jobs': {}, 'rows': []}
    out = tempfile.mkdtemp(prefix='bench_dist_')
    try:
        for engine in args.engines:
            load = os.getloadavg()[0]
            job = _run_job(args, engine, out)
            results['jobs'][engine] = {'exit_status': job['exit_status'],
                                       'wall_s': job['wall_s'],
                                       'loadavg_1min_before_after': [load, os.getloadavg()[0]],
                                       'worker_seconds': [w['seconds'] for w in job['workers']]}
            results['rows'] += summarize(engine, job)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    results['machine'] = machine(engines=args.engines)
    print('machine: %s' % results['machine'])
    print('MLP %d x %d + 10-way output: %d parameters (%.1f MB float32); 2 workers, '
          'batch %d per worker, batch_scale %d; %d rounds x %d windows'
          % (args.layers, args.hidden, params, 4e-6 * params, args.batch, B, args.rounds,
             args.windows))
    print(table(results['rows']))
    for r in results['rows']:
        if r['variant'] == UNCHANGED:
            print('%s: unchanged loop / ideal = %.2f (target <= %.2f): %s' % (
                r['engine'], r['ratio_to_ideal'], TARGET,
                'met' if r['ratio_to_ideal'] <= TARGET else 'NOT met'))
    save_json(args.json, results)
    return results


if __name__ == '__main__':
    main()
