"""A process that has imported torch and transformers once and forks kvferry servers from
there, for runs that start many of them (the test suite starts over a hundred: each fresh
interpreter spends ~4 s of a 2-core machine's CPU importing torch and transformers, most of a
small server's start).

`start()` runs `python -m deploy.zygote SOCKET` and names the socket in KVFERRY_ZYGOTE; from
then on `deploy.launcher` (in that process and in every process started with its environment)
asks the zygote for each server: `spawn` sends the `deploy.cli` arguments, the environment and
the working directory over the Unix socket with the server's stdout and stderr descriptors,
and the zygote forks. The child leads a session of its own (as `start_new_session`), takes
that environment, those descriptors and /dev/null for stdin, and runs `deploy.cli` as
`python -m deploy.cli` would, exiting through the interpreter's normal shutdown. The zygote
reaps it and sends its exit code back on the same connection: `ZygoteProcess` answers
`poll`/`wait`/`send_signal` as `subprocess.Popen` does.

What is forked has imported only third-party libraries (no kvferry module, so no setting read
at import, and no thread but OpenBLAS's pool, which forks cleanly): after the fork the server
imports kvferry under its own environment. Without KVFERRY_ZYGOTE, or when the zygote is gone,
the launcher starts a fresh interpreter as before. The zygote exits when the process that
started it does (its stdin closes).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

from deploy.child_env import without_router_secrets

if TYPE_CHECKING:
    from kvferry.model.tp_group import RankProcess, RankSpec
    from kvferry.model.tp_rendezvous import Rendezvous

ZYGOTE_ENV = "KVFERRY_ZYGOTE"  # the socket's path; "off": never start one
CLI = "deploy.cli"  # what a forked child runs unless its request names another module
_MAX_MESSAGE = 1 << 20


def _preload() -> None:
    """The imports every server makes and none reads our settings at: most of a start."""
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def _serve(path: str) -> tuple[list[str], str, str] | None:
    """Fork a server for each request until stdin closes. In a child: its (arguments,
    working directory), its descriptors and environment already in place."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)  # clients queue here while the imports run
    _preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending: list[socket.socket] = []  # connected, request not read yet
    children: dict[int, socket.socket] = {}
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r, sys.stdin, *pending], [], [])
        except InterruptedError:
            continue
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1 << 10):
            return None  # the starting process is gone
        if wake_r in readable:
            os.read(wake_r, 1 << 10)
        _reap(children)
        if listener in readable:
            pending.append(listener.accept()[0])
        for conn in [c for c in pending if c in readable]:
            pending.remove(conn)
            try:
                data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
            except OSError:
                conn.close()
                continue
            if not data or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for other in [listener, conn, *pending, *children.values()]:
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                return _become(request, fds)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.send(f"pid {pid}".encode())


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            except OSError:
                pass  # nobody listens any more
            conn.close()


def _become(request: dict[str, object], fds: list[int]) -> tuple[list[str], str, str]:
    """In the forked child: a session of its own, the caller's descriptors and environment."""
    os.setsid()
    stdout_fd, stderr_fd = fds
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    assert isinstance(env, dict)  # noqa: S101 - written by spawn below
    os.environ.clear()
    os.environ.update(env)
    argv, cwd, module = request["argv"], request["cwd"], request.get("module", CLI)
    assert isinstance(argv, list) and isinstance(cwd, str)  # noqa: S101
    assert isinstance(module, str)  # noqa: S101
    return [str(a) for a in argv], cwd, module


