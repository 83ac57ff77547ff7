"""Soak test for loopback ``dist_sync`` jobs: N consecutive small Gluon jobs through
``mx_lbsgd.launch``, watching for jobs that fail, leave a process behind, or whose workers
finish but whose processes do not exit.

    python benchmarks/soak_dist.py --jobs 50 --json soak.json [--stacks]
    nice -n 19 python benchmarks/soak_dist.py --jobs 200 --spinners 2 --optimizer lbsgd
    nice -n 19 python benchmarks/soak_dist.py --jobs 100 --dist-tests-every 20 --optimizer lbsgd
    python benchmarks/soak_dist.py --job sparse --jobs 200 --spinners 2 --stacks \
        --hang-after 10 --timeout 60 --json benchmarks/soak-dist-sparse-exit.json

``--spinners N`` keeps N processes spinning on the CPU for the whole soak (they inherit the
soak's niceness). ``--dist-tests-every K`` runs the suite's dist tests (``--dist-tests``,
default tests/test_kvstore.py's dist jobs) before job 0, K, 2K, ..., so that jobs start right
after them, as after a CI run. Jobs run back to back, with no pause.

Each job: 1 scheduler, ``--servers`` servers and ``--workers`` workers; every worker trains a
small Gluon MLP for ``--steps`` ``trainer.step`` calls on ``kvstore='dist_sync'`` with
``update_on_kvstore=False``, checks that all workers hold the same weights, prints
``rank R done`` and exits (the kvstore is freed, and ps-lite finalized, at interpreter exit).

``--job sparse`` runs tests/sparse_dist_worker.py instead (SparseEmbedding, the optimizer on
the server; ``--sparse-config``, default the config of tests/test_sparse.py's
``test_sparse_embedding_dist_sync_equals_one_process[lbsgd-power2-B2]``): each worker saves
its table and prints ``rank R done``; a job whose workers' tables differ fails.
Every worker runs with ``faulthandler.register(SIGUSR1, all_threads=True)``: a worker found
hung at exit gets SIGUSR1 before gdb, and its Python stacks land in the job's log.

Recorded per job: wall time, the launcher's exit status, every process's exit status (as the
launcher reports it), and whether the job hung at exit: some process still alive
``--hang-after`` seconds after every worker printed ``done``. For such a job the still-alive
processes are listed and, with ``--stacks``, their native stacks (``gdb``) are saved in the
JSON, showing where they hung. A job fails when the launcher's status is not 0, a worker
did not finish, or a process of the job is still alive 3 s after the launcher returned
(``left_over``: such processes are listed, then killed). For a failed job the TCP sockets
of the machine with their processes (``ss -tanp``) are saved, showing who talked to whom.
Not part of the test suite (minutes of wall time; tests/test_launch.py has a CI-sized soak).
"""
import argparse
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mx_lbsgd import launch as launch_module  # noqa: E402

WORKER = '''\
import os, sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
import mx_lbsgd

optimizer, steps, batch = sys.argv[1], int(sys.argv[2]), 8
kv = mx.kv.create('dist_sync')
rank, n = kv.rank, kv.num_workers
mx.random.seed(0)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(16, activation='relu'), gluon.nn.Dense(4))
net.initialize(mx.init.Xavier())
net(nd.zeros((1, 8)))
trainer = gluon.Trainer(net.collect_params(), optimizer,
                        dict(learning_rate=0.1, momentum=0.9), kvstore=kv,
                        update_on_kvstore=False)
mx_lbsgd.init_kvstore(trainer, batch * n)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.RandomState(rank)
for step in range(steps):
    x = nd.array(rng.randn(batch, 8))
    y = nd.array(rng.randint(0, 4, batch))
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(batch * n)
# every worker must hold the same weights: sum of all workers' checksums == n * own
total = sum(float(p.data().sum().asscalar()) for p in net.collect_params().values())
check = nd.array([total])
kv.init(999, nd.zeros((1,)))
kv.push(999, check)
got = nd.zeros((1,))
kv.pull(999, out=got)
assert abs(got.asscalar() - n * total) < 1e-3 * max(1.0, abs(n * total)), (got, total)
print('rank %d done' % rank, flush=True)
'''


