"""Local dist_sync launcher: real scheduler/server/worker processes on the loopback."""
import io
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from mx_lbsgd.launch import launch, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = 'MX_LBSGD_TEST_TAG'
LIMIT = 60          # launcher timeout: no test can hang


def _tagged(tag):
    """Pids of live processes (zombies excluded) whose environment holds ``TAG=tag``."""
    needle = f'{TAG}={tag}'.encode()
    pids = []
    for name in os.listdir('/proc'):
        if name.isdigit():
            try:
                with open(f'/proc/{name}/environ', 'rb') as f:
                    if needle in f.read().split(b'\0'):   # a zombie's environ is empty
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def _alive(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in 'ZX'
    except OSError:
        return False


def _assert_gone(tag, pids=()):
    deadline = time.monotonic() + 2
    while (_tagged(tag) or any(map(_alive, pids))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _tagged(tag) == []
    assert [p for p in pids if _alive(p)] == []


@pytest.fixture
def tag():
    return uuid.uuid4().hex


def _run(tmp_path, tag, source, num_workers, **kwargs):
    script = tmp_path / 'worker.py'
    script.write_text(textwrap.dedent(source))
    out = io.StringIO()
    env = {TAG: tag, 'PYTHONPATH': ROOT}
    start = time.monotonic()
    code = launch([sys.executable, str(script)], num_workers, env=env, stream=out,
                  timeout=kwargs.pop('timeout', LIMIT), **kwargs)
    return code, out.getvalue(), time.monotonic() - start


def test_dist_sync_two_workers(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import os
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        assert kv.num_workers == 2
        kv.init(3, mx.nd.zeros((4,)))
        kv.push(3, mx.nd.ones((4,)) * (kv.rank + 1))
        out = mx.nd.zeros((4,))
        kv.pull(3, out=out)
        assert (out.asnumpy() == 3).all(), out
        print('rank', kv.rank, 'label', os.environ['MX_LBSGD_RANK'], 'role', os.environ['DMLC_ROLE'])
    """, 2)
    assert code == 0, out
    assert elapsed < 40
    for rank in (0, 1):
        assert f'[worker {rank}] rank ' in out
        assert f'rank {rank} label' in out
    assert out.count('role worker') == 2
    assert '[launch]' not in out      # the servers and the scheduler stopped by themselves
    _assert_gone(tag)


def test_worker_failure_stops_everything(tmp_path, tag):
    started = {}
    code, out, elapsed = _run(tmp_path, tag, """
        import os, subprocess, sys, time
        if os.environ['MX_LBSGD_RANK'] == '1':
            child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
            print('grandchild', child.pid)
            sys.exit(3)
        time.sleep(60)
    """, 2, on_start=started.update)
    assert code == 3, out
    assert elapsed < 15
    assert '[launch] worker 1 exited with code 3' in out
    assert sorted(started) == ['scheduler', 'server 0', 'worker 0', 'worker 1']
    grandchild = int(out.split('grandchild ')[1].split()[0])
    _assert_gone(tag, list(started.values()) + [grandchild])


def test_worker_killed_while_other_waits(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import os, signal
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(0, mx.nd.ones((3,)))
        if kv.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print('waiting', flush=True)
        kv.push(0, mx.nd.ones((3,)))
        out = mx.nd.zeros((3,))
        kv.pull(0, out=out)          # needs worker 1's push: waits forever
        out.wait_to_read()
        print('unreachable')
    """, 2)
    assert code == 128 + signal.SIGKILL, out
    assert elapsed < 30
    assert 'killed by signal 9' in out and 'unreachable' not in out
    _assert_gone(tag)


def test_timeout(tag, monkeypatch, capsys):
    monkeypatch.setenv(TAG, tag)
    start = time.monotonic()
    code = main(['-n', '2', '--timeout', '3', '--',
                 sys.executable, '-c', 'import time; time.sleep(60)'])
    elapsed = time.monotonic() - start
    assert code == 124
    assert 3 <= elapsed < 12
    assert '[launch] timeout after 3 s' in capsys.readouterr().out
    _assert_gone(tag)


def test_port_in_use(tag, monkeypatch, capsys):
    monkeypatch.setenv(TAG, tag)
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(['-n', '1', '--port', str(port), '--', sys.executable, '-c', 'pass']) == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and f'port {port} is already in use' in err
        started = []
        with pytest.raises(ValueError, match=f'port {port}'):
            launch([sys.executable, '-c', 'pass'], 1, port=port, on_start=started.append)
        assert started == [] and _tagged(tag) == []


@pytest.mark.parametrize('argv, name', [
    (['-n', '0', '--', 'python'], '-n/--num-workers'),
    (['-n', 'two', '--', 'python'], '-n/--num-workers'),
    (['--', 'python'], '-n/--num-workers'),
    (['-n', '1', '-s', '0', '--', 'python'], '-s/--num-servers'),
    (['-n', '1', '--timeout', '0', '--', 'python'], '--timeout'),
    (['-n', '1', '--port', '70000', '--', 'python'], '--port'),
    (['-n', '1'], 'command'),
    (['-n', '1', '--'], 'command'),
])
def test_bad_arguments(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_command_line(monkeypatch):
    import mx_lbsgd.launch as module
    calls = []
    monkeypatch.setattr(module, 'launch', lambda *a, **k: calls.append((a, k)) or 7)
    assert main(['-n', '2', '--timeout', '9.5', '--', 'python', 't.py', '-n', '5']) == 7
    assert main(['-n', '3', '-s', '2', '--port', '1234', 'python', 't.py', '--', 'x']) == 7
    assert calls == [((['python', 't.py', '-n', '5'], 2, 1), dict(port=None, timeout=9.5)),
                     ((['python', 't.py', '--', 'x'], 3, 2), dict(port=1234, timeout=None))]


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match='num_workers'):
        launch(['python'], 0)
    with pytest.raises(ValueError, match='command'):
        launch([], 1)


def test_lbsgd_optimizer_runs_on_server(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import mxnet as mx
        import mx_lbsgd
        opt = mx.optimizer.create('lbsgd', learning_rate=0.1)
        assert type(opt) is mx_lbsgd.LBSGD
        kv = mx.kv.create('dist_sync')
        kv.set_optimizer(opt)
        kv.init(0, mx.nd.ones((3,)))
        kv.push(0, mx.nd.ones((3,)) * (kv.rank + 1))
        got = mx.nd.zeros((3,))
        kv.pull(0, out=got)
        # what the server should have done: one update with the summed gradient 1 + 2
        want = mx.nd.ones((3,))
        update = mx.optimizer.get_updater(mx.optimizer.create('lbsgd', learning_rate=0.1))
        update(0, mx.nd.ones((3,)) * 3, want)
        assert abs(want.asnumpy() - 1).min() > 0.1, want
        assert abs(got.asnumpy() - want.asnumpy()).max() < 1e-6, (got, want)
        print('updated', got.asnumpy())
    """, 2)
    assert code == 0, out
    assert elapsed < 40
    assert '[worker 0] updated' in out and '[worker 1] updated' in out
    _assert_gone(tag)


def test_unloadable_optimizer_fails_the_job(tmp_path, tag):
    code, out, elapsed = _run(tmp_path, tag, """
        import mxnet as mx
        class Local(mx.optimizer.SGD):   # lives in the worker's __main__ only
            pass
        kv = mx.kv.create('dist_sync')
        kv.set_optimizer(Local(learning_rate=0.1))
        kv.init(0, mx.nd.ones((3,)))
        kv.push(0, mx.nd.ones((3,)))
        out = mx.nd.zeros((3,))
        kv.pull(0, out=out)
        out.wait_to_read()
    """, 1)
    assert code == 1, out
    assert elapsed < 40
    assert "[server 0] AttributeError: Can't get attribute 'Local'" in out
    assert '[launch] server 0 exited with code 1' in out
    _assert_gone(tag)


@pytest.mark.parametrize('signum, status', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher(signum, status, tag):
    env = dict(os.environ, **{TAG: tag, 'PYTHONPATH': ROOT})
    cmd = [sys.executable, '-m', 'mx_lbsgd.launch', '-n', '2', '--',
           sys.executable, '-c', "print('ready', flush=True); import time; time.sleep(60)"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    out = []
    try:
        deadline = time.monotonic() + 30
        while sum(l.endswith('] ready\n') for l in out) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, ''.join(out)
            try:
                out.append(lines.get(timeout=0.1))
            except queue.Empty:
                pass
        proc.send_signal(signum)
        # teardown takes at most 3 s of grace and 2 s of output draining
        try:
            code = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            time.sleep(0.5)
            while not lines.empty():
                out.append(lines.get())
            with open('/proc/%d/status' % proc.pid) as f:
                masks = [l.strip() for l in f if l.startswith(('SigIgn', 'SigCgt', 'State'))]
            pytest.fail('launcher still running 40 s after signal %d; %s; its output:\n%s'
                        % (signum, masks, ''.join(out)))
        assert code == status, ''.join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_gone(tag)


def test_worker_stuck_after_final_barrier_is_stopped(tmp_path, tag, monkeypatch):
    """A worker stuck after ps-lite's final barrier (the scheduler has left it, so every
    worker's work is done) is stopped after _EXIT_HANG s; the job succeeds and the launcher
    says how every process ended."""
    import mx_lbsgd.launch as module
    monkeypatch.setattr(module, '_EXIT_HANG', 2.0)
    report = {}
    code, out, elapsed = _run(tmp_path, tag, """
        import gc, time
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(0, mx.nd.zeros((2,)))
        kv.push(0, mx.nd.ones((2,)))
        out = mx.nd.zeros((2,))
        kv.pull(0, out=out)
        rank = kv.rank
        print('rank', rank, 'done', out.asnumpy(), flush=True)
        del kv
        gc.collect()                 # ~KVStoreDist: barriers, ps::Finalize
        if rank == 1:
            print('stuck', flush=True)
            time.sleep(60)           # as if stuck in ps-lite's exit
    """, 2, report=report)
    assert code == 0, out
    assert elapsed < 40
    assert 'stuck in ps-lite' in out and '[launch] exit status: ' in out, out
    procs = report['processes']
    assert report['status'] == 0
    assert procs['scheduler'] == dict(status=0, note='') and procs['server 0']['status'] == 0
    stuck = int(out.split('] stuck')[0].rsplit('[worker ', 1)[1])
    assert procs[f'worker {1 - stuck}'] == dict(status=0, note='')
    assert procs[f'worker {stuck}']['status'] is None
    assert 'hung in ps-lite exit' in procs[f'worker {stuck}']['note']
    _assert_gone(tag)


def test_report_of_clean_and_failed_jobs(tmp_path, tag):
    report = {}
    code, out, _ = _run(tmp_path, tag, "import sys; sys.exit(0)", 1, report=report)
    # a worker that never creates a kvstore: the scheduler and server wait for it forever
    assert code == 0, out
    assert report['processes']['worker 0'] == dict(status=0, note='')
    assert 'stopped' in report['processes']['scheduler']['note']
    assert '[launch] exit status: scheduler: still running after the workers succeeded' in out
    report = {}
    code, out, _ = _run(tmp_path, tag, "import sys, time; sys.exit(5)", 1, report=report)
    assert code == 5 and report['status'] == 5
    assert report['processes']['worker 0'] == dict(status=5, note='')
    assert 'worker 0: exit 5' in out
    _assert_gone(tag)


def test_workers_exiting_without_freeing_the_kvstore(tmp_path, tag):
    """The exit hang's symptom, made deterministic: workers that exit without destroying
    their kvstore never enter ps-lite's final barrier, so the scheduler and server would
    wait forever; the launcher stops them and the job, whose work is done, exits 0."""
    report = {}
    code, out, wall = _run(tmp_path, tag, """\
        import os
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(3, mx.nd.zeros((2,)))
        kv.push(3, mx.nd.ones((2,)))
        got = mx.nd.zeros((2,))
        kv.pull(3, out=got)
        assert got.asnumpy().tolist() == [2.0, 2.0]
        print('rank', kv.rank, 'done', flush=True)
        os._exit(0)        # no KVStore destructor, so no ps::Finalize
        """, 2, report=report)
    assert code == 0, out
    assert out.count(' done') == 2
    for label in ('scheduler', 'server 0'):
        assert report['processes'][label]['note'] == \
            'still running after the workers succeeded; stopped', out
    for label in ('worker 0', 'worker 1'):
        assert report['processes'][label] == dict(status=0, note='')
    assert wall < LIMIT / 2
    _assert_gone(tag)
