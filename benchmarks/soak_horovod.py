"""Soak test for two-rank Horovod jobs: the suite's Horovod jobs, many times over, under CPU
load, counting crashes and hangs (issue 29).

    python benchmarks/soak_horovod.py --jobs 500 --queued 100 --raising 20 \\
        --burners 1 --parallel 2 --json soak-horovod.json --keep soak-horovod-failures

Two-rank jobs (``horovodrun --gloo -np 2 -H localhost:2``), in a fixed rotation:

* ``tests/dist_worker.py`` with each Horovod config of tests/test_horovod.py (its
  ``EQUIVALENT`` and ``MULTS`` parameters); a job passes when it exits 0 and both ranks
  saved the same weights;
* every ``--mlm-every``-th unit, ``mx-lbsgd mlm --horovod`` with tests/test_mlm.py's resume
  arguments, three jobs: an uninterrupted run, a run stopped after micro-batch 8, and its
  resumption; they pass when all exit 0 and the resumed run ends with the uninterrupted
  run's parameter digests.

Interleaved with them: ``--queued`` runs of tests/hvd_exit_worker.py ``queued`` (training,
then 96 ``hvd.allreduce_`` calls nobody waits for, then the end of the script; passes when
it exits 0 with no error from an exit hook) and ``--raising`` runs of its ``raise`` mode
(rank 1 raises with collectives in flight; passes when the job exits non-zero with that
exception and within ``--raise-seconds``). ``--unprotected`` runs the exit worker without
the package's exit drain (to measure what the drain prevents).

``--native both`` (default) alternates ``MX_LBSGD_NATIVE=1`` and ``=0`` job by job.
``--burners N`` keeps N processes spinning on the CPU for the whole soak; ``--parallel P``
runs P units at once (more load, more jobs per minute). Workers get
``PYTHONFAULTHANDLER=1`` (Python stacks of every thread on a fatal signal) on top of
MXNet's own segfault handler (native stack).

Each job is classified: ``crash`` (its output shows a fatal signal, a glibc heap abort,
``std::terminate``, a negative exit status or an exception in an exit hook: the marks of
tests/harness.py), ``hang`` (no end within ``--timeout`` s: horovodrun gets SIGTERM, then
SIGKILL), ``fail`` (anything else unexpected) or ``ok``. The whole output of every job that
is not ``ok`` goes to ``--keep`` DIR. The JSON (rewritten after every job, so an
interrupted soak keeps its counts) holds the settings, the machine, the counts per kind
and per job family, wall time, jobs per minute and the load average seen, with the
command, the date, the CPU model and its vector extensions.
``--sharded K`` adds K runs of ``mx-lbsgd mlm --horovod --shard-states`` (12 steps, the
sharded exchange) at ``--sharded-ranks`` ranks (default 2). ``--plant-hang N`` adds N runs of the exit worker's ``stuck`` mode with a
``--plant-timeout`` bound, which must be caught as hangs with stacks.

``--hvd-broadcast N`` soaks a plain user script instead of the suite's jobs (`USER_SCRIPT`,
written to a temporary file; like Horovod's MXNet examples): ``hvd.init()``, a small Gluon
MLP, ``hvd.broadcast_parameters`` (Horovod's own MXNet broadcast, one per parameter array),
``hvd.DistributedTrainer`` with the package's ``'lblamb'``, a few steps, and the end of the
script with the last step's collectives still queued. It runs N times with each
interpreter of ``--python NAME=PATH`` (repeatable; default the soak's own), alternating
between them, each under the ``horovodrun`` next to it and with only its own installed
packages (the repository is not on its path): two environments with Horovod built stock
and patched (``HOROVOD_STOCK=1`` and not, scripts/install_horovod.sh) compare the two
builds under the same load. A run passes when it exits 0 and both ranks print their
``done`` line; the counts are per build (``by_family``: ``hvd-broadcast-NAME``), and a
crash or hang whose output or stacks show ``EnqueueTensorBroadcast`` says so in its note.
``--widen SECONDS`` runs each rank under gdb, which holds every thread for SECONDS right
after it put a tensor on Horovod's queue (`WIDEN_GDB`): the defect's window, made wide
enough that the collective finishes inside it, every time.

    python benchmarks/soak_horovod.py --hvd-broadcast 300 --burners 1 --parallel 3 \\
        --timeout 120 --max-minutes 100 --python stock=/tmp/hvd-stock-venv/bin/python \\
        --python patched=/tmp/hvd-patched-venv/bin/python \\
        --json soak-horovod-broadcast.json --keep soak-broadcast-failures

Every rank is watched while its job runs (psutil, every 0.2 s): its peak resident memory
and its wall time go into the record, and a rank above 2x the median of its job family in
either fails the job (``outlier``). A rank above ``--rss-limit`` MB (a runaway copy) gets
the job killed at once, counted as a crash. A job that passes ``--timeout`` gets its stacks
before it is killed: each rank's Python stacks (SIGUSR1, which a ``sitecustomize`` on the
workers' path registers with ``faulthandler`` for all threads) and native stacks
(``gdb -p PID -batch -ex 'thread apply all bt'``); a crashed job with ``--cores`` gets the
native stacks of its core file. The stacks go into the job's record in the JSON and into
``--keep``.

    python benchmarks/soak_horovod.py --jobs 200 --queued 300 --raising 0 --sharded 200 \
        --mlm-every 0 --burners 1 --parallel 2 --cores --timeout 120 \
        --json benchmarks/soak-horovod-results.json --keep soak-failures

Not part of the test suite (hours of wall time for 1000 jobs on 2 cores).
"""
import argparse
import concurrent.futures
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, 'tests')
sys.path.insert(0, TESTS)

