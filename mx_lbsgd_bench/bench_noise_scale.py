"""What `mx_lbsgd.GradientNoiseScale` costs on the training step of ``mx-lbsgd train``.

The default main run's step (the MLP 64-64 in float16 with fp32 master weights, hybridized,
micro-batches of 32 accumulated 8 at a time by lbsgd with linear warmup, dynamic loss
scaling; forward, backward and ``trainer.step``) is built twice from the same seed, once
watched by the monitor and once not, and both train on the same digits batches (so they
stay bit for bit equal). They take turns, round after round, the order alternating; a
round is --steps micro-batches timed (wall clock and process CPU time) with the engine
drained at its end, and the cost is the median over rounds of the ratio within a round.
Operator calls and host reads per micro-batch are counted too (a count does not depend on
the machine's load, a time does).

    python -m mx_lbsgd_bench.bench_noise_scale [--rounds 61] [--steps 160] [--interval 10]
                                              [--small-every K]
    python benchmarks/bench_noise_scale.py ...
"""
import dataclasses
import statistics
import time

import mxnet as mx

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from mx_lbsgd_demo.args import Parser, check_output_option, number
from mx_lbsgd_demo.config import DEMO_DEFAULTS, TrainConfig
from mx_lbsgd_demo.data import load_data
from mx_lbsgd_demo.models import mlp
from mx_lbsgd_demo.train import NOISE_SCALE_INTERVAL, build
from .bench_step import machine, save_json

__all__ = ['default_config', 'run', 'main']


def default_config():
    """The main run of ``mx-lbsgd train`` (without the per-step records)."""
    return dataclasses.replace(TrainConfig(**DEMO_DEFAULTS), record_steps=False)


class _Setup:
    """One net and trainer of `cfg`, optionally watched; steps through `batches`."""

    def __init__(self, cfg, batches, steps_per_epoch, interval, small_every=None):
        self.net = mlp(tuple(cfg.hidden), dtype=cfg.dtype, seed=cfg.seed)
        self.net.hybridize(static_alloc=True)
        self.trainer, _, self.scaler = build(cfg, self.net, steps_per_epoch)
        self.monitor = (mx_lbsgd.GradientNoiseScale(self.trainer, interval=interval,
                                                    small_every=small_every)
                        if interval else None)
        self.loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        self.batches, self.batch_size, self.position = batches, cfg.batch_size, 0
        self.times, self.cpu_times = [], []

    def step(self):
        xb, yb = self.batches[self.position % len(self.batches)]
        self.position += 1
        with mx.autograd.record():
            loss = self.loss_fn(self.net(xb).astype('float32'), yb) * self.scaler.scale
        loss.backward()
        self.trainer.step(self.batch_size)

    def count(self, steps):
        """(operator calls, host reads) per micro-batch over `steps` untimed micro-batches."""
        with count_kernel_launches() as ops, count_host_syncs(include_waitall=False) as reads:
            for _ in range(steps):
                self.step()
        return len(ops) / steps, len(reads) / steps

    def round(self, steps):
        mx.nd.waitall()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        mx.nd.waitall()
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - cpu)


def _batches(cfg):
    x, y = load_data(cfg.seed, cfg.test_fraction, cfg.val_fraction, cfg.dataset)[:2]
    n = len(x) // cfg.batch_size
    return [(mx.nd.array(x[i * cfg.batch_size:(i + 1) * cfg.batch_size]),
             mx.nd.array(y[i * cfg.batch_size:(i + 1) * cfg.batch_size])) for i in range(n)], n


def run(rounds=61, steps=160, interval=NOISE_SCALE_INTERVAL, warmup_rounds=2,
        small_every=None):
    """The timings and their ratio (dict)."""
    cfg = default_config()
    batches, per_epoch = _batches(cfg)
    plain = _Setup(cfg, batches, per_epoch, 0)
    watched = _Setup(cfg, batches, per_epoch, interval, small_every)
    for r in range(warmup_rounds + rounds):
        for setup in ((plain, watched) if r % 2 == 0 else (watched, plain)):
            setup.round(steps)
    for setup in (plain, watched):
        del setup.times[:warmup_rounds], setup.cpu_times[:warmup_rounds]
    (plain_ops, plain_reads), (ops, reads) = plain.count(steps), watched.count(steps)
    ratios = [w / p for w, p in zip(watched.times, plain.times)]
    cpu_ratios = [w / p for w, p in zip(watched.cpu_times, plain.cpu_times)]
    same = all((a.data().asnumpy() == b.data().asnumpy()).all() for a, b in zip(
        plain.net.collect_params().values(), watched.net.collect_params().values()))
    return dict(machine=machine(), rounds=rounds, steps_per_round=steps,
                interval=interval, small_every=small_every, batch_size=cfg.batch_size,
                batch_scale=cfg.batch_scale,
                dtype=cfg.dtype,
                ms_per_step_plain=1e3 * statistics.median(plain.times) / steps,
                ms_per_step_watched=1e3 * statistics.median(watched.times) / steps,
                ratio=statistics.median(ratios), ratio_min=min(ratios),
                ratio_max=max(ratios), cpu_ratio=statistics.median(cpu_ratios),
                fastest_round_ratio=min(watched.times) / min(plain.times),
                weights_equal=same, ops_per_step_plain=plain_ops, ops_per_step_watched=ops,
                reads_per_step_plain=plain_reads, reads_per_step_watched=reads)


def main(argv=None):
    p = Parser(prog='bench_noise_scale', description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=number(int, 1), default=61,
                   help='interleaved rounds (default 61; 21 gave -1.7%% to +10.8%% on a '
                        '2-core VM)')
    p.add_argument('--steps', type=number(int, 1), default=160,
                   help='micro-batches per round (default 160: 20 updates, 2 host reads)')
    p.add_argument('--interval', type=number(int, 1), default=NOISE_SCALE_INTERVAL)
    p.add_argument('--small-every', type=number(int, 1), default=None,
                   help="the monitor's small_every (default: the first micro-batch of each "
                        'window; 1: every micro-batch)')
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    out = run(args.rounds, args.steps, args.interval, small_every=args.small_every)
    print(out['machine'])
    print('mx-lbsgd train main run step: %s MLP, micro-batch %d x batch_scale %d, dynamic '
          'loss scaling, lbsgd linear warmup; %d interleaved rounds of %d micro-batches'
          % (out['dtype'], out['batch_size'], out['batch_scale'], out['rounds'],
             out['steps_per_round']))
    print('without monitor %.3f ms/step, with (interval %d%s) %.3f ms/step; ratio %.3f '
          '(median of per-round ratios; min %.3f, max %.3f): cost %+.1f%%; weights equal: %s'
          % (out['ms_per_step_plain'], out['interval'],
             '' if args.small_every is None else ', small_every %d' % args.small_every,
             out['ms_per_step_watched'],
             out['ratio'], out['ratio_min'], out['ratio_max'], 100 * (out['ratio'] - 1),
             out['weights_equal']))
    print('process CPU time (all threads), median of per-round ratios: %.3f (cost %+.1f%%); '
          'fastest round against fastest round: %.3f'
          % (out['cpu_ratio'], 100 * (out['cpu_ratio'] - 1), out['fastest_round_ratio']))
    print('per micro-batch: %.2f -> %.2f operator calls through mx.nd, %.3f -> %.3f host '
          'reads (counted, not timed)'
          % (out['ops_per_step_plain'], out['ops_per_step_watched'],
             out['reads_per_step_plain'], out['reads_per_step_watched']))
    if args.json:
        save_json(args.json, out)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
