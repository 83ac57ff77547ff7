"""The mx_lbsgd states file's header (issue 31 item 5): MXNet's own loaders and pickle stop
on it with an error that names mx_lbsgd.checkpoint.load_states (not "pickle data was
truncated"), files with the earlier header still load, a damaged header or a truncated
file is refused as corrupted with the file's name, in one exception."""
import hashlib
import pickle

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import checkpoint

pytestmark = pytest.mark.unit

LOADER = r'mx_lbsgd\.checkpoint\.load_states'


def _trainer(steps=2):
    mx.random.seed(0)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Xavier())
    scaler = mx_lbsgd.DynamicLossScaler(init_scale=8.0, growth_interval=100)
    trainer = gluon.Trainer(net.collect_params(), 'lssgd', dict(
        learning_rate=0.1, momentum=0.9, loss_scaler=scaler), kvstore=None)
    for step in range(steps):
        with autograd.record():
            loss = (net(nd.ones((2, 4)) * (step + 1)) ** 2).sum() * scaler.scale
            if step == 0:
                loss = loss * float('inf')
        loss.backward()
        trainer.step(2)
    return net, trainer


def _snapshot(trainer):
    states = trainer._updaters[0].states
    return (trainer.optimizer, trainer.optimizer.num_update,
            trainer.optimizer.loss_scaler.state_dict(),
            {k: v.asnumpy().copy() for k, v in states.items()})


def _same(a, b):
    return (a[0] is b[0] and a[1:3] == b[1:3] and a[3].keys() == b[3].keys()
            and all(np.array_equal(a[3][k], b[3][k]) for k in a[3]))


@pytest.fixture
def saved(tmp_path):
    net, trainer = _trainer()
    path = str(tmp_path / 'run.states')
    checkpoint.save_states(trainer, path)
    return trainer, path


def test_mxnet_trainer_load_states_names_the_loader(saved):
    trainer, path = saved
    _, other = _trainer(steps=1)
    before = _snapshot(other)
    with pytest.raises(ValueError, match='mx_lbsgd optimizer states file.*' + LOADER):
        other.load_states(path)
    assert _same(_snapshot(other), before)          # nothing changed
    with pytest.raises(ValueError, match=LOADER):
        with open(path, 'rb') as f:
            pickle.load(f)
    checkpoint.load_states(other, path)
    assert other.optimizer.loss_scaler.state_dict() == trainer.optimizer.loss_scaler.state_dict()


def test_module_load_optimizer_states_names_the_loader(tmp_path):
    data = mx.sym.Variable('data')
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=3, name='fc'),
                               name='softmax')
    mod = mx.mod.Module(out, context=mx.cpu())
    mod.bind([('data', (2, 4))], [('softmax_label', (2,))])
    mod.init_params()
    mod.init_optimizer(optimizer='lbsgd', optimizer_params=dict(learning_rate=0.1,
                                                                momentum=0.9))
    mod.forward_backward(mx.io.DataBatch([nd.ones((2, 4))], [nd.array([0, 1])]))
    mod.update()
    checkpoint.save_checkpoint(mod, str(tmp_path / 'm'), 1)
    with pytest.raises(ValueError, match=LOADER):
        mod.load_optimizer_states(str(tmp_path / 'm-0001.states'))
    checkpoint.load_states(mod, str(tmp_path / 'm-0001.states'))


def test_files_with_the_earlier_header_still_load(saved, tmp_path):
    trainer, path = saved
    with open(path, 'rb') as f:
        blob = f.read()
    body = blob[len(checkpoint.MX_LBSGD_MAGIC):]
    old = str(tmp_path / 'old.states')
    with open(old, 'wb') as f:
        f.write(b'MXLBSGD-STATES\x00\x02' + body)      # what the previous version wrote
    _, other = _trainer(steps=1)
    checkpoint.load_states(other, old)
    assert other.optimizer.num_update == trainer.optimizer.num_update
    assert other.optimizer.loss_scaler.state_dict() == trainer.optimizer.loss_scaler.state_dict()
    for k, v in trainer._updaters[0].states.items():
        np.testing.assert_array_equal(other._updaters[0].states[k].asnumpy(), v.asnumpy())


def test_every_header_bit_flip_and_truncation_is_corrupted(saved, tmp_path):
    """Each single-bit flip of the header and digest, and a cut at every length up to just
    past the header: one ValueError that names the file, nothing changed."""
    _, path = saved
    with open(path, 'rb') as f:
        blob = f.read()
    head = len(checkpoint.MX_LBSGD_MAGIC) + 32
    variants = [blob[:n] for n in range(1, head + 8)]
    for pos in range(len(checkpoint.MX_LBSGD_MAGIC) * 8):
        flipped = bytearray(blob)
        flipped[pos // 8] ^= 1 << (pos % 8)
        variants.append(bytes(flipped))
    variants += [blob[:-1], blob[:len(blob) // 2]]
    _, target = _trainer(steps=1)
    before = _snapshot(target)
    bad = str(tmp_path / 'bad.states')
    for variant in variants:
        with open(bad, 'wb') as f:
            f.write(variant)
        with pytest.raises(ValueError) as info:
            checkpoint.load_states(target, bad)
        assert repr(bad) in str(info.value) and 'corrupted' in str(info.value), variant[:60]
        assert info.value.__cause__ is None and (info.value.__context__ is None
                                                 or info.value.__suppress_context__)
        assert _same(_snapshot(target), before)


def test_the_header_function_is_not_loadable_without_the_header(tmp_path):
    """The safe unpickler refuses a bare pickle that calls the header's function (it is
    not an allowed global), so the header adds nothing a file could run through it."""
    class Calls:
        def __reduce__(self):
            return checkpoint._refuse_plain_unpickling, ()

    path = str(tmp_path / 'bare.states')
    _, target = _trainer(steps=1)
    for blob in (pickle.dumps({0: Calls()}), pickle.dumps(Calls(), protocol=0)):
        with open(path, 'wb') as f:
            f.write(blob)
        with pytest.raises(ValueError, match='_refuse_plain_unpickling, which is not an '
                                             'allowed type'):
            checkpoint.load_states(target, path)
    payload = pickle.dumps([1, 2])
    with open(path, 'wb') as f:       # a valid header over a payload of the wrong kind
        f.write(checkpoint.MX_LBSGD_MAGIC + hashlib.sha256(payload).digest() + payload)
    with pytest.raises(ValueError, match='not an optimizer states file'):
        checkpoint.load_states(target, path)