import harness  # noqa: E402  (CRASH_MARKS: what a crashed worker prints)

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
DIST_WORKER = os.path.join(TESTS, 'dist_worker.py')
EXIT_WORKER = os.path.join(TESTS, 'hvd_exit_worker.py')
SIGNALLED = re.compile(r'exit with status code -\d+|exited with non-zero status.*\n'
                       r'.*\n.*Exit code: -\d+')
#: the CPU's vector extensions that the results name (those /proc/cpuinfo lists)
CPU_FLAGS = ('avx', 'avx2', 'fma', 'avx512f', 'avx512bw', 'avx512vl', 'avx512_vnni',
             'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile')
#: where the Horovod defect of --hvd-broadcast shows in a crashed or hung job's stacks
UAF_FRAMES = ('EnqueueTensorBroadcast', 'EnqueueTensorAlltoall')

#: The plain user script of --hvd-broadcast (argv: number of hidden layers, steps). Its
#: rank prints "rank R done" after the loop; the last step's collectives are still queued
#: in MXNet's engine when it ends.
USER_SCRIPT = '''\
import sys

import mxnet as mx
from mxnet import autograd, gluon
import horovod.mxnet as hvd
import mx_lbsgd  # noqa: F401  (registers 'lblamb')

layers, steps = int(sys.argv[1]), int(sys.argv[2])
hvd.init()
mx.random.seed(hvd.rank())
net = gluon.nn.HybridSequential()
for _ in range(layers):
    net.add(gluon.nn.Dense(32, activation='relu'))
net.add(gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
net(mx.nd.zeros((1, 32)))
params = net.collect_params()
hvd.broadcast_parameters(params, root_rank=0)
trainer = hvd.DistributedTrainer(params, 'lblamb', {'learning_rate': 0.01 * hvd.size()})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for step in range(steps):
    x = mx.nd.random.uniform(-1, 1, (32, 32))
    y = mx.nd.random.randint(0, 10, (32,)).astype('float32')
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(32)
print('rank %d done' % hvd.rank(), flush=True)
'''

#: --widen: a gdb script (non-stop: only the thread that hit a breakpoint stops) that holds
#: each thread for DELAY s right after Horovod's TensorQueue::AddToTensorQueue returns: in
#: EnqueueTensorBroadcast / EnqueueTensorAlltoall, the window between enqueuing and reading
#: the name, wide enough for the collective to finish and MXNet to free the name.
WIDEN_GDB = '''\
import time
import gdb

DELAY, held = %r, [0]


class AfterEnqueue(gdb.FinishBreakpoint):
    def stop(self):
        held[0] += 1
        time.sleep(DELAY)
        return False

    def out_of_scope(self):
        pass


class Enqueue(gdb.Breakpoint):
    def stop(self):
        AfterEnqueue(gdb.newest_frame(), internal=True)
        return False


for command in ('set pagination off', 'set non-stop on', 'set breakpoint pending on',
                'handle SIGPIPE nostop noprint pass'):
    gdb.execute(command)
Enqueue('horovod::common::TensorQueue::AddToTensorQueue')
gdb.execute('run')
print('widen: held %%d enqueues for %%.2f s each' %% (held[0], DELAY))
for thread in gdb.selected_inferior().threads():
    if thread.is_valid() and thread.is_stopped():
        thread.switch()
        print('widen: thread %%d stopped' %% thread.num)
        gdb.execute('bt 12')
'''


def cpu_info():
    """(model name, [the CPU_FLAGS it has]) from /proc/cpuinfo."""
    cpu, flags = platform.processor() or 'unknown CPU', []
    try:
        with open('/proc/cpuinfo') as f:
            lines = f.read().splitlines()
        cpu = next(line.split(':', 1)[1].strip() for line in lines
                   if line.startswith('model name'))
        have = next(line.split(':', 1)[1].split() for line in lines
                    if line.startswith('flags'))
        flags = [flag for flag in CPU_FLAGS if flag in have]
    except (OSError, StopIteration):
        pass
    return cpu, flags


