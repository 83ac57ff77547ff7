"""Resume scenarios of ``lr_scaling='adascale'`` and ``batch_scale='auto'`` for
tests/test_scaling_resume.py: one process (gluon.Trainer), or a rank of a Horovod job
(Horovod's DistributedTrainer or mx_lbsgd.ShardedTrainer).

    python tests/scaling_resume_worker.py JOB_JSON OUT_DIR      # under horovodrun

JOB_JSON: {"phase": "first" | "second", "scenarios": [scenario, ...]}. A scenario names
`name`, `kind` ('gluon', 'horovod', 'sharded'), `optimizer` ('lbsgd': momentum 0.9;
'lblamb'), `batch_scale` (an int or 'auto', with `bounds` and `interval`) and `total`
micro-batches.

- phase "first": `run_whole` trains to `total` (rank's NAME.rR.whole.json), then `run_until`
  trains a fresh run to `stop` ({'after': n, 'where': 'boundary' | 'mid'}: the first count
  >= n at a window boundary or inside a window) and saves: states as the package documents
  (a ShardedTrainer: its own consolidated save_states, every rank; Horovod's
  DistributedTrainer: mx_lbsgd.checkpoint on rank 0 at a boundary, every rank its own file
  inside a window), and per rank the weights, the data rng's state and the virtual clock
  (NAME.rR.side.npz) and what the optimizer held (NAME.rR.saved.json).
- phase "second": `resume` builds a fresh run from a scenario's `resume`
  ({'name': the saved scenario, 'per_rank': bool, 'reseed': bool}: load the states of the
  saved scenario's file(s), its rank 0 (or own rank's) weights and rng; with `reseed` (a
  world size other than the saved one) rank R draws from a fresh rng of seed 7000 + R),
  records the data of the first update it applies and the optimizer after it, and trains
  to `total` (NAME.rR.resumed.json).

The problem is tests/test_lr_scaling.py's noisy linear regression (`_regression`; a bias
too, so that a ShardedTrainer has a parameter per rank); rank R draws its micro-batches of
B examples from np.random.RandomState(1000 + R). The window seconds come from
tests/test_batch_choice.py's virtual `_Clock` (the same on every rank and in every run), so
the window choice of a resumed run sees the uninterrupted run's times.
"""
import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import gluon, nd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mx_lbsgd  # noqa: E402
from test_batch_choice import _Clock, _step  # noqa: E402
from test_lr_scaling import B, D, NOISE, _regression  # noqa: E402

T_MICRO, T_UPDATE = 0.01, 0.05
BIAS0 = 0.3
#: lr_scaling_smoothing (its default, set here so that the tests' reference reads it)
SMOOTHING = 0.999


def problem():
    """(wstar, initial weight, initial bias): the same on every rank."""
    _, wstar, delta, _, _ = _regression(0)
    return wstar, (wstar + delta).astype('f'), np.array([BIAS0], 'f')


def optimizer_args(sc):
    args = dict(learning_rate=0.02 if sc['optimizer'] == 'lbsgd' else 0.01,
                lr_scaling='adascale', lr_scaling_smoothing=SMOOTHING,
                batch_scale=sc['batch_scale'])
    if sc['optimizer'] == 'lbsgd':
        args.update(momentum=0.9, warmup_epochs=0)
    if sc['batch_scale'] == 'auto':
        args.update(batch_scale_bounds=tuple(sc['bounds']),
                    batch_scale_interval=sc['interval'])
    return args


