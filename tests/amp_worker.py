"""Run by tests/test_amp.py in a fresh interpreter (``contrib.amp.init`` runs once per
process): ``amp.init`` before or after ``import mx_lbsgd``, a user's wrapper on
``mx.nd.FullyConnected`` and ``mx.sym.FullyConnected``, then training steps with the
package's optimizers on the Gluon path (a Trainer, hybridized and not) and on the symbolic
path (Module.fit); the first step loads the native operators when they are built. Prints
one JSON line: whether AMP was active before and after the steps, which operator functions
of MXNet changed identity, how often the user's wrapper ran, and what the optimizers saw.

    python amp_worker.py bfloat16|float16 before|after [matmul|no-matmul]

The models trained: ``matmul`` (bfloat16's default) Dense / FullyConnected layers, which
AMP runs in bfloat16, forward and backward: that needs MXNet's oneDNN to train bfloat16
(AVX512, `mx_lbsgd.amp_support`). ``no-matmul`` (float16's only choice: the CPU wheel has
no float16 matmul) an embedding and elementwise operators, which AMP keeps in float32, so
the steps run on any CPU; the bfloat16 Dense layers are then only typed (their output
dtype, the Module graph's casts), and whether their forward ran is reported.
"""
import json
import sys
import types

dtype, order = sys.argv[1], sys.argv[2]
model = sys.argv[3] if len(sys.argv) > 3 else \
    ('matmul' if dtype == 'bfloat16' else 'no-matmul')
assert model in ('matmul', 'no-matmul') and (dtype == 'bfloat16' or model == 'no-matmul')
import mxnet as mx  # noqa: E402
from mxnet.contrib import amp  # noqa: E402

if order == 'before':
    amp.init(target_dtype=dtype)
    import mx_lbsgd
else:
    import mx_lbsgd
    amp.init(target_dtype=dtype)
import numpy as np  # noqa: E402

calls = []


def user_wrapper(function):
    def wrapped(*args, **kwargs):
        calls.append(function.__name__)
        return function(*args, **kwargs)
    return wrapped


mx.nd.FullyConnected = user_wrapper(mx.nd.FullyConnected)
mx.sym.FullyConnected = user_wrapper(mx.sym.FullyConnected)


def operator_functions():
    """Every function object held by a module of MXNet (mx.nd, mx.sym, mx.np, mx.npx and
    their submodules included), by (module, name)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if (name == 'mxnet' or name.startswith('mxnet.')) and module is not None:
            for attr, value in list(vars(module).items()):
                if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
                    found[(name, attr)] = value
    return found


def dtype_name(t):
    """numpy's name of a dtype; MXNet's bfloat16 is a structured numpy dtype."""
    t = np.dtype(t)
    return t.names[0] if t.names else t.name


forward_ran = []      # per amp_active() call (bfloat16): whether the Dense forward ran


def amp_active():
    """AMP's casts on the imperative path (mx.nd) and the symbolic path (mx.sym)."""
    net = mx.gluon.nn.Dense(2, in_units=4)
    net.initialize()
    if dtype == 'bfloat16':
        # the output's dtype is decided when the operator is queued; running it needs
        # MXNet's bfloat16 kernels (where they are missing, the error is taken here)
        out = net(mx.nd.ones((2, 4)))
        imperative = dtype_name(out.dtype) == 'bfloat16'
        try:
            out.wait_to_read()
            forward_ran.append(True)
        except mx.MXNetError as error:
            forward_ran.append(str(error).splitlines()[0])
    else:
        # AMP casts FullyConnected's float32 inputs to float16, which MXNet's CPU build
        # refuses: the refusal shows the cast happened
        try:
            mx.nd.FullyConnected(mx.nd.ones((2, 4)), mx.nd.ones((2, 4)), mx.nd.zeros(2),
                                 num_hidden=2).wait_to_read()
            imperative = False
        except mx.MXNetError as error:
            imperative = 'float16' in str(error)
    net.hybridize()
    out_types = net(mx.sym.var('data')).infer_type(data='float32')[1]
    symbolic = [dtype_name(t) for t in out_types] == [dtype]
    return {'imperative': imperative, 'symbolic': symbolic}


def gluon_net():
    if model == 'matmul':
        net = mx.gluon.nn.HybridSequential()
        net.add(mx.gluon.nn.Dense(8, in_units=4, activation='relu'),
                mx.gluon.nn.Dense(3, in_units=8))
        return net, lambda x: net(x)
    # float16 AMP cannot run a matmul on CPU: an embedding and elementwise ops
    net = mx.gluon.nn.Embedding(12, 3)
    return net, lambda x: net(x.sum(axis=1).clip(0, 11)).tanh()


