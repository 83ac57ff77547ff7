"""Whether MXNet can train in bfloat16 here, asked of MXNet itself.

MXNet 1.9.1's oneDNN runs ``FullyConnected`` and ``Convolution`` in bfloat16 only with
AVX512 (``avx512f``, ``avx512bw``, ``avx512dq``, ``avx512vl``); elsewhere, for instance on
an AVX2-only CPU, a bfloat16 layer under ``mxnet.contrib.amp`` fails inside MXNet with
``MXNetError: could not create a primitive descriptor iterator``, whatever the optimizer.
`amp_bfloat16_support` trains a tiny bfloat16 Dense layer (``amp.init``, a forward, a
backward and a step of MXNet's own ``'sgd'``) in a child interpreter, since ``amp.init``
is global and cannot be undone, and keeps the answer for the process. The child inherits
the environment: ``DNNL_MAX_CPU_ISA=AVX2`` makes oneDNN behave as on an AVX2 CPU, and the
answer follows it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Mapping, NamedTuple

__all__ = ['Bfloat16Support', 'amp_bfloat16_support', 'amp_bfloat16_trains']

#: Seconds the child interpreter may take (importing MXNet is most of it: about 2 s).
_TIMEOUT = 120.0
#: The AVX512 subsets oneDNN's bfloat16 kernels need (its ``avx512_core``).
_AVX512_CORE = ('avx512f', 'avx512bw', 'avx512dq', 'avx512vl')
_CPUINFO = '/proc/cpuinfo'
_ISA_VARIABLE = 'DNNL_MAX_CPU_ISA'

# The child: each stage prints "probe: <stage>" once it ran (MXNet runs operators
# asynchronously: each stage waits for its result), a failure prints
# "probe: failed <stage>: <error's first line>". It exits with os._exit, which skips
# MXNet's shutdown hook (that hook re-raises an operator's error a second time).
_PROBE = r'''
import os, sys
def stage(name, run):
    try:
        run()
    except BaseException as error:
        text = str(error).strip().splitlines() or ['']
        line = text[0] if text[0].startswith(type(error).__name__) \
            else '%s: %s' % (type(error).__name__, text[0])
        print('probe: failed %s: %s' % (name, line), flush=True)
        os._exit(1)
    print('probe: ' + name, flush=True)
def start():
    global mx, amp
    import mxnet as mx
    from mxnet.contrib import amp
def init():
    global net, trainer
    amp.init(target_dtype='bfloat16')
    net = mx.gluon.nn.Dense(4, in_units=8)
    net.initialize()
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
def forward():
    global out, loss
    with mx.autograd.record():
        out = net(mx.nd.ones((2, 8)))
        loss = out.sum()
    out.wait_to_read()
def cast():
    if getattr(out.dtype, 'names', None) != ('bfloat16',):
        raise RuntimeError('the layer ran in %s' % getattr(out.dtype, '__name__', out.dtype))
def backward():
    loss.backward()
    net.weight.grad().wait_to_read()
def step():
    trainer.step(2)
    mx.nd.waitall()
for name, run in [('start', start), ('init', init), ('forward', forward), ('cast', cast),
                  ('backward', backward), ('step', step)]:
    stage(name, run)
sys.stdout.flush()
os._exit(0)
'''
_STAGES = ('start', 'init', 'forward', 'cast', 'backward', 'step')
#: What a stage that failed could not do.
_FAILED = {
    'start': 'the probe could not import MXNet',
    'init': "MXNet's AMP could not set up a bfloat16 Dense layer",
    'forward': "MXNet's oneDNN cannot run a bfloat16 Dense layer's forward",
    'cast': "MXNet's AMP did not cast a Dense layer to bfloat16",
    'backward': "MXNet's oneDNN cannot run bfloat16 backward",
    'step': "MXNet's 'sgd' cannot step after a bfloat16 backward",
}


class Bfloat16Support(NamedTuple):
    """Whether MXNet trains in bfloat16 under ``mxnet.contrib.amp`` here, and why.

    A named tuple: ``ok, reason = amp_bfloat16_support()`` unpacks it.

    Attributes
    ----------
    ok : bool
        True when a bfloat16 Dense layer ran its forward, its backward and an update.
    reason : str
        One line: what ran, or what failed, with the CPU's AVX512 (read from
        ``/proc/cpuinfo``), ``DNNL_MAX_CPU_ISA`` when it is set, and MXNet's own error.

    Examples
    --------
    >>> from mx_lbsgd.amp_support import Bfloat16Support
    >>> support = Bfloat16Support(False, 'no AVX512')
    >>> ok, reason = support
    >>> ok, support.reason
    (False, 'no AVX512')
    """

    ok: bool
    reason: str


_lock = threading.Lock()
_answer: list[Bfloat16Support] = []       # [the process's answer] once asked


def amp_bfloat16_support() -> Bfloat16Support:
    """Whether MXNet can train in bfloat16 here, and why: asked of MXNet once per process.

    A child interpreter (this Python, this environment) runs ``amp.init(target_dtype=
    'bfloat16')`` and trains a ``Dense(4)`` layer one step with MXNet's own ``'sgd'``: a
    forward, a backward and an update, each waited for. The answer is kept: later calls
    return the same object at no cost. The child has 120 s (it takes about 2 s, mostly
    importing MXNet); running out of time is a "no".

    Returns
    -------
    Bfloat16Support
        ``ok``: the step ran in bfloat16; ``reason``: one line saying what ran, or what
        could not run and why, for example "MXNet's oneDNN cannot run a bfloat16 Dense
        layer's forward on this CPU (no AVX512): MXNetError: could not create a
        primitive descriptor iterator".

    See Also
    --------
    amp_bfloat16_trains : ``amp_bfloat16_support().ok``.

    Notes
    -----
    ``DNNL_MAX_CPU_ISA=AVX2`` in the environment limits MXNet's oneDNN to AVX2 on any
    CPU, so a machine with AVX512 answers as an AVX2-only one would: a way to try the
    other answer's code path.

    Examples
    --------
    >>> from mx_lbsgd.amp_support import amp_bfloat16_support
    >>> support = amp_bfloat16_support()
    >>> isinstance(support.ok, bool) and support.reason != ''
    True
    >>> amp_bfloat16_support() is support             # asked once per process
    True
    >>> target_dtype = 'bfloat16' if support.ok else None   # else train in float32
    """
    with _lock:
        if not _answer:
            _answer.append(_probe(_PROBE, _TIMEOUT, os.environ))
        return _answer[0]


def amp_bfloat16_trains() -> bool:
    """Whether MXNet can train in bfloat16 under ``mxnet.contrib.amp`` here: a bfloat16
    Dense layer's forward, backward and update run (`amp_bfloat16_support`'s ``ok``;
    its ``reason`` says why not).

    Returns
    -------
    bool

    Examples
    --------
    >>> from mx_lbsgd.amp_support import amp_bfloat16_support, amp_bfloat16_trains
    >>> amp_bfloat16_trains() is amp_bfloat16_support().ok
    True
    >>> dtype = 'bfloat16' if amp_bfloat16_trains() else 'float32'
    >>> # if dtype == 'bfloat16': mxnet.contrib.amp.init(target_dtype='bfloat16')
    """
    return amp_bfloat16_support().ok


def _probe(script: str, timeout: float, env: Mapping[str, str]) -> Bfloat16Support:
    """Run `script` (the child's program) under `env` and read its stage lines; not
    cached (`amp_bfloat16_support` keeps the answer)."""
    try:
        proc = subprocess.run([sys.executable, '-c', script], env=dict(env),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Bfloat16Support(False, 'the bfloat16 probe (a child interpreter training a '
                               'bfloat16 Dense layer) did not finish within %g s' % timeout)
    except OSError as error:
        return Bfloat16Support(False, 'the bfloat16 probe could not start %s: %s'
                               % (sys.executable, error))
    return _read_probe(proc.stdout, proc.stderr, proc.returncode, env, _cpu_flags())


def _read_probe(stdout: str, stderr: str, returncode: int, env: Mapping[str, str],
               flags: frozenset[str] | None) -> Bfloat16Support:
    """The answer the child's output gives: every stage ran and it exited 0, or the
    stage that failed, with its error, the CPU's AVX512 and ``DNNL_MAX_CPU_ISA``."""
    lines = [line[len('probe: '):] for line in stdout.splitlines()
             if line.startswith('probe: ')]
    ran = [line for line in lines if line in _STAGES]
    where = _cpu_note(flags, env.get(_ISA_VARIABLE))
    if returncode == 0 and tuple(ran) == _STAGES:
        return Bfloat16Support(True, 'MXNet trained a bfloat16 Dense layer under AMP '
                               "(forward, backward and an 'sgd' step) %s" % where)
    failed = next((line[len('failed '):] for line in lines if line.startswith('failed ')), '')
    stage, _, error = failed.partition(': ')
    if stage not in _FAILED:
        stage = _STAGES[len(ran)] if len(ran) < len(_STAGES) else 'step'
        error = _last_error(stderr) or 'the probe exited with code %d' % returncode
    if stage == 'start':
        return Bfloat16Support(False, '%s: %s' % (_FAILED[stage], error))
    return Bfloat16Support(False, '%s %s: %s' % (_FAILED[stage], where, error))


def _last_error(stderr: str) -> str:
    """The last line of `stderr` that names an error, its type without the module path
    (``mxnet.base.MXNetError: MXNetError: x`` gives ``MXNetError: x``)."""
    for line in reversed(stderr.splitlines()):
        head, colon, rest = line.strip().partition(':')
        name = head.rsplit('.', 1)[-1]
        if colon and ' ' not in head and name.endswith(('Error', 'Exception')):
            rest = rest.strip()
            return rest if rest.startswith(name + ':') else '%s: %s' % (name, rest)
    return ''


def _cpu_flags(path: str = _CPUINFO) -> frozenset[str] | None:
    """The CPU's flags as ``/proc/cpuinfo`` lists them (its first ``flags`` line), or
    None where the file cannot be read or has none (not Linux)."""
    try:
        with open(path, encoding='utf-8', errors='replace') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'flags':
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def _cpu_note(flags: frozenset[str] | None, isa_limit: str | None) -> str:
    """Where the probe ran, as the reason says it: "on this CPU (no AVX512)", "with
    DNNL_MAX_CPU_ISA=AVX2, which caps oneDNN's instructions (this CPU: AVX512, ...)"."""
    if flags is None:
        cpu = 'AVX512 unknown: no flags in %s' % _CPUINFO
    else:
        missing = [f for f in _AVX512_CORE if f not in flags]
        if not any(f.startswith('avx512') for f in flags):
            cpu = 'no AVX512'
        elif missing:
            cpu = 'no full AVX512: %s missing' % ', '.join(missing)
        else:
            cpu = 'AVX512, %s avx512_bf16' % ('with' if 'avx512_bf16' in flags else 'without')
    if isa_limit:
        return "with %s=%s, which caps oneDNN's instructions (this CPU: %s)" % (
            _ISA_VARIABLE, isa_limit, cpu)
    return 'on this CPU (%s)' % cpu
