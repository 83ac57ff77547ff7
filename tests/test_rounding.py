"""``'lbsgd'`` against MXNet 1.9.1's ``'sgd'`` and ``'nag'`` bit for bit at every learning
rate, on every kernel route and in every variant of the native library.

Two things make the last bits of an update, besides the arithmetic's order:

- **How MXNet reads a hyperparameter.** An operator's ``float`` parameter (``lr``, ``wd``,
  ``momentum``, ``rescale_grad`` of ``nag_mom_update``, ``sgd_update`` and their ``mp_``
  forms; ``momentum`` and ``rescale_grad`` of every operator) goes through dmlc-core's own
  ``strtof``, which lands one float32 ulp away from the correctly rounded value for about
  one decimal in eight (``6.24e-07`` reads as 6.2399995e-07). The ``lrs``/``wds`` tuples of
  ``multi_sgd_*`` are read correctly rounded. MXNet's ``'sgd'`` runs the multi-tensor
  operators, its ``'nag'`` the per-tensor ones; the native kernels read each value as the
  operator they reproduce reads it (``field_float`` in ``csrc/native_ops.cc``).
- **No FMA contraction** in any variant the library's ``target_clones`` may pick: the library
  is compiled with ``-ffp-contract=off`` and holds no fused multiply-add instruction.

The scan: fixed learning rates and log-uniform ones between 1e-7 and 1 (a fixed seed), with
and without momentum and weight decay, ``rescale_grad`` 1, 1/48 and 1/49152 (read one ulp off
its float32 by MXNet's parser), float32 and
float16 with ``multi_precision``, gradient clipping, 3 updates of 3 tensors; weights, momenta
and master copies compared with ``np.array_equal``. Routes: the default (the native operator
where built), ``fused=True`` and ``fused=False``; CI runs this file again with
``MX_LBSGD_NATIVE=0`` (the default route is then MXNet's operators). The variants: the
native library built with only its AVX2 (x86-64-v3) loops and with only its baseline loops,
each scanned in a subprocess. Then a GluonCV-style run: a small convnet, a cosine schedule
with linear warmup from 0 (whose first rates are the small ones MXNet reads inexactly), 32
steps, ``'lbsgd'`` with ``nesterov=True`` against ``'nag'``.
"""
import ctypes
import glob
import itertools
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import _native, amp_support
from digits_mlp import load_digits

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: the rates the issue found (GluonCV's first warmup rate among them), round values, and
#: log-uniform ones between 1e-7 and 1
LRS = [6.24e-07, 1e-05, 4.6e-05, 1e-7, 1e-3, 0.1, 1.0] + [
    float(x) for x in np.exp(np.random.RandomState(20261129).uniform(np.log(1e-7), 0, 25))]
SHAPES = [(5,), (3, 4), (257,)]


def _cases():
    """(lr, options) over the grid; clipping on a quarter of it (it changes no reading)."""
    grid = itertools.product(LRS, [0.0, 0.9], [0.0, 1e-4], ['float32', 'float16'],
                             [False, True], [1.0, 1 / 48, 1 / 49152])
    for k, (lr, momentum, wd, dtype, nesterov, rescale) in enumerate(grid):
        yield dict(learning_rate=lr, momentum=momentum, wd=wd, rescale_grad=rescale,
                   multi_precision=dtype == 'float16', dtype=dtype, nesterov=nesterov,
                   clip_gradient=0.5 if k % 4 == 3 else None)


def _run(opt, dtype, steps=3):
    """The weights and every state array after `steps` updates of SHAPES (fixed data)."""
    rng = np.random.RandomState(7)
    weights = [nd.array(rng.randn(*s), dtype=dtype) for s in SHAPES]
    updater = mx.optimizer.get_updater(opt)
    for _ in range(steps):
        grads = [nd.array(rng.randn(*s), dtype=dtype) for s in SHAPES]
        updater(list(range(len(weights))), grads, weights)
    out = [w.asnumpy() for w in weights]
    for i in range(len(weights)):
        state = updater.states[i]
        for s in state if isinstance(state, (tuple, list)) else [state]:
            if s is not None:
                out.append(s.asnumpy())
    return out


def scan(fused):
    """The cases whose weights or states differ from MXNet's optimizer's, bit for bit."""
    differ = []
    for case in _cases():
        options = {k: v for k, v in case.items() if k not in ('dtype', 'nesterov')}
        theirs = (mx.optimizer.NAG if case['nesterov'] else mx.optimizer.SGD)(**options)
        ours = mx_lbsgd.LBSGD(nesterov=case['nesterov'], fused=fused, **options)
        a, b = _run(ours, case['dtype']), _run(theirs, case['dtype'])
        if len(a) != len(b) or any(not np.array_equal(x, y) for x, y in zip(a, b)):
            differ.append(case)
    return differ


@pytest.mark.parametrize('fused', [None, True, False], ids=['default', 'multi', 'pertensor'])
def test_every_learning_rate_equals_mxnet_bit_for_bit(fused):
    differ = scan(fused)
    assert not differ, '%d of %d cases differ from MXNet, e.g. %s' % (
        len(differ), len(list(_cases())), differ[:3])


def _mxnet_reads(text):
    """The float32 that MXNet's per-tensor operators take for lr=`text` (NAG's sgd_update:
    from a zero weight and a gradient of -1, the new weight is exactly lr)."""
    weight, grad = nd.zeros(1), -nd.ones(1)
    nd.sgd_update(weight, grad, out=weight, lr=text, wd=0.0)
    return weight.asnumpy()[0]


@pytest.mark.skipif(_native.ops() is None, reason='the native library is not built (no C++ '
                    'compiler at install time) or MX_LBSGD_NATIVE=0')
def test_the_native_library_reads_a_float_parameter_as_mxnet():
    """field_float against MXNet's reading, on the texts Python gives MXNet: repr of
    log-uniform doubles over float32's normal range, short decimals, more than 19
    fraction digits, and exponents up to float32's largest."""
    field_float = ctypes.CDLL(_native.native_library()).mx_lbsgd_field_float
    field_float.restype = ctypes.c_float
    field_float.argtypes = [ctypes.c_char_p]
    rng = np.random.RandomState(3)
    texts = [repr(float(x)) for x in np.exp(rng.uniform(np.log(1e-37), np.log(1e37), 1500))]
    texts += ['%.*g' % (int(d), x) for d, x in zip(rng.randint(1, 9, 300),
                                              np.exp(rng.uniform(-20, 5, 300)))]
    texts += ['0.9', '0.99', '1', '0.0', '-0.5', '0.020833333333333332', '3e38', '1.5e-38',
              '0.1234567890123456789012', '12345678901.25', '+2.5E+3']
    assert len(texts) > 1800
    differ = [(t, field_float(t.encode()), _mxnet_reads(t)) for t in texts
              if np.float32(field_float(t.encode())).tobytes() !=
              np.float32(_mxnet_reads(t)).tobytes()]
    assert not differ, differ[:5]
    # the reading is not strtof's: it differs on about one text in eight
    inexact = [t for t in texts[:1500] if np.float32(_mxnet_reads(t)) != np.float32(float(t))]
    assert len(inexact) > 100


def _native_library_file():
    path = _native.native_library()
    return path if path and os.path.exists(path) else None


@pytest.mark.skipif(_native.ops() is None, reason='the native library is not built (no C++ '
                    'compiler at install time) or MX_LBSGD_NATIVE=0')
def test_the_native_library_holds_no_fused_multiply_add():
    """-ffp-contract=off kept: MXNet's kernels round every product and sum apart, and so
    must every variant of ours (the AVX2 variant may use FMA instructions otherwise)."""
    objdump = shutil.which('objdump')
    if objdump is None:
        pytest.skip('objdump (binutils) is not installed')
    text = subprocess.run([objdump, '-d', _native_library_file()], check=True,
                          capture_output=True, text=True).stdout
    assert 'vcvtph2ps' in text              # the disassembly holds the F16C loops
    fused = [line for line in text.splitlines()
             if any(op in line for op in ('vfmadd', 'vfmsub', 'vfnmadd', 'vfnmsub'))]
    assert not fused, fused[:3]


def _build_variant(tmp_path, define):
    """The native library compiled with only one variant of its loops (or None when no
    compiler or MXNet header is found), with setup.py's flags."""
    compiler = shutil.which('g++') or shutil.which('c++')
    mxnet_root = os.path.dirname(mx.__file__)
    lib_api = os.path.join(mxnet_root, 'src', 'lib_api.cc')
    if compiler is None or not os.path.exists(lib_api):
        return None
    out = str(tmp_path / ('_native_ops_%s.so' % define.lower()))
    subprocess.run([compiler, '-shared', '-fPIC', '-std=c++17', '-O3', '-fopenmp',
                    '-fno-math-errno', '-ffp-contract=off', '-w', '-g0', '-D' + define,
                    '-I' + os.path.join(mxnet_root, 'include'),
                    os.path.join(ROOT, 'csrc', 'native_ops.cc'), lib_api, '-o', out,
                    '-fopenmp', '-Wl,-Bsymbolic'], check=True, capture_output=True)
    return out


@pytest.mark.skipif(_native.ops() is None, reason='the native library is not built (no C++ '
                    'compiler at install time) or MX_LBSGD_NATIVE=0')
@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, 'csrc', 'native_ops.cc')),
                    reason='the native sources are not in this checkout')