def train_gluon(name, options, hybridize):
    net, forward = gluon_net()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    trainer = mx.gluon.Trainer(net.collect_params(), name, options)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    first = {k: p.data().asnumpy().copy() for k, p in net.collect_params().items()}
    out_dtype = None
    for _ in range(4):
        x = mx.nd.array(rng.uniform(0, 3, (8, 4)))
        y = mx.nd.array(rng.randint(0, 3, 8))
        with mx.autograd.record():
            out = forward(x)
            loss = loss_fn(out, y)
        loss.backward()
        trainer.step(8)
        out_dtype = dtype_name(out.dtype)
    params = net.collect_params().values()
    return {'weights_fp32': all(p.data().dtype == np.float32 for p in params),
            'grads_fp32': all(p.grad().dtype == np.float32 for p in params),
            'changed': all(not np.array_equal(first[k], p.data().asnumpy())
                           for k, p in net.collect_params().items()),
            'out_dtype': out_dtype}


def fc_symbol(data):
    # the weights' types given: AMP's amp_cast in front of them hides them from Module's
    # type inference (MXNet's own 'sgd' fails the same way without them)
    return mx.sym.FullyConnected(data, mx.sym.var('fc_weight', dtype='float32'),
                                 mx.sym.var('fc_bias', dtype='float32'), num_hidden=3,
                                 name='fc')


def module_graph():
    """A FullyConnected Module under bfloat16 AMP, bound for training (nothing run): the
    graph's casts and the layer's output dtype."""
    fc = fc_symbol(mx.sym.var('data'))
    sym = mx.sym.SoftmaxOutput(fc, name='softmax')
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('softmax_label', (8,))])
    return {'bound': mod.binded,
            'amp_cast_in_graph': 'amp_cast' in sym.tojson(remove_amp_cast=False),
            'fc_dtype': dtype_name(fc.infer_type(data='float32')[1][0])}


def registered():
    """The class each of the package's optimizer names creates."""
    return {name: type(mx.optimizer.create(name)).__name__
            for name in ('lbsgd', 'lssgd', 'lblamb')}


def train_module(name, options):
    data = mx.sym.var('data')
    if model == 'matmul':
        out = fc_symbol(data)
    else:
        # bfloat16 AMP casts Embedding's inputs to float32, which hides the weight's type
        # as it hides FullyConnected's
        weight = {'weight': mx.sym.var('emb_weight', dtype='float32')} \
            if dtype == 'bfloat16' else {}
        out = mx.sym.Embedding(mx.sym.clip(mx.sym.sum(data, axis=1), 0, 11), input_dim=12,
                               output_dim=3, name='emb', **weight)
    sym = mx.sym.SoftmaxOutput(out, name='softmax')
    rng = np.random.RandomState(1)
    it = mx.io.NDArrayIter(rng.uniform(0, 3, (32, 4)).astype('float32'),
                           rng.randint(0, 3, 32).astype('float32'), batch_size=8,
                           label_name='softmax_label')
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.fit(it, optimizer=name, optimizer_params=options, num_epoch=1,
            initializer=mx.init.Xavier())
    arg_params, _ = mod.get_params()
    return {'weights_fp32': all(v.dtype == np.float32 for v in arg_params.values()),
            'amp_cast_in_graph': 'amp_cast' in sym.tojson(remove_amp_cast=False)}


before = operator_functions()
active_before = amp_active()
calls.clear()
runs = {
    'lbsgd': train_gluon('lbsgd', dict(learning_rate=0.1, momentum=0.9, batch_scale=2,
                                       lars=True, warmup_strategy='linear',
                                       updates_per_epoch=4), hybridize=False),
    'lbsgd_hybrid': train_gluon('lbsgd', dict(learning_rate=0.1, momentum=0.9),
                                hybridize=True),
    'lssgd': train_gluon('lssgd', dict(learning_rate=0.1, momentum=0.9), hybridize=False),
    'lblamb': train_gluon('lblamb', dict(learning_rate=0.01), hybridize=True),
    'module_lbsgd': train_module('lbsgd', dict(learning_rate=0.1, momentum=0.9)),
}
calls_during_training = len(calls)
graph = module_graph() if dtype == 'bfloat16' else None
after = operator_functions()
active_after = amp_active()
print(json.dumps({
    'native': mx_lbsgd.native_library() is not None,
    'model': model,
    'registered': registered(),
    'bf16_forward_ran': forward_ran,
    'module_graph': graph,
    'active_before': active_before,
    'active_after': active_after,
    'user_wrapper_calls_after': calls[calls_during_training:],
    'changed': sorted('%s.%s' % key for key in before if after.get(key) is not before[key]),
    'added': sorted('%s.%s' % key for key in after if key not in before
                    and not key[0].startswith('mxnet.contrib.amp')),
    'user_wrapper_calls': calls_during_training,
    'runs': runs,
}))
