"""A trust ratio on several kvstore servers (issue 40, item 6).

MXNet 1.9.1's dist kvstore splits every array of at least ``MXNET_KVSTORE_BIGARRAY_BOUND``
elements across its servers, so with ``update_on_kvstore=True`` each server would compute
the LARS / LAMB trust ratio of such a tensor from its own slice (silently wrong). The
optimizer refuses it on the worker when it is pickled for the servers, before any update:
in process (the message, who is exempt) and in real loopback jobs (`mx_lbsgd.launch`: the
error reaches the script, stops it, and the job ends; one server trains).

Run as a script, this file is the jobs' worker::

    python tests/test_server_split.py CONFIG_JSON OUT_DIR
"""
import io
import json
import os
import pickle
import re
import sys
import time

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mx_lbsgd  # noqa: E402,F401  (registers 'lbsgd' and 'lblamb')
from mx_lbsgd.launch import launch  # noqa: E402
from harness import CRASH_MARKS, digits, mlp  # noqa: E402

pytestmark = pytest.mark.multiprocess

HERE = os.path.abspath(__file__)
# The launcher's --timeout: a bound that keeps a broken job from hanging the suite, not a
# deadline (that a job ended by itself is checked by its status: 124 is the timeout's)
LIMIT = 300
# digits MLP 64 -> 64 -> 10: dense0_weight 4096, dense0_bias 64, dense1_weight 640,
# dense1_bias 10 elements. At bound 64 the kvstore splits the first three over 2 servers.
BOUND = 64


# -- in process: the refusal at pickling (what kv.set_optimizer does on a worker) ---------

def _split_env(monkeypatch, servers=2, bound=BOUND):
    monkeypatch.setenv('DMLC_NUM_SERVER', str(servers))
    if bound is None:
        monkeypatch.delenv('MXNET_KVSTORE_BIGARRAY_BOUND', raising=False)
    else:
        monkeypatch.setenv('MXNET_KVSTORE_BIGARRAY_BOUND', str(bound))


def _optimizer(name, **params):
    """`name`'s optimizer with the digits MLP's param_dict (a gluon.Trainer gives it)."""
    net = mlp()
    return gluon.Trainer(net.collect_params(), name, params, kvstore=None).optimizer


def _sent_to_servers(opt):
    """What kv.set_optimizer does on a worker of a dist kvstore."""
    return pickle.loads(pickle.dumps(opt, 0))


def named(message):
    """[(name without the net's prefix, elements)] a refusal names, in its order."""
    return [(re.sub(r'^hybridsequential\d+_', '', name), int(size)) for name, size in
            re.findall(r"'([^']+)' \((\d+) elements\)", message)]


@pytest.mark.parametrize('name, params', [
    pytest.param('lbsgd', dict(lars=True), id='lbsgd-lars'),
    pytest.param('lbsgd', dict(warmup_strategy='lars'), id='lbsgd-warmup-lars'),
])
def test_lars_on_split_tensors_is_refused(monkeypatch, name, params):
    _split_env(monkeypatch)
    with pytest.raises(ValueError) as caught:
        _sent_to_servers(_optimizer(name, **params))
    message = str(caught.value)
    assert message.startswith('LBSGD cannot update on the 2 servers of this dist kvstore')
    # the tensors (largest first; LARS leaves biases out: ratio 1), the servers, the bound
    # and the three ways out
    assert named(message) == [('dense0_weight', 4096), ('dense1_weight', 640)]
    assert re.search(r"trust ratio of '\w+' \(4096 elements\), '\w+' \(640 elements\) "
                     r'from its own slice only \(a silently wrong update\)', message)
    for way_out in ('MXNET_KVSTORE_BIGARRAY_BOUND=64 elements', 'DMLC_NUM_SERVER=1',
                    'MXNET_KVSTORE_BIGARRAY_BOUND=4097 or more',
                    'set for every process of the job',
                    'gluon.Trainer(..., update_on_kvstore=False)', 'mx_lbsgd.ShardedTrainer',
                    'MXNET_UPDATE_ON_KVSTORE=0'):
        assert way_out in message, way_out


ALL_SPLIT = [('dense0_weight', 4096), ('dense1_weight', 640), ('dense0_bias', 64)]


