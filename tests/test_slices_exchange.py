"""The even-slice exchange on Horovod (gloo, loopback): `_compat.horovod_reducescatter_into`
gives each rank the sum of its slice, `_compat.horovod_allgather_into` puts every rank's
slice back in rank order, both asynchronously into preallocated views, 300 times in a row,
at 2, 3 and 4 ranks; and Horovod's reducescatter of uneven parts in float16 and float64."""
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
from mx_lbsgd import _compat

hvd.init()
rank, size = hvd.rank(), hvd.size()
shard = 1 << 14
grads = mx.nd.zeros((shard * size,))
weights = mx.nd.zeros((shard * size,))
received = mx.nd.zeros((shard,))
updated = mx.nd.zeros((shard,))
wrong = 0
for step in range(300):
    grads[:] = mx.nd.arange(shard * size) * (rank + 1) + step
    _compat.horovod_reducescatter_into(grads, received, 'test.grad')
    updated[:] = received * 2            # reads the reduce-scatter's output: engine-ordered
    _compat.horovod_allgather_into(updated, weights, 'test.weight')
    want = 2 * (np.arange(shard * size) * sum(k + 1 for k in range(size)) + size * step)
    wrong += not np.array_equal(weights.asnumpy(), want.astype(np.float32))
# uneven parts (the first n % size ranks get one more row), float16 and float64, through
# Horovod's own reducescatter: the ring of the patched build for one tensor
for dtype in ('float16', 'float64'):
    rows = 3 * size + 1
    x = mx.nd.arange(rows * 5, dtype=dtype).reshape((rows, 5)) * (rank + 1)
    got = hvd.reducescatter(x, op=hvd.Sum, name='test.uneven.' + dtype).asnumpy()
    total = np.arange(rows * 5).reshape((rows, 5)) * sum(k + 1 for k in range(size))
    bounds = np.cumsum([0] + [rows // size + (k < rows % size) for k in range(size)])
    wrong += not np.array_equal(got, total[bounds[rank]:bounds[rank + 1]].astype(dtype))
print('exchange on rank %d: %d wrong' % (rank, wrong), flush=True)
'''


@pytest.mark.parametrize('ranks', [2, 3, 4])
def test_reduce_scatter_then_allgather_into_views(tmp_path, ranks):
    script = tmp_path / 'job.py'
    script.write_text(JOB)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        root, os.environ.get('PYTHONPATH')])))
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', str(ranks), '-H', 'localhost:%d' % ranks,
                       sys.executable, str(script)], timeout=180, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in range(ranks):
        assert 'exchange on rank %d: 0 wrong' % rank in proc.stdout, proc.stdout[-4000:]
