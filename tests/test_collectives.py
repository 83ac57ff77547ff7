"""`mx_lbsgd.distributed.collectives`: broadcasts built on Horovod's allreduce (Horovod
0.28.1's MXNet broadcast reads a freed name on MXNet's engine thread), in real 2-rank
horovodrun jobs: every rank receives the root's values bit for bit (-0.0, inf, subnormals;
NaN stays NaN), in float32, float16, float64 and int32, from either root; Gluon parameters on two contexts; Module's
NDArray dicts; bad input refused."""
import os
import subprocess
import sys

import pytest

from harness import HOROVODRUN, horovodrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

JOB = r'''
import numpy as np
import mxnet as mx
import horovod.mxnet as hvd
from mx_lbsgd.distributed import broadcast_parameters
from mx_lbsgd.distributed.collectives import broadcast_

hvd.init()
rank = hvd.rank()
special = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 1e-30, -3.5, 65504.0])


def values(dtype, seed):
    rng = np.random.RandomState(seed)
    if np.dtype(dtype).kind == 'i':
        return rng.randint(-1000, 1000, 40).astype(dtype)
    return np.concatenate([special, rng.randn(32)]).astype(dtype)


for root in (0, 1):
    for dtype in ('float32', 'float16', 'float64', 'int32'):
        mine = values(dtype, seed=10 * rank + 1)
        root_values = values(dtype, seed=10 * root + 1)
        x = mx.nd.array(mine, dtype=dtype)
        broadcast_(x, root_rank=root, name='t.%d.%s' % (root, dtype))
        got = x.asnumpy()
        if dtype != 'int32':    # NaN stays NaN (Horovod's float16 sum drops its payload)
            nan = np.isnan(root_values)
            assert np.array_equal(np.isnan(got), nan), (root, dtype)
            got, root_values = got[~nan], root_values[~nan]
        assert got.view('u%d' % got.itemsize).tolist() == \
            root_values.view('u%d' % root_values.itemsize).tolist(), (root, dtype)
# many tensors in groups
xs = [mx.nd.ones((5,)) * (rank + 1) * k for k in range(150)]
broadcast_(xs, root_rank=1, name='many')
assert all((x.asnumpy() == 2 * k).all() for k, x in enumerate(xs))
# Gluon parameters on two contexts, and Module's dicts
net = mx.gluon.nn.Dense(3, in_units=4)
net.initialize(mx.init.Uniform(), ctx=[mx.cpu(0), mx.cpu(1)])
for p in net.collect_params().values():
    p.set_data(mx.nd.ones(p.shape) * (rank + 7))
broadcast_parameters(net.collect_params(), root_rank=0)
for p in net.collect_params().values():
    for d in p.list_data():
        assert (d.asnumpy() == 7).all(), p.name
arg = {'w': mx.nd.ones((2, 2)) * rank, 'b': mx.nd.ones((2,)) * (rank + 3)}
broadcast_parameters(arg, root_rank=1, prefix='module')
assert (arg['w'].asnumpy() == 1).all() and (arg['b'].asnumpy() == 4).all()
# refused
deferred = mx.gluon.nn.Dense(3)
deferred.initialize()
for call, words in ((lambda: broadcast_parameters(deferred.collect_params()), 'deferred'),
                    (lambda: broadcast_(mx.nd.ones(2), root_rank=2, name='bad'),
                     'root_rank must be in [0, 2)'),
                    (lambda: broadcast_parameters({'x': 3.0}), 'expected Gluon Parameters')):
    try:
        call()
    except ValueError as err:
        assert words in str(err), err
    else:
        raise AssertionError('not refused: ' + words)
mx.nd.waitall()
print('collectives ok on rank %d' % rank, flush=True)
'''


def test_broadcasts_give_the_roots_bits(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text(JOB)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        root, os.environ.get('PYTHONPATH')])))
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, str(script)], timeout=120, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count('collectives ok on rank') == 2, proc.stdout[-4000:]
