"""Processes that force the launcher's port races: a stale ps-lite worker and a port intruder."""
import os
import signal
import subprocess
import sys
import time

# A worker of a job whose scheduler is gone: ps-lite queues its registration (ADD_NODE, no
# sender id yet) and ZeroMQ reconnects to the scheduler's address every 100-200 ms, for ever.
# Whatever listens there next receives the registration.
_STALE = """\
import mxnet as mx
print('stale worker registering', flush=True)
mx.kv.create('dist_sync')
"""

_INTRUDER = """\
import socket, sys, time
sock = socket.socket()
sock.bind(('', int(sys.argv[1])))
sock.listen()
print('listening', flush=True)
time.sleep(120)
"""


def start_stale_worker(host, port, env):
    """A stale worker whose scheduler was ``host:port``; returns the Popen (own session)."""
    penv = dict(os.environ, **env)
    penv.update(DMLC_ROLE='worker', DMLC_PS_ROOT_URI=host, DMLC_PS_ROOT_PORT=str(port),
                DMLC_NODE_HOST='127.0.0.1', DMLC_NUM_WORKER='1', DMLC_NUM_SERVER='1',
                OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable, '-c', _STALE], env=penv, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().startswith('stale worker registering')
    return proc


def start_intruder(port, env):
    """A process listening on every address at ``port``; returns the Popen once it listens."""
    proc = subprocess.Popen([sys.executable, '-c', _INTRUDER, str(port)],
                            env=dict(os.environ, **env), start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == 'listening\n'
    return proc


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def listening_ports(pid):
    """TCP ports that process ``pid`` listens on."""
    from mx_lbsgd.launch import _socket_inodes
    mine, ports = _socket_inodes(pid), []
    with open('/proc/net/tcp') as f:
        for row in (line.split() for line in f.readlines()[1:]):
            if row[3] == '0A' and int(row[9]) in mine:
                ports.append(int(row[1].rsplit(':', 1)[1], 16))
    return ports


def wait_for(predicate, limit, what):
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f'no {what} after {limit} s')
        time.sleep(0.05)