@pytest.mark.parametrize('define', ['MX_LBSGD_VARIANT_V3', 'MX_LBSGD_VARIANT_BASELINE'])
def test_each_variant_of_the_native_loops_equals_mxnet(tmp_path, define):
    flags = amp_support._cpu_flags() or frozenset()
    if define == 'MX_LBSGD_VARIANT_V3' and not all(f in flags for f in ('avx2', 'fma', 'f16c')):
        pytest.skip('this CPU cannot run the x86-64-v3 variant (no AVX2/FMA/F16C)')
    library = _build_variant(tmp_path, define)
    if library is None:
        pytest.skip('no C++ compiler or no MXNet lib_api.cc to build a variant')
    script = textwrap.dedent('''
        import sys
        sys.path[:0] = [%r, %r]
        from mx_lbsgd import _native
        _native._LIBRARY_GLOB = %r            # this variant instead of the installed one
        assert _native.native_library() == %r
        import test_rounding
        differ = test_rounding.scan(None)
        print('DIFFER', len(differ), differ[:3])
    ''') % (ROOT, HERE, library, library)
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          env=dict(os.environ, MX_LBSGD_NATIVE='1'), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'DIFFER 0 []' in done.stdout, done.stdout[-2000:]


def _convnet(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=1, activation='relu'),
            gluon.nn.BatchNorm(in_channels=8), gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(16, 3, padding=1, in_channels=8, activation='relu'),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10, in_units=16))
    net.initialize(mx.init.Xavier())
    return net


