"""Checkpoints: atomic saves, resume bit for bit (Trainer and Module), bad files."""
import os

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import checkpoint
from harness import digits, mlp

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

X, Y, XT, YT = digits()
STEPS = 8

OPTIMIZERS = [
    pytest.param('lbsgd', dict(warmup_strategy='linear', warmup_epochs=1, updates_per_epoch=6,
                               batch_scale=2), id='lbsgd-linear-B2'),
    pytest.param('lbsgd', dict(warmup_strategy='lars'), id='lbsgd-lars'),
    pytest.param('lssgd', dict(loss_scaler=mx_lbsgd.DynamicLossScaler(
        init_scale=2.0 ** 4, growth_interval=3)), id='lssgd'),
]


def gluon_steps(net, trainer, begin, end):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    scaler = getattr(trainer.optimizer, 'loss_scaler', None)
    for step in range(begin, end):
        x, y = nd.array(X[step * 32:(step + 1) * 32]), nd.array(Y[step * 32:(step + 1) * 32])
        with autograd.record():
            loss = loss_fn(net(x), y) * (scaler.scale if scaler else 1.0)
        loss.backward()
        trainer.step(32)


def fresh_trainer(name, params):
    import copy
    net = mlp()
    return net, gluon.Trainer(net.collect_params(), name, dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, **copy.deepcopy(params)), kvstore=None)


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_trainer_resume_bit_identical(tmp_path, name, params):
    net_a, trainer_a = fresh_trainer(name, params)
    gluon_steps(net_a, trainer_a, 0, STEPS)
    net_b, trainer_b = fresh_trainer(name, params)
    gluon_steps(net_b, trainer_b, 0, STEPS // 2 + 1)     # inside an accumulation window
    path = str(tmp_path / 'trainer.states')
    checkpoint.save_states(trainer_b, path)
    net_b.save_parameters(str(tmp_path / 'net.params'))
    net_c, trainer_c = fresh_trainer(name, params)
    net_c.load_parameters(str(tmp_path / 'net.params'))
    checkpoint.load_states(trainer_c, path)
    gluon_steps(net_c, trainer_c, STEPS // 2 + 1, STEPS)
    for a, c in zip(net_a.collect_params().values(), net_c.collect_params().values()):
        np.testing.assert_array_equal(a.data().asnumpy(), c.data().asnumpy())
    if name == 'lssgd':
        assert (trainer_c.optimizer.loss_scaler.state_dict()
                == trainer_a.optimizer.loss_scaler.state_dict())


def module(name, params):
    import copy
    data = mx.sym.Variable('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=32, name='fc1'), 'relu')
    out = mx.sym.FullyConnected(h, num_hidden=10, name='fc2')
    if name == 'lssgd':
        out = mx_lbsgd.scale_gradient(out)
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(out, name='softmax'), context=mx.cpu())
    train = mx.io.NDArrayIter(X[:640], Y[:640], batch_size=64, label_name='softmax_label')
    mod.bind(train.provide_data, train.provide_label)
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer=name, optimizer_params=dict(
        learning_rate=0.1, momentum=0.9, wd=1e-4, rescale_grad=1 / 64.,
        **copy.deepcopy(params)))
    return mod, train


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_module_save_checkpoint_resumes_bit_identical(tmp_path, name, params):
    mod_a, train = module(name, params)
    mod_a.fit(train, num_epoch=3)
    mod_b, train = module(name, params)
    prefix = str(tmp_path / 'run')
    mod_b.fit(train, num_epoch=1,
              epoch_end_callback=lambda epoch, *_: checkpoint.save_checkpoint(
                  mod_b, prefix, epoch + 1))
    assert sorted(os.listdir(tmp_path)) == ['run-0001.params', 'run-0001.params.sha256',
                                            'run-0001.states', 'run-symbol.json',
                                            'run-symbol.json.sha256']
    mod_c, train = module(name, params)
    mod_c.load_params(prefix + '-0001.params')
    checkpoint.load_states(mod_c, prefix + '-0001.states')
    mod_c.fit(train, num_epoch=3, begin_epoch=1)
    for key, value in mod_a.get_params()[0].items():
        np.testing.assert_array_equal(mod_c.get_params()[0][key].asnumpy(), value.asnumpy())
    assert mod_c._optimizer.num_update == mod_a._optimizer.num_update
    if name == 'lssgd':
        assert (mod_c._optimizer.loss_scaler.state_dict()
                == mod_a._optimizer.loss_scaler.state_dict())


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_module_own_save_load_keeps_states_like_mxnet(tmp_path, name, params):
    """Module.save/load_optimizer_states write the per-parameter states only (MXNet's
    layout): they come back exactly, the counters restart as with MXNet's optimizers."""
    mod_b, train = module(name, params)
    mod_b.fit(train, num_epoch=1)
    mod_b.save_optimizer_states(str(tmp_path / 'mod.states'))
    mod_c, train = module(name, params)
    mod_c.load_optimizer_states(str(tmp_path / 'mod.states'))
    saved, loaded = mod_b._updater.states, mod_c._updater.states
    assert sorted(saved) == sorted(loaded)
    for key in saved:
        for a, b in zip(_arrays(saved[key]), _arrays(loaded[key])):
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    mod_c.fit(train, num_epoch=2, begin_epoch=1)
    assert mod_c._optimizer.num_update == 10 < mod_b._optimizer.num_update + 10


def _arrays(state):
    return [s for s in (state if isinstance(state, tuple) else (state,)) if s is not None]


def test_states_interchangeable_with_mxnet_sgd(tmp_path):
    """lbsgd states load into mx.optimizer.SGD (fine-tuning after large-batch training)
    and SGD's load into lbsgd, through MXNet's own Trainer.save_states/load_states."""
    for first, second in [('lbsgd', 'sgd'), ('sgd', 'lbsgd')]:
        for dtype, mp in [('float32', False), ('float16', True)]:
            params = [gluon.Parameter('p%d' % i, shape=(3 + i,), dtype=dtype)
                      for i in range(3)]
            for p in params:
                p.initialize(mx.init.Uniform(1.0))
            args = dict(learning_rate=0.1, momentum=0.9, multi_precision=mp)
            a = gluon.Trainer(params, first, args, kvstore=None)
            _square_steps(params, a, 2)
            a.save_states(str(tmp_path / 'a.states'))
            b = gluon.Trainer(params, second, args, kvstore=None)
            b.load_states(str(tmp_path / 'a.states'))
            for key, state in a._updaters[0].states.items():
                for x, y in zip(_arrays(state), _arrays(b._updaters[0].states[key])):
                    np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())
            before = [p.data().asnumpy() for p in params]
            _square_steps(params, b, 2)
            assert all(not np.array_equal(x, p.data().asnumpy())
                       for x, p in zip(before, params))


