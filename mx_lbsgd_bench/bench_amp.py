"""What bfloat16 AMP (``mxnet.contrib.amp``) costs or saves on CPU, with the package's
optimizers and MXNet's SGD.

Two hybridized Gluon models on synthetic data: ``mlp`` (4 Dense layers of 1024 units and a
10-way Dense; batch 256 of 1024 features) and ``convnet`` (three Conv2D 3x3 of 64 channels,
the second with stride 2, each with BatchNorm and ReLU, then a 10-way Dense; batch 64 of
32x32x3 images); float32 against ``amp.init(target_dtype='bfloat16')``; the optimizers
``'lbsgd'`` (momentum 0.9), ``'lblamb'`` and MXNet's ``'sgd'`` (momentum 0.9) through a
gluon Trainer. Under AMP the model's FullyConnected and Convolution run in bfloat16 while
the parameters and gradients stay float32: each configuration checks the dtype of the
model's output and of the weights and gradients the optimizer receives, and fails unless
they are bfloat16 (float32 without AMP) and float32.

``amp.init`` runs once per process, so every configuration runs in a fresh interpreter
(``python -c``; its results come back as one JSON line) and the configurations take turns
round after round. In each round a configuration times forward+backward (engine drained
before and after) and ``trainer.step`` alone (engine drained after it) over a few steps
after warm-up steps; the table shows medians over rounds, and ``bf16/fp32`` is the median
over rounds of the ratio of the total step time within a round. Max RSS is the peak
resident memory of the configuration's process. With ``--json`` the output also holds a
check that training works under bfloat16 AMP: 50 steps of 'lbsgd' on a small synthetic
classification task, under AMP and in float32, with the loss of every step.

    python -m mx_lbsgd_bench.bench_amp [--rounds 5] [--json F]
    python benchmarks/bench_amp.py ...
"""
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

from mx_lbsgd_demo.args import Parser, check_output_option, number
from .bench_step import machine, save_json

__all__ = ['run', 'main']

MODELS = ('mlp', 'convnet')
PRECISIONS = ('float32', 'bfloat16')
OPTIMIZERS = {
    'lbsgd': dict(learning_rate=0.1, momentum=0.9, wd=1e-4),
    'lblamb': dict(learning_rate=1e-3, wd=1e-4),
    'sgd': dict(learning_rate=0.1, momentum=0.9, wd=1e-4),
}
WARMUP_STEPS = 3
TIMED_STEPS = 8
TRAIN_STEPS = 50

# the checkout (or site-packages) holding mx_lbsgd_bench, for the worker processes
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER = 'import sys; from mx_lbsgd_bench.bench_amp import _worker; _worker(sys.argv[1])'


def _dtype_name(t):
    """numpy's name of a dtype; MXNet's bfloat16 is a structured numpy dtype."""
    import numpy as np
    t = np.dtype(t)
    return t.names[0] if t.names else t.name


def _model(name, rng):
    """(net, data, labels) of a model, synthetic data from `rng`."""
    import mxnet as mx
    nn = mx.gluon.nn
    net = nn.HybridSequential()
    if name == 'mlp':
        for _ in range(4):
            net.add(nn.Dense(1024, activation='relu'))
        net.add(nn.Dense(10))
        data, batch = (256, 1024), 256
    elif name == 'convnet':
        for stride in (1, 2, 1):
            net.add(nn.Conv2D(64, 3, strides=stride, padding=1), nn.BatchNorm(),
                    nn.Activation('relu'))
        net.add(nn.Dense(10))
        data, batch = (64, 3, 32, 32), 64
    else:
        raise ValueError('unknown model %r' % name)
    x = mx.nd.array(rng.uniform(-1, 1, data))
    y = mx.nd.array(rng.randint(0, 10, batch))
    return net, x, y


def _seen_by_optimizer(trainer, step):
    """Run `step()` with the optimizer's update_multi_precision wrapped on the instance;
    return the dtype names of the weights and gradients it received."""
    opt = trainer.optimizer
    seen = {'weights': set(), 'grads': set()}

    def listed(x):
        return x if isinstance(x, (list, tuple)) else [x]

    def spy(index, weight, grad, state):
        seen['weights'].update(_dtype_name(w.dtype) for w in listed(weight))
        seen['grads'].update(_dtype_name(g.dtype) for g in listed(grad))
        return original(index, weight, grad, state)
    own = vars(opt).get('update_multi_precision')
    original = opt.update_multi_precision
    opt.update_multi_precision = spy
    try:
        step()
    finally:
        if own is None:
            del opt.update_multi_precision      # the class's method again
        else:
            opt.update_multi_precision = own
    if not seen['weights']:
        raise AssertionError('the optimizer received no update_multi_precision call')
    return {k: sorted(v) for k, v in seen.items()}