@pytest.mark.parametrize('name, params, expected', [
    pytest.param('lblamb', {}, ALL_SPLIT, id='lblamb-every-layer'),
    pytest.param('lblamb', dict(trust_exclude=True), ALL_SPLIT[:2], id='lblamb-trust-exclude'),
    pytest.param('lbsgd', dict(lars=True, lars_exclude=()), ALL_SPLIT, id='lbsgd-no-exclusion'),
])
def test_the_refusal_names_the_tensors_with_a_ratio(monkeypatch, name, params, expected):
    _split_env(monkeypatch)
    with pytest.raises(ValueError, match='cannot update on the 2 servers') as caught:
        _sent_to_servers(_optimizer(name, **params))
    assert named(str(caught.value)) == expected       # dense1_bias (10) is not split


@pytest.mark.parametrize('name, params, env', [
    pytest.param('lbsgd', dict(lars=True), dict(servers=1), id='one-server'),
    pytest.param('lbsgd', dict(lars=True), dict(bound=4097), id='bound-above-the-largest'),
    pytest.param('lbsgd', dict(lars=True), dict(bound=None), id='default-bound'),
    pytest.param('lbsgd', dict(lars=True), dict(bound=-1), id='negative-bound-splits-none'),
    pytest.param('lbsgd', dict(warmup_strategy='linear'), {}, id='lbsgd-without-lars'),
    pytest.param('lbsgd', dict(lars=True, lars_exclude=('weight', 'bias')), {},
                 id='every-split-tensor-excluded'),
    pytest.param('lblamb', dict(trust_exclude=lambda name: True), {}, id='lblamb-all-out'),
])
def test_sent_when_no_ratio_sees_a_slice(monkeypatch, name, params, env):
    _split_env(monkeypatch, **env)
    if callable(params.get('trust_exclude')):
        opt = _optimizer(name, **params)
        assert not any(opt.trust_ratio_applies(p.name) for p in opt.param_dict.values())
        return                 # (a lambda does not pickle; the refusal never got that far)
    copy = _sent_to_servers(_optimizer(name, **params))
    assert type(copy).__name__ in ('LBSGD', 'LAMB')


def test_parameters_without_gradient_are_exempt(monkeypatch):
    _split_env(monkeypatch)
    net = mlp()
    for p in net.collect_params().values():
        if p.name.endswith('weight'):
            p.grad_req = 'null'                       # frozen: never updated
    trainer = gluon.Trainer(net.collect_params(), 'lbsgd', dict(lars=True), kvstore=None)
    _sent_to_servers(trainer.optimizer)


def test_many_tensors_name_the_five_largest(monkeypatch):
    _split_env(monkeypatch, bound=10)
    params = gluon.ParameterDict()
    for i in range(8):
        params.get('layer%d_weight' % i, shape=(10 + i, 3)).initialize()
    opt = gluon.Trainer(params, 'lbsgd', dict(lars=True), kvstore=None).optimizer
    with pytest.raises(ValueError) as caught:
        _sent_to_servers(opt)
    message = str(caught.value)
    assert ("'layer7_weight' (51 elements), 'layer6_weight' (48 elements), 'layer5_weight' "
            "(45 elements), 'layer4_weight' (42 elements), 'layer3_weight' (39 elements) and "
            '3 more from its own slice only') in message
    assert 'layer2_weight' not in message
    assert 'MXNET_KVSTORE_BIGARRAY_BOUND=52 or more' in message


def test_other_pickles_are_not_checked(monkeypatch):
    """Only protocol 0 (kv.set_optimizer) sends the optimizer to servers; a checkpoint or a
    copy pickles it with another protocol."""
    _split_env(monkeypatch)
    opt = _optimizer('lbsgd', lars=True)
    assert pickle.loads(pickle.dumps(opt, pickle.HIGHEST_PROTOCOL)).lars


# -- loopback jobs --------------------------------------------------------------------------

def run_job(cfg, tmp_path, servers, workers=1, bound=BOUND):
    """(status, output, seconds, {rank: the worker's record}) of a dist_sync job running
    this file as its worker."""
    out = io.StringIO()
    env = {'PYTHONPATH': os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(HERE)), os.environ.get('PYTHONPATH')]))}
    if bound is not None:
        env['MXNET_KVSTORE_BIGARRAY_BOUND'] = str(bound)
    start = time.monotonic()
    code = launch([sys.executable, HERE, json.dumps(cfg), str(tmp_path)],
                                  workers, servers, timeout=LIMIT, stream=out, env=env)
    seconds = time.monotonic() - start
    log = out.getvalue()
    records = {}
    for name in os.listdir(str(tmp_path)):
        with open(os.path.join(str(tmp_path), name)) as f:
            record = json.load(f)
        records[record['rank']] = record
    assert not any(mark in log for mark in CRASH_MARKS), log
    return code, log, seconds, records