#: GluonCV's ImageNet recipe in small: a cosine schedule whose first updates warm up
#: linearly from 0, at rates below 1e-4 (the ones MXNet writes in e-notation and reads inexactly)
BASE_LR = 1e-4


def _schedule():
    return mx.lr_scheduler.CosineScheduler(max_update=40, base_lr=BASE_LR, final_lr=0.0,
                                           warmup_steps=16, warmup_begin_lr=0.0,
                                           warmup_mode='linear')


def _gluoncv_run(name, options, steps=32, batch=32):
    """The recipe with momentum 0.9 and wd 1e-4: the losses and the parameters."""
    x, y, _, _ = load_digits()
    net = _convnet(5)
    trainer = gluon.Trainer(net.collect_params(), name, dict(
        options, learning_rate=BASE_LR, momentum=0.9, wd=1e-4, lr_scheduler=_schedule()))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(steps):
        xb = nd.array(x[step * batch:(step + 1) * batch].reshape(-1, 1, 8, 8))
        yb = nd.array(y[step * batch:(step + 1) * batch])
        with autograd.record():
            loss = loss_fn(net(xb), yb)
        loss.backward()
        trainer.step(batch)
        losses.append(loss.mean().asscalar())
    return losses, [p.data().asnumpy() for p in net.collect_params().values()]


def test_gluoncv_style_warmup_and_cosine_equal_nag_bit_for_bit():
    our_losses, ours = _gluoncv_run('lbsgd', dict(nesterov=True))
    their_losses, theirs = _gluoncv_run('nag', {})
    assert our_losses == their_losses
    assert len(ours) == len(theirs) > 6
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    # the schedule's first rates are among those MXNet reads inexactly
    schedule = _schedule()
    rates = [schedule(k) for k in range(1, 33)]
    assert sum(np.float32(_mxnet_reads(repr(r))) != np.float32(r) for r in rates) >= 3