def _time_config(spec):
    import numpy as np
    import mxnet as mx
    mx.random.seed(spec['seed'])
    net, x, y = _model(spec['model'], np.random.RandomState(spec['seed']))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = mx.gluon.Trainer(net.collect_params(), spec['optimizer'],
                               OPTIMIZERS[spec['optimizer']])
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    batch = x.shape[0]
    fwd_bwd, step, total = [], [], []
    dtypes = None
    for i in range(WARMUP_STEPS + TIMED_STEPS):
        mx.nd.waitall()
        t0 = time.perf_counter()
        with mx.autograd.record():
            out = net(x)
            loss = loss_fn(out, y)
        loss.backward()
        mx.nd.waitall()
        t1 = time.perf_counter()
        if i == 0:                      # a warm-up step: the optimizer's view, not timed
            dtypes = _seen_by_optimizer(trainer, lambda: trainer.step(batch))
        else:
            trainer.step(batch)
        mx.nd.waitall()
        t2 = time.perf_counter()
        if i >= WARMUP_STEPS:
            fwd_bwd.append(1e3 * (t1 - t0))
            step.append(1e3 * (t2 - t1))
            total.append(1e3 * (t2 - t0))
    params = [p for p in net.collect_params().values() if p.grad_req != 'null']
    dtypes.update(output=_dtype_name(out.dtype),
                  params=sorted({_dtype_name(p.data().dtype) for p in params}),
                  param_grads=sorted({_dtype_name(p.grad().dtype) for p in params}))
    want_out = 'bfloat16' if spec['precision'] == 'bfloat16' else 'float32'
    if dtypes['output'] != want_out or any(
            dtypes[k] != ['float32'] for k in ('weights', 'grads', 'params', 'param_grads')):
        raise AssertionError('unexpected dtypes for %s: %s (want output %s, float32 '
                             'parameters and gradients)' % (spec, dtypes, want_out))
    return dict(fwd_bwd_ms=statistics.median(fwd_bwd), step_ms=statistics.median(step),
                total_ms=statistics.median(total), dtypes=dtypes,
                parameters=int(sum(p.data().size for p in params)))


def _train_config(spec):
    """TRAIN_STEPS steps of 'lbsgd' on 3 Gaussian blobs in 32 dimensions (512 samples,
    batches of 64); the loss (mean over the batch) of every step, the final accuracy."""
    import numpy as np
    import mxnet as mx
    mx.random.seed(spec['seed'])
    rng = np.random.RandomState(spec['seed'])
    centers = rng.normal(0, 0.25, (3, 32))
    labels = rng.randint(0, 3, 512)
    data = centers[labels] + rng.normal(0, 1.0, (512, 32))
    x_all, y_all = mx.nd.array(data), mx.nd.array(labels)
    nn = mx.gluon.nn
    net = nn.HybridSequential()
    net.add(nn.Dense(64, activation='relu'), nn.Dense(3))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, warmup_strategy='linear', warmup_epochs=1,
        updates_per_epoch=8))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for i in range(TRAIN_STEPS):
        j = 64 * (i % 8)
        x, y = x_all[j:j + 64], y_all[j:j + 64]
        with mx.autograd.record():
            out = net(x)
            loss = loss_fn(out, y)
        loss.backward()
        trainer.step(64)
        losses.append(float(loss.astype('float32').mean().asscalar()))
    predicted = net(x_all).astype('float32').argmax(axis=1).asnumpy()
    params = [p for p in net.collect_params().values() if p.grad_req != 'null']
    return dict(losses=losses, first_loss=losses[0], last_loss=losses[-1],
                first_epoch_mean_loss=statistics.mean(losses[:8]),
                last_epoch_mean_loss=statistics.mean(losses[-8:]),
                accuracy=float((predicted == labels).mean()), output=_dtype_name(out.dtype),
                params=sorted({_dtype_name(p.data().dtype) for p in params}),
                param_grads=sorted({_dtype_name(p.grad().dtype) for p in params}))


