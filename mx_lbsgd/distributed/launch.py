"""Run an MXNet parameter-server (``dist_sync``) job on this machine.

MXNet 1.9.1's ``tools/launch.py`` needs the dmlc tracker, which the wheel lacks. This
launcher starts one scheduler, S servers and N workers on the loopback interface::

    mx-lbsgd launch -n 2 -s 1 -- python train.py --epochs 3
    python -m mx_lbsgd.launch -n 2 -s 1 -- python train.py --epochs 3

Every process gets ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI`` and ``DMLC_NODE_HOST`` (both the job's
own loopback address, below), ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``,
plus ``MX_LBSGD_ROLE`` and ``MX_LBSGD_RANK`` (the launcher's index of the process within its
role: the order in which it was started); ``DMLC_LOCAL`` and ``DMLC_USE_KUBERNETES`` are
removed (with them ps-lite would use ``ipc:///tmp/<port>`` or bind the scheduler to 0.0.0.0,
shared by every job). ``MX_LBSGD_RANK`` is not ``kv.rank``: ps-lite's scheduler hands
out the ranks by the workers' ports (which each picks at random), so use ``kv.rank`` to
shard data.
``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1`` are set unless already set. Workers run the
command; the scheduler
and servers run this interpreter with ``mx_lbsgd`` imported before they enter the server
loop, so a pickled ``mx_lbsgd`` optimizer (``kv.set_optimizer``) loads there; a server
that cannot load the optimizer exits with status 1 (MXNet would go on summing gradients).
The optimizer's class must be importable there: not defined in the worker's ``__main__``.

Addresses and ports: no process of another job can reach this job's nodes.
Each job gets a random loopback address ``127.a.b.c`` (Linux routes all of 127/8 to ``lo``;
127.0.0.1 where that address cannot be bound), and every node binds and connects on that
address only, so a process of an earlier or concurrent job, which connects to its own
job's address, never reaches this job's nodes, whatever port they took. The scheduler's
port, unless given (``--port``), is drawn at random outside the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``) and outside 10000-49999, where ps-lite retries
a node's failed bind: no node's ``bind(0)``, no outgoing connection and no ps-lite retry
can take it. The scheduler starts first; servers and workers start only once *that*
process listens on the port. If another process holds the port first, the launcher says
so in one line naming that process: with ``--port`` it exits 2, otherwise it tries another
port (up to 3). Servers' and workers' own ports are picked by ps-lite (``bind(0)``); MXNet
1.9.1 reads no variable for them.

Output lines are prefixed ``[scheduler]``, ``[server 0]`` and, for a worker, ``[worker R]``
with R its kvstore rank (``kv.rank``) once the scheduler has assigned it, before that (and
for a worker that never creates a dist kvstore) ``[worker #i]``, i its launch order
(``MX_LBSGD_RANK``); the launcher's messages and ``report`` use the same labels, and
its own lines are prefixed ``[launch]``. The rank comes from ps-lite's own log line
``W[id] is connected to others``, which a worker writes when it has its rank, before its
program runs on: the launcher sets ``PS_VERBOSE=1`` for the workers (unless set) and hides
ps-lite's informational lines then. Every node is started with ``PR_SET_PDEATHSIG``: if the
launcher itself is killed (SIGKILL, which it cannot catch), its nodes die with it. Exit
status: 0 when every worker exits 0 (servers and scheduler then stop by
themselves; any still running after a few seconds are stopped), or when the job's work is
done but a process is stuck in ps-lite's exit (below); otherwise the status of the
first process to fail, 128 + N for a process killed by signal N, and the launcher stops all
the others at once (SIGTERM to each process group, SIGKILL 3 s later), so a job whose
survivors wait forever in a ps-lite barrier still ends. 124 when ``--timeout`` expires, 130
on Ctrl-C, 143 on SIGTERM, 2 for bad arguments or a port already in use.

Exit hangs. A worker frees its kvstore at interpreter exit, and MXNet's ``~KVStoreDist`` then
runs ps-lite's ``Finalize``: a barrier of every node, then ``Van::Stop``. The scheduler (run
by this launcher) leaves that barrier, and exits, only once every server and worker has
entered it, so once the scheduler has exited 0 every worker's program is done. ps-lite's exit
is not reliable (the scheduler sends the barrier's release and then closes its ZeroMQ
sockets with ``ZMQ_LINGER=0``, which may drop releases not yet written; a process also
sometimes stays in its own exit): a worker or server still running ``_EXIT_HANG`` (10) s after
the scheduler exited 0 is stopped and reported as "hung in ps-lite exit after the final
barrier; stopped", and does not fail the job. (A worker that frees its kvstore early and
then goes on working for longer than that would be stopped too: keep the kvstore to the
end.) Whenever the launcher steps in (failure, timeout, signal, stuck processes) it ends
with one line, ``[launch] exit status: scheduler: exit 0, server 0: ..., worker 0: exit 0,
...``, saying how every process ended; ``launch(report={})`` gives the same as a dict.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, Iterable, List, Mapping, NoReturn, Sequence, TextIO

#: A process of the job: ``[label, subprocess.Popen]`` (the label changes when a worker learns
#: its kvstore rank), or a ``(label, Popen)`` pair.
_Entry = Sequence[Any]

__all__ = ['launch', 'main']

_GRACE = 3.0          # seconds between SIGTERM and SIGKILL
_LINGER = 5.0         # seconds servers/scheduler get to exit after the workers succeed
_EXIT_HANG = 10.0     # seconds a process gets to exit after the scheduler left the final barrier
_LISTEN_LIMIT = 60.0  # seconds the scheduler gets to listen on its port
_PORT_TRIES = 3       # ports tried when another process takes a drawn one first
_POLL = 0.05
_PORT_RANGE_FILE = '/proc/sys/net/ipv4/ip_local_port_range'
_LINUX_EPHEMERAL = (32768, 60999)
# ps-lite's ZMQVan::Bind: a node whose first bind fails retries on 10000 + rand() % 40000
_PS_LITE_RETRY = range(10000, 50000)
_SHARED_ENV = ('DMLC_LOCAL', 'DMLC_USE_KUBERNETES')

# Imported as a worker so that mxnet and mx_lbsgd load completely (with DMLC_ROLE=server,
# ``import mxnet`` enters the server loop half-way through: kvstore_server.py), then the
# server loop is run. MXNet ignores an exception raised while loading the optimizer sent by
# ``kv.set_optimizer`` (the server then just sums gradients): exit instead.
_BOOTSTRAP = """\
import os
role = os.environ['DMLC_ROLE']
os.environ['DMLC_ROLE'] = 'worker'
import mxnet as mx
import mx_lbsgd
os.environ['DMLC_ROLE'] = role
from mx_lbsgd._compat import exit_when_server_command_fails
server = mx.kv.KVStoreServer(mx.kv.create('dist'))
exit_when_server_command_fails(server)
server.run()
"""


_SIGNAL_STATUS: Dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}
# ps-lite's informational lines (dmlc's LOG(INFO) format: '[hh:mm:ss] path/van.cc:N: ...')
_PS_LITE_INFO = re.compile(r'^\[\d\d:\d\d:\d\d\] \S*(?:van\.cc|zmq_van\.h):\d+: '
                           r'(?:Bind to |[HSW]\[\d+\] is (?:connected to others|stopping|'
                           r'stopped)$)')
# a worker's ps-lite id is 9 + 2 * kv.rank (ps::Postoffice::WorkerRankToID)
_WORKER_CONNECTED = re.compile(r': W\[(\d+)\] is connected to others$')
_PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):    # not Linux
        return None


_PRCTL = _libc_prctl()


def _die_with(parent: int, prctl: Callable[..., int]) -> None:
    """In a new node, before exec: SIGKILL when the launcher's thread that started it ends,
    so that no node outlives a launcher killed by SIGKILL (start_new_session puts each
    node out of the launcher's process group and terminal). `prctl`: libc's (`_PRCTL`)."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:        # the launcher died before the prctl
        os._exit(1)


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound on every address (as ZeroMQ binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(('', port))
        except OSError:
            return False
    return True


def _check_port(port: int) -> None:
    """Raise ValueError unless ``port`` can be bound."""
    if not _bindable(port):
        raise ValueError(f'port {port} is already in use')


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(_PORT_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return _LINUX_EPHEMERAL
    return low, high


def _scheduler_ports() -> list[int]:
    """Ports the scheduler may get: outside the kernel's ephemeral range (``bind(0)`` and
    outgoing connections take theirs there) and outside ps-lite's bind retries."""
    low, high = _ephemeral_range()
    return [p for p in range(1024, 65536) if not low <= p <= high and p not in _PS_LITE_RETRY]


def _choose_port(tried: Sequence[int] = ()) -> int:
    """A random bindable port from ``_scheduler_ports()``, not one of ``tried``."""
    ports = [p for p in _scheduler_ports() if p not in tried]
    for port in random.SystemRandom().sample(ports, min(len(ports), 64)):
        if _bindable(port):
            return port
    low, high = _ephemeral_range()
    raise ValueError(f'no free port for the scheduler outside the ephemeral range {low}-{high} '
                     f'({_PORT_RANGE_FILE}) and 10000-49999; give one with port (--port)')


def _job_host() -> str:
    """A random loopback address 127.a.b.c for one job; 127.0.0.1 if it cannot be bound."""
    rng = random.SystemRandom()
    host = f'127.{rng.randrange(1, 255)}.{rng.randrange(256)}.{rng.randrange(1, 255)}'
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError:             # a system that configures 127.0.0.1 only
            return '127.0.0.1'
    return host


def _address(hexaddr: str) -> str:
    """The address in /proc/net/tcp{,6} notation (32-bit words in host order) as text."""
    raw = b''.join(struct.pack('=I', int(hexaddr[i:i + 8], 16))
                   for i in range(0, len(hexaddr), 8))
    if len(raw) == 16 and raw[:12] == bytes(10) + b'\xff\xff':
        raw = raw[12:]
    return socket.inet_ntoa(raw) if len(raw) == 4 else socket.inet_ntop(socket.AF_INET6, raw)


def _listeners(port: int) -> list[tuple[str, int]]:
    """``[(address, socket inode)]`` of the TCP sockets listening on ``port``."""
    found = []
    for name in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            with open(name) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            address, hexport = row[1].rsplit(':', 1)
            if row[3] == '0A' and int(hexport, 16) == port:      # 0A: TCP_LISTEN
                found.append((_address(address), int(row[9])))
    return found


def _socket_inodes(pid: int | str) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f'/proc/{pid}/fd/{fd}')
        except OSError:
            continue
        if link.startswith('socket:['):
            inodes.add(int(link[8:-1]))
    return inodes


def _holder(inode: int) -> str:
    """'pid N: command line' of a process that holds socket ``inode``."""
    for name in os.listdir('/proc'):
        if name.isdigit() and inode in _socket_inodes(name):
            try:
                with open(f'/proc/{name}/cmdline', 'rb') as f:
                    raw = f.read().replace(b'\0', b' ')
                cmdline = ' '.join(raw.decode('utf-8', 'replace').split())
            except OSError:
                cmdline = '?'
            return f'pid {name}: {cmdline[:120]}'
    return 'a process of another user'


def _blocking_listeners(host: str, port: int) -> list[int]:
    """Inodes of the sockets listening where a bind to host:port would collide."""
    return [inode for address, inode in _listeners(port)
            if address in (host, '0.0.0.0', '::')]


def _await_listening(proc: subprocess.Popen[bytes], host: str, port: int,
                     deadline: float | None, caught: Sequence[int]) -> tuple[Any, ...] | None:
    """Poll until process ``proc`` listens on host:port: None then, else why not:
    ``('taken', inode)``, ``('exited', code)``, ``('signal', signum)``, ``('timeout',)``
    or ``('limit',)``."""
    limit = time.monotonic() + _LISTEN_LIMIT
    while True:
        if caught:
            return ('signal', caught[0])
        blocking = _blocking_listeners(host, port)
        if blocking:
            mine = _socket_inodes(proc.pid)
            if any(inode in mine for inode in blocking):
                return None
            return ('taken', blocking[0])
        code = proc.poll()
        if code is not None:
            return ('exited', code)
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return ('timeout',)
        if now > limit:
            return ('limit',)
        time.sleep(_POLL)


class _Gate:
    """Holds a process's output back until it is shown (``open``) or dropped (``drop``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.state = 'hold'

    def open(self, stream: TextIO, lock: threading.Lock) -> None:
        with lock:
            for line in self.lines:
                stream.write(line)
            stream.flush()
            self.state = 'open'

    def drop(self, lock: threading.Lock) -> None:
        with lock:
            self.state = 'drop'


def _status(returncode: int) -> int:
    """Shell-style exit status: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(pipe: IO[bytes], entry: _Entry, stream: TextIO, lock: threading.Lock,
          gate: _Gate | None = None, watch: Callable[[str], object] | None = None) -> None:
    """Copy ``pipe`` to ``stream`` line by line, prefixed with the label ``entry[0]`` as
    it is when the line is read (held back by ``gate``; dropped when ``watch(line)``)."""
    with pipe:
        for raw in iter(pipe.readline, b''):
            line = raw.decode('utf-8', 'replace').rstrip('\r\n')
            if watch is not None and watch(line):
                continue
            prefix = f'[{entry[0]}] '
            with lock:
                if gate is not None and gate.state != 'open':
                    if gate.state == 'hold':
                        gate.lines.append(f'{prefix}{line}\n')
                    continue
                stream.write(f'{prefix}{line}\n')
                stream.flush()


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _teardown(procs: Sequence[_Entry]) -> None:
    """SIGTERM every process group, SIGKILL what is left after the grace period."""
    for _, proc in procs:
        _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE
    while time.monotonic() < deadline:
        if all(p.poll() is not None and not _group_alive(p.pid) for _, p in procs):
            return
        time.sleep(_POLL)
    for _, proc in procs:
        _killpg(proc.pid, signal.SIGKILL)
    for _, proc in procs:
        proc.wait()


def _check_counts(num_workers: int, num_servers: int) -> None:
    for name, value in (('num_workers', num_workers), ('num_servers', num_servers)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f'{name} must be an integer >= 1, got {value!r}')


class _Job:
    """The processes of one job, their output and the launcher's messages."""

    def __init__(self, stream: TextIO, env: dict[str, str], caught: list[int]) -> None:
        self.stream, self.env, self.caught = stream, env, caught
        self.lock = threading.Lock()
        self.procs: list[list[Any]] = []             # [label, Popen], in start order
        self.threads: list[threading.Thread] = []    # their output pumps
        self.states: dict[str, str] = {}             # label -> how the launcher ended it
        self.said: list[str] = []                    # the launcher's messages

    def say(self, message: str) -> None:
        self.said.append(message)
        with self.lock:
            self.stream.write(f'[launch] {message}\n')
            self.stream.flush()

    def spawn(self, label: str, role: str, rank: int, argv: Sequence[str],
              gate: _Gate | None = None) -> subprocess.Popen[bytes]:
        penv = dict(self.env, DMLC_ROLE=role, MX_LBSGD_ROLE=role, MX_LBSGD_RANK=str(rank))
        watch = None
        if role != 'worker':     # so that the bootstrap imports this very mx_lbsgd
            # the folder that holds the mx_lbsgd package (this file is mx_lbsgd/distributed/)
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            penv['PYTHONPATH'] = os.pathsep.join(p for p in (root, penv.get('PYTHONPATH')) if p)
        entry: list[Any] = [label, None]
        if role == 'worker':
            quiet = 'PS_VERBOSE' not in penv
            penv.setdefault('PS_VERBOSE', '1')
            watch = functools.partial(self._watch_worker, entry, quiet)
        proc = subprocess.Popen(argv, env=penv, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=(functools.partial(_die_with, os.getpid(), _PRCTL)
                                            if _PRCTL is not None else None))
        entry[1] = proc
        self.procs.append(entry)
        thread = threading.Thread(target=_pump, daemon=True, args=(
            proc.stdout, entry, self.stream, self.lock, gate, watch))
        thread.start()
        self.threads.append(thread)
        return proc

    def _watch_worker(self, entry: list[Any], quiet: bool, line: str) -> bool:
        """Relabel a worker by its kv.rank when ps-lite says it has one; True for the
        ps-lite lines that only PS_VERBOSE=1 (set by the launcher) prints."""
        found = _WORKER_CONNECTED.search(line)
        if found and _PS_LITE_INFO.match(line):
            with self.lock:
                old, entry[0] = entry[0], f'worker {(int(found.group(1)) - 9) // 2}'
                if old in self.states:
                    self.states[entry[0]] = self.states.pop(old)
        return quiet and _PS_LITE_INFO.match(line) is not None

    def start_scheduler(self, port: int, given: bool, timeout: float | None,
                        deadline: float | None) -> int | None:
        """Start the scheduler and wait until it listens on its port (another port if one
        drawn at random is taken first). Returns None then, else the job's exit status."""
        host = self.env['DMLC_PS_ROOT_URI']
        tried: list[int] = []
        while True:
            tried.append(port)
            self.env['DMLC_PS_ROOT_PORT'] = str(port)
            gate = _Gate()
            proc = self.spawn('scheduler', 'scheduler', 0, [sys.executable, '-c', _BOOTSTRAP],
                              gate)
            why = _await_listening(proc, host, port, deadline, self.caught)
            if why is None:
                gate.open(self.stream, self.lock)
                return None
            if why[0] == 'exited':
                self.threads[-1].join(timeout=2)       # its last words, read below
            if why[0] == 'taken' or (why[0] == 'exited' and
                                     any('bind failed' in line for line in gate.lines)):
                gate.drop(self.lock)
                _teardown(self.procs[-1:])
                del self.procs[-1]
                blocking = [why[1]] if why[0] == 'taken' else _blocking_listeners(host, port)
                who = _holder(blocking[0]) if blocking else 'its holder has gone'
                if given or len(tried) == _PORT_TRIES:
                    self.say(f'the scheduler cannot listen on {host}:{port}: the port is '
                             f'already in use ({who})')
                    return 2
                port = _choose_port(tried)
                self.say(f'port {tried[-1]} was taken before the scheduler bound it ({who}); '
                         f'trying port {port}')
                continue
            gate.open(self.stream, self.lock)
            if why[0] == 'signal':
                return _stop_for_signal(why[1], self.say)
            if why[0] == 'timeout':
                self.say(f'timeout after {timeout:g} s, before the scheduler listened on '
                         f'{host}:{port}; stopping it')
                return 124
            if why[0] == 'limit':
                self.say(f'the scheduler does not listen on {host}:{port} after '
                         f'{_LISTEN_LIMIT:g} s; stopping it')
                return 1
            self.say(f'scheduler {_how(why[1])} before listening on {host}:{port}')
            return _status(why[1])


def _how(code: int) -> str:
    return f'killed by signal {-code}' if code < 0 else f'exited with code {code}'


def launch(command: Iterable[str], num_workers: int, num_servers: int = 1,
           port: int | None = None, timeout: float | None = None,
           env: Mapping[str, str] | None = None, stream: TextIO | None = None,
           on_start: Callable[[dict[str, int]], object] | None = None,
           report: dict[str, Any] | None = None) -> int:
    """Run ``command`` (a list of arguments) as ``num_workers`` workers of a local PS job.

    ``port``: the scheduler's port (default: a free one outside the ephemeral range);
    ValueError if it is in use. ``timeout``: wall-clock limit in seconds (None: none).
    ``env``: variables added to ``os.environ`` for every process. ``stream``: where
    prefixed output goes (default ``sys.stdout``). ``on_start``: called with
    ``{label: pid}`` once every process has started (each pid is also its process group).
    ``report``: a dict, filled in with ``'status'`` (the return value), ``'processes'``:
    ``{label: {'status', 'note'}}`` for every process (see ``_summary``), and ``'host'``
    and ``'port'``, the scheduler's address. Returns the exit status (module doc).

    Parameters
    ----------
    command : iterable of str
        The worker command, e.g. ``['python', 'train.py']``.
    num_workers, num_servers : int >= 1
    port : int, optional
    timeout : float > 0, optional
    env : mapping of str to str, optional
    stream : text stream, optional
    on_start : callable(dict), optional
    report : dict, optional

    Returns
    -------
    int
        The job's exit status: 0 when every worker exits 0 (module doc).

    Raises
    ------
    ValueError
        An empty `command`, a count < 1, a `timeout` <= 0, or a `port` out of range or in
        use.

    Examples
    --------
    A job of two workers and one server (started here only where processes may be: the
    lines are skipped in the doctests); every line of the job's output is prefixed with
    the process it comes from:

    >>> from mx_lbsgd.distributed.launch import launch
    >>> report = {}
    >>> launch(['python', 'train.py', '--epochs', '1'], num_workers=2,  # doctest: +SKIP
    ...        timeout=600, report=report)
    [worker 0] ...
    0
    >>> sorted(report['processes'])                                   # doctest: +SKIP
    ['scheduler', 'server 0', 'worker 0', 'worker 1']

    Bad arguments raise before anything starts:

    >>> launch([], num_workers=1)
    Traceback (most recent call last):
    ...
    ValueError: command is empty
    """
    command = list(command)
    if not command:
        raise ValueError('command is empty')
    _check_counts(num_workers, num_servers)
    if timeout is not None and timeout <= 0:
        raise ValueError(f'timeout must be > 0, got {timeout!r}')
    given = port is not None
    port = _scheduler_port(port)
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    host = _job_host()
    base = _job_env(env, host, num_servers, num_workers)
    # SIGINT/SIGTERM only set a flag that the waits poll: an exception raised at an arbitrary
    # point could leave a lock held (Popen.poll's waitpid lock), and the teardown would then
    # wait on it forever
    caught: list[int] = []
    job = _Job(sys.stdout if stream is None else stream, base, caught)
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        old_handlers = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                        for sig in _SIGNAL_STATUS}
    try:
        status = _run(job, command, num_workers, num_servers, port, given, timeout, start,
                      deadline, on_start)
    finally:
        if on_main:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
    _conclude(job, status, host, report)
    return status


def _scheduler_port(port: int | None) -> int:
    """The scheduler's port: ``port`` checked (ValueError when it is out of range or in use),
    or a free one drawn at random when it is None."""
    if port is None:
        return _choose_port()
    if not 0 < port < 65536:
        raise ValueError(f'port must be in 1..65535, got {port!r}')
    _check_port(port)
    return port


def _job_env(env: Mapping[str, str] | None, host: str, num_servers: int,
             num_workers: int) -> dict[str, str]:
    """The variables every process of the job gets (module doc)."""
    base = dict(os.environ)
    base.update(env or {})
    for name in _SHARED_ENV:
        base.pop(name, None)
    base.setdefault('OMP_NUM_THREADS', '1')
    base.setdefault('PYTHONUNBUFFERED', '1')
    base.update(DMLC_PS_ROOT_URI=host, DMLC_NODE_HOST=host, DMLC_NUM_SERVER=str(num_servers),
                DMLC_NUM_WORKER=str(num_workers))
    return base


def _run(job: _Job, command: Sequence[str], num_workers: int, num_servers: int, port: int,
         given: bool, timeout: float | None, start: float, deadline: float | None,
         on_start: Callable[[dict[str, int]], object] | None) -> int:
    """Start the scheduler, then the servers and workers, and wait for the job; stops every
    process still running before it returns the job's exit status."""
    try:
        status = job.start_scheduler(port, given, timeout, deadline)
        if status is None:
            for i in range(num_servers):
                job.spawn(f'server {i}', 'server', i, [sys.executable, '-c', _BOOTSTRAP])
            for i in range(num_workers):
                job.spawn(f'worker #{i}', 'worker', i, command)
            if on_start is not None:
                on_start({label: proc.pid for label, proc in job.procs})
            status = _wait(job.procs, timeout, start, job.say, job.states, job.caught)
    except KeyboardInterrupt:          # not on the main thread: Python's own handler
        job.say('interrupted; stopping all processes')
        status = 130
    except FileNotFoundError as err:
        job.say(f'cannot start {err.filename!r}: {err.strerror}')
        status = 127
    finally:
        for label, proc in job.procs:
            if proc.poll() is None and label not in job.states:
                job.states[label] = 'still running; stopped by the launcher'
        _teardown(job.procs)
    return status


def _conclude(job: _Job, status: int, host: str, report: dict[str, Any] | None) -> None:
    """Once every process has ended: collect the rest of their output, say how each ended
    if the launcher stepped in, and fill in ``report``."""
    drained = time.monotonic() + 2          # the output threads end with their pipes
    for thread in job.threads:
        thread.join(timeout=max(0.0, drained - time.monotonic()))
    summary = _summary(job.procs, job.states)
    if job.said and summary:        # the launcher stepped in: say how every process ended
        job.say('exit status: ' + ', '.join(
            f'{label}: {_describe(entry)}' for label, entry in summary.items()))
    if report is not None:
        report.update(status=status, processes=summary, host=host,
                      port=int(job.env['DMLC_PS_ROOT_PORT']))


def _wait(procs: Sequence[_Entry], timeout: float | None, start: float,
          say: Callable[[str], None], states: dict[str, str],
          caught: Sequence[int] = ()) -> int:
    """Poll until the workers are done, something fails or the time is up; returns status.

    ``states`` maps each label to a note on how the launcher ended that process (filled in
    here for the processes it stops on purpose; see ``_summary``).
    """
    workers = [p for label, p in procs if label.startswith('worker')]
    scheduler = procs[0][1]
    done_at = barrier_at = None
    while True:
        if caught:
            return _stop_for_signal(caught[0], say)
        failed = _first_failure(procs, say, states)
        if failed is not None:
            return failed
        now = time.monotonic()
        if all(p.returncode == 0 or label in states for label, p in procs):
            return 0
        if barrier_at is None and scheduler.returncode == 0:
            barrier_at = now
        if barrier_at is not None and now - barrier_at > _EXIT_HANG:
            return _stop_hung(procs, say, states)
        if done_at is None and all(p.returncode == 0 for p in workers):
            done_at = now
        if done_at is not None and now - done_at > _LINGER:
            return _stop_lingering(procs, say, states)
        if timeout is not None and now - start > timeout:
            say(f'timeout after {timeout:g} s; stopping all processes')
            return 124
        time.sleep(_POLL)


def _stop_for_signal(signum: int, say: Callable[[str], None]) -> int:
    """Say that SIGINT or SIGTERM (``signum``) stops the job; its exit status."""
    say('interrupted; stopping all processes' if signum == signal.SIGINT
        else 'got SIGTERM; stopping all processes')
    return _SIGNAL_STATUS[signum]


def _first_failure(procs: Sequence[_Entry], say: Callable[[str], None],
                   states: Mapping[str, str]) -> int | None:
    """Poll every process: the exit status of the first one that failed by itself (said),
    else None."""
    for label, proc in procs:
        code = proc.poll()
        if code and label not in states:
            say(f'{label} {_how(code)}; stopping all processes')
            return _status(code)
    return None


def _stop_hung(procs: Sequence[_Entry], say: Callable[[str], None],
               states: dict[str, str]) -> int:
    """Stop the processes still running well after the scheduler left the final barrier;
    the job succeeded (0)."""
    # The scheduler leaves ps-lite's final barrier (ps::Finalize) only once every
    # server and worker has entered it, i.e. every worker's program is done and its
    # kvstore is being destroyed. What still runs is stuck in ps-lite's exit.
    hung = [(label, p) for label, p in procs if p.poll() is None]
    for label, _ in hung:
        states[label] = 'hung in ps-lite exit after the final barrier; stopped'
    say(f'{", ".join(l for l, _ in hung)} still running {_EXIT_HANG:g} s after the '
        "job's final ps-lite barrier (their work is done): stuck in ps-lite's exit; "
        'stopping them')
    _teardown(hung)
    return 0


def _stop_lingering(procs: Sequence[_Entry], say: Callable[[str], None],
                    states: dict[str, str]) -> int:
    """Mark the servers/scheduler still running well after every worker succeeded (the
    caller's teardown stops them); the job succeeded (0)."""
    left = [label for label, p in procs if p.poll() is None]
    for label in left:
        states[label] = 'still running after the workers succeeded; stopped'
    say(f'all workers finished but servers/scheduler still run after {_LINGER:g} s; '
        'stopping them')
    return 0


def _summary(procs: Sequence[_Entry], states: Mapping[str, str]
             ) -> dict[str, dict[str, Any]]:
    """``{label: {'status': int or None, 'note': str}}`` once every process has ended.

    ``status`` is the process's own exit status (128 + N if killed by signal N), or ``None``
    for a process stopped by the launcher after its work was done (``note`` says why);
    ``note`` is '' for a process that exited by itself.
    """
    out: dict[str, dict[str, Any]] = {}
    for label, proc in procs:
        code = proc.returncode
        if label in states:
            out[label] = dict(status=None if code is None or code < 0 else code,
                              note=states[label] if code is None or code < 0 else '')
        elif code is None:
            out[label] = dict(status=None, note='did not start')
        else:
            out[label] = dict(status=_status(code), note='')
    return out


def _describe(entry: Mapping[str, Any]) -> str:
    if entry['note']:
        return entry['note']
    status = entry['status']
    if status is None:
        return 'not started'
    return f'killed by signal {status - 128}' if status > 128 else f'exit {status}'


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'invalid integer {text!r}') from None
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be >= 1, got {value}')
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'invalid number {text!r}') from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f'must be > 0, got {text}')
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f'must be <= 65535, got {value}')
    return value


