"""Training used by the kvstore tests: run in-process (the reference, local/device kvstores)
or as a worker of a `dist_sync` job started by `mx_lbsgd.launch`.

    python tests/dist_worker.py CONFIG_JSON OUT_DIR

A config names the API ('gluon' or 'module'), kvstore ('horovod': horovod's
DistributedTrainer / DistributedOptimizer, started by horovodrun), update_on_kvstore,
optimizer and its parameters, steps, the per-worker batch, contexts per worker, `inject`
({step: rank}: that rank writes `inject_value` (inf) into one gradient after backward),
`compression` ('fp16', horovod), `mults` ({'lr'|'wd': {name: mult}}: set on the
Parameters in Gluon, through `set_lr_mult`/`set_wd_mult` on Module's optimizer) and
`resume` ({'at': step, 'per_rank': bool}: save states and weights there, rank 0 only
unless per_rank, rebuild everything and load them on every rank), `reports` (save the
optimizer's or hook's `last_overflow` of every step, as dicts, in rankR.reports.json),
`hook_clip` (LossScaling(max_grad_norm=...)) and `check_local` (LossScaling(check_local=True), or check_local_overflow=True on the
optimizer). Worker r of n trains on
samples [s*n*b + r*b, s*n*b + (r+1)*b) at step s, so n workers of batch b see what one
process of batch n*b sees. Each worker saves its weights, loss scales and skip flags, and
the gradient reductions (pushpull / allreduce calls) of every step, and the optimizer's or
hook's ``last_grad_norm`` after every step (``norms``; NaN without clipping).
`sharded` (mx_lbsgd.ShardedTrainer under horovod), `perturb_rank` (that rank's first
parameter differs), `die_in_save` (that rank exits inside save_states), `split_step` (allreduce_grads() then
update() instead of step()), `dtype`
('float16' parameters), `stop_at` (save net.params and
trainer.states into the output folder before that step and stop) and `start_from`
({'dir', 'at'}: load them and train from that step, at any world size) drive the sharding
tests; sharded (or `memory`) runs write rankR.info.json (state and accumulator bytes, the
partition, the bytes exchanged per update).
"""
import copy
import json
import os
import sys
import weakref

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mx_lbsgd  # noqa: E402
from harness import digits, mlp  # noqa: E402
from sparse_dist_worker import end_dist_worker  # noqa: E402

X, Y, _, _ = digits()


def _optimizer_params(cfg):
    defaults = dict(learning_rate=0.1, wd=1e-4)
    if cfg['optimizer'] != 'lblamb':            # LAMB has no momentum argument
        defaults['momentum'] = 0.9
    params = dict(defaults, **copy.deepcopy(cfg['params']))
    if 'loss_scaler' in params:
        params['loss_scaler'] = mx_lbsgd.DynamicLossScaler(**params['loss_scaler'])
        if cfg.get('check_local'):
            params['check_local_overflow'] = True
    return params


def _shard(step, rank, num_workers, batch):
    start = (step * num_workers + rank) * batch
    return X[start:start + batch], Y[start:start + batch]


COMM = []      # one entry per gradient reduction call (pushpull, horovod allreduce)
REPORTS = []   # cfg['reports']: the last_overflow of every step (a dict or None)
NORMS = []     # the clipping norm of every step (last_grad_norm; NaN without clipping)
INFO = {}      # sharded / memory runs: state and accumulator bytes, partition, exchange


def _keep_report(source):
    report = source.last_overflow
    REPORTS.append(None if report is None else dict(
        report.__dict__, parameters=dict(report.parameters), counts=dict(report.counts)))


def _count_kvstore(kv):
    original = kv.pushpull

    def counting(key, *args, **kwargs):
        COMM.append(key)
        return original(key, *args, **kwargs)
    kv.pushpull = counting