def _square_steps(params, trainer, n):
    for _ in range(n):
        with autograd.record():
            loss = nd.add_n(*[p.data().astype('float32').square().sum() for p in params])
        loss.backward()
        trainer.step(1)


def test_truncated_or_corrupted_file_gives_clear_error(tmp_path):
    net, trainer = fresh_trainer('lbsgd', {})
    gluon_steps(net, trainer, 0, 2)
    path = str(tmp_path / 'trainer.states')
    checkpoint.save_states(trainer, path)
    blob = open(path, 'rb').read()
    open(path, 'wb').write(blob[:len(blob) // 2])
    with pytest.raises(ValueError, match='corrupted'):
        checkpoint.load_states(trainer, path)
    open(path, 'wb').write(b'not a pickle at all')
    with pytest.raises(ValueError, match='truncated or corrupted'):
        checkpoint.load_states(trainer, path)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    net, trainer = fresh_trainer('lbsgd', {})
    gluon_steps(net, trainer, 0, 2)
    path = str(tmp_path / 'trainer.states')
    checkpoint.save_states(trainer, path)
    before = open(path, 'rb').read()

    def dies_mid_write(fname, blob):
        with open(fname, 'wb') as f:
            f.write(blob[:100])
        raise KeyboardInterrupt('killed mid-save')
    monkeypatch.setattr(checkpoint, '_write_bytes', dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_states(trainer, path)
    assert open(path, 'rb').read() == before
    assert os.listdir(tmp_path) == ['trainer.states']       # no temporary file left


@pytest.mark.parametrize('batch_scale, works', [
    pytest.param(1, True, id='same-layout-works'),
    pytest.param(2, False, id='accumulation-fails-clearly'),
])
def test_states_from_mxnet_builtin_lbsgd(tmp_path, batch_scale, works):
    net = mlp()
    old = gluon.Trainer(net.collect_params(), mx_lbsgd.MXNET_LBSGD(
        learning_rate=0.1, momentum=0.9), kvstore=None)
    gluon_steps(net, old, 0, 2)
    path = str(tmp_path / 'builtin.states')
    old.save_states(path)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=0.1, momentum=0.9, batch_scale=batch_scale), kvstore=None)
    if not works:       # refused at load, before anything changes
        with pytest.raises(ValueError, match='batch_scale=1'):
            checkpoint.load_states(trainer, path)
        assert not trainer._updaters[0].states
        return
    checkpoint.load_states(trainer, path)
    assert isinstance(trainer.optimizer, mx_lbsgd.LBSGD)
    mom = trainer._updaters[0].states[0].asnumpy()
    if works:
        gluon_steps(net, trainer, 2, 4)
        assert not np.array_equal(trainer._updaters[0].states[0][0].asnumpy()
                                  if isinstance(trainer._updaters[0].states[0], tuple)
                                  else trainer._updaters[0].states[0].asnumpy(), mom)
    else:
        with pytest.raises(ValueError, match='batch_scale=1'):
            gluon_steps(net, trainer, 2, 3)


KILLED_SAVER = r'''
import sys, time
sys.path.insert(0, sys.argv[2])
import mxnet as mx
from mx_lbsgd import checkpoint
from harness import mlp
net = mlp(hidden=512)
trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', dict(momentum=0.9), kvstore=None)
def step():
    with mx.autograd.record():
        loss = net(mx.nd.ones((4, 64))).sum()
    loss.backward()
    trainer.step(1)
step()
checkpoint.save_states(trainer, sys.argv[1])
def half_then_wait(path, blob):        # the second save stops half-way through its write
    with open(path, 'wb') as f:
        f.write(blob[:len(blob) // 2])
        f.flush()
    print('mid-save', flush=True)
    time.sleep(600)
checkpoint._write_bytes = half_then_wait
step()
checkpoint.save_states(trainer, sys.argv[1])
'''


def test_process_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL while the file is half written (deterministically: the child waits there):
    the previous checkpoint is intact and loads; an in-place save would leave half a file."""
    import signal
    import subprocess
    import sys
    path = str(tmp_path / 'trainer.states')
    proc = subprocess.Popen([sys.executable, '-c', KILLED_SAVER, path,
                             os.path.dirname(os.path.abspath(__file__))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == 'mid-save'
    first = open(path, 'rb').read()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert open(path, 'rb').read() == first
    net = mlp(hidden=512)
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(momentum=0.9), kvstore=None)
    checkpoint.load_states(trainer, path)       # never a half-written file
    assert len(trainer._updaters[0].states) == 4


def test_two_device_trainer_resume_bit_identical(tmp_path):
    """Trainer.load_states unpickles the file once per device: every copy is the same
    optimizer, so the counters of all devices stay in step."""
    ctxs = [mx.cpu(0), mx.cpu(1)]

    def fresh():
        net = mlp()
        net.collect_params().reset_ctx(ctxs)
        return net, gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            learning_rate=0.1, momentum=0.9, batch_scale=2, warmup_epochs=1,
            updates_per_epoch=6), kvstore='device', update_on_kvstore=False)

    def steps(net, trainer, begin, end):
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        for step in range(begin, end):
            xs = gluon.utils.split_and_load(nd.array(X[step * 32:(step + 1) * 32]), ctxs)
            ys = gluon.utils.split_and_load(nd.array(Y[step * 32:(step + 1) * 32]), ctxs)
            with autograd.record():
                losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(32)

    net_a, trainer_a = fresh()
    steps(net_a, trainer_a, 0, 8)
    net_b, trainer_b = fresh()
    steps(net_b, trainer_b, 0, 3)
    net_b.save_parameters(str(tmp_path / 'net.params'))
    checkpoint.save_states(trainer_b, str(tmp_path / 'trainer.states'))
    net_c, trainer_c = fresh()
    net_c.load_parameters(str(tmp_path / 'net.params'), ctx=ctxs)
    checkpoint.load_states(trainer_c, str(tmp_path / 'trainer.states'))
    steps(net_c, trainer_c, 3, 8)
    for a, c in zip(net_a.collect_params().values(), net_c.collect_params().values()):
        for ctx in ctxs:
            np.testing.assert_array_equal(a.data(ctx).asnumpy(), c.data(ctx).asnumpy())


# -- files written by mx_lbsgd 0.1 -----------------------------------------------------------
# 0.1 ended every per-parameter state with a `_Ledger` whose `.opt` is the optimizer: a
# Trainer file is pickle.dumps((states, optimizer)), a Module file pickle.dumps(states).
# The states below are today's layout (MXNet SGD's, then the accumulator) with that ledger
# appended, written the way MXNet's Updater.get_states writes them.
import pickle  # noqa: E402

from mx_lbsgd.loss_scaling import graph as _graph_scale  # noqa: E402
from mx_lbsgd.lbsgd import _Ledger  # noqa: E402


def _v01_states(states, opt):
    ledger = _Ledger(opt)              # one per optimizer in 0.1
    return {key: (state if isinstance(state, tuple) else (state,)) + (ledger,)
            for key, state in states.items()}


def write_v01(path, states, opt, trainer_file):
    old = _v01_states(states, opt)
    with open(path, 'wb') as f:
        f.write(pickle.dumps((old, opt) if trainer_file else old))


def _assert_states_equal(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        g = got[key] if isinstance(got[key], tuple) else (got[key],)
        w = want[key] if isinstance(want[key], tuple) else (want[key],)
        assert len(g) == len(w), key                   # the ledger is gone
        assert not any(isinstance(p, _Ledger) for p in g)
        for a, b in zip(g, w):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def _counters(opt):
    return ({k: dict(v) for k, v in opt._all_index_update_counts.items()}, opt.num_update)


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_v01_trainer_file_loads_and_resumes_bit_identical(tmp_path, name, params):
    net_a, trainer_a = fresh_trainer(name, params)
    gluon_steps(net_a, trainer_a, 0, STEPS)
    net_b, trainer_b = fresh_trainer(name, params)
    gluon_steps(net_b, trainer_b, 0, STEPS // 2 + 1)
    path = str(tmp_path / 'v01.states')
    write_v01(path, trainer_b._updaters[0].states, trainer_b.optimizer, trainer_file=True)
    net_b.save_parameters(str(tmp_path / 'net.params'))
    net_c, trainer_c = fresh_trainer(name, params)
    net_c.load_parameters(str(tmp_path / 'net.params'))
    checkpoint.load_states(trainer_c, path)
    _assert_states_equal(trainer_c._updaters[0].states, trainer_b._updaters[0].states)
    opt_b, opt_c = trainer_b.optimizer, trainer_c.optimizer
    assert _counters(opt_c) == _counters(opt_b) != ({0: {}}, 0)
    if name == 'lssgd':
        assert opt_c.loss_scaler.state_dict() == opt_b.loss_scaler.state_dict()
        assert opt_c.loss_scaler.state_dict() != mx_lbsgd.DynamicLossScaler(
            init_scale=2.0 ** 4, growth_interval=3).state_dict()
    gluon_steps(net_c, trainer_c, STEPS // 2 + 1, STEPS)
    for a, c in zip(net_a.collect_params().values(), net_c.collect_params().values()):
        np.testing.assert_array_equal(a.data().asnumpy(), c.data().asnumpy())
    assert _counters(trainer_c.optimizer) == _counters(trainer_a.optimizer)


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_v01_module_file_takes_counters_from_the_ledger(tmp_path, name, params):
    """A Module file holds no optimizer besides the ledgers': the counters and the loss
    scale come from the ledger's optimizer, and training resumes bit for bit."""
    mod_a, train = module(name, params)
    mod_a.fit(train, num_epoch=3)
    mod_b, train = module(name, params)
    mod_b.fit(train, num_epoch=1)
    mod_b.save_params(str(tmp_path / 'mod.params'))
    path = str(tmp_path / 'v01.states')
    write_v01(path, mod_b._updater.states, mod_b._optimizer, trainer_file=False)
    mod_c, train = module(name, params)
    mod_c.load_params(str(tmp_path / 'mod.params'))
    checkpoint.load_states(mod_c, path)
    _assert_states_equal(mod_c._updater.states, mod_b._updater.states)
    assert _counters(mod_c._optimizer) == _counters(mod_b._optimizer)
    assert mod_c._optimizer.num_update == 10
    if name == 'lssgd':
        assert (mod_c._optimizer.loss_scaler.state_dict()
                == mod_b._optimizer.loss_scaler.state_dict())
    mod_c.fit(train, num_epoch=3, begin_epoch=1)
    for key, value in mod_a.get_params()[0].items():
        np.testing.assert_array_equal(mod_c.get_params()[0][key].asnumpy(), value.asnumpy())
    assert mod_c._optimizer.num_update == mod_a._optimizer.num_update


@pytest.mark.parametrize('name, params', OPTIMIZERS)
def test_mxnet_load_states_on_v01_file_fails_at_next_step(tmp_path, name, params):
    net_b, trainer_b = fresh_trainer(name, params)
    gluon_steps(net_b, trainer_b, 0, 3)
    path = str(tmp_path / 'v01.states')
    write_v01(path, trainer_b._updaters[0].states, trainer_b.optimizer, trainer_file=True)
    net_c, trainer_c = fresh_trainer(name, params)
    trainer_c.load_states(path)                 # MXNet's loader takes it as it is
    before = [p.data().asnumpy() for p in net_c.collect_params().values()]
    with pytest.raises(ValueError, match=r'mx_lbsgd\.checkpoint\.load_states'):
        gluon_steps(net_c, trainer_c, 3, 4)
    for b, p in zip(before, net_c.collect_params().values()):
        np.testing.assert_array_equal(b, p.data().asnumpy())


class _PickledAs:
    """Pickles as an instance of `cls` whose __dict__ is `state` (what 0.1's __getstate__
    wrote), whatever today's __getstate__ would write."""

    def __init__(self, cls, state):
        self.cls, self.state = cls, state

    def __reduce_ex__(self, protocol):
        import copyreg     # what protocol 0/1 pickles of plain classes use
        return copyreg._reconstructor, (self.cls, object, None), self.state


def _genuine_v01_optimizer(opt, monkeypatch, step_gate_module):
    """What 0.1 pickled for `opt`: no window_position/window_phase/_plans (added later), its
    own ledger, token and adopted set, and (with step_gate_module) a `_gate` of class
    mx_lbsgd._step_gate._StepGate, the module 0.1 kept it in."""
    import types
    import uuid
    state = opt.__getstate__()
    for later in ('window_position', 'window_phase', '_plans', '_gate'):
        state.pop(later, None)
    state['_scratch'] = {}
    state['_token'] = uuid.uuid4().hex
    state['_adopted'] = set()
    proxy = _PickledAs(type(opt), state)
    ledger = _Ledger(proxy)
    state['_ledger'] = ledger
    if step_gate_module:
        fake = types.ModuleType('mx_lbsgd._step_gate')
        gate_cls = type('_StepGate', (), {'__module__': 'mx_lbsgd._step_gate'})
        fake._StepGate = gate_cls
        monkeypatch.setitem(__import__('sys').modules, 'mx_lbsgd._step_gate', fake)
        gate = gate_cls()
        gate.__dict__.update(fused=opt.fused, skip=None, counted=False, scale=1.0,
                             scale_override=None)
        state['_gate'] = gate
    return proxy, ledger


@pytest.mark.parametrize('step_gate_module', [pytest.param(False, id='attributes-only'),
                                              pytest.param(True, id='with-step-gate-class')])
def test_genuine_v01_optimizer_in_the_ledger_loads(tmp_path, monkeypatch, step_gate_module):
    name, params = 'lssgd', dict(loss_scaler=mx_lbsgd.DynamicLossScaler(
        init_scale=2.0 ** 4, growth_interval=3))
    net_b, trainer_b = fresh_trainer(name, params)
    gluon_steps(net_b, trainer_b, 0, 3)
    proxy, ledger = _genuine_v01_optimizer(trainer_b.optimizer, monkeypatch, step_gate_module)
    old = {key: (state if isinstance(state, tuple) else (state,)) + (ledger,)
           for key, state in trainer_b._updaters[0].states.items()}
    path = str(tmp_path / 'v01.states')
    with open(path, 'wb') as f:
        f.write(pickle.dumps(old))              # a Module file: only the ledger has counters
    monkeypatch.delitem(__import__('sys').modules, 'mx_lbsgd._step_gate', raising=False)
    net_c, trainer_c = fresh_trainer(name, params)
    checkpoint.load_states(trainer_c, path)
    assert _counters(trainer_c.optimizer) == _counters(trainer_b.optimizer)
    assert (trainer_c.optimizer.loss_scaler.state_dict()
            == trainer_b.optimizer.loss_scaler.state_dict())


# -- loading has no global side effects -------------------------------------------------------
@pytest.mark.parametrize('writer', ['checkpoint', 'mxnet', 'v01'])
def test_load_states_does_not_change_the_served_scalers(tmp_path, writer):
    """The scale_gradient registry keeps serving the live optimizer's scaler: the optimizer
    unpickled from the file (MXNet's and 0.1 files hold one) must not take the key over."""
    key = 'load-side-effects-' + writer
    params = dict(loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=2.0 ** 4,
                                                          growth_interval=3), scale_key=key)
    net_b, trainer_b = fresh_trainer('lssgd', params)
    gluon_steps(net_b, trainer_b, 0, 4)
    path = str(tmp_path / 'trainer.states')
    if writer == 'checkpoint':
        checkpoint.save_states(trainer_b, path)
    elif writer == 'mxnet':
        trainer_b.save_states(path)
    else:
        write_v01(path, trainer_b._updaters[0].states, trainer_b.optimizer, trainer_file=True)
    net_c, trainer_c = fresh_trainer('lssgd', params)
    live = trainer_c.optimizer.loss_scaler
    assert _graph_scale.served(key) is live
    before = dict(_graph_scale._SCALERS)
    checkpoint.load_states(trainer_c, path)
    assert set(_graph_scale._SCALERS) == set(before)
    for k, scaler in before.items():
        assert _graph_scale._SCALERS[k] is scaler, k
    assert trainer_c.optimizer.loss_scaler is live          # loaded in place
    assert live.state_dict() == trainer_b.optimizer.loss_scaler.state_dict()