class ZygoteProcess:
    """A server the zygote forked, with the part of `subprocess.Popen` the launcher and the
    tests use; its exit code arrives on the connection that asked for it."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout: IO[str]) -> None:
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()  # one reader of the exit message (a rank's is polled
        # from its group's watch thread and the worker's own)

    def _read_exit(self, timeout_s: float | None) -> bool:
        with self._lock:
            if self.returncode is not None:
                return True
            ready, _, _ = select.select([self._conn], [], [], timeout_s)
            if not ready:
                return False
            message = self._conn.recv(64).decode()
            self._conn.close()
            # No message: the zygote died first (the run is ending); the child is gone or
            # going.
            self.returncode = int(message.split()[1]) if message.startswith("exit ") else -9
            return True

    def exit_fd(self) -> int:
        """A descriptor readable once the child has exited (a copy: the caller closes it)."""
        return os.dup(self._conn.fileno())

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None  # noqa: S101
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(args: list[str], env: dict[str, str], stderr: IO[str] | None,
          cwd: str | Path | None = None, module: str = CLI) -> ZygoteProcess | None:
    """`python -m <module> args` (a server: `deploy.cli args`) forked by the zygote that
    KVFERRY_ZYGOTE names in `env` (the server's environment), its stdout a pipe to us; None
    when there is none or it says "off" (the caller starts a fresh interpreter)."""
    path = env.get(ZYGOTE_ENV, "")
    if not path or path == "off":
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_fd, write_fd = os.pipe()
    try:
        conn.connect(path)
        message = json.dumps({"argv": args, "env": env, "module": module,
                              "cwd": str(cwd or os.getcwd())}).encode()
        socket.send_fds(conn, [message], [write_fd, (stderr or sys.stderr).fileno()])
        answer = conn.recv(64).decode()
    except OSError:
        answer = ""
    finally:
        os.close(write_fd)
    if not answer.startswith("pid "):
        conn.close()
        os.close(read_fd)
        return None
    stdout = open(read_fd, encoding="utf-8", errors="replace")  # noqa: SIM115
    return ZygoteProcess([module, *args], int(answer.split()[1]), conn, stdout)


class ZygoteRank:
    """A tensor-parallel rank the zygote forked, as its group uses a rank's process
    (kvferry/model/tp_group.py `RankProcess`)."""

    def __init__(self, name: str, proc: ZygoteProcess) -> None:
        self.name, self.pid = name, proc.pid
        self._proc = proc
        self.sentinel = proc.exit_fd()
        # closed with this object, as multiprocessing closes a Process's (the group's watch
        # thread holds the group, and so its ranks, while it waits on the sentinels)
        weakref.finalize(self, os.close, self.sentinel)

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # still running, as multiprocessing's join leaves it

    def kill(self) -> None:
        self._proc.kill()


def start_rank(rank: int, size: int, rendezvous: Rendezvous, spec: RankSpec) -> RankProcess:
    """Rank `rank` of a worker's tensor-parallel group forked by the zygote, torch imported
    already (a fresh interpreter spends ~2 s of CPU importing it); spawned as
    multiprocessing does when there is no zygote."""
    from kvferry.model.tp_group import rank_args, spawn_rank

    proc = spawn([rank_args(rank, size, rendezvous, spec)], dict(os.environ), None,
                 module="kvferry.model.tp_rank")
    if proc is None:
        return spawn_rank(rank, size, rendezvous, spec)
    return ZygoteRank(f"tp-rank-{rank}", proc)


def run(args: list[str], env: dict[str, str], cwd: str | Path, timeout_s: float
        ) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, -m, deploy.cli, *args], capture_output=True, text=True)`,
    forked by the zygote when `env` names one (a bad-input check then takes a fraction of a
    second instead of an import of torch)."""
    with tempfile.TemporaryFile("w+") as stderr:
        forked = spawn(args, env, stderr, cwd)
        if forked is None:
            return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
        stdout = forked.stdout.read()  # to its end: the server exited, or closed it
        code = forked.wait(timeout_s)
        stderr.seek(0)
        return subprocess.CompletedProcess(forked.args, code, stdout, stderr.read())


def start() -> subprocess.Popen[bytes] | None:
    """Start a zygote for this process and the ones it starts (KVFERRY_ZYGOTE names it);
    None when KVFERRY_ZYGOTE is "off" or already names one."""
    if os.environ.get(ZYGOTE_ENV):
        return None
    path = str(Path(tempfile.mkdtemp(prefix="kvferry-zygote-")) / "socket")
    # Without the router's secrets: a forked server's /proc/PID/environ shows the zygote's
    # own environment, whatever `spawn` hands it (a router gets its key through that).
    zygote = subprocess.Popen([sys.executable, "-m", "deploy.zygote", path],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              env=without_router_secrets(os.environ))
    deadline = time.monotonic() + 30
    while not Path(path).exists():  # bound before the imports: a fraction of a second
        if zygote.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.01)  # paces the wait for the socket file
    os.environ[ZYGOTE_ENV] = path
    return zygote


def main() -> None:
    path = Path(sys.argv[1])
    became = _serve(str(path))
    if became is None:  # the zygote exits: its socket, and the folder start() made for it, go
        path.unlink(missing_ok=True)
        path.parent.rmdir()
        return
    argv, cwd, module = became
    os.chdir(cwd)
    sys.argv = [module, *argv]
    _run_child(module)


def _run_child(module: str) -> NoReturn:
    """`python -m module` in the forked child, ended as the interpreter ends one (its other
    threads joined, its atexit handlers run, its standard streams flushed; the exit status of
    its SystemExit, 1 after an uncaught exception, killed by SIGINT after a Ctrl-C) but without
    the teardown of its modules: everything the zygote imported is shared with the child
    copy-on-write, and that teardown writes to every object of torch and transformers (0.7 s
    of CPU a child, as long as the rest of a bad-input command)."""
    import atexit
    import runpy

    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # noqa: BLE001 - reported as the interpreter would report it
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter calls at exit: threading's exit hooks (a thread pool's wake its
    # idle workers so they end) and the join of the other non-daemon threads, then atexit's.
    threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader gone
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_status(code: object) -> int:
    """The status `sys.exit(code)` ends an interpreter with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
