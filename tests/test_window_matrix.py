"""The accumulation window on every path: optimizer x dtype x batch_scale x kernel path x
entry, against the numpy float64 reference (tests/reference.py).

- optimizers: 'lbsgd' (linear warmup), 'lbsgd' with LARS, 'lbsgd' with LARS and Nesterov
  momentum, 'lssgd' (loss scaling, B=1 only), 'lblamb';
- dtypes: float32; float16 weights with fp32 master copies (multi_precision);
- batch_scale 1 and 4;
- kernel paths: fused=None (the native operators when built, else MXNet's operators routed
  by size), fused=True (MXNet's multi-tensor operators), fused=False (per tensor). CI runs
  this file with MX_LBSGD_NATIVE=1 and again with MX_LBSGD_NATIVE=0;
- entries: a gluon Trainer (the window at its reduction; with float16, a dynamic loss scaler
  in the optimizer, as the BERT recipe), the `LossScaling` hook, `Module.fit`, a bare
  Updater (`mx.optimizer.get_updater`) and a Trainer that updates on the kvstore (two
  contexts), where the optimizer allows it (a loss scaler refuses kvstore updates).

With float16 weights every run also asserts that each weight equals its master copy cast
to float16: a path that updates the master copy but never writes the weight fails here on
the fallback path too.
"""
import os
import pickle
import tempfile
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from reference import LBSGDReference, clip_coefficient, lamb_step

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

SHAPES = [(3, 4), (5,), (2, 3, 2), (1,)]
NAMES = ['fc0_weight', 'fc0_bias', 'conv0_weight', 'bn0_gamma']
RESCALE = 0.5          # trainer.step(2), and the optimizer's rescale_grad elsewhere
LOSS_SCALE = 8.0       # a power of two: scaled float16 gradients stay exact
WINDOWS = 2            # updates per run (3 with batch_scale=1)

OPTIMIZERS = {
    'lbsgd': ('lbsgd', dict(learning_rate=0.1, momentum=0.9, wd=1e-3, warmup_strategy='linear',
                            warmup_epochs=1, updates_per_epoch=4)),
    'lars': ('lbsgd', dict(learning_rate=0.1, momentum=0.9, wd=1e-3, warmup_strategy='linear',
                           warmup_epochs=1, updates_per_epoch=4, lars=True)),
    # Nesterov momentum (MXNet NAG's rule) with warmup and LARS
    'nag-lars': ('lbsgd', dict(learning_rate=0.1, momentum=0.9, wd=1e-3,
                               warmup_strategy='linear', warmup_epochs=1,
                               updates_per_epoch=4, lars=True, nesterov=True)),
    'lssgd': ('lssgd', dict(learning_rate=0.1, momentum=0.9, wd=1e-3)),
    'lblamb': ('lblamb', dict(learning_rate=0.01, wd=0.01)),
}
DTYPES = ['fp32', 'fp16mp']
PATHS = {'default': None, 'multi': True, 'pertensor': False}
ENTRIES = ['trainer', 'hook', 'module', 'updater', 'kvstore']


def _allowed(opt, entry, batch_scale):
    if opt == 'lssgd':
        # SGD with loss scaling only: no batch_scale; it scales itself (no hook) and a
        # loss scaler refuses updates on the kvstore
        return batch_scale == 1 and entry in ('trainer', 'module', 'updater')
    return True


MATRIX = [pytest.param(o, d, b, p, e, id='%s-%s-B%d-%s-%s' % (o, d, b, p, e))
          for o in OPTIMIZERS for d in DTYPES for b in (1, 4) for p in PATHS for e in ENTRIES
          if _allowed(o, e, b)]


def _micro_batches(count):
    """Per micro-batch, per parameter, a gradient of values exact in float16."""
    rng = np.random.RandomState(7)
    return [[rng.uniform(-1, 1, s).astype(np.float16).astype(np.float64) for s in SHAPES]
            for _ in range(count)]


def _start(dtype):
    rng = np.random.RandomState(3)
    return [rng.uniform(-1, 1, s).astype(dtype).astype(np.float64) for s in SHAPES]


def _scaled(opt, dtype, entry):
    """The loss scale of this run's gradients, and whether the optimizer holds a scaler."""
    if opt == 'lssgd':
        return LOSS_SCALE, True
    if entry == 'hook':
        return LOSS_SCALE, False
    if entry == 'trainer' and dtype == 'float16':
        return LOSS_SCALE, True
    return 1.0, False


def _optimizer(opt, dtype, batch_scale, fused, entry, extra=None):
    name, args = OPTIMIZERS[opt]
    args = dict(args, multi_precision=dtype == 'float16', fused=fused, **(extra or {}))
    if opt != 'lssgd':
        args['batch_scale'] = batch_scale
    scale, own = _scaled(opt, dtype, entry)
    if own:
        args['loss_scaler'] = mx_lbsgd.DynamicLossScaler(init_scale=scale,
                                                         growth_interval=10 ** 6)
    if entry in ('module', 'updater'):
        args['rescale_grad'] = RESCALE
    if entry == 'updater':
        args['param_idx2name'] = dict(enumerate(NAMES))
    return mx.optimizer.create(name, **args)