class Run:
    """A model, its Trainer, the rank's data rng and the virtual clock."""

    def __init__(self, sc, weight, bias, rng, now=None):
        self.sc = sc
        self.net = gluon.nn.Dense(1, in_units=D, prefix='lin_')
        self.net.initialize()
        self.net.weight.set_data(nd.array(weight))
        self.net.bias.set_data(nd.array(bias))
        params = self.net.collect_params()
        kind, name, args = sc['kind'], sc['optimizer'], optimizer_args(sc)
        if kind == 'gluon':
            self.trainer = gluon.Trainer(params, name, args)
        elif kind == 'horovod':
            import horovod.mxnet as hvd
            self.trainer = hvd.DistributedTrainer(params, name, args)
        else:
            self.trainer = mx_lbsgd.ShardedTrainer(params, name, args)
        self.opt = self.trainer.optimizer
        self.clock = _Clock(T_MICRO, T_UPDATE)
        if now is not None:
            self.clock.now = now
        self.opt._pieces.lr_gain._clock = self.clock
        self.rng = rng
        self.wstar = problem()[0]
        self.gains = []          # (applied updates, last_gain) after every applied update

    def batch(self):
        x = self.rng.normal(size=(B, D)).astype('f')
        return x, x @ self.wstar.T + NOISE * self.rng.normal(size=(B, 1)).astype('f')

    def micro_batch(self, record=None):
        x, y = self.batch()
        if record is not None:
            record.append((x.astype(np.float64).tolist(), y.astype(np.float64).tolist()))
        before = self.opt.applied_updates
        self.clock.step(self.opt, lambda: _step(self.net, self.trainer, x, y))
        if self.opt.applied_updates != before:
            self.gains.append((self.opt.applied_updates, self.opt.last_gain))

    def train(self, until, limit=1000):
        while until(self.opt):
            if self.opt.micro_batches >= limit:      # e.g. no window ever longer than 1
                raise RuntimeError('%s: no stop before %d micro-batches' % (self.sc['name'],
                                                                            limit))
            self.micro_batch()

    def weights(self):
        return (self.net.weight.data().asnumpy().astype(np.float64).tolist(),
                self.net.bias.data().asnumpy().astype(np.float64).tolist())

    def optimizer_view(self):
        """What the comparisons read: plain values, exact through JSON."""
        opt, gain = self.opt, self.opt._pieces.lr_gain
        chooser = gain.chooser
        view = dict(
            scale_invariant_steps=opt.scale_invariant_steps, last_gain=opt.last_gain,
            piece=gain.piece.state.as_dict(), window_history=opt.window_history,
            batch_scale=opt.batch_scale, micro_batches=opt.micro_batches,
            applied_updates=opt.applied_updates, window_position=opt.window_position)
        if chooser is not None:
            state = chooser.state
            view.update(timings=[(t.length, t.seconds) for t in state.timings],
                        timing_counts=[t.count for t in state.timings],
                        pending=state.pending, since_choice=state.since_choice,
                        chooser=state.as_dict())
        return view

    def outcome(self):
        weight, bias = self.weights()
        return dict(self.optimizer_view(), weight=weight, bias=bias, gains=self.gains)


def _barrier(sc):
    if sc['kind'] != 'gluon':
        import horovod.mxnet as hvd
        hvd.allreduce(nd.ones((1,)), name='scaling_resume.barrier').wait_to_read()


def _write(path, content):
    with open(path, 'w') as f:
        json.dump(content, f)


def fresh(sc, rank):
    _, weight, bias = problem()
    return Run(sc, weight, bias, np.random.RandomState(1000 + rank))


def run_whole(sc, out, rank):
    run = fresh(sc, rank)
    run.train(lambda o: o.micro_batches < sc['total'])
    _write(os.path.join(out, '%s.r%d.whole.json' % (sc['name'], rank)), run.outcome())


def _states_path(out, name, rank, per_rank):
    return os.path.join(out, '%s.r%d.states' % (name, rank) if per_rank
                        else '%s.states' % name)