def versions(python, plain=False):
    """mxnet, Horovod (its distribution's version: a patched build has a local label),
    mx_lbsgd and whether its native library is built, in `python`'s environment (`plain`:
    without the repository on the path)."""
    out = subprocess.run(
        [python, '-c', 'import importlib.metadata as md, mxnet, horovod, mx_lbsgd; '
         'print(mxnet.__version__, md.version("horovod"), mx_lbsgd.__version__, '
         'mx_lbsgd.native_library() is not None)'],
        capture_output=True, text=True, env=_env('1', plain=plain), cwd=tempfile.gettempdir()
    ).stdout.split()
    return dict(mxnet=out[0] if out else None, horovod=out[1] if len(out) > 1 else None,
                mx_lbsgd=out[2] if len(out) > 2 else None,
                native_library_built=out[3] == 'True' if len(out) > 3 else None)


def machine():
    cpu, flags = cpu_info()
    found = versions(sys.executable)
    return dict(cpu=cpu, cpu_flags=flags, cpus=os.cpu_count(),
                python=platform.python_version(), mxnet=found['mxnet'],
                horovod=found['horovod'], native_library_built=found['native_library_built'])


#: put first on the workers' PYTHONPATH: SIGUSR1 prints every thread's Python stack
_SITE = tempfile.mkdtemp(prefix='soak-site-')
with open(os.path.join(_SITE, 'sitecustomize.py'), 'w') as _f:
    _f.write('import faulthandler, signal\n'
             'faulthandler.register(signal.SIGUSR1, all_threads=True)\n')


def _env(native, cores=False, plain=False):
    """The workers' environment; `plain`: the repository is not on the path (a user's
    script with the packages installed in its interpreter's environment)."""
    env = dict(os.environ, MX_LBSGD_NATIVE=native, PYTHONFAULTHANDLER='1',
               OMP_NUM_THREADS='1')
    if cores:      # MXNet's handler exits without a core; faulthandler re-raises the signal
        env['MXNET_USE_SIGNAL_HANDLER'] = '0'
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [_SITE] + ([] if plain else [ROOT]) +
                                               [env.get('PYTHONPATH')]))
    return env


def _ranks(proc):
    """The rank processes (Python interpreters) under a horovodrun process."""
    import psutil
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for c in children:
        try:
            cmd = ' '.join(c.cmdline())
            # (horovodrun's own helpers: multiprocessing children)
            if 'python' in os.path.basename(c.exe()) and 'multiprocessing' not in cmd \
                    and 'horovodrun' not in cmd:
                out.append(c)
        except psutil.Error:
            pass
    return out


class _Watch(threading.Thread):
    """Peak resident memory and wall time of every rank process of one job; a rank above
    `limit_mb` gets the job killed (`runaway` holds its pid and size)."""

    def __init__(self, proc, limit_mb=None):
        super().__init__(daemon=True)
        self.proc, self.seen, self.done = proc, {}, threading.Event()
        self.limit_mb, self.runaway = limit_mb, None

    def run(self):
        import psutil
        while not self.done.is_set():
            now = time.monotonic()
            for c in _ranks(self.proc):
                try:
                    rss = c.memory_info().rss
                except psutil.Error:
                    continue
                entry = self.seen.setdefault(c.pid, dict(start=now, end=now, rss=0,
                                                         cmd=' '.join(c.cmdline()[1:3])))
                entry['end'], entry['rss'] = now, max(entry['rss'], rss)
                if self.limit_mb and rss > self.limit_mb * 2 ** 20 and not self.runaway:
                    self.runaway = (c.pid, round(rss / 2 ** 20))
                    for r in _ranks(self.proc) + [self.proc]:
                        try:
                            r.kill()
                        except (OSError, psutil.Error):
                            pass
            self.done.wait(0.2)

    def ranks(self):
        """[{pid, peak_mb, seconds, cmd}] of the rank processes seen (the interpreters
        horovodrun started; launcher helpers that live < 1 s are left out)."""
        return [dict(pid=pid, peak_mb=round(e['rss'] / 2 ** 20, 1),
                     seconds=round(e['end'] - e['start'], 2), cmd=e['cmd'])
                for pid, e in sorted(self.seen.items()) if e['end'] - e['start'] >= 1.0]