def _fp16_steps(trainer, params, begin, end):
    for step in range(begin, end):
        draw = np.random.RandomState(step)
        with autograd.record():
            loss = nd.add_n(*[(p.data().astype('float32') * nd.array(draw.uniform(-1, 1, p.shape))
                               ).sum() for p in params])
        loss.backward()
        trainer.step(4)


def _fp16_trainer(name, args):
    params = [gluon.Parameter('p%d_weight' % i, shape=s, dtype='float16')
              for i, s in enumerate([(30, 20), (20,)])]
    for i, p in enumerate(params):
        p.initialize(mx.init.Constant(0.1 * (i + 1)))
    return params, gluon.Trainer(params, name, dict(args), kvstore=None)


@pytest.mark.parametrize('name, args', [
    pytest.param('lblamb', dict(learning_rate=0.01, multi_precision=True), id='lblamb-mp'),
    pytest.param('lblamb', dict(learning_rate=0.01, multi_precision=True, batch_scale=2),
                 id='lblamb-mp-B2'),
    pytest.param('adam', dict(learning_rate=0.01, multi_precision=True), id='mxnet-adam-mp')])
def test_nested_multi_precision_states_resume_bit_identical(tmp_path, name, args):
    """(weight_fp32, (mean, var)) states nest a tuple: they save and load like flat ones."""
    params_a, trainer_a = _fp16_trainer(name, args)
    _fp16_steps(trainer_a, params_a, 0, 6)
    params_b, trainer_b = _fp16_trainer(name, args)
    _fp16_steps(trainer_b, params_b, 0, 3)
    path = str(tmp_path / 'trainer.states')
    checkpoint.save_states(trainer_b, path)
    params_c, trainer_c = _fp16_trainer(name, args)
    for b, c in zip(params_b, params_c):
        c.set_data(b.data())
    checkpoint.load_states(trainer_c, path)
    _fp16_steps(trainer_c, params_c, 3, 6)
    for a, c in zip(params_a, params_c):
        np.testing.assert_array_equal(a.data().asnumpy(), c.data().asnumpy())
        assert not np.array_equal(a.data().asnumpy(), np.full(a.shape, 0.1, np.float16))