# -- the entries: each returns (weights as float64 arrays, {index: state}, optimizer) ----

def _gluon(opt, dtype, start, micro, scale, ctxs, kvstore, hook):
    params = [gluon.Parameter(n, shape=s, dtype=dtype) for n, s in zip(NAMES, SHAPES)]
    for p, w in zip(params, start):
        p.initialize(ctx=ctxs)
        p.set_data(nd.array(w, dtype=dtype))
    trainer = gluon.Trainer(params, opt, kvstore=kvstore,
                            update_on_kvstore=True if kvstore else None)
    scaling = None
    if hook:
        scaling = mx_lbsgd.LossScaling(trainer, mx_lbsgd.DynamicLossScaler(
            init_scale=scale, growth_interval=10 ** 6), force=True)
    for grads in micro:
        with autograd.record():
            losses = [nd.add_n(*[(p.data(c) * nd.array(g, ctx=c, dtype=dtype)).sum()
                                 for p, g in zip(params, grads)]).astype('float32')
                      for c in ctxs]
            if scaling is not None:
                losses = [scaling.scale_loss(loss) for loss in losses]
            elif scale != 1.0:
                losses = [loss * scale for loss in losses]
        autograd.backward(losses)
        if scaling is not None:
            assert scaling.step(2)
        else:
            trainer.step(2)
    for p in params:                       # every device holds the same weights
        for d in p.list_data()[1:]:
            np.testing.assert_array_equal(d.asnumpy(), p.data(ctxs[0]).asnumpy())
    return ([p.data(ctxs[0]).asnumpy().astype(np.float64) for p in params],
            _trainer_states(trainer), trainer.optimizer)