class _Parser(argparse.ArgumentParser):
    """Errors in one line, ``PROG: error: MESSAGE`` (exit status 2), not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f'{self.prog}: error: {message} (see {self.prog} --help)\n')


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``mx-lbsgd launch -n WORKERS [-s SERVERS] [--port P] [--timeout S] -- CMD``.

    What ``python -m mx_lbsgd.launch`` and ``mx-lbsgd launch`` run.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The job's exit status (`launch`), or 2 when a port is in use.

    Raises
    ------
    SystemExit
        With status 2 and a one-line message on stderr for bad arguments (argparse), or 0
        after ``--help``.

    Examples
    --------
    >>> from mx_lbsgd.distributed.launch import main
    >>> main(['-n', '2', '--', 'python', 'train.py'])          # doctest: +SKIP
    0
    >>> main(['-n', '0', '--', 'python', 'train.py'])
    Traceback (most recent call last):
    ...
    SystemExit: 2
    """
    parser = _Parser(
        prog='mx-lbsgd launch',
        description='Run an MXNet dist_sync job (scheduler, servers, workers) on this machine.',
        epilog="Output lines are prefixed [scheduler], [server i] and [worker R], R the "
               "worker's kvstore rank (kv.rank) once the scheduler has assigned it; until "
               "then, and for a worker that never creates a dist kvstore, [worker #i], i "
               "the order in which it was started (its MX_LBSGD_RANK variable, which is not "
               "kv.rank: shard data by kv.rank). Exit status: 0 when every worker exits 0, "
               "else the first failure's (128+N for signal N), 124 on --timeout, 130 on "
               "Ctrl-C, 143 on SIGTERM, 2 for bad arguments.")
    parser.add_argument('-n', '--num-workers', type=_positive_int, required=True,
                        help='number of worker processes')
    parser.add_argument('-s', '--num-servers', type=_positive_int, default=1,
                        help='number of server processes (default 1)')
    parser.add_argument('--port', type=_port,
                        help="scheduler's port (default: a random free one outside the kernel's "
                             'ephemeral range)')
    parser.add_argument('--timeout', type=_positive_float,
                        help='wall-clock limit in seconds; exit 124 when it expires')
    parser.add_argument('command', nargs=argparse.REMAINDER,
                        help='worker command, after --')
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        parser.error('the following arguments are required: command (give it after --)')
    try:
        return launch(command, args.num_workers, args.num_servers, port=args.port,
                      timeout=args.timeout)
    except ValueError as err:
        print(f'{parser.prog}: error: {err}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