def _worker(argument):
    """In a fresh interpreter: amp.init if asked, run one configuration, print one JSON
    line with its results and the process's peak resident memory."""
    spec = json.loads(argument)
    import mxnet as mx  # noqa: F401
    import mx_lbsgd  # noqa: F401       (registers 'lbsgd' and 'lblamb')
    if spec['precision'] == 'bfloat16':
        from mxnet.contrib import amp
        amp.init(target_dtype='bfloat16')
    out = _train_config(spec) if spec['kind'] == 'train' else _time_config(spec)
    out['max_rss_mb'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    sys.stdout.write('\n' + json.dumps(out) + '\n')
    sys.stdout.flush()


def _in_subprocess(spec):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (_ROOT, env.get('PYTHONPATH')) if p)
    proc = subprocess.run([sys.executable, '-c', _WORKER, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError('the worker for %s failed (exit status %d):\n%s'
                           % (spec, proc.returncode, proc.stderr[-4000:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(rounds, seed=0):
    configs = [(m, p, o) for m in MODELS for p in PRECISIONS for o in OPTIMIZERS]
    per_round = {c: [] for c in configs}
    for r in range(rounds):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            m, p, o = c
            per_round[c].append(_in_subprocess(dict(kind='time', model=m, precision=p,
                                                    optimizer=o, seed=seed)))
    results = []
    for (m, p, o), runs in per_round.items():
        fp32 = per_round[(m, 'float32', o)]
        row = dict(model=m, precision=p, optimizer=o, parameters=runs[0]['parameters'],
                   dtypes=runs[0]['dtypes'], rounds=runs)
        for key in ('fwd_bwd_ms', 'step_ms', 'total_ms', 'max_rss_mb'):
            row[key] = statistics.median(x[key] for x in runs)
        for key in ('fwd_bwd_ms', 'step_ms', 'total_ms'):
            row[key.replace('_ms', '_vs_float32')] = statistics.median(
                a[key] / b[key] for a, b in zip(runs, fp32))
        results.append(row)
    training = {p: _in_subprocess(dict(kind='train', precision=p, seed=seed))
                for p in PRECISIONS}
    loss_gap = max(abs(a - b) for a, b in zip(training['bfloat16']['losses'],
                                               training['float32']['losses']))
    return dict(machine=machine(), models={
        'mlp': '4 x Dense(1024, relu) + Dense(10); batch 256 x 1024 features',
        'convnet': '3 x (Conv2D(64, 3x3, strides 1, 2, 1) + BatchNorm + ReLU) + Dense(10); '
                   'batch 64 x 3x32x32'}, optimizers=OPTIMIZERS, hybridized=True,
        rounds=rounds, warmup_steps=WARMUP_STEPS, timed_steps_per_round=TIMED_STEPS,
        results=results, training=dict(task="'lbsgd', %d steps, 3 Gaussian blobs in 32 "
                                       'dimensions, Dense(64, relu) + Dense(3), batch 64'
                                       % TRAIN_STEPS, runs=training,
                                       max_loss_gap_bfloat16_float32=loss_gap))


def _short(names):
    return '/'.join({'float32': 'f32', 'bfloat16': 'bf16'}.get(n, n) for n in names)


def main(argv=None):
    p = Parser(prog='bench_amp', description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=number(int, 1), default=5)
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)
    check_output_option(p, '--json', args.json)
    out = run(args.rounds)
    out['command'] = shlex.join([sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))
    print(out['machine'])
    for model, what in out['models'].items():
        print('%s: %s' % (model, what))
    print('hybridized; each configuration in its own process; median of %d interleaved '
          'rounds of %d timed steps' % (args.rounds, TIMED_STEPS))
    print('%-8s %-9s %-7s %10s %8s %9s %10s %8s  %s' % (
        'model', 'precision', 'optim', 'fwd+bwd ms', 'step ms', 'total ms', 'bf16/fp32',
        'maxRSS MB', 'dtypes out|weights|grads'))
    for r in out['results']:
        d = r['dtypes']
        print('%-8s %-9s %-7s %10.1f %8.2f %9.1f %10s %9.0f  %s|%s|%s' % (
            r['model'], r['precision'], r['optimizer'], r['fwd_bwd_ms'], r['step_ms'],
            r['total_ms'], '%.2f' % r['total_vs_float32'] if r['precision'] == 'bfloat16'
            else '', r['max_rss_mb'], _short([d['output']]), _short(d['weights']),
            _short(d['grads'])))
    for prec, t in out['training']['runs'].items():
        print("training check, 'lbsgd' %s: loss %.3f -> %.3f in %d steps (mean of the "
              'first / last 8: %.3f -> %.3f), accuracy %.3f' % (
                  prec, t['first_loss'], t['last_loss'], len(t['losses']),
                  t['first_epoch_mean_loss'], t['last_epoch_mean_loss'], t['accuracy']))
    print('largest loss difference bfloat16 - float32 over the steps: %.4f'
          % out['training']['max_loss_gap_bfloat16_float32'])
    save_json(args.json, out, p.prog)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
