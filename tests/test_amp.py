"""``mxnet.contrib.amp`` beside the package: loading the native operators changes no
operator function of MXNet, so ``amp.init()`` (bfloat16 or float16, called before or
after ``import mx_lbsgd``) stays in force through any number of steps on the Gluon path
(a Trainer, hybridized or not) and the symbolic path (Module.fit), a user's own wrapper
on ``mx.nd.FullyConnected`` / ``mx.sym.FullyConnected`` stays in place, and every function
object of ``mx.nd``, ``mx.sym``, ``mx.np`` and ``mx.npx`` is the one it was. Each case runs
in a fresh interpreter (``tests/amp_worker.py``; AMP initializes once per process), with
the native operators and with ``MX_LBSGD_NATIVE=0``.

Training Dense layers in bfloat16 needs MXNet's oneDNN to run them (AVX512): where
`mx_lbsgd.amp_support.amp_bfloat16_support` says it cannot, those cases skip with its
reason, and bfloat16 AMP is checked with models it keeps in float32 (an embedding), the
Dense layers only typed, which runs on any CPU."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd import _native
from mx_lbsgd.amp_support import amp_bfloat16_support

pytestmark = pytest.mark.unit

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT = _native._library_path() is not None
NATIVE = pytest.mark.parametrize('native', ['1', '0'], ids=['native', 'mxnet-ops'])
ORDER = pytest.mark.parametrize('order', ['before', 'after'],
                                ids=['amp-first', 'import-first'])


def _run_worker(dtype, order, native, model=None):
    if native == '1' and not BUILT:
        pytest.skip('the native library is not built (no C++ compiler at install time)')
    env = dict(os.environ, MX_LBSGD_NATIVE=native,
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    args = [dtype, order] + ([model] if model else [])
    proc = subprocess.run([sys.executable, os.path.join(HERE, 'amp_worker.py')] + args,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_in_force(result, native):
    """What holds for either dtype and either model: AMP's casts, MXNet's function
    objects, the user's wrappers, the optimizers' names and what they see."""
    assert result['native'] == (native == '1')
    # AMP's casts on both paths, before the first step and after every run below
    assert result['active_before'] == {'imperative': True, 'symbolic': True}
    assert result['active_after'] == {'imperative': True, 'symbolic': True}
    # no function object of any MXNet module was replaced, none was added
    assert result['changed'] == [] and result['added'] == []
    # the user's wrappers still run, under AMP's: the probes after training call both
    assert sorted(set(result['user_wrapper_calls_after'])) == ['FullyConnected'] and \
        len(result['user_wrapper_calls_after']) >= 2
    # the package's optimizers keep their names under AMP
    assert result['registered'] == {'lbsgd': 'LBSGD', 'lssgd': 'LossScaledSGD',
                                    'lblamb': 'LAMB'}
    runs = result['runs']
    for name in ('lbsgd', 'lbsgd_hybrid', 'lssgd', 'lblamb'):
        run = runs[name]
        # what the optimizer sees under AMP: float32 weights and gradients
        assert run['weights_fp32'] and run['grads_fp32'] and run['changed'], (name, run)
    assert runs['module_lbsgd']['weights_fp32']
    assert runs['module_lbsgd']['amp_cast_in_graph']


@NATIVE
@ORDER
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_amp_stays_in_force_through_training(dtype, order, native):
    if dtype == 'bfloat16':
        support = amp_bfloat16_support()
        if not support.ok:
            pytest.skip(support.reason)
    result = _run_worker(dtype, order, native)
    _check_in_force(result, native)
    if dtype == 'bfloat16':
        runs = result['runs']
        assert result['model'] == 'matmul'
        assert result['bf16_forward_ran'] == [True, True]
        # the model ran in bfloat16 on every step; the user's wrapper of
        # mx.nd.FullyConnected ran under AMP's (non-hybridized forward passes)
        assert {runs[n]['out_dtype'] for n in ('lbsgd', 'lssgd')} == {'bfloat16'}
        assert runs['lbsgd_hybrid']['out_dtype'] == 'bfloat16'
        assert result['user_wrapper_calls'] >= 8


@NATIVE
@ORDER
def test_bfloat16_amp_stays_in_force_on_any_cpu(order, native):
    """bfloat16 AMP where MXNet may not run bfloat16 Dense layers: the steps train an
    embedding (AMP keeps it in float32); the Dense layers are typed, not trained. Runs
    everywhere; where MXNet trains bfloat16 their forward runs too."""
    result = _run_worker('bfloat16', order, native, 'no-matmul')
    _check_in_force(result, native)
    assert result['model'] == 'no-matmul'
    # AMP's casts type a Dense layer's output bfloat16 (checked by active_*), and a
    # FullyConnected Module with its weights' types declared binds, its layer bfloat16
    assert result['module_graph'] == {'bound': True, 'amp_cast_in_graph': True,
                                      'fc_dtype': 'bfloat16'}
    # what AMP leaves in float32 trains in float32
    assert {run.get('out_dtype') for name, run in result['runs'].items()
            if name != 'module_lbsgd'} == {'float32'}
    if amp_bfloat16_support().ok:
        assert result['bf16_forward_ran'] == [True, True]