def stacks_of(proc):
    """Every rank's Python stacks (SIGUSR1: written to the job's output) and native stacks
    (gdb), as text, before the job is killed."""
    parts = []
    ranks = _ranks(proc)
    for c in ranks:
        try:
            os.kill(c.pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(2)
    for c in ranks:
        try:
            gdb = subprocess.run(['gdb', '-p', str(c.pid), '-batch', '-ex',
                                  'thread apply all bt'], capture_output=True, text=True,
                                 timeout=120)
            text = gdb.stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            text = 'gdb failed: %s' % err
        parts.append('---- native stacks of pid %d (%s) ----\n%s' % (
            c.pid, ' '.join(c.cmdline()[1:3]) if c.is_running() else '?', text))
    return '\n'.join(parts)


def core_stacks(folder, python=None):
    """The native stacks of every core file under `folder` (gdb on `python`, default the
    soak's own, and the core)."""
    parts = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            if name == 'core' or name.startswith('core.'):
                path = os.path.join(dirpath, name)
                try:
                    gdb = subprocess.run([
                        'gdb', python or sys.executable, path, '-batch', '-ex',
                        'thread apply all bt'], capture_output=True, text=True, timeout=300)
                    parts.append('---- core %s ----\n%s' % (path, gdb.stdout[-200000:]))
                except (OSError, subprocess.TimeoutExpired) as err:
                    parts.append('---- core %s: gdb failed: %s' % (path, err))
    return '\n'.join(parts)


def horovod_configs():
    """(id, config) of every Horovod config tests/test_horovod.py runs through dist_worker."""
    import test_horovod
    return [(p.id, p.values[0]) for p in test_horovod.EQUIVALENT + test_horovod.MULTS]


def mlm_argv():
    import test_mlm
    return test_mlm.RESUME_BASE + ['--batch-size', '2']


def _allow_cores():
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


#: what the last run_job of each thread saw: its ranks and any stacks
_LAST = threading.local()


def run_job(argv, native, timeout, cwd, cores=False, rss_limit=None, plain=False,
            horovodrun=None, ranks=2):
    """(kind, seconds, exit status or None, output) of one horovodrun job (`horovodrun`,
    default the one next to ``argv[0]``, the job's interpreter). `cores`: workers may dump
    core (where kernel.core_pattern says), with MXNet's segfault handler off. `rss_limit`:
    MB a rank may reach before the job is killed (a crash). `plain`: see `_env`. `ranks`:
    the job's processes. Afterwards `last_job()` holds the ranks' peak memory and wall time and any stacks."""
    start = time.monotonic()
    horovodrun = horovodrun or os.path.join(os.path.dirname(argv[0]), 'horovodrun')
    proc = subprocess.Popen([horovodrun, '--gloo', '-np', str(ranks), '-H',
                             'localhost:%d' % ranks] + argv,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(native, cores, plain), cwd=cwd,
                            preexec_fn=_allow_cores if cores else None)
    watch = _Watch(proc, rss_limit)
    watch.start()
    _LAST.stacks = ''
    collected = []
    reader = threading.Thread(target=lambda: collected.append(proc.stdout.read()),
                              daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        _LAST.stacks = stacks_of(proc)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(30)
    watch.done.set()
    watch.join()
    _LAST.ranks = watch.ranks()
    out = collected[0] if collected else ''
    seconds = time.monotonic() - start
    if hung:
        return 'hang', seconds, None, out + '\n' + _LAST.stacks
    if watch.runaway:
        out += '\nsoak: rank pid %d reached %d MB (--rss-limit): job killed\n' % watch.runaway
    crashed = [m for m in harness.CRASH_MARKS if m in out] or SIGNALLED.findall(out)
    if crashed or proc.returncode < 0 or watch.runaway:
        if cores:
            _LAST.stacks = core_stacks(cwd, argv[0] if 'python' in argv[0] else None)
        return 'crash', seconds, proc.returncode, out + '\n' + _LAST.stacks
    return 'ok', seconds, proc.returncode, out


def last_job():
    """(ranks, stacks) of this thread's last run_job."""
    return getattr(_LAST, 'ranks', []), getattr(_LAST, 'stacks', '')


class Soak:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.records = []
        self.counter = itertools.count()
        self.start = time.monotonic()
        self.loads = []
        self.stop = threading.Event()
        self.command, self.date, self.machine, self.builds = '', '', {}, {}
        self.user_script = self.widen_script = None
        self.rounds, self.skipped = set(), 0      # (rounds of builds started, units not run)

    # -- units: each returns [(family, name, kind, seconds, code, output, note)] ---------
    def job(self, argv, native, tmp, timeout=None, plain=False, horovodrun=None, ranks=2):
        """run_job with the soak's settings."""
        return run_job(argv, native, timeout or self.args.timeout, tmp, self.args.cores,
                       self.args.rss_limit, plain, horovodrun, ranks)

    def dist(self, name, cfg, native, tmp):
        kind, sec, code, out = self.job([sys.executable, DIST_WORKER, json.dumps(cfg), tmp],
                                        native, tmp)
        seen = last_job()
        note = ''
        if kind == 'ok' and code != 0:
            kind, note = 'fail', 'exit %d' % code
        elif kind == 'ok':
            import numpy as np
            try:
                a, b = (np.load(os.path.join(tmp, 'rank%d.npz' % r)) for r in range(2))
                same = (lambda x, y: np.array_equal(x, y, equal_nan=True)
                        if x.dtype.kind == 'f' else np.array_equal(x, y))
                if any(not same(a[k], b[k]) for k in a.files):   # (norms: NaN unclipped)
                    kind, note = 'fail', 'ranks hold different weights'
            except (OSError, KeyError, ValueError) as err:
                kind, note = 'fail', 'results unreadable: %s' % err
        return [('dist', name, kind, sec, code, out, note, seen)]

    def mlm(self, native, tmp):
        base = [sys.executable, '-m', 'mx_lbsgd_demo', 'mlm', '--horovod'] + mlm_argv()
        stopped = os.path.join(tmp, 'resumed', 'checkpoints', 'micro-batch-0000008')
        steps = [('mlm-straight', ['--out', os.path.join(tmp, 'straight')]),
                 ('mlm-stop-after-8', ['--out', os.path.join(tmp, 'resumed'),
                                       '--stop-after', '8']),
                 ('mlm-resume', ['--out', os.path.join(tmp, 'resumed'), '--resume', stopped])]
        rows = []
        for name, extra in steps:
            kind, sec, code, out = self.job(base + extra, native, tmp)
            seen = last_job()
            note = ''
            if kind == 'ok' and code != 0:
                kind, note = 'fail', 'exit %d' % code
            if kind == 'ok' and name == 'mlm-resume':
                try:
                    digests = [json.load(open(os.path.join(tmp, d, 'summary.json')))
                               ['param_sha256_per_rank'] for d in ('straight', 'resumed')]
                    if digests[0] != digests[1] or len(set(digests[0])) != 1:
                        kind, note = 'fail', 'resumed digests %s != %s' % tuple(digests)
                except (OSError, KeyError, ValueError) as err:
                    kind, note = 'fail', 'summary unreadable: %s' % err
            rows.append(('mlm', name, kind, sec, code, out, note, seen))
            if kind != 'ok':
                break
        return rows

    def exit_worker(self, mode, native, tmp):
        argv = [sys.executable, EXIT_WORKER, mode] + \
            (['--unprotected'] if self.args.unprotected else [])
        kind, sec, code, out = self.job(argv, native, tmp)
        seen = last_job()
        note = ''
        if kind == 'ok':
            if mode == 'queued' and code != 0:
                kind, note = 'fail', 'exit %d' % code
            elif mode == 'queued' and ('Horovod has been shut down' in out
                                       or 'still queued at exit failed' in out):
                kind, note = 'fail', 'a queued collective failed at exit'
            elif mode == 'raise' and (code == 0 or 'RuntimeError: worker 1 fails' not in out):
                kind, note = 'fail', 'exit %d without the exception' % code
            elif mode == 'raise' and sec > self.args.raise_seconds:
                kind, note = 'fail', 'took %.1f s' % sec
        return [('exit-' + mode, mode, kind, sec, code, out, note, seen)]

    def sharded(self, native, tmp):
        """``mx-lbsgd mlm --horovod --shard-states``: 12 steps of the sharded exchange, at
        ``--sharded-ranks`` ranks."""
        argv = [sys.executable, '-m', 'mx_lbsgd_demo', 'mlm', '--horovod', '--steps', '12',
                '--warmup', '2', '--quiet', '--shard-states', '--out',
                os.path.join(tmp, 'out')]
        kind, sec, code, out = self.job(argv, native, tmp, ranks=self.args.sharded_ranks)
        seen = last_job()
        note = ''
        if kind == 'ok' and code != 0:
            kind, note = 'fail', 'exit %d' % code
        elif kind == 'ok' and not os.path.exists(os.path.join(tmp, 'out', 'summary.json')):
            kind, note = 'fail', 'no summary.json'
        return [('sharded', 'mlm-shard-states-np%d' % self.args.sharded_ranks, kind, sec,
                 code, out, note, seen)]

    def planted(self, native, tmp):
        """The exit worker's ``stuck`` mode under --plant-timeout: a hang that must be
        caught, with every rank's Python and native stacks."""
        argv = [sys.executable, EXIT_WORKER, 'stuck']
        kind, sec, code, out = self.job(argv, native, tmp, self.args.plant_timeout)
        seen = last_job()
        stacks = seen[1]
        caught = kind == 'hang' and 'Thread 1' in stacks and 'most recent call first' in out
        return [('planted-hang', 'stuck', 'ok' if caught else 'fail', sec, code, out,
                 'caught with stacks' if caught else 'not caught as a hang with stacks',
                 seen)]

    def user_broadcast(self, build, native, tmp):
        """`USER_SCRIPT` (Horovod's own broadcast_parameters) with the interpreter of
        `build` (a --python NAME): passes when it exits 0 and both ranks print 'done'."""
        python = dict(self.args.python)[build]
        argv = [python, self.user_script, str(self.args.user_layers),
                str(self.args.user_steps)]
        if self.args.widen:
            argv = ['gdb', '-q', '-batch', '-x', self.widen_script, '--args'] + argv
        kind, sec, code, out = self.job(
            argv, native, tmp, plain=True,
            horovodrun=os.path.join(os.path.dirname(python), 'horovodrun'))
        seen = last_job()
        note = ''
        if kind == 'ok' and code != 0:
            kind, note = 'fail', 'exit %d' % code
        elif kind == 'ok' and any('rank %d done' % r not in out for r in range(2)):
            kind, note = 'fail', "a rank did not print 'done'"
        elif kind != 'ok':
            frames = [f for f in UAF_FRAMES if f in out]
            note = '; '.join((['in %s' % ', '.join(frames)] if frames else []) +
                             (['runaway memory'] if '(--rss-limit): job killed' in out else []))
        if self.args.widen:        # how many enqueues gdb held on each rank
            held = dict(re.findall(r'\[(\d)\]<stdout>:widen: held (\d+) enqueues', out))
            note = '; '.join(filter(None, [note, 'held %s enqueues on ranks 0/1' % '/'.join(
                held.get(r, '?') for r in '01')]))
        return [('hvd-broadcast-' + build, build, kind, sec, code, out, note, seen)]

    # -- driver ----------------------------------------------------------------------------
    def units(self):
        configs = horovod_configs()
        total = self.args.queued + self.args.raising
        exits = []                                  # the raising runs spread among the queued
        for i in range(total):
            due = (len([x for x in exits if x == 'raise']) + 1) * total / max(1, self.args.raising)
            exits.append('raise' if self.args.raising and i + 1 >= due else 'queued')
        two_rank, k, e = 0, 0, 0
        # spread the exit runs evenly over the two-rank jobs
        per_exit = max(1, self.args.jobs // max(1, len(exits))) if exits else None
        while two_rank < self.args.jobs or e < len(exits):
            if two_rank < self.args.jobs:
                if self.args.mlm_every and k % self.args.mlm_every == self.args.mlm_every - 1:
                    yield ('mlm',)
                    two_rank += 3
                else:
                    name, cfg = configs[k % len(configs)]
                    yield ('dist', name, cfg)
                    two_rank += 1
                k += 1
            if e < len(exits) and (two_rank >= self.args.jobs or
                                   two_rank >= (e + 1) * per_exit * 0.9):
                yield ('exit', exits[e])
                e += 1
        for _ in range(self.args.plant_hang):
            yield ('planted',)

    def all_units(self):
        """`units`, with the sharded runs spread evenly among them; with --hvd-broadcast,
        its runs alone, alternating between the builds (rounds of one run of each)."""
        if self.args.hvd_broadcast:
            return [('user', name, k) for k in range(self.args.hvd_broadcast)
                    for name, _ in self.args.python]
        base = list(self.units())
        if not self.args.sharded:
            return base
        every = max(1, len(base) // self.args.sharded)
        out, left = [], self.args.sharded
        for k, unit in enumerate(base):
            out.append(unit)
            if left and k % every == every - 1:
                out.append(('sharded',))
                left -= 1
        return out + [('sharded',)] * left

    def due(self, unit):
        """Whether `unit` still runs: not after SIGTERM, nor once --max-minutes have passed
        (the rest of a round of builds that started still runs)."""
        if self.stop.is_set():
            return False
        limit = self.args.max_minutes
        with self.lock:
            if unit[0] == 'user' and unit[2] in self.rounds:
                return True
            if limit and time.monotonic() - self.start > limit * 60:
                self.skipped += 1
                return False
            if unit[0] == 'user':
                self.rounds.add(unit[2])
        return True

    def run_unit(self, unit):
        if not self.due(unit):
            return
        index = next(self.counter)
        turn = unit[2] if unit[0] == 'user' else index      # (a round of builds: one turn)
        native = {'1': '1', '0': '0'}.get(self.args.native, '1' if turn % 2 == 0 else '0')
        tmp = tempfile.mkdtemp(prefix='soak-hvd-')
        try:
            if unit[0] == 'user':
                rows = self.user_broadcast(unit[1], native, tmp)
            elif unit[0] == 'dist':
                rows = self.dist(unit[1], unit[2], native, tmp)
            elif unit[0] == 'mlm':
                rows = self.mlm(native, tmp)
            elif unit[0] == 'sharded':
                rows = self.sharded(native, tmp)
            elif unit[0] == 'planted':
                rows = self.planted(native, tmp)
            else:
                rows = self.exit_worker(unit[1], native, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        load = os.getloadavg()[0]
        with self.lock:
            for family, name, kind, sec, code, out, note, (ranks, stacks) in rows:
                n = len(self.records)
                self.records.append(dict(index=n, family=family, name=name, native=native,
                                         **({'build': name} if unit[0] == 'user' else {}),
                                         kind=kind, seconds=round(sec, 2), code=code,
                                         note=note, load=round(load, 2), ranks=ranks,
                                         **({'stacks': stacks} if stacks else {})))
                self.loads.append(load)
                if kind != 'ok' and self.args.keep:
                    os.makedirs(self.args.keep, exist_ok=True)
                    path = os.path.join(self.args.keep, '%04d-%s-%s-%s-native%s.log'
                                        % (n, kind, family, name, native))
                    with open(path, 'w') as f:
                        f.write('%s %s (exit %s) %s\n%s' % (kind, name, code, note, out))
                print('[%4d] %-9s %-45s native=%s %-5s %6.1fs load %5.1f %s'
                      % (n, family, name, native, kind, sec, load, note), flush=True)
            self.save()

    def outliers(self):
        """Records with a rank above 2x its family's median peak memory or wall time."""
        import statistics
        out = []
        for family in {r['family'] for r in self.records}:
            rows = [r for r in self.records if r['family'] == family and r['ranks']
                    and r['kind'] == 'ok']
            if len(rows) < 3:
                continue
            peaks = statistics.median(x['peak_mb'] for r in rows for x in r['ranks'])
            times = statistics.median(x['seconds'] for r in rows for x in r['ranks'])
            for r in rows:
                worst = [x for x in r['ranks'] if x['peak_mb'] > 2 * peaks
                         or x['seconds'] > 2 * times]
                if worst:
                    out.append(dict(index=r['index'], family=family, ranks=worst,
                                    median_peak_mb=peaks, median_seconds=times))
        return out

    def summary(self):
        kinds = ('ok', 'crash', 'hang', 'fail')
        outliers = self.outliers()
        families = sorted({r['family'] for r in self.records})
        two_rank = [r for r in self.records if r['family'] in ('dist', 'mlm')]
        wall = time.monotonic() - self.start
        return dict(
            command=self.command, date=self.date,
            settings=vars(self.args), machine=self.machine,
            **({'builds': self.builds, 'user_script': USER_SCRIPT}
               if self.args.hvd_broadcast else {}),
            **({'widen_gdb': WIDEN_GDB % self.args.widen} if self.args.widen else {}),
            wall_seconds=round(wall, 1),
            jobs=len(self.records), two_rank_jobs=len(two_rank),
            units_not_run_after_max_minutes=self.skipped,
            exit_worker_runs={m: sum(r['family'] == 'exit-' + m for r in self.records)
                              for m in ('queued', 'raise')},
            counts={k: sum(r['kind'] == k for r in self.records) for k in kinds},
            outliers=outliers,
            ranks_per_family={f: dict(
                peak_mb=dict(median=_median([x['peak_mb'] for r in self.records
                                             if r['family'] == f for x in r['ranks']]),
                             max=max([x['peak_mb'] for r in self.records
                                      if r['family'] == f for x in r['ranks']] or [0])),
                seconds=dict(median=_median([x['seconds'] for r in self.records
                                             if r['family'] == f for x in r['ranks']]),
                             max=max([x['seconds'] for r in self.records
                                      if r['family'] == f for x in r['ranks']] or [0])))
                for f in families},
            by_family={f: {k: sum(r['family'] == f and r['kind'] == k for r in self.records)
                           for k in kinds} for f in families},
            by_native={n: {k: sum(r['native'] == n and r['kind'] == k for r in self.records)
                           for k in kinds} for n in ('1', '0')},
            jobs_per_minute=round(len(self.records) / wall * 60, 2) if wall else None,
            load_average_1min=dict(min=min(self.loads), max=max(self.loads),
                                   mean=round(sum(self.loads) / len(self.loads), 2))
            if self.loads else None,
            records=self.records)

    def save(self):
        if self.args.json:
            with open(self.args.json + '.tmp', 'w') as f:
                json.dump(self.summary(), f, indent=1)
            os.replace(self.args.json + '.tmp', self.args.json)


def _median(values):
    import statistics
    return round(statistics.median(values), 2) if values else None


def _burn():
    while True:
        pass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--jobs', type=int, default=500,
                   help='two-rank jobs of the test configs and mlm (default 500)')
    p.add_argument('--queued', type=int, default=100,
                   help='runs of the exit-with-work-queued worker (default 100)')
    p.add_argument('--raising', type=int, default=20,
                   help='runs of the worker that raises with collectives in flight')
    p.add_argument('--mlm-every', type=int, default=8,
                   help='every K-th unit is an mlm --horovod resume trio (0: none)')
    p.add_argument('--native', choices=['both', '1', '0'], default='both')
    p.add_argument('--burners', type=int, default=1, help='CPU-spinning processes')
    p.add_argument('--parallel', type=int, default=1, help='units run at once')
    p.add_argument('--timeout', type=float, default=180.0, help='seconds before a hang')
    p.add_argument('--raise-seconds', type=float, default=60.0,
                   help='a raising job must end within this (default 60)')
    p.add_argument('--unprotected', action='store_true',
                   help="exit worker without the package's exit drain (baseline)")
    p.add_argument('--sharded', type=int, default=0,
                   help='runs of mx-lbsgd mlm --horovod --shard-states (default 0)')
    p.add_argument('--sharded-ranks', type=int, default=2,
                   help='ranks of each --sharded run (default 2)')
    p.add_argument('--hvd-broadcast', type=int, default=0, metavar='N',
                   help="instead of the suite's jobs: N runs per --python of a plain user "
                        "script with Horovod's own broadcast_parameters (USER_SCRIPT)")
    p.add_argument('--python', action='append', default=[], metavar='NAME=PATH',
                   help='an interpreter (its environment: a Horovod build) that '
                        '--hvd-broadcast runs, under its own horovodrun; repeatable '
                        '(default: this one, as NAME "current")')
    p.add_argument('--user-layers', type=int, default=16,
                   help="hidden layers of --hvd-broadcast's MLP (default 16: 34 parameter "
                        "arrays, one broadcast each)")
    p.add_argument('--user-steps', type=int, default=4,
                   help="training steps of --hvd-broadcast's script (default 4)")
    p.add_argument('--widen', type=float, default=0, metavar='SECONDS',
                   help="--hvd-broadcast's ranks run under gdb, which holds each thread "
                        "SECONDS right after it put a tensor on Horovod's queue (WIDEN_GDB): "
                        "the defect's window made wide (default 0: no gdb)")
    p.add_argument('--max-minutes', type=float, default=0,
                   help='start no unit (no round of --hvd-broadcast builds) after this many '
                        'minutes (default 0: no limit)')
    p.add_argument('--rss-limit', type=float, default=4096,
                   help='MB of resident memory a rank may reach before its job is killed '
                        'and counted as a crash (default 4096)')
    p.add_argument('--plant-hang', type=int, default=0,
                   help="runs of the exit worker's stuck mode, caught as hangs")
    p.add_argument('--plant-timeout', type=float, default=20.0,
                   help='seconds before a planted hang is caught (default 20)')
    p.add_argument('--json', help='write the results here (after every job)')
    p.add_argument('--keep', help='write the output of every job not ok into this folder')
    p.add_argument('--cores', action='store_true',
                   help='let crashed workers dump core (MXNET_USE_SIGNAL_HANDLER=0, no core '
                        'size limit; the kernel\'s core_pattern says where): open one with '
                        'gdb python CORE for the native stack of every thread')
    args = p.parse_args(argv)
    for name in ('jobs', 'queued', 'raising', 'burners', 'mlm_every', 'sharded',
                 'plant_hang', 'hvd_broadcast'):
        if getattr(args, name) < 0:
            p.error('argument --%s: must be >= 0, got %d'
                    % (name.replace('_', '-'), getattr(args, name)))
    if args.parallel < 1:
        p.error('argument --parallel: must be >= 1, got %d' % args.parallel)
    if args.sharded_ranks < 2:
        p.error('argument --sharded-ranks: must be >= 2, got %d' % args.sharded_ranks)
    try:
        args.python = [tuple(x.split('=', 1)) for x in args.python] or \
            [('current', sys.executable)]
        args.python = [(name, os.path.abspath(path)) for name, path in args.python]
    except ValueError:
        p.error('argument --python: expected NAME=PATH, got %r' % args.python)
    if len({name for name, _ in args.python}) < len(args.python):
        p.error('argument --python: each NAME once')
    for python in [path for _, path in args.python] if args.hvd_broadcast else \
            [sys.executable]:
        if not os.path.exists(os.path.join(os.path.dirname(python), 'horovodrun')):
            p.error('horovodrun not found next to %s (bash scripts/install_horovod.sh)'
                    % python)
    soak = Soak(args)
    soak.command = ' '.join(['python', 'benchmarks/soak_horovod.py'] +
                            (sys.argv[1:] if argv is None else list(argv)))
    soak.date = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    soak.machine = machine()
    print('machine: %s' % soak.machine, flush=True)
    if args.hvd_broadcast:
        soak.builds = {name: dict(python=path, **versions(path, plain=True))
                       for name, path in args.python}
        print('builds: %s' % soak.builds, flush=True)
        soak.user_script = os.path.join(_SITE, 'user_broadcast.py')
        with open(soak.user_script, 'w') as f:
            f.write(USER_SCRIPT)
        if args.widen:
            soak.widen_script = os.path.join(_SITE, 'widen_gdb.py')
            with open(soak.widen_script, 'w') as f:
                f.write(WIDEN_GDB % args.widen)
    import multiprocessing
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    signal.signal(signal.SIGTERM, lambda *a: soak.stop.set())
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            for f in [pool.submit(soak.run_unit, u) for u in soak.all_units()]:
                try:
                    f.result()
                except KeyboardInterrupt:
                    soak.stop.set()
    except KeyboardInterrupt:
        soak.stop.set()
    finally:
        for b in burners:
            b.terminate()
    soak.save()
    s = soak.summary()
    print('%d jobs (%d two-rank, exit worker %s) in %.0f s, %.1f jobs/min: %s; load %s'
          % (s['jobs'], s['two_rank_jobs'], s['exit_worker_runs'], s['wall_seconds'],
             s['jobs_per_minute'] or 0, s['counts'], s['load_average_1min']))
    if args.hvd_broadcast:
        for family, counts in s['by_family'].items():
            print('%s: %s' % (family, counts))
    print('outliers (a rank above 2x its family\'s median memory or time): %d'
          % len(s['outliers']))
    return 0 if s['counts']['ok'] == s['jobs'] and not s['outliers'] else 1


if __name__ == '__main__':
    sys.exit(main())
