"""``mxnet.contrib.amp`` beside the package: loading the native operators changes no
operator function of MXNet, so ``amp.init()`` (bfloat16 or float16, called before or
after ``import mx_lbsgd``) stays in force through any number of steps on the Gluon path
(a Trainer, hybridized or not) and the symbolic path (Module.fit), a user's own wrapper
on ``mx.nd.FullyConnected`` / ``mx.sym.FullyConnected`` stays in place, and every function
object of ``mx.nd``, ``mx.sym``, ``mx.np`` and ``mx.npx`` is the one it was. Each case runs
in a fresh interpreter (``tests/amp_worker.py``; AMP initializes once per process), with
the native operators and with ``MX_LBSGD_NATIVE=0``."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd import _native

pytestmark = pytest.mark.unit

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT = _native._library_path() is not None


def _run_worker(dtype, order, native):
    if native == '1' and not BUILT:
        pytest.skip('the native library is not built (no C++ compiler at install time)')
    env = dict(os.environ, MX_LBSGD_NATIVE=native,
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, 'amp_worker.py'), dtype, order],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('native', ['1', '0'], ids=['native', 'mxnet-ops'])
@pytest.mark.parametrize('order', ['before', 'after'], ids=['amp-first', 'import-first'])
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_amp_stays_in_force_through_training(dtype, order, native):
    result = _run_worker(dtype, order, native)
    assert result['native'] == (native == '1')
    # AMP's casts on both paths, before the first step and after every run below
    assert result['active_before'] == {'imperative': True, 'symbolic': True}
    assert result['active_after'] == {'imperative': True, 'symbolic': True}
    # no function object of any MXNet module was replaced, none was added
    assert result['changed'] == [] and result['added'] == []
    # the user's wrappers still run, under AMP's: the probes after training call both
    assert sorted(set(result['user_wrapper_calls_after'])) == ['FullyConnected'] and \
        len(result['user_wrapper_calls_after']) >= 2
    runs = result['runs']
    for name in ('lbsgd', 'lbsgd_hybrid', 'lssgd', 'lblamb'):
        run = runs[name]
        # what the optimizer sees under AMP: float32 weights and gradients
        assert run['weights_fp32'] and run['grads_fp32'] and run['changed'], (name, run)
    assert runs['module_lbsgd']['weights_fp32']
    if dtype == 'bfloat16':
        # the model ran in bfloat16 on every step; the user's wrapper of
        # mx.nd.FullyConnected ran under AMP's (non-hybridized forward passes)
        assert {runs[n]['out_dtype'] for n in ('lbsgd', 'lssgd')} == {'bfloat16'}
        assert runs['lbsgd_hybrid']['out_dtype'] == 'bfloat16'
        assert runs['module_lbsgd']['amp_cast_in_graph']
        assert result['user_wrapper_calls'] >= 8
