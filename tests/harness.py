"""MXNet-side helpers shared by the tests (the numpy side is reference.py)."""
import importlib.util
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import mx_lbsgd  # noqa: F401  (registers 'lbsgd')
from digits_mlp import load_digits
from digits_mlp import mlp as _mlp

SHAPES = [(7, 5), (5,), (3, 4, 2, 2), (1,), (11,), (4, 4)]
NAMES = ['fc0_weight', 'fc0_bias', 'conv0_weight', 'bn0_gamma', 'bn0_beta', 'fc1_weight']


def flag_read(fused=None):
    """The name `count_host_syncs` gives the loss-scale decision's one read: the finite
    check on the host with the native library and fused=None (no operator call), else the
    flag operator's asscalar."""
    native = fused is None and mx_lbsgd.native_library() is not None
    return 'host_all_finite' if native else 'asscalar'


def make_problem(steps, shapes=SHAPES, seed=0, grad_scale=0.1, zero_grad=(2, 1)):
    """Initial weights and `steps` gradient sets; one all-zero gradient at `zero_grad`."""
    rng = np.random.RandomState(seed)
    weights = [rng.uniform(-1, 1, s) for s in shapes]
    grads = [[rng.uniform(-1, 1, s) * grad_scale for s in shapes] for _ in range(steps)]
    if zero_grad is not None and zero_grad[0] < steps:
        step, i = zero_grad
        grads[step][i] = np.zeros(shapes[i])
    return weights, grads


def run_optimizer(opt, weights, grads, dtype, ctx=mx.cpu(), read=True):
    """Run `opt` through MXNet's Updater (as Gluon and Module do); return the weights
    (NDArrays when not `read`), the updater and the NDArrays."""
    updater = mx.optimizer.get_updater(opt)
    w_nd = [mx.nd.array(w, ctx=ctx, dtype=dtype) for w in weights]
    g_steps = [[mx.nd.array(g, ctx=ctx, dtype=dtype) for g in step] for step in grads]
    for g_nd in g_steps:
        updater(list(range(len(w_nd))), g_nd, w_nd)
    return ([w.asnumpy() for w in w_nd] if read else list(w_nd)), updater, w_nd


def digits(test_fraction=0.25, seed=0):
    """scikit-learn's bundled 8x8 digits: (x_train, y_train, x_test, y_test), x in [0, 1]
    (the demo's data: digits_mlp.load_digits, a copy of mx_lbsgd_demo.data.load_digits)."""
    return load_digits(seed, test_fraction)


def mlp(hidden=64, seed=0):
    """The demo's float32 MLP (digits_mlp.mlp, a copy of mx_lbsgd_demo.models.mlp) with one
    hidden layer: 64 -> hidden -> 10, parameters dense0_weight, dense0_bias, dense1_weight,
    dense1_bias."""
    return _mlp((hidden,), seed=seed)


def accuracy(net, x, y):
    pred = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float(np.mean(pred == y))


#: What a crashed or corrupted worker prints (MXNet's SIGSEGV handler, glibc's heap checks,
#: std::terminate, an exception in MXNet's exit hook): a job showing one fails its test
#: whatever its exit status.
CRASH_MARKS = ('Segmentation fault', 'double free', 'free(): ', 'malloc(): ', 'corrupted ',
               'Aborted', 'core dumped', 'terminate called', 'Fatal Python error',
               'Exception ignored in atexit callback')


def _job_report(argv, code, output):
    return ('horovodrun job %s\n%s\n---- full output (both ranks) ----\n%s\n---- end ----'
            % (code, ' '.join(argv), output))


#: horovodrun of the interpreter running the tests (Horovod installs it next to python)
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
NO_HOROVOD = ('Horovod with MXNet is not installed in this environment (the quick start does '
              'not install it; bash scripts/install_horovod.sh does)')


def require_horovod():
    """Skip the calling test, with the reason, where Horovod's MXNet binding or its
    horovodrun is missing (the README's test command runs on a machine without Horovod)."""
    if importlib.util.find_spec('horovod') is None or \
            importlib.util.find_spec('horovod.mxnet') is None or not os.path.exists(HOROVODRUN):
        pytest.skip(NO_HOROVOD)


def horovodrun(argv, timeout, **kwargs):
    """subprocess.run(argv, timeout=timeout, **kwargs) of a horovodrun job, run once: a
    test whose job is a horovodrun command skips (`require_horovod`) where Horovod is
    missing; a
    crash or hang is the test's failure, never retried. A job whose output shows a crash
    (`CRASH_MARKS`) raises AssertionError with the whole output of both ranks, first line to
    last; a failed job's whole output also goes to stderr (kept in the test report where an
    assertion shows only part). On timeout horovodrun gets SIGTERM (it terminates its
    workers), then SIGKILL, and TimeoutExpired carries the output so far."""
    if os.path.basename(argv[0]) == 'horovodrun':
        require_horovod()
    proc = subprocess.Popen(argv, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        output = (out or '') + (err or '')
        sys.stderr.write(_job_report(argv, 'hung (no end after %ss)' % timeout, output) + '\n')
        raise subprocess.TimeoutExpired(argv, timeout, output=output) from None
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    output = (out or '') + (err or '')
    crashed = [m for m in CRASH_MARKS if m in output]
    if crashed:
        raise AssertionError(_job_report(argv, 'crashed (%s; exit %d)'
                                         % (', '.join(crashed), proc.returncode), output))
    if proc.returncode != 0:
        sys.stderr.write(_job_report(argv, 'failed (exit %d)' % proc.returncode, output) + '\n')
    return result
