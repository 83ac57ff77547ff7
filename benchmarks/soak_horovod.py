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
and per job family, wall time, jobs per minute and the load average seen.
Not part of the test suite (an hour or more of wall time).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, 'tests')
sys.path.insert(0, TESTS)

import harness  # noqa: E402  (CRASH_MARKS: what a crashed worker prints)

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
DIST_WORKER = os.path.join(TESTS, 'dist_worker.py')
EXIT_WORKER = os.path.join(TESTS, 'hvd_exit_worker.py')
SIGNALLED = re.compile(r'exit with status code -\d+|exited with non-zero status.*\n'
                       r'.*\n.*Exit code: -\d+')


def machine():
    cpu = platform.processor() or 'unknown CPU'
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(line.split(':', 1)[1].strip() for line in f
                       if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    versions = subprocess.run(
        [sys.executable, '-c', 'import mxnet, horovod, mx_lbsgd; '
         'print(mxnet.__version__, horovod.__version__, mx_lbsgd.native_library() is not None)'],
        capture_output=True, text=True, env=_env('1')).stdout.split()
    return dict(cpu=cpu, cpus=os.cpu_count(), python=platform.python_version(),
                mxnet=versions[0] if versions else None,
                horovod=versions[1] if len(versions) > 1 else None,
                native_library_built=versions[2] == 'True' if len(versions) > 2 else None)


def _env(native, cores=False):
    env = dict(os.environ, MX_LBSGD_NATIVE=native, PYTHONFAULTHANDLER='1',
               OMP_NUM_THREADS='1')
    if cores:      # MXNet's handler exits without a core; faulthandler re-raises the signal
        env['MXNET_USE_SIGNAL_HANDLER'] = '0'
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [ROOT, env.get('PYTHONPATH')]))
    return env


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


def run_job(argv, native, timeout, cwd, cores=False):
    """(kind, seconds, exit status or None, output) of one horovodrun job. `cores`: workers
    may dump core (where kernel.core_pattern says), with MXNet's segfault handler off."""
    start = time.monotonic()
    proc = subprocess.Popen([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2'] + argv,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(native, cores), cwd=cwd,
                            preexec_fn=_allow_cores if cores else None)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return 'hang', time.monotonic() - start, None, out or ''
    seconds = time.monotonic() - start
    crashed = [m for m in harness.CRASH_MARKS if m in out] or SIGNALLED.findall(out)
    if crashed or proc.returncode < 0:
        return 'crash', seconds, proc.returncode, out
    return 'ok', seconds, proc.returncode, out


class Soak:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.records = []
        self.counter = itertools.count()
        self.start = time.monotonic()
        self.loads = []
        self.stop = threading.Event()

    # -- units: each returns [(family, name, kind, seconds, code, output, note)] ---------
    def dist(self, name, cfg, native, tmp):
        kind, sec, code, out = run_job([sys.executable, DIST_WORKER, json.dumps(cfg), tmp],
                                       native, self.args.timeout, tmp, self.args.cores)
        note = ''
        if kind == 'ok' and code != 0:
            kind, note = 'fail', 'exit %d' % code
        elif kind == 'ok':
            import numpy as np
            try:
                a, b = (np.load(os.path.join(tmp, 'rank%d.npz' % r)) for r in range(2))
                if any(not np.array_equal(a[k], b[k]) for k in a.files):
                    kind, note = 'fail', 'ranks hold different weights'
            except (OSError, KeyError, ValueError) as err:
                kind, note = 'fail', 'results unreadable: %s' % err
        return [('dist', name, kind, sec, code, out, note)]

    def mlm(self, native, tmp):
        base = [sys.executable, '-m', 'mx_lbsgd_demo', 'mlm', '--horovod'] + mlm_argv()
        stopped = os.path.join(tmp, 'resumed', 'checkpoints', 'micro-batch-0000008')
        steps = [('mlm-straight', ['--out', os.path.join(tmp, 'straight')]),
                 ('mlm-stop-after-8', ['--out', os.path.join(tmp, 'resumed'),
                                       '--stop-after', '8']),
                 ('mlm-resume', ['--out', os.path.join(tmp, 'resumed'), '--resume', stopped])]
        rows = []
        for name, extra in steps:
            kind, sec, code, out = run_job(base + extra, native, self.args.timeout, tmp,
                                           self.args.cores)
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
            rows.append(('mlm', name, kind, sec, code, out, note))
            if kind != 'ok':
                break
        return rows

    def exit_worker(self, mode, native, tmp):
        argv = [sys.executable, EXIT_WORKER, mode] + (['--unprotected'] if
                                                      self.args.unprotected else [])
        kind, sec, code, out = run_job(argv, native, self.args.timeout, tmp, self.args.cores)
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
        return [('exit-' + mode, mode, kind, sec, code, out, note)]

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

    def run_unit(self, unit):
        if self.stop.is_set():
            return
        index = next(self.counter)
        native = {'1': '1', '0': '0'}.get(self.args.native, '1' if index % 2 == 0 else '0')
        tmp = tempfile.mkdtemp(prefix='soak-hvd-')
        try:
            if unit[0] == 'dist':
                rows = self.dist(unit[1], unit[2], native, tmp)
            elif unit[0] == 'mlm':
                rows = self.mlm(native, tmp)
            else:
                rows = self.exit_worker(unit[1], native, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        load = os.getloadavg()[0]
        with self.lock:
            for family, name, kind, sec, code, out, note in rows:
                n = len(self.records)
                self.records.append(dict(index=n, family=family, name=name, native=native,
                                         kind=kind, seconds=round(sec, 2), code=code,
                                         note=note, load=round(load, 2)))
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

    def summary(self):
        kinds = ('ok', 'crash', 'hang', 'fail')
        families = sorted({r['family'] for r in self.records})
        two_rank = [r for r in self.records if r['family'] in ('dist', 'mlm')]
        wall = time.monotonic() - self.start
        return dict(
            settings=vars(self.args), machine=self.machine,
            wall_seconds=round(wall, 1),
            jobs=len(self.records), two_rank_jobs=len(two_rank),
            exit_worker_runs={m: sum(r['family'] == 'exit-' + m for r in self.records)
                              for m in ('queued', 'raise')},
            counts={k: sum(r['kind'] == k for r in self.records) for k in kinds},
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
    p.add_argument('--json', help='write the results here (after every job)')
    p.add_argument('--keep', help='write the output of every job not ok into this folder')
    p.add_argument('--cores', action='store_true',
                   help='let crashed workers dump core (MXNET_USE_SIGNAL_HANDLER=0, no core '
                        'size limit; the kernel\'s core_pattern says where): open one with '
                        'gdb python CORE for the native stack of every thread')
    args = p.parse_args(argv)
    for name in ('jobs', 'queued', 'raising', 'burners', 'mlm_every'):
        if getattr(args, name) < 0:
            p.error('argument --%s: must be >= 0, got %d'
                    % (name.replace('_', '-'), getattr(args, name)))
    if args.parallel < 1:
        p.error('argument --parallel: must be >= 1, got %d' % args.parallel)
    if not os.path.exists(HOROVODRUN):
        p.error('horovodrun not found next to %s (bash scripts/install_horovod.sh)'
                % sys.executable)
    soak = Soak(args)
    soak.machine = machine()
    print('machine: %s' % soak.machine, flush=True)
    import multiprocessing
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    signal.signal(signal.SIGTERM, lambda *a: soak.stop.set())
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            for f in [pool.submit(soak.run_unit, u) for u in soak.units()]:
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
    return 0 if s['counts']['ok'] == s['jobs'] else 1


if __name__ == '__main__':
    sys.exit(main())
