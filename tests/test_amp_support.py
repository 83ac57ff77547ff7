"""``mx_lbsgd.amp_support``: whether MXNet trains bfloat16 here, asked of MXNet in a child
interpreter once per process. ``DNNL_MAX_CPU_ISA=AVX2`` makes MXNet's oneDNN behave as on
an AVX2-only CPU on any machine, so the "no" is checked everywhere; the answer without it
is checked against the CPU's flags in ``/proc/cpuinfo``. How the child's output becomes an
answer is checked on planted outputs."""
import json
import os
import subprocess
import sys

import pytest

from mx_lbsgd import amp_support
from mx_lbsgd.amp_support import Bfloat16Support, amp_bfloat16_support, amp_bfloat16_trains

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MXNET_ERROR = 'MXNetError: could not create a primitive descriptor iterator'
AVX512 = frozenset(['avx2', 'avx512f', 'avx512bw', 'avx512dq', 'avx512vl', 'avx512_bf16'])


def _answer_in(env):
    """amp_bfloat16_support() of a fresh interpreter under `env`."""
    code = ('import json\n'
            'from mx_lbsgd.amp_support import amp_bfloat16_support, amp_bfloat16_trains\n'
            'support = amp_bfloat16_support()\n'
            'assert amp_bfloat16_trains() is support.ok\n'
            'print(json.dumps(support._asdict()))\n')
    env = dict(env, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [env.get('PYTHONPATH')] if p]))
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Bfloat16Support(**json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_answer_is_asked_once_per_process():
    support = amp_bfloat16_support()
    assert isinstance(support, Bfloat16Support) and isinstance(support.ok, bool)
    assert support.reason and '\n' not in support.reason
    assert amp_bfloat16_support() is support
    assert amp_bfloat16_trains() is support.ok
    ok, reason = support
    assert (ok, reason) == (support.ok, support.reason)


def test_an_avx2_limit_says_no_with_mxnets_error():
    """Capped at AVX2, MXNet's oneDNN has no bfloat16 kernels on any CPU."""
    support = _answer_in(dict(os.environ, DNNL_MAX_CPU_ISA='AVX2'))
    assert not support.ok
    assert support.reason.startswith("MXNet's oneDNN cannot run"), support.reason
    assert 'with DNNL_MAX_CPU_ISA=AVX2' in support.reason, support.reason
    assert support.reason.endswith(MXNET_ERROR), support.reason


def test_without_a_limit_the_answer_follows_the_cpu():
    """AVX512 (avx512f, avx512bw, avx512dq, avx512vl) trains bfloat16; a CPU without any
    AVX512 cannot. Other CPUs (part of AVX512, or flags unknown) are not judged here."""
    env = {k: v for k, v in os.environ.items() if k != 'DNNL_MAX_CPU_ISA'}
    flags = amp_support._cpu_flags()
    if flags is None:
        pytest.skip('no CPU flags in /proc/cpuinfo: nothing to check the answer against')
    full = all(f in flags for f in amp_support._AVX512_CORE)
    none = not any(f.startswith('avx512') for f in flags)
    if not (full or none):
        pytest.skip('this CPU has part of AVX512: no answer is known for it')
    support = _answer_in(env)
    assert support.ok == full, support
    if full:
        assert support.reason.startswith('MXNet trained a bfloat16 Dense layer under AMP')
        assert 'on this CPU (AVX512, with' in support.reason, support.reason
    else:
        assert 'on this CPU (no AVX512)' in support.reason, support.reason
        assert 'MXNetError' in support.reason, support.reason


# -- the child's output, read ----------------------------------------------------------------

STAGES = ['start', 'init', 'forward', 'cast', 'backward', 'step']


def _stdout(ran, failed=None):
    return ''.join('probe: %s\n' % s for s in ran) + (
        'probe: failed %s\n' % failed if failed else '')


def test_every_stage_ran():
    support = amp_support._read_probe(_stdout(STAGES), '', 0, {}, AVX512)
    assert support == (True, "MXNet trained a bfloat16 Dense layer under AMP (forward, "
                             "backward and an 'sgd' step) on this CPU (AVX512, with "
                             "avx512_bf16)")


def test_a_failed_stage_names_what_failed_the_cpu_and_the_error():
    no_avx512 = frozenset(['sse2', 'avx', 'avx2', 'fma'])
    out = _stdout(STAGES[:4], 'backward: ' + MXNET_ERROR)
    assert amp_support._read_probe(out, '', 1, {}, no_avx512) == (
        False, "MXNet's oneDNN cannot run bfloat16 backward on this CPU (no AVX512): "
               + MXNET_ERROR)
    out = _stdout(STAGES[:2], 'forward: ' + MXNET_ERROR)
    assert amp_support._read_probe(out, '', 1, {'DNNL_MAX_CPU_ISA': 'AVX2'}, AVX512) == (
        False, "MXNet's oneDNN cannot run a bfloat16 Dense layer's forward with "
               "DNNL_MAX_CPU_ISA=AVX2, which caps oneDNN's instructions (this CPU: AVX512, "
               "with avx512_bf16): " + MXNET_ERROR)
    out = _stdout([], "start: ModuleNotFoundError: No module named 'mxnet'")
    assert amp_support._read_probe(out, '', 1, {}, AVX512) == (
        False, "the probe could not import MXNet: ModuleNotFoundError: No module named "
               "'mxnet'")


def test_a_crash_is_read_from_the_stage_reached_and_stderr():
    stderr = ('[02:00:00] ../src/x.cc:1: detail\nTraceback (most recent call last):\n'
              '  File "<string>", line 3\nmxnet.base.MXNetError: MXNetError: it broke\n')
    support = amp_support._read_probe(_stdout(STAGES[:4]), stderr, 1, {}, None)
    assert support == (False, "MXNet's oneDNN cannot run bfloat16 backward on this CPU "
                              "(AVX512 unknown: no flags in /proc/cpuinfo): "
                              "MXNetError: it broke")
    stderr = 'Traceback (most recent call last):\nRuntimeError: no room\n'
    support = amp_support._read_probe(_stdout(STAGES[:1]), stderr, 1, {}, AVX512)
    assert support.reason == ("MXNet's AMP could not set up a bfloat16 Dense layer on this "
                              "CPU (AVX512, with avx512_bf16): RuntimeError: no room")
    support = amp_support._read_probe(_stdout(STAGES[:2]), '', -11, {}, AVX512)
    assert support.reason.endswith('forward on this CPU (AVX512, with avx512_bf16): '
                                   'the probe exited with code -11'), support


def test_a_layer_amp_did_not_cast_is_a_no():
    out = _stdout(STAGES[:3], 'cast: RuntimeError: the layer ran in float32')
    assert amp_support._read_probe(out, '', 1, {}, AVX512) == (
        False, "MXNet's AMP did not cast a Dense layer to bfloat16 on this CPU (AVX512, "
               "with avx512_bf16): RuntimeError: the layer ran in float32")


def test_a_probe_that_hangs_is_a_no():
    support = amp_support._probe('import time; time.sleep(60)', 0.5, os.environ)
    assert support == (False, 'the bfloat16 probe (a child interpreter training a bfloat16 '
                              'Dense layer) did not finish within 0.5 s')


def test_the_cpu_flags_and_how_the_reason_says_them(tmp_path):
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text('processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\n'
                       'processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f\n')
    flags = amp_support._cpu_flags(str(cpuinfo))
    assert flags == {'fpu', 'sse2', 'avx2', 'avx512f'}
    assert amp_support._cpu_flags(str(tmp_path / 'missing')) is None
    assert amp_support._cpu_note(flags, None) == (
        'on this CPU (no full AVX512: avx512bw, avx512dq, avx512vl missing)')
    assert amp_support._cpu_note(frozenset(['avx2']), None) == 'on this CPU (no AVX512)'
    assert amp_support._cpu_note(AVX512 - {'avx512_bf16'}, None) == (
        'on this CPU (AVX512, without avx512_bf16)')
    assert amp_support._cpu_note(frozenset(['avx2']), 'AVX2') == (
        "with DNNL_MAX_CPU_ISA=AVX2, which caps oneDNN's instructions (this CPU: no AVX512)")
