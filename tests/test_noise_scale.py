"""GradientNoiseScale against the exact answer (tests/noise_worker.py: tr(Sigma) and |G|^2
known in closed form), in the four places two batch sizes come from, with each engine's
step(batch) as the README passes it (plain Trainer and LossScaling hook; Horovod with a
gradient_predivide_factor); training is bit for bit the same with and without the
monitor; the host reads once per interval."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd.counting import count_host_syncs
from mx_lbsgd.launch import launch
from digits_mlp import mlp as demo_mlp
from harness import digits, horovodrun, mlp
import noise_worker

pytestmark = pytest.mark.unit

WORKER = os.path.abspath(noise_worker.__file__)
HVD_WORKER = os.path.join(os.path.dirname(WORKER), 'noise_hvd_worker.py')
HOOK_WORKER = os.path.join(os.path.dirname(WORKER), 'noise_hook_worker.py')
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
TOLERANCE = 0.10


def _assert_close_to_truth(result):
    truth = result['truth']
    for key in ('b_simple', 'gradient_sq', 'trace_sigma'):
        assert result[key] is not None, key
        assert abs(result[key] / truth[key] - 1) < TOLERANCE, (key, result[key], truth[key])


@pytest.mark.parametrize('cfg, sizes', [
    pytest.param(dict(batch=8, batch_scale=4, updates=400), (8, 32), id='accumulation'),
    pytest.param(dict(batch=8, devices=2, kvstore='device', updates=400), (8, 16),
                 id='two-devices'),
    pytest.param(dict(batch=8, devices=2, kvstore='device', batch_scale=2, updates=400,
                      optimizer='lblamb'), (8, 32), id='lblamb-two-devices-accumulation'),
])
def test_estimate_within_10_percent_in_process(cfg, sizes):
    result = noise_worker.run(cfg)
    assert (result['b_small'], result['b_big']) == sizes
    _assert_close_to_truth(result)


def _env():
    return {'PYTHONPATH': os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.path.dirname(WORKER),
        os.environ.get('PYTHONPATH')]))}


@pytest.mark.multiprocess
def test_estimate_within_10_percent_on_dist_sync(tmp_path):
    """The README's dist_sync loop: trainer.step(batch_per_worker * num_workers) (the
    servers sum, so that is the step that applies the mean gradient). The monitor once read
    the step's batch as the worker's: B_small 16, B_big 32 and B_simple 65.3 / 61.8 against
    32."""
    cfg = dict(batch=8, kvstore='dist_sync', updates=300)
    out = io.StringIO()
    code = launch([sys.executable, WORKER, json.dumps(cfg), str(tmp_path)], 2, 1,
                  timeout=120, stream=out, env=_env())
    assert code == 0, out.getvalue()
    for rank in range(2):
        with open(str(tmp_path / ('rank%d.json' % rank))) as f:
            result = json.load(f)
        assert (result['b_small'], result['b_big']) == (8, 16)
        _assert_close_to_truth(result)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_estimate_within_10_percent_under_horovod(tmp_path):
    pytest.importorskip('horovod.mxnet')
    cfg = dict(batch=8, kvstore='horovod', updates=300)
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, WORKER, json.dumps(cfg), str(tmp_path)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=180, env=dict(os.environ, **_env()))
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in range(2):
        with open(str(tmp_path / ('rank%d.json' % rank))) as f:
            result = json.load(f)
        assert (result['b_small'], result['b_big']) == (8, 16)
        _assert_close_to_truth(result)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_estimate_within_10_percent_under_horovod_with_a_predivide_factor(tmp_path):
    """DistributedTrainer(gradient_predivide_factor=4): the allreduce sums the gradients
    divided by 4, and the Trainer's scale carries 4 / size. The reduced gradient is the sum
    over workers / 4, which the monitor must not take for the sum."""
    pytest.importorskip('horovod.mxnet')
    cfg = dict(batch=8, kvstore='horovod', updates=300, predivide=4.0)
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, HVD_WORKER, json.dumps(cfg), str(tmp_path)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=180, env=dict(os.environ, **_env()))
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in range(2):
        with open(str(tmp_path / ('rank%d.json' % rank))) as f:
            result = json.load(f)
        assert (result['b_small'], result['b_big']) == (8, 16)
        _assert_close_to_truth(result)


@pytest.mark.multiprocess
@pytest.mark.parametrize('kvstore, unscale', [
    pytest.param('dist_sync', False, id='dist_sync'),
    pytest.param('dist_sync', True, id='dist_sync-unscale'),
    pytest.param('horovod', True, id='horovod-unscale', marks=pytest.mark.horovod),
])
def test_estimate_within_10_percent_under_the_loss_scaling_hook(kvstore, unscale, tmp_path):
    """The LossScaling hook's step(batch) as the README's recipe for each engine passes it
    (the job's batch on dist_sync, the worker's under Horovod), a static scale of 2^10, with
    and without unscale() before the step (then the first update, whose batch the monitor
    cannot know yet, is left out)."""
    cfg = dict(kvstore=kvstore, batch=8, updates=300, scale=2.0 ** 10, unscale=unscale)
    argv = [sys.executable, HOOK_WORKER, json.dumps(cfg), str(tmp_path)]
    if kvstore == 'horovod':
        pytest.importorskip('horovod.mxnet')
        proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2'] + argv,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180, env=dict(os.environ, **_env()))
        assert proc.returncode == 0, proc.stdout[-3000:]
    else:
        out = io.StringIO()
        code = launch(argv, 2, 1, timeout=120, stream=out, env=_env())
        assert code == 0, out.getvalue()
    for rank in range(2):
        with open(str(tmp_path / ('rank%d.json' % rank))) as f:
            result = json.load(f)
        assert (result['b_small'], result['b_big']) == (8, 16)
        assert result['reads'] == 300 - unscale
        _assert_close_to_truth(result)


X, Y, _, _ = digits()


def _train(monitor, optimizer, args, dtype='float32', steps=24, interval=5):
    net = demo_mlp((64,), dtype=dtype)
    trainer = gluon.Trainer(net.collect_params(), optimizer, dict(args))
    gns = mx_lbsgd.GradientNoiseScale(trainer, interval=interval) if monitor else None
    scaler = getattr(trainer.optimizer, 'loss_scaler', None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    reads = []
    for step in range(steps):
        x, y = nd.array(X[step * 16:(step + 1) * 16], dtype=dtype), nd.array(Y[step * 16:(step + 1) * 16])
        with autograd.record():
            loss = loss_fn(net(x).astype('float32'), y) * (scaler.scale if scaler else 1.0)
        loss.backward()
        with count_host_syncs(include_waitall=False) as syncs:
            trainer.step(16)
        reads.append(len(syncs))
    return [p.data().asnumpy() for p in net.collect_params().values()], gns, reads


@pytest.mark.parametrize('optimizer, args, dtype', [
    pytest.param('lbsgd', dict(learning_rate=0.1, momentum=0.9, batch_scale=4,
                               warmup_strategy='linear', warmup_epochs=1, updates_per_epoch=4),
                 'float32', id='lbsgd-B4'),
    pytest.param('lbsgd', dict(learning_rate=0.1, momentum=0.9, batch_scale=2,
                               multi_precision=True,
                               loss_scaler=mx_lbsgd.DynamicLossScaler(init_scale=2. ** 10)),
                 'float16', id='lbsgd-scaled-fp16-B2'),
    pytest.param('lblamb', dict(learning_rate=0.01, batch_scale=3), 'float32', id='lblamb-B3'),
])
def test_training_is_bit_identical_and_reads_once_per_interval(optimizer, args, dtype):
    import copy
    plain, _, plain_reads = _train(False, optimizer, copy.deepcopy(args), dtype)
    watched, gns, reads = _train(True, optimizer, copy.deepcopy(args), dtype)
    for a, b in zip(plain, watched):
        np.testing.assert_array_equal(a, b)
    extra = [r - p for r, p in zip(reads, plain_reads)]
    B = args['batch_scale']
    updates = 24 // B
    # one read at every interval-th update (5 updates), none anywhere else
    assert extra == [1 if (s + 1) % B == 0 and ((s + 1) // B) % 5 == 0 else 0
                     for s in range(24)]
    gns.flush()
    assert len(gns.history) <= updates and len(gns.history) >= updates - 2
    assert gns.b_small == 16 and gns.b_big == 16 * B
    assert gns.b_simple is None or gns.b_simple > 0


def test_one_batch_size_is_refused_with_what_to_change():
    trainer = gluon.Trainer(mlp().collect_params(), 'lbsgd', dict(learning_rate=0.1))
    with pytest.raises(ValueError, match='batch_scale > 1.*more than one device.*worker'):
        mx_lbsgd.GradientNoiseScale(trainer)


@pytest.mark.parametrize('kwargs, message', [
    pytest.param(dict(interval=0), 'interval must be an int >= 1', id='interval'),
    pytest.param(dict(smoothing=1.0), r'smoothing must be a float in \[0, 1\)', id='smoothing'),
])
def test_bad_arguments_name_the_parameter(kwargs, message):
    trainer = gluon.Trainer(mlp().collect_params(), 'lbsgd',
                            dict(learning_rate=0.1, batch_scale=2))
    with pytest.raises(ValueError, match=message):
        mx_lbsgd.GradientNoiseScale(trainer, **kwargs)


def test_other_optimizers_are_refused():
    trainer = gluon.Trainer(mlp().collect_params(), 'sgd', dict(learning_rate=0.1))
    with pytest.raises(TypeError, match="'lbsgd', 'lssgd', 'lblamb'"):
        mx_lbsgd.GradientNoiseScale(trainer)


def test_update_on_kvstore_is_refused():
    trainer = gluon.Trainer(mlp().collect_params(), 'lbsgd', dict(learning_rate=0.1),
                            kvstore='device', update_on_kvstore=True)
    with pytest.raises(ValueError, match='update_on_kvstore=True'):
        mx_lbsgd.GradientNoiseScale(trainer)


@pytest.mark.parametrize('value', [0, 1.5, True])
def test_bad_small_every_is_refused(value):
    trainer = gluon.Trainer(mlp().collect_params(), 'lbsgd',
                            dict(learning_rate=0.1, batch_scale=2))
    with pytest.raises(ValueError, match='small_every must be None or an int >= 1'):
        mx_lbsgd.GradientNoiseScale(trainer, small_every=value)
