"""What ``lr_scaling=`` does: AdaScale's gain against the exact gain, and a schedule tuned
at batch 32 run unchanged at batches 256 and 512.

1. Exactness. Linear regression y = x.w* + noise (x ~ N(0, I_10), noise ~ N(0, 1)) held at
   w = w* + delta (lr 0): the mean gradient is delta and tr(Sigma) = 11 |delta|^2 + 10 per
   example, so AdaScale's r at scale S for the base batch of 8 is known. After 400 updates
   of ``batch_scale=S`` micro-batches under a gluon Trainer, ``last_gain`` and
   ``scale_invariant_steps`` against r and 400 r ('lblamb': sqrt(r)), per seed.
2. Scale rules on digits (``mx_lbsgd_demo.study_scaling``): the base run (batch 32, lr 0.05,
   momentum 0.9, the lr divided by 10 at 50% and 75% of 12 epochs of base iterations),
   then 'adascale' and 'linear' at scales 8 and 16 with the same schedule, no warmup, same
   seed: final test accuracy, updates, examples and the last gain.

    python -m mx_lbsgd_bench.bench_lr_scaling [--seeds 3] [--epochs 12] [--json F]
    python benchmarks/bench_lr_scaling.py ...
"""
import math
import sys

import numpy as np
from mxnet import autograd, gluon, nd

from mx_lbsgd_demo.args import Parser, check_output_option, number
from mx_lbsgd_demo.study_scaling import run_scale_rule
from .bench_step import machine, save_json

__all__ = ['exactness', 'scale_rules', 'main']

D, B, NOISE, UPDATES = 10, 8, 1.0, 400


def _gain_run(optimizer, scale, seed):
    rng = np.random.RandomState(seed)
    wstar = rng.normal(size=(1, D)).astype('f')
    delta = 0.3 * np.ones((1, D), 'f')
    mu2 = float((delta.astype(np.float64) ** 2).sum())
    sigma2 = ((D + 1) * mu2 + D * NOISE ** 2) / B
    net = gluon.nn.Dense(1, in_units=D, use_bias=False)
    net.initialize()
    net.weight.set_data(nd.array(wstar + delta))
    args = dict(learning_rate=0.0, batch_scale=scale, lr_scaling='adascale')
    if optimizer == 'lbsgd':
        args['warmup_epochs'] = 0
    trainer = gluon.Trainer(net.collect_params(), optimizer, args)
    loss_fn = gluon.loss.L2Loss()
    for _ in range(UPDATES * scale):
        x = rng.normal(size=(B, D)).astype('f')
        y = x @ wstar.T + NOISE * rng.normal(size=(B, 1)).astype('f')
        with autograd.record():
            loss = loss_fn(net(nd.array(x)), nd.array(y))
        loss.backward()
        trainer.step(B)
    r = (sigma2 + mu2) / (sigma2 / scale + mu2)
    power = 0.5 if optimizer == 'lblamb' else 1.0
    opt = trainer.optimizer
    return dict(optimizer=optimizer, scale=scale, seed=seed, exact_r=r,
                gain=opt.last_gain, gain_over_exact=opt.last_gain / r ** power,
                progress_over_exact=opt.scale_invariant_steps / (UPDATES * r))


def exactness(seeds=3):
    return [_gain_run(o, s, seed) for o in ('lbsgd', 'lblamb') for s in (4, 16)
            for seed in range(seeds)]


def scale_rules(epochs=12, seed=0, scales=(8, 16)):
    runs = [(None, 1)] + [(rule, s) for s in scales for rule in ('adascale', 'linear')]
    out = []
    for rule, scale in runs:
        r = run_scale_rule(dict(rule=rule, scale=scale, epochs=epochs, seed=seed,
                                dataset='digits-shifted'))
        r.pop('curve')
        out.append(r)
    return out


def tables(result):
    lines = ['| optimizer | S | exact r | gain / exact | progress / exact |',
             '|---|---:|---:|---:|---:|']
    for r in result['exactness']:
        lines.append('| %s | %d | %.3f | %.3f | %.3f |' % (
            r['optimizer'], r['scale'], r['exact_r'], r['gain_over_exact'],
            r['progress_over_exact']))
    lines += ['', '| rule | S | batch | test accuracy | updates | examples | last gain |',
              '|---|---:|---:|---:|---:|---:|---:|']
    for r in result['scale_rules']:
        lines.append('| %s | %d | %d | %.4f%s | %d | %d | %.2f |' % (
            r['rule'] or 'base', r['scale'], 32 * r['scale'], r['test_acc'],
            ' (diverged)' if r['diverged'] else '', r['updates'], r['examples'],
            r['last_gain']))
    return '\n'.join(lines)


def main(argv=None):
    p = Parser(prog='bench_lr_scaling', description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=number(int, 1), default=3,
                   help='seeds of the exactness runs (default %(default)s)')
    p.add_argument('--epochs', type=number(int, 1), default=12,
                   help='base epochs of the digits schedule (default %(default)s)')
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    result = dict(machine=machine(), exactness=exactness(args.seeds),
                  scale_rules=scale_rules(args.epochs))
    print(tables(result))
    save_json(args.json, result, 'bench_lr_scaling')
    return 0 if all(math.isfinite(r['gain']) for r in result['exactness']) else 1


if __name__ == '__main__':
    sys.exit(main())