def assert_refused_before_any_update(code, log, records, workers, owner, expected):
    assert code not in (0, 124), log            # failed, by itself (124: the launcher's timeout)
    assert sorted(records) == list(range(workers)), log
    for record in records.values():
        assert record['steps'] == 0 and not record['changed'], record
        error = record['error']
        assert error.startswith('%s cannot update on the 2 servers of this dist kvstore'
                                % owner), error
        assert 'MXNET_KVSTORE_BIGARRAY_BOUND=%d elements' % BOUND in error
        assert named(error) == expected, error
    # the exception reached the script's top level (a traceback, status 1) and every
    # process of the job ended (launch returns when all have)
    assert 'ValueError: %s cannot update on the 2 servers' % owner in log, log
    assert 'Traceback (most recent call last)' in log, log


def test_gluon_lars_on_two_servers_stops_before_its_first_update(tmp_path):
    cfg = dict(api='gluon', optimizer='lbsgd', params=dict(lars=True))
    code, log, seconds, records = run_job(cfg, tmp_path, servers=2, workers=2)
    assert_refused_before_any_update(code, log, records, 2, 'LBSGD', ALL_SPLIT[:2])


def test_gluon_lars_on_one_server_trains(tmp_path):
    cfg = dict(api='gluon', optimizer='lbsgd', params=dict(lars=True))
    code, log, seconds, records = run_job(cfg, tmp_path, servers=1, workers=1)
    assert code == 0, log
    assert records[0]['steps'] == STEPS and records[0]['changed'] and 'error' not in records[0]


def test_lblamb_on_two_servers_is_refused(tmp_path):
    cfg = dict(api='gluon', optimizer='lblamb', params=dict(learning_rate=0.01))
    code, log, seconds, records = run_job(cfg, tmp_path, servers=2)
    assert_refused_before_any_update(code, log, records, 1, 'LAMB', ALL_SPLIT)


def test_module_fit_lars_on_two_servers_is_refused(tmp_path):
    """Module.fit on a dist kvstore updates on the servers by default: init_optimizer sends
    the optimizer there and the refusal comes out of fit."""
    cfg = dict(api='module', optimizer='lbsgd', params=dict(warmup_strategy='lars'))
    code, log, seconds, records = run_job(cfg, tmp_path, servers=2)
    assert_refused_before_any_update(code, log, records, 1, 'LBSGD',
                                     [('fc1_weight', 4096), ('fc2_weight', 640)])


# -- the worker -----------------------------------------------------------------------------

STEPS = 3
BATCH = 16


def _gluon(cfg, kv, rank, record):
    x, y, _, _ = digits()
    net = mlp()
    params = net.collect_params()
    initial = {p.name: p.data().asnumpy() for p in params.values()}
    trainer = gluon.Trainer(params, cfg['optimizer'], dict(cfg['params']), kvstore=kv,
                            update_on_kvstore=True)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    try:
        for step in range(STEPS):
            start = (step * kv.num_workers + rank) * BATCH
            with autograd.record():
                loss = loss_fn(net(nd.array(x[start:start + BATCH])),
                               nd.array(y[start:start + BATCH]))
            loss.backward()
            trainer.step(BATCH * kv.num_workers)     # creates the kvstore at step 0
            record['steps'] += 1
    finally:
        record['changed'] = any(not np.array_equal(p.data().asnumpy(), initial[p.name])
                                for p in params.values())


def _module(cfg, kv, rank, record):
    x, y, _, _ = digits()
    data = mx.sym.Variable('data')
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name='fc1'), 'relu')
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=10, name='fc2'),
                               name='softmax')
    mod = mx.mod.Module(out)
    it = mx.io.NDArrayIter(x[:STEPS * BATCH], y[:STEPS * BATCH], BATCH,
                           label_name='softmax_label')
    mod.bind(it.provide_data, it.provide_label)
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    initial = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}

    def count(_):
        record['steps'] += 1
    try:
        mod.fit(it, num_epoch=1, kvstore=kv, optimizer=cfg['optimizer'],
                optimizer_params=dict(cfg['params']), batch_end_callback=count)
    finally:
        record['changed'] = any(not np.array_equal(v.asnumpy(), initial[k])
                                for k, v in mod.get_params()[0].items())


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    kv = mx.kv.create('dist_sync')
    record = dict(rank=kv.rank, steps=0, changed=False)
    try:
        (_gluon if cfg['api'] == 'gluon' else _module)(cfg, kv, kv.rank, record)
    except ValueError as err:
        record['error'] = str(err)
        raise                 # the script stops here: the traceback is in the job's output
    finally:
        with open(os.path.join(out, 'rank%d.json' % kv.rank), 'w') as f:
            json.dump(record, f)


if __name__ == '__main__':
    main()
