"""Checkpoints cannot run code, and every corruption is caught (mx_lbsgd.checkpoint)."""
import os
import pickle

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import checkpoint
from harness import digits, mlp

pytestmark = pytest.mark.unit

X, Y, _, _ = digits()


def trained_trainer(name='lbsgd', steps=3, **params):
    net = mlp(hidden=8)
    trainer = gluon.Trainer(net.collect_params(), name, dict(
        learning_rate=0.1, momentum=0.9, **params), kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(steps):
        with autograd.record():
            loss = loss_fn(net(nd.array(X[step * 16:(step + 1) * 16])),
                           nd.array(Y[step * 16:(step + 1) * 16]))
        loss.backward()
        trainer.step(16)
    return net, trainer


def snapshot(trainer):
    opt = trainer.optimizer
    states = {k: [None if a is None else a.asnumpy() for a in
                  (v if isinstance(v, tuple) else (v,))]
              for k, v in trainer._updaters[0].states.items()}
    return states, opt.num_update, {k: dict(v) for k, v in
                                    opt._all_index_update_counts.items()}


def same(a, b):
    if a[1:] != b[1:] or sorted(a[0]) != sorted(b[0]):
        return False
    return all(x is None and y is None or np.array_equal(x, y)
               for k in a[0] for x, y in zip(a[0][k], b[0][k]))


class _Payload:
    """Pickles to a call of `func(*args)`: what a malicious file does."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _malicious(kind, marker):
    import builtins
    import subprocess
    touch = "open(%r, 'w').write('ran')" % marker
    return {
        'os.system': _Payload(os.system, 'touch %s' % marker),
        'eval': _Payload(eval, touch),
        'exec': _Payload(exec, touch),
        'subprocess': _Payload(subprocess.call, ['touch', marker]),
        '__import__': _Payload(builtins.__import__, 'antigravity_not_really'),
    }[kind]


@pytest.mark.parametrize('kind', ['os.system', 'eval', 'exec', 'subprocess', '__import__'])
@pytest.mark.parametrize('wrap', ['bare', 'as-trainer-file', 'inside-a-state'])
def test_code_in_a_file_is_refused_and_never_runs(tmp_path, kind, wrap):
    marker = str(tmp_path / 'ran')
    payload = _malicious(kind, marker)
    obj = {'bare': payload, 'as-trainer-file': ({0: payload}, None),
           'inside-a-state': {0: (nd.ones((2,)), payload)}}[wrap]
    path = str(tmp_path / 'evil.states')
    with open(path, 'wb') as f:
        pickle.dump(obj, f)
    _, trainer = trained_trainer()
    before = snapshot(trainer)
    with pytest.raises(ValueError, match='not an allowed type.*trusted=True'):
        checkpoint.load_states(trainer, path)
    assert not os.path.exists(marker)
    assert same(snapshot(trainer), before)


def test_trusted_opt_in_loads_other_types(tmp_path):
    """A callable lars_exclude is a global the allowlist refuses; trusted=True loads it."""
    _, trainer = trained_trainer(lars_exclude=_exclude_bias, warmup_strategy='lars')
    path = str(tmp_path / 'trusted.states')
    trainer.save_states(path)                     # MXNet's own writer: pickles the optimizer
    _, other = trained_trainer(lars_exclude=_exclude_bias, warmup_strategy='lars')
    with pytest.raises(ValueError, match='_exclude_bias'):
        checkpoint.load_states(other, path)
    checkpoint.load_states(other, path, trusted=True)
    assert same(snapshot(other)[:1] + snapshot(trainer)[1:], snapshot(trainer))


def _exclude_bias(name):
    return name.endswith('bias')


@pytest.mark.parametrize('writer', ['mx_lbsgd', 'mxnet-trainer'])
@pytest.mark.parametrize('name, params', [
    pytest.param('lbsgd', dict(batch_scale=2), id='lbsgd-B2'),
    pytest.param('lssgd', dict(loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=8.0)),
                 id='lssgd'),
    pytest.param('sgd', dict(lr_scheduler=mx.lr_scheduler.FactorScheduler(2, 0.5)),
                 id='mxnet-sgd-factor-scheduler'),
])
def test_allowed_files_load_safely(tmp_path, writer, name, params):
    import copy
    _, trainer = trained_trainer(name, **copy.deepcopy(params))
    path = str(tmp_path / 'ok.states')
    if writer == 'mx_lbsgd':
        checkpoint.save_states(trainer, path)
    else:
        trainer.save_states(path)
    _, other = trained_trainer(name, steps=1, **copy.deepcopy(params))
    checkpoint.load_states(other, path)
    assert same(snapshot(other), snapshot(trainer))


def _valid_file(tmp_path):
    _, trainer = trained_trainer('lbsgd', batch_scale=2)
    path = str(tmp_path / 'valid.states')
    checkpoint.save_states(trainer, path)
    return trainer, path, open(path, 'rb').read()


def test_fuzz_truncations_and_bit_flips(tmp_path):
    """Every truncation and a few hundred single-bit flips: each variant loads
    bit-identical or raises the package's ValueError, never another exception."""
    trainer, path, blob = _valid_file(tmp_path)
    expected = snapshot(trainer)
    rng = np.random.RandomState(0)
    variants = [blob[:n] for n in range(0, len(blob), max(1, len(blob) // 400))]
    for pos in rng.randint(0, len(blob) * 8, size=300):
        flipped = bytearray(blob)
        flipped[pos // 8] ^= 1 << (pos % 8)
        variants.append(bytes(flipped))
    _, target = trained_trainer('lbsgd', steps=1, batch_scale=2)
    clean = snapshot(target)
    bad = str(tmp_path / 'bad.states')
    outcomes = {'loaded': 0, 'refused': 0}
    for variant in variants:
        with open(bad, 'wb') as f:
            f.write(variant)
        try:
            checkpoint.load_states(target, bad)
        except ValueError as err:
            assert any(w in str(err) for w in ('corrupted', 'empty', 'not an', 'allowed')), err
            assert same(snapshot(target), clean)        # nothing changed
            outcomes['refused'] += 1
            continue
        assert same(snapshot(target), expected)
        outcomes['loaded'] += 1
        checkpoint.load_states(target, path)            # (a no-op flip) back to clean below
        _, target = trained_trainer('lbsgd', steps=1, batch_scale=2)
        clean = snapshot(target)
    assert outcomes['refused'] >= len(variants) - 1      # only the untouched full file loads


@pytest.mark.parametrize('content, match', [
    pytest.param(b'', 'empty', id='empty'),
    pytest.param(os.urandom(64), 'corrupted|not an', id='random-bytes'),
    pytest.param(pickle.dumps([1, 2, 3]), 'not an optimizer states file', id='a-list'),
    pytest.param(pickle.dumps(({0: 1}, 'x')), 'not an optimizer', id='pair-without-optimizer'),
    pytest.param(pickle.dumps({0: 'momentum'}), 'not NDArrays', id='state-of-strings'),
])
def test_malformed_files_give_clear_errors(tmp_path, content, match):
    path = str(tmp_path / 'x.states')
    with open(path, 'wb') as f:
        f.write(content)
    _, trainer = trained_trainer()
    before = snapshot(trainer)
    with pytest.raises(ValueError, match=match):
        checkpoint.load_states(trainer, path)
    assert same(snapshot(trainer), before)


def test_missing_file_and_directory(tmp_path):
    _, trainer = trained_trainer()
    with pytest.raises(FileNotFoundError, match='does not exist'):
        checkpoint.load_states(trainer, str(tmp_path / 'nope.states'))
    with pytest.raises(ValueError, match='directory'):
        checkpoint.load_states(trainer, str(tmp_path))


@pytest.mark.parametrize('other, match', [
    pytest.param(dict(hidden=16), 'does not fit', id='other-shapes'),
    pytest.param(dict(momentum=0.0), 'does not fit', id='other-layout-no-momentum'),
    pytest.param(dict(batch_scale=2), 'does not fit', id='other-layout-accumulator'),
    pytest.param(dict(layers=1), 'does not (fit|have)', id='fewer-parameters'),
])
def test_states_that_do_not_fit_the_target(tmp_path, other, match):
    _, trainer = trained_trainer()
    path = str(tmp_path / 's.states')
    checkpoint.save_states(trainer, path)
    if other.get('layers') == 1:
        net = gluon.nn.Dense(10, in_units=64)
        net.initialize()
        target = gluon.Trainer(net.collect_params(), 'lbsgd', dict(momentum=0.9),
                               kvstore=None)
    else:
        net = mlp(hidden=other.get('hidden', 8))
        target = gluon.Trainer(net.collect_params(), 'lbsgd', dict(
            momentum=other.get('momentum', 0.9), batch_scale=other.get('batch_scale', 1)),
            kvstore=None)
    with pytest.raises(ValueError, match=match):
        checkpoint.load_states(target, path)
    assert all(not u.states for u in target._updaters)      # nothing loaded


def test_module_checkpoint_sidecars(tmp_path):
    data = mx.sym.Variable('data')
    out = mx.sym.FullyConnected(data, num_hidden=10, name='fc')
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(out, name='softmax'))
    mod.bind([('data', (8, 64))], [('softmax_label', (8,))])
    mod.init_params()
    mod.init_optimizer(optimizer='lbsgd', optimizer_params=dict(momentum=0.9))
    prefix = str(tmp_path / 'run')
    checkpoint.save_checkpoint(mod, prefix, 1)
    sym, args, _ = checkpoint.load_checkpoint(prefix, 1)
    np.testing.assert_array_equal(args['fc_weight'].asnumpy(),
                                  mod.get_params()[0]['fc_weight'].asnumpy())
    params = prefix + '-0001.params'
    blob = bytearray(open(params, 'rb').read())
    blob[len(blob) // 2] ^= 4
    open(params, 'wb').write(bytes(blob))
    with pytest.raises(ValueError, match='corrupted'):
        checkpoint.load_checkpoint(prefix, 1)
    checkpoint.load_states(mod, prefix + '-0001.states')