def run_until(sc, out, rank):
    """Train to `stop`, save (see the module docstring); a ShardedTrainer inside a window
    first tries to save and records the refusal."""
    run = fresh(sc, rank)
    stop = sc['stop']
    refused = None
    run.train(lambda o: o.micro_batches < stop['after'])
    if sc['kind'] == 'sharded' and run.opt.window_position:
        try:
            run.trainer.save_states(os.path.join(out, '%s.refused.states' % sc['name']))
        except ValueError as err:
            refused = str(err)
    inside = stop['where'] == 'mid'
    run.train(lambda o: bool(o.window_position) != inside)
    per_rank = sc['kind'] == 'horovod' and inside
    path = _states_path(out, sc['name'], rank, per_rank)
    if sc['kind'] == 'sharded':
        run.trainer.save_states(path)              # every rank; rank 0 writes
    elif per_rank or rank == 0:
        mx_lbsgd.checkpoint.save_states(run.trainer, path)
    _barrier(sc)
    keys, pos, has_gauss, cached = run.rng.get_state()[1:]
    weight, bias = run.weights()
    np.savez(os.path.join(out, '%s.r%d.side.npz' % (sc['name'], rank)),
             weight=np.array(weight, 'f'), bias=np.array(bias, 'f'), rng_keys=keys,
             rng_pos=pos, rng_has_gauss=has_gauss, rng_cached=cached, now=run.clock.now)
    _write(os.path.join(out, '%s.r%d.saved.json' % (sc['name'], rank)),
           dict(run.optimizer_view(), refused=refused, per_rank=per_rank))


def load_side(out, name, rank):
    """(weight, bias, rng, clock time) a saved run's rank `rank` left."""
    side = np.load(os.path.join(out, '%s.r%d.side.npz' % (name, rank)))
    rng = np.random.RandomState()
    rng.set_state(('MT19937', side['rng_keys'], int(side['rng_pos']),
                   int(side['rng_has_gauss']), float(side['rng_cached'])))
    return side['weight'], side['bias'], rng, float(side['now'])


def resume(sc, out, rank):
    """A fresh run that loads the saved scenario's files (module docstring); returns the
    run after loading, before its first micro-batch, and the loaded view."""
    spec = sc['resume']
    per_rank = spec.get('per_rank', False)
    weight, bias, rng, now = load_side(spec.get('dir', out), spec['name'],
                                       rank if per_rank or not spec.get('reseed') else 0)
    if spec.get('reseed'):
        rng = np.random.RandomState(7000 + rank)
    run = Run(sc, weight, bias, rng, now)
    path = _states_path(spec.get('dir', out), spec['name'], rank, per_rank)
    if sc['kind'] == 'sharded':
        run.trainer.load_states(path)
    else:
        mx_lbsgd.checkpoint.load_states(run.trainer, path)
    return run, run.optimizer_view()


def first_update(run):
    """Train to the end of the first window the run applies; (the data of its micro-batches,
    the optimizer view after it, the window length and the weights before it)."""
    weights = run.weights()
    data = []
    start = run.opt.applied_updates
    while run.opt.applied_updates == start:
        run.micro_batch(record=data)
    # the length of the window just applied (a pending one took effect at its start)
    return dict(data=data, after=run.optimizer_view(), length=run.opt.batch_scale,
                weight=weights[0], bias=weights[1])


def run_resumed(sc, out, rank):
    run, loaded = resume(sc, out, rank)
    first = first_update(run) if sc.get('record_first') else None
    run.train(lambda o: o.micro_batches < sc['total'])
    _write(os.path.join(out, '%s.r%d.resumed.json' % (sc['name'], rank)),
           dict(run.outcome(), loaded=loaded, first=first))


def main():
    job, out = json.loads(sys.argv[1]), sys.argv[2]
    import horovod.mxnet as hvd
    hvd.init()
    rank = hvd.rank()
    for sc in job['scenarios']:
        if job['phase'] == 'first':
            run_whole(sc, out, rank)
            run_until(sc, out, rank)
        else:
            run_resumed(sc, out, rank)
    mx.nd.waitall()
    print('rank %d done' % rank, flush=True)


if __name__ == '__main__':
    main()