def _count_horovod():
    import horovod.mxnet as hvd
    for name in ('allreduce_', 'grouped_allreduce_'):
        original = getattr(hvd, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            tensors = kwargs.get('tensors', args[0] if args else None)
            COMM.extend([_name] * (len(tensors) if isinstance(tensors, (list, tuple)) else 1))
            return _original(*args, **kwargs)
        setattr(hvd, name, counting)


def _gluon_trainer(cfg, net, kv, num_workers):
    if cfg.get('kvstore') == 'horovod' and cfg.get('sharded'):
        return mx_lbsgd.ShardedTrainer(net.collect_params(), cfg['optimizer'],
                                       _optimizer_params(cfg)), cfg['batch']
    if cfg.get('kvstore') == 'horovod':
        import horovod.mxnet as hvd
        compression = hvd.Compression.fp16 if cfg.get('compression') == 'fp16' else \
            hvd.Compression.none
        return hvd.DistributedTrainer(net.collect_params(), cfg['optimizer'],
                                      _optimizer_params(cfg), compression=compression), \
            cfg['batch']                     # horovod averages: step(per-worker batch)
    trainer = gluon.Trainer(net.collect_params(), cfg['optimizer'], _optimizer_params(cfg),
                            kvstore=kv, update_on_kvstore=cfg.get('update_on_kvstore'))
    if kv is not None:
        mx_lbsgd.init_kvstore(trainer, cfg['batch'] * num_workers)
        _count_kvstore(trainer._kvstore or kv)
    return trainer, cfg['batch'] * num_workers


def _set_param_mults(cfg, net):
    """Gluon: `mults` ({'lr': {name: m}, 'wd': {name: m}}) on the Parameters."""
    for p in net.collect_params().values():
        short = p.name.split('_', 1)[1]
        for kind in ('lr', 'wd'):
            if short in cfg.get('mults', {}).get(kind, {}):
                setattr(p, kind + '_mult', cfg['mults'][kind][short])


class _Tiny(gluon.HybridBlock):
    """`body`'s logits times the mean of a learned vector of `size` elements in
    `param_dtype` (``tiny_scale``: with one element, a tensor with fewer elements than
    ranks; in float32 beside a float16 body, a second dtype)."""

    def __init__(self, body, dtype, size=1, param_dtype=None):
        super().__init__(prefix='tiny_')
        self.body = body
        self._dtype = dtype
        with self.name_scope():
            self.scale = self.params.get('scale', shape=(size,), dtype=param_dtype or dtype)
        self.scale.initialize(mx.init.Constant(1.0), ctx=mx.cpu())

    def hybrid_forward(self, F, x, scale):
        factor = F.cast(F.mean(scale, axis=0, keepdims=True), dtype=self._dtype)
        return F.broadcast_mul(self.body(x), factor)


def _net(cfg):
    """The digits MLP; `dtype` 'float16': float16 parameters (fp32 inside the products);
    `tiny`: times a learned scale (`_Tiny`: `tiny_size` elements in `tiny_dtype`)."""
    if cfg.get('dtype') == 'float16':
        from digits_mlp import mlp as typed_mlp
        net = typed_mlp((64,), dtype='float16')
    else:
        net = mlp()
    dtype = cfg.get('dtype', 'float32')
    return _Tiny(net, dtype, cfg.get('tiny_size', 1), cfg.get('tiny_dtype')) \
        if cfg.get('tiny') else net


def _gluon(cfg, kv, rank, num_workers, contexts):
    net = _net(cfg)
    if cfg.get('perturb_rank') == rank:       # a rank whose parameters differ
        list(net.collect_params().values())[0].data()[:] += 1e-3
    _set_param_mults(cfg, net)
    if len(contexts) > 1:
        net.collect_params().reset_ctx(contexts)
    trainer, step_batch = _gluon_trainer(cfg, net, kv, num_workers)
    hook = None
    if cfg.get('hook'):
        hook = mx_lbsgd.LossScaling(trainer, mx_lbsgd.DynamicLossScaler(**cfg['hook']),
                                    force=True, check_local=bool(cfg.get('check_local')),
                                    max_grad_norm=cfg.get('hook_clip'))
    NORMS.clear()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    record, comm = [], []
    resume = cfg.get('resume')
    first = 0
    if cfg.get('start_from'):         # a job that resumes another job's files (any size)
        first = cfg['start_from']['at']
        net.load_parameters(os.path.join(cfg['start_from']['dir'], 'net.params'), ctx=contexts)
        states = os.path.join(cfg['start_from']['dir'], 'trainer.states')
        if isinstance(trainer, mx_lbsgd.ShardedTrainer):
            trainer.load_states(states)
        else:                         # a consolidated file into an unsharded Trainer
            mx_lbsgd.checkpoint.load_states(trainer, states)
    for step in range(first, cfg['steps']):
        if resume and step == resume['at']:
            net, trainer = _resume(cfg, net, trainer, kv, rank, num_workers, contexts)
        if cfg.get('stop_at') == step:
            _save(cfg, net, trainer, rank)
            break
        x, y = _shard(step, rank, num_workers, cfg['batch'])
        opt = trainer.optimizer
        scale = opt.loss_scaler.scale if getattr(opt, 'loss_scaler', None) else 1.0
        scale = hook.scale if hook else scale
        xs = gluon.utils.split_and_load(nd.array(x), contexts)
        ys = gluon.utils.split_and_load(nd.array(y), contexts)
        with autograd.record():
            losses = [loss_fn(net(a.astype(cfg.get('dtype', 'float32'))).astype('float32'), b)
                      * scale for a, b in zip(xs, ys)]
        autograd.backward(losses)
        if cfg.get('inject', {}).get(str(step)) == rank:
            list(net.collect_params().values())[1].list_grad()[-1][:] = \
                cfg.get('inject_value', np.inf)
        before = len(COMM)
        if hook:
            hook.step(step_batch)
        elif cfg.get('split_step'):           # the Trainer interface's two halves
            trainer.allreduce_grads()
            trainer.update(step_batch)
        else:
            trainer.step(step_batch)
        comm.append(len(COMM) - before)
        record.append((hook.scaler.scale, hook.last_step_skipped) if hook
                      else _scale_record(trainer.optimizer))
        if cfg.get('reports'):
            _keep_report(hook or trainer.optimizer)
        norm = getattr(hook or trainer.optimizer, 'last_grad_norm', None)
        NORMS.append(float('nan') if norm is None else float(norm.asscalar()))
    weights = {p.name.split('_', 1)[1]: p.data(contexts[0]).asnumpy()
               for p in net.collect_params().values()}
    if cfg.get('sharded') or cfg.get('memory'):
        INFO.update(state_bytes=_state_bytes(trainer), partition=_partition(trainer),
                    exchange=_exchange(trainer), num_workers=num_workers)
    return weights, record, comm


def _state_bytes(trainer):
    """(optimizer state bytes, accumulator bytes) this rank holds."""
    if isinstance(trainer, mx_lbsgd.ShardedTrainer):
        return trainer.optimizer_state_bytes(), trainer.accumulator_bytes()
    opt, updater = trainer.optimizer, trainer._updaters[0]
    state = acc = 0
    for i, s in updater.states.items():
        family, master, accumulator = opt.split_state(trainer._params[i].data(), s)
        state += sum(a.size * np.dtype(a.dtype).itemsize for a in _flat((family, master)))
        acc += 0 if accumulator is None else accumulator.size * 4
    return state, acc


def _flat(state):
    if isinstance(state, nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for part in state for a in _flat(part)]
    return []


def _partition(trainer):
    return trainer.holders() if isinstance(trainer, mx_lbsgd.ShardedTrainer) else None


def _exchange(trainer):
    return trainer.exchange_bytes() if isinstance(trainer, mx_lbsgd.ShardedTrainer) else None


def _save(cfg, net, trainer, rank):
    """`stop_at`: save the weights (rank 0) and the trainer states, for another job."""
    folder = cfg['save_dir']
    if cfg.get('die_in_save') == rank:      # this rank dies in the middle of the save:
        # at the first allgather of the states
        mx_lbsgd._compat.horovod_allgather_into = _die
    if rank == 0 and not cfg.get('die_in_save'):
        net.save_parameters(os.path.join(folder, 'net.params'))
    if isinstance(trainer, mx_lbsgd.ShardedTrainer):
        trainer.save_states(os.path.join(folder, 'trainer.states'))   # every rank takes part
    elif rank == 0:
        mx_lbsgd.checkpoint.save_states(trainer, os.path.join(folder, 'trainer.states'))
    _barrier(cfg, None)


def _die(*args, **kwargs):
    """A rank lost in the middle of a save."""
    os._exit(1)


def _resume(cfg, net, trainer, kv, rank, num_workers, contexts):
    """Save (rank 0, or every rank with per_rank), rebuild net and trainer, load on every
    rank: what a restarted job does."""
    folder = cfg['resume']['dir']
    tag = rank if cfg['resume'].get('per_rank') else 0
    if rank == tag:
        net.save_parameters(os.path.join(folder, 'net%d.params' % tag))
    if isinstance(trainer, mx_lbsgd.ShardedTrainer):
        trainer.save_states(os.path.join(folder, 'trainer%d.states' % tag))
    elif rank == tag:
        mx_lbsgd.checkpoint.save_states(trainer, os.path.join(folder, 'trainer%d.states' % tag))
    _barrier(cfg, kv)
    net = _net(cfg)
    _set_param_mults(cfg, net)
    net.load_parameters(os.path.join(folder, 'net%d.params' % tag), ctx=contexts)
    trainer, _ = _gluon_trainer(cfg, net, kv, num_workers)
    states = os.path.join(folder, 'trainer%d.states' % tag)
    if isinstance(trainer, mx_lbsgd.ShardedTrainer):
        trainer.load_states(states)
    else:
        mx_lbsgd.checkpoint.load_states(trainer, states)
    return net, trainer


def _barrier(cfg, kv):
    if cfg.get('kvstore') == 'horovod':
        import horovod.mxnet as hvd
        hvd.allreduce(nd.ones((1,)), name='barrier').wait_to_read()
    elif kv is not None:
        kv._barrier()


def _scale_record(opt):
    scaler = getattr(opt, 'loss_scaler', None)
    return (scaler.scale, bool(opt.last_step_skipped)) if scaler else (1.0, False)


def _module(cfg, kv, rank, num_workers, contexts):
    data = mx.sym.Variable('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name='fc1'), 'relu')
    out = mx.sym.FullyConnected(h, num_hidden=10, name='fc2')
    if cfg['optimizer'] == 'lssgd':
        out = mx_lbsgd.scale_gradient(out)
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(out, name='softmax'), context=contexts)
    batch = cfg['batch']
    mod.bind([('data', (batch, 64))], [('softmax_label', (batch,))])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    if cfg.get('kvstore') == 'horovod':
        import horovod.mxnet as hvd
        params = dict(_optimizer_params(cfg), rescale_grad=1.0 / batch)
        if cfg.get('names'):
            params['param_idx2name'] = dict(enumerate(
                n for n in mod.symbol.list_arguments() if n not in ('data', 'softmax_label')))
        opt = hvd.DistributedOptimizer(mx.optimizer.create(cfg['optimizer'], **params))
        mod.init_optimizer(kvstore=None, optimizer=opt)
    else:
        mod.init_optimizer(kvstore=kv, optimizer=cfg['optimizer'],
                           optimizer_params=_optimizer_params(cfg))
    if cfg.get('mults'):      # by name, through horovod's wrapper where there is one
        mod._optimizer.set_lr_mult(cfg['mults'].get('lr', {}))
        mod._optimizer.set_wd_mult(cfg['mults'].get('wd', {}))
    record, comm = [], []
    for step in range(cfg['steps']):
        x, y = _shard(step, rank, num_workers, batch)
        mod.forward_backward(mx.io.DataBatch([nd.array(x)], [nd.array(y)]))
        if cfg.get('inject', {}).get(str(step)) == rank:
            mod._exec_group.grad_arrays[0][-1][:] = np.inf
        before = len(COMM)
        mod.update()
        comm.append(len(COMM) - before)
        record.append(_scale_record(mod._optimizer))
        if cfg.get('reports'):
            _keep_report(mod._optimizer)
    weights = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    return weights, record, comm


def train(cfg, kv=None, rank=0, num_workers=1):
    """Weights (by name), [(loss scale, skipped)] per step and reductions per step."""
    contexts = [mx.cpu(i) for i in range(cfg.get('contexts', 1))]
    run = _gluon if cfg['api'] == 'gluon' else _module
    return run(cfg, kv, rank, num_workers, contexts)


def main():
    """Train and save; a weakref to the kvstore of a dist job (for `end_dist_worker`)."""
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    if cfg.get('module_update_on_kvstore') is not None:
        os.environ['MXNET_UPDATE_ON_KVSTORE'] = str(int(cfg['module_update_on_kvstore']))
    if cfg['kvstore'] == 'horovod':
        import horovod.mxnet as hvd
        hvd.init()
        _count_horovod()
        kv, rank, size = None, hvd.rank(), hvd.size()
    else:
        kv = mx.kv.create(cfg['kvstore'])
        rank, size = kv.rank, kv.num_workers
    if cfg.get('resume'):
        cfg['resume']['dir'] = out
    if cfg.get('stop_at') is not None:
        cfg['save_dir'] = out
    try:
        weights, record, comm = train(cfg, kv, rank, size)
    except ValueError as err:        # a refusal: one line for the test to read
        print('rank %d ValueError: %s' % (rank, err), flush=True)
        sys.exit(3)
    np.savez(os.path.join(out, 'rank%d.npz' % rank), record=np.array(record, dtype=float),
             comm=np.array(comm), norms=np.array(NORMS, dtype=float), **weights)
    if cfg.get('reports'):
        with open(os.path.join(out, 'rank%d.reports.json' % rank), 'w') as f:
            json.dump(REPORTS, f)
    if INFO:
        with open(os.path.join(out, 'rank%d.info.json' % rank), 'w') as f:
            json.dump(INFO, f)
    print('rank %d done' % rank, flush=True)
    return weakref.ref(kv) if kv is not None and 'dist' in kv.type else None


if __name__ == '__main__':
    KV_REF = main()
    if KV_REF is not None:      # once main's frame is gone: see end_dist_worker
        end_dist_worker(KV_REF)