# Runs a worker script with Python's stacks on SIGUSR1 (to the job's output), e.g.
# ``python -c WRAP tests/sparse_dist_worker.py CFG OUT``.
WRAP = """\
import faulthandler, runpy, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""
SPARSE_WORKER = os.path.join(ROOT, 'tests', 'sparse_dist_worker.py')
# tests/test_sparse.py: test_sparse_embedding_dist_sync_equals_one_process[lbsgd-power2-B2]
SPARSE_CONFIG = dict(optimizer='lbsgd', params=dict(
    warmup_strategy='power2', batch_scale=2, warmup_epochs=1, updates_per_epoch=2),
    kvstore='dist_sync')


class _Watch(io.TextIOBase):
    """Stream given to the launcher: keeps the output, notes when each worker is done."""

    def __init__(self, num_workers, echo):
        self.lines, self.done_at, self.num_workers, self.echo = [], {}, num_workers, echo
        self._buf = ''

    def write(self, text):
        self._buf += text
        *lines, self._buf = self._buf.split('\n')
        for line in lines:
            self.lines.append((time.monotonic(), line))
            if line.startswith('[worker ') and ' done' in line and 'rank ' in line:
                self.done_at[line.split(']')[0][1:]] = time.monotonic()
            if self.echo:
                print(line, flush=True)
        return len(text)

    def all_done(self):
        return len(self.done_at) == self.num_workers


def _alive(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in 'ZX'
    except OSError:
        return False


def _wchan(pid):
    try:
        with open(f'/proc/{pid}/wchan') as f:
            return f.read().strip()
    except OSError:
        return '?'


def _stacks(pid):
    """Native stacks of every thread of ``pid`` (gdb), the frames of interest kept."""
    if not shutil.which('gdb'):
        return 'gdb not found'
    try:
        out = subprocess.run(['gdb', '-p', str(pid), '-batch', '-nx', '-ex',
                              'thread apply all bt 30'], capture_output=True, text=True,
                             timeout=60).stdout
    except subprocess.TimeoutExpired:
        return 'gdb timed out'
    keep = [line for line in out.splitlines() if line.startswith(('Thread ', '#'))]
    return '\n'.join(keep)


def _tagged(tag):
    """``{pid: command line}`` of live processes whose environment holds ``SOAK_TAG=tag``."""
    needle, found = f'SOAK_TAG={tag}'.encode(), {}
    for name in os.listdir('/proc'):
        if name.isdigit() and _alive(name):
            try:
                with open(f'/proc/{name}/environ', 'rb') as f:
                    if needle in f.read().split(b'\0'):
                        with open(f'/proc/{name}/cmdline', 'rb') as c:
                            found[int(name)] = c.read().replace(b'\0', b' ').decode()[:200]
            except OSError:
                pass
    return found


def _left_over(tag, wait=3.0):
    """Processes of the job still alive ``wait`` s after the launcher returned; kills them."""
    deadline = time.monotonic() + wait
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _tagged(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _sockets():
    try:
        return subprocess.run(['ss', '-tanp'], capture_output=True, text=True,
                              timeout=20).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f'ss failed: {err}']


def _monitor(watch, pids, hang_after, stacks, record, stop):
    """Once all workers are done, wait ``hang_after`` s; record who is still alive."""
    while not stop.is_set() and not watch.all_done():
        time.sleep(0.05)
    if stop.is_set():
        return
    last = max(watch.done_at.values())
    while not stop.is_set() and time.monotonic() - last < hang_after:
        time.sleep(0.05)
    if stop.is_set():
        return
    alive = {label: pid for label, pid in pids.items() if _alive(pid)}
    if not alive:
        return
    record['hung'] = {label: dict(pid=pid, wchan=_wchan(pid)) for label, pid in alive.items()}
    for label, pid in alive.items():
        if label.startswith('worker'):     # Python stacks into the job's output (WRAP)
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    if stacks:
        for label, pid in alive.items():
            record['hung'][label]['stack'] = _stacks(pid)


def run_job(index, args, workdir):
    watch = _Watch(args.workers, args.verbose)
    pids, record, stop = {}, dict(job=index), threading.Event()
    monitor = threading.Thread(target=_monitor, daemon=True, args=(
        watch, pids, args.hang_after, args.stacks, record, stop))
    report, tag = {}, uuid.uuid4().hex
    kwargs = dict(timeout=args.timeout, stream=watch, on_start=pids.update,
                  env={'SOAK_TAG': tag, 'PYTHONPATH': os.pathsep.join(
                      filter(None, [ROOT, os.environ.get('PYTHONPATH')]))})
    if args.ps_verbose:
        kwargs['env']['PS_VERBOSE'] = '1'
    if 'report' in launch_module.launch.__code__.co_varnames:
        kwargs['report'] = report
    if args.job == 'sparse':
        out = tempfile.mkdtemp(prefix='job%d_' % index, dir=workdir)
        command = [sys.executable, '-c', WRAP, SPARSE_WORKER, args.sparse_config, out]
    else:
        command = [sys.executable, '-c', WRAP, os.path.join(workdir, 'worker.py'),
                   args.optimizer, str(args.steps)]
    monitor.start()
    start = time.monotonic()
    status = launch_module.launch(command, args.workers, args.servers, **kwargs)
    wall = time.monotonic() - start
    stop.set()
    monitor.join()
    left = _left_over(tag)
    done = sorted(watch.done_at)
    record.update(status=status, wall_s=round(wall, 3), workers_done=len(done),
                  host=report.get('host'), port=report.get('port'), left_over=left,
                  exit_wait_s=round(time.monotonic() - max(watch.done_at.values()) - 0, 3)
                  if done else None,
                  processes=report.get('processes'),
                  launcher_lines=[line for _, line in watch.lines if line.startswith('[launch]')])
    if args.job == 'sparse':
        record['tables_equal'] = _tables_equal(out, args.workers)
        shutil.rmtree(out, ignore_errors=True)
    record['failed'] = bool(status != 0 or len(done) != args.workers or left or
                            record.get('tables_equal') is False)
    if record['failed'] or record.get('hung'):
        record['log_tail'] = [line for _, line in watch.lines][-60:]
    if record['failed']:
        record['sockets'] = _sockets()
    record.setdefault('hung', {})
    return record


def _tables_equal(out, workers):
    """Whether every worker saved the same table (False also when one is missing)."""
    import numpy as np
    try:
        tables = [np.load(os.path.join(out, 'rank%d.npy' % r)) for r in range(workers)]
    except OSError:
        return False
    return all(np.array_equal(tables[0], t) for t in tables[1:])


def _table(records):
    rows = ['  job  status   wall s  left over  hung at exit']
    for r in records:
        hung = ', '.join(f"{k} ({v['wchan']})" for k, v in r['hung'].items()) or '-'
        rows.append(f"{r['job']:5d}  {r['status']:6d}  {r['wall_s']:7.2f}  "
                    f"{len(r['left_over']):9d}  {hung}")
    return '\n'.join(rows)


def _dist_tests(command, before_job):
    start = time.monotonic()
    proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or [''])[-1]
    print(f'dist tests before job {before_job}: exit {proc.returncode}, '
          f'{time.monotonic() - start:.0f} s: {last}', flush=True)
    return dict(before_job=before_job, status=proc.returncode, summary=last,
                wall_s=round(time.monotonic() - start, 1))


def _machine():
    with open('/proc/cpuinfo') as f:
        model = next((line.split(':', 1)[1].strip() for line in f
                      if line.startswith('model name')), '?')
    with open('/proc/cpuinfo') as f:
        flags = next((line.split(':', 1)[1].split() for line in f
                      if line.startswith('flags')), [])
    with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
        ports = '-'.join(f.read().split())
    return dict(cpu=model, cores=os.cpu_count(), nice=os.nice(0), ephemeral_ports=ports,
                avx2='avx2' in flags, avx512f='avx512f' in flags,
                avx512_flags=sorted(f for f in flags if f.startswith('avx512')))


def _load():
    with open('/proc/loadavg') as f:
        return [float(x) for x in f.read().split()[:3]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--jobs', type=int, default=50, help='consecutive jobs (default 50)')
    parser.add_argument('--workers', type=int, default=2, help='workers per job (default 2)')
    parser.add_argument('--servers', type=int, default=1, help='servers per job (default 1)')
    parser.add_argument('--timeout', type=float, default=60,
                        help="launcher's --timeout per job in s (default 60)")
    parser.add_argument('--job', default='mlp', choices=['mlp', 'sparse'],
                        help='mlp: the Gluon MLP worker above (default); sparse: '
                             'tests/sparse_dist_worker.py with --sparse-config')
    parser.add_argument('--sparse-config', default=json.dumps(SPARSE_CONFIG),
                        help='CONFIG_JSON of tests/sparse_dist_worker.py (default: the '
                             "lbsgd-power2-B2 case of tests/test_sparse.py)")
    parser.add_argument('--optimizer', default='sgd', choices=['sgd', 'lbsgd'])
    parser.add_argument('--steps', type=int, default=3, help='trainer.step calls per job')
    parser.add_argument('--hang-after', type=float, default=3.0,
                        help='a process alive this long after all workers printed done counts '
                             'as hung at exit (default 3 s)')
    parser.add_argument('--stacks', action='store_true',
                        help='save gdb stacks of the processes hung at exit')
    parser.add_argument('--ps-verbose', action='store_true',
                        help='PS_VERBOSE=1: ps-lite logs its barriers and van stops')
    parser.add_argument('--linger', type=float,
                        help="diagnosis: override the launcher's wait for servers/scheduler "
                             'after the workers succeed (leaves time for --stacks)')
    parser.add_argument('--spinners', type=int, default=0,
                        help='processes spinning on the CPU during the soak (default 0)')
    parser.add_argument('--dist-tests-every', type=int, metavar='K',
                        help='run the dist tests before job 0, K, 2K, ...')
    parser.add_argument('--dist-tests', default=f'{shlex.quote(sys.executable)} -m pytest -q '
                        '-p no:cacheprovider tests/test_kvstore.py -k dist_workers',
                        help='the dist tests command (run in the repository)')
    parser.add_argument('--json', help='write the records and summary here')
    parser.add_argument('--verbose', action='store_true', help="echo the jobs' output")
    parser.add_argument('--exit-hang', type=float,
                        help="diagnosis: override the launcher's wait after the scheduler "
                             'exited 0 (leaves time for --stacks)')
    args = parser.parse_args(argv)
    if args.linger is not None:
        launch_module._LINGER = args.linger
    if args.exit_hang is not None:
        launch_module._EXIT_HANG = args.exit_hang

    workdir = tempfile.mkdtemp(prefix='soak_dist_')
    with open(os.path.join(workdir, 'worker.py'), 'w') as f:
        f.write(textwrap.dedent(WORKER))
    records, dist_runs = [], []
    started = time.time()
    load_start = _load()
    spinners = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])
                for _ in range(args.spinners)]
    try:
        for index in range(args.jobs):
            if args.dist_tests_every and index % args.dist_tests_every == 0:
                dist_runs.append(_dist_tests(args.dist_tests, index))
            record = run_job(index, args, workdir)
            records.append(record)
            hung = ', '.join(record['hung']) or '-'
            print(f"job {index:3d}: status {record['status']:3d}  {record['wall_s']:6.2f} s  "
                  f"workers done {record['workers_done']}/{args.workers}  hung: {hung}  "
                  f"left over: {len(record['left_over'])}  {record['host']}:{record['port']}"
                  + ('  FAILED' if record['failed'] else ''), flush=True)
            for line in record['launcher_lines']:
                print('         ' + line, flush=True)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    walls = [r['wall_s'] for r in records]
    summary = dict(
        command=' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        date=time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(started)),
        loadavg_start=load_start, loadavg_end=_load(),
        jobs=len(records), ok=sum(not r['failed'] for r in records),
        failed=sum(r['failed'] for r in records),
        nonzero_status=sum(r['status'] != 0 for r in records),
        left_over=sum(bool(r['left_over']) for r in records),
        launcher_stepped_in=sum(bool(r['launcher_lines']) for r in records),
        distinct_addresses=len({(r['host'], r['port']) for r in records}),
        dist_test_runs=dist_runs,
        all_workers_done=sum(r['workers_done'] == args.workers for r in records),
        hung_at_exit=sum(bool(r['hung']) for r in records),
        timeouts=sum(r['status'] == 124 for r in records),
        stopped_hung_in_exit=sum(any('hung in ps-lite exit' in p['note']
                                     for p in (r['processes'] or {}).values())
                                 for r in records),
        stopped_after_workers_succeeded=sum(any('after the workers succeeded' in p['note']
                                                for p in (r['processes'] or {}).values())
                                            for r in records),
        wall_median_s=round(statistics.median(walls), 2) if walls else None,
        wall_max_s=round(max(walls), 2) if walls else None,
        total_s=round(time.time() - started, 1),
        settings=vars(args), python=sys.version.split()[0], machine=_machine())
    print(_table(records))
    print(json.dumps({k: v for k, v in summary.items() if k != 'settings'}))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(summary=summary, records=records), f, indent=1)
    return 0 if summary['failed'] == 0 else 1


if __name__ == '__main__':
    sys.exit(main())