def _saved(save):
    """What `save(path)` writes (a pickle), read back."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'states')
        save(path)
        with open(path, 'rb') as f:
            return pickle.loads(f.read())


def _trainer_states(trainer):
    states = _saved(trainer.save_states)
    return states[0] if isinstance(states, tuple) else states


def _module(opt, dtype, start, micro, scale):
    terms = []
    for i, (name, shape) in enumerate(zip(NAMES, SHAPES)):
        w = mx.sym.Variable(name, shape=shape, dtype=dtype)
        c = mx.sym.Variable('c%d' % i)
        terms.append(mx.sym.sum(w * mx.sym.Cast(mx.sym.reshape(c, shape=shape), dtype=dtype)))
    out = mx.sym.add_n(*terms)
    if scale != 1.0:
        out = mx_lbsgd.scale_gradient(out)
    loss = mx.sym.MakeLoss(out)
    data = {'c%d' % i: np.stack([m[i] for m in micro]).reshape((len(micro), -1))
            for i in range(len(NAMES))}       # float32 inputs, cast in the graph
    last = 'c%d' % (len(NAMES) - 1)        # Module needs a label: the last input
    train = mx.io.NDArrayIter({k: v for k, v in data.items() if k != last},
                              {last: data[last]}, batch_size=1)
    mod = mx.mod.Module(loss, data_names=sorted(set(data) - {last}), label_names=[last],
                        context=mx.cpu())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # rescale_grad is not 1/batch_size: on purpose
        mod.fit(train, num_epoch=1, optimizer=opt, eval_metric='loss',
                arg_params={n: nd.array(w, dtype=dtype) for n, w in zip(NAMES, start)})
    arg_params, _ = mod.get_params()
    states = _saved(mod.save_optimizer_states)
    # Module's parameter index i: the i-th argument that is not an input
    order = [n for n in loss.list_arguments() if n not in data]
    weights = [arg_params[n].asnumpy().astype(np.float64) for n in NAMES]
    return weights, {NAMES.index(n): states[i] for i, n in enumerate(order)}, opt


def _updater(opt, dtype, start, micro, scale):
    updater = mx.optimizer.get_updater(opt)
    weights = [nd.array(w, dtype=dtype) for w in start]
    for grads in micro:
        updater(list(range(len(weights))), [nd.array(g * scale, dtype=dtype) for g in grads],
                weights)
    states = pickle.loads(updater.get_states(dump_optimizer=False))
    return [w.asnumpy().astype(np.float64) for w in weights], states, opt


def _run(opt, dtype, batch_scale, fused, entry, start, micro, extra=None):
    optimizer = _optimizer(opt, dtype, batch_scale, fused, entry, extra)
    scale, _ = _scaled(opt, dtype, entry)
    if entry in ('trainer', 'hook'):
        return _gluon(optimizer, dtype, start, micro, scale, [mx.cpu()], None,
                      entry == 'hook')
    if entry == 'kvstore':
        return _gluon(optimizer, dtype, start, micro, scale, [mx.cpu(0), mx.cpu(1)],
                      'device', False)
    if entry == 'module':
        return _module(optimizer, dtype, start, micro, scale)
    return _updater(optimizer, dtype, start, micro, scale)


# -- the reference ----------------------------------------------------------------------

def _reference(opt, batch_scale, start, micro, wd_mults, max_grad_norm=None):
    """The float64 weights after `micro`, and the clip coefficient of each update."""
    if opt == 'lblamb':
        w = [x.copy() for x in start]
        moments = [(np.zeros_like(x), np.zeros_like(x)) for x in w]
        coefficients = []
        for t, k in enumerate(range(0, len(micro), batch_scale), start=1):
            means = [sum(m[i] for m in micro[k:k + batch_scale]) / batch_scale
                     for i in range(len(w))]
            coefficients.append(clip_coefficient(means, RESCALE, max_grad_norm))
            for i in range(len(w)):
                g = coefficients[-1] * means[i]
                w[i], *moments[i] = lamb_step(w[i], g, *moments[i], t=t, lr=0.01,
                                              wd=0.01 * wd_mults.get(NAMES[i], 1.0),
                                              rescale=RESCALE)
        return w, coefficients
    args = OPTIMIZERS[opt][1]
    ref = LBSGDReference(start, NAMES, lr=args['learning_rate'], wd=args['wd'],
                         momentum=args['momentum'], strategy='linear',
                         B=batch_scale, warmup_epochs=args.get('warmup_epochs', 0),
                         updates_per_epoch=args.get('updates_per_epoch', 32),
                         rescale=RESCALE, lars=bool(args.get('lars')), wd_mults=wd_mults,
                         max_grad_norm=max_grad_norm, nesterov=bool(args.get('nesterov')))
    for grads in micro:
        ref.step(grads)
    return ref.w, ref.coefficients


def _rounded_window_means(micro, batch_scale, scale):
    """Each window's micro-batches replaced by B copies of its mean as the Trainer writes
    it into float16 gradient buffers (in units of the loss-scaled gradient)."""
    out = []
    for k in range(0, len(micro), batch_scale):
        window = micro[k:k + batch_scale]
        means = [(np.float16(scale * sum(m[i] for m in window) / batch_scale)
                  .astype(np.float64) / scale) for i in range(len(NAMES))]
        out += [means] * batch_scale
    return out


@pytest.mark.parametrize('opt, dtype_id, batch_scale, path, entry', MATRIX)
def test_window_matrix(opt, dtype_id, batch_scale, path, entry):
    check_against_reference(opt, dtype_id, batch_scale, path, entry)


def check_against_reference(opt, dtype_id, batch_scale, path, entry, max_grad_norm=None):
    """Run one case of the matrix and compare it with the reference; returns the
    optimizer and the reference's clip coefficients."""
    dtype = 'float16' if dtype_id == 'fp16mp' else 'float32'
    steps = WINDOWS * batch_scale if batch_scale > 1 else 3
    start = _start(dtype)
    micro = _micro_batches(steps)
    extra = {'max_grad_norm': max_grad_norm} if max_grad_norm else None
    weights, states, optimizer = _run(opt, dtype, batch_scale, PATHS[path], entry, start,
                                      micro, extra)
    # two contexts each computed the micro-batch's gradient: the kvstore sums them
    seen = [[2 * g for g in m] for m in micro] if entry == 'kvstore' else micro
    if entry == 'trainer' and dtype == 'float16' and batch_scale > 1:
        # the window at the Trainer communicates its mean in the gradients' dtype
        seen = _rounded_window_means(seen, batch_scale, _scaled(opt, dtype, entry)[0])
    # MXNet's Optimizer(param_idx2name=...) sets wd_mult 0 for names not ending in
    # _weight or _gamma (Gluon and Module do not pass names that way)
    wd_mults = ({n: 0.0 for n in NAMES if not n.endswith(('_weight', '_gamma'))}
                if entry == 'updater' else {})
    ref, coefficients = _reference(opt, batch_scale, start, seen, wd_mults, max_grad_norm)
    lamb = opt == 'lblamb'
    for i, (w, r) in enumerate(zip(weights, ref)):
        got = w
        if dtype == 'float16':
            _, master, _ = optimizer.split_state(nd.zeros(SHAPES[i], dtype=dtype), states[i])
            master = master.asnumpy()
            # the weight is its master copy cast to float16, on every path
            np.testing.assert_array_equal(w.astype(np.float16), master.astype(np.float16),
                                          err_msg='%s: weight != master copy' % NAMES[i])
            got = master.astype(np.float64)
        np.testing.assert_allclose(got, r, rtol=1e-4 if lamb else 2e-5,
                                   atol=1e-5 if lamb else 2e-6, err_msg=NAMES[i])
    assert optimizer.applied_updates == steps // batch_scale
    return optimizer, coefficients
