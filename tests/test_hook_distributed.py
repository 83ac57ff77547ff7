"""The LossScaling hook on 2 workers (issue 30): Horovod started by horovodrun (gloo, CPU)
and a dist_sync kvstore started by mx_lbsgd.launch.

After ``allreduce_grads()`` both hold the sum over workers here (dist_sync's servers sum;
Horovod on this build averages in the framework: the allreduce sums and the Trainer's scale
carries 1/size). The hook's unscale() must leave the mean over workers (one worker's
gradient on one process), clip_global_norm() must clip that, and the update must equal
the one-process run on the whole batch."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mxnet import autograd, gluon, nd

from harness import digits, horovodrun, mlp
from mx_lbsgd.launch import launch

pytestmark = pytest.mark.multiprocess

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hook_engine_worker.py')
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')


def reference(cfg):
    """One process, the whole batch (both ranks' shards): per step the mean over workers
    of the workers' gradients (the whole batch's gradient / 2), clipped, applied with
    Horovod's rescale (1 / (2 * per-rank batch)) folded as mean * rescale."""
    x_all, y_all, _, _ = digits()
    net = mlp(hidden=16)
    params = net.collect_params()
    trainer = gluon.Trainer(params, 'sgd', dict(learning_rate=0.1, momentum=0.9),
                            kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    grads, norms = [], []
    for step in range(cfg['steps']):
        lo = step * cfg['batch']
        x, y = nd.array(x_all[lo:lo + cfg['batch']]), nd.array(y_all[lo:lo + cfg['batch']])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        for p in params.values():
            p.grad()[:] = p.grad() / 2          # the mean over the 2 workers
        grads.append([p.grad().asnumpy() for p in params.values()])
        if cfg['clip']:
            norms.append(gluon.utils.clip_global_norm([p.grad() for p in params.values()],
                                                      cfg['clip']))
        trainer.step(cfg['batch'] // 2)
    return grads, norms, [p.data().asnumpy() for p in params.values()]


def _pythonpath():
    return os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(WORKER)),
                                         os.environ.get('PYTHONPATH')]))


def _run(engine, cfg, tmp_path):
    argv = [sys.executable, WORKER, json.dumps(dict(cfg, engine=engine)), str(tmp_path)]
    if engine == 'horovod':
        pytest.importorskip('horovod.mxnet')
        proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2'] + argv,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=_pythonpath()))
        return proc.returncode, proc.stdout
    out = io.StringIO()
    code = launch(argv, 2, 1, timeout=300, stream=out, env={'PYTHONPATH': _pythonpath()})
    return code, out.getvalue()


@pytest.mark.parametrize('engine', [pytest.param('horovod', marks=pytest.mark.horovod),
                                    'dist_sync'])
@pytest.mark.parametrize('clip', [None, 1.0])
def test_hook_unscale_and_clip_see_the_mean_over_workers(tmp_path, engine, clip):
    cfg = dict(steps=3, batch=32, scale=1024.0, clip=clip)
    code, log = _run(engine, cfg, tmp_path)
    assert code == 0, log
    ranks = [np.load(str(tmp_path / ('rank%d.npz' % r))) for r in range(2)]
    for name in ranks[0].files:                       # both ranks agree
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
    saved = ranks[0]
    assert float(saved['mean_factor']) == 0.5          # the reduction sums over workers
    grads, norms, weights = reference(cfg)
    for step, per_param in enumerate(grads):
        for i, g in enumerate(per_param):
            np.testing.assert_allclose(saved['grad%d_%d' % (step, i)], g, rtol=1e-5,
                                       atol=1e-7)
        if clip:
            np.testing.assert_allclose(float(saved['norm%d' % step]), norms[step], rtol=1e-5)
    if clip:
        assert max(norms) > clip                       # the clip bites
    for i, w in enumerate(weights):
        np.testing.assert_allclose(saved['weight%d' % i], w, rtol=1e-5, atol=1e-6)
