"""The zygote: a Python process that has imported torch once and forks worker processes.

Run as a script by `support.prefork` (never imported by tests):
``python zygote.py SOCKET MODULE...``, the modules being what it imports before it forks.
Importing torch costs a fresh interpreter about 1.3 CPU-seconds on the development machine,
and importing the coordinator about 0.3; the multiprocess and system tiers start hundreds of
workers and coordinators, and on two cores those imports were a large share of the suite's
CPU. A child forked from this process starts with the modules already imported and runs
its script exactly as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would: its own
argv, environment, working directory, standard streams and passed descriptors, a fresh seed
for `random` and numpy's global generator (a fresh interpreter draws its own), and the
normal shutdown (non-daemon threads joined, atexit handlers run) before it exits with the
script's status.

Protocol (one SOCK_SEQPACKET connection per child, so message boundaries hold): the client
sends one JSON request with the descriptors the child needs (SCM_RIGHTS); the zygote answers
``{"pid": N}`` and, when that child exits, one more message ``{"status": S}`` with the raw
wait status, and closes the connection. The zygote leaves when its standard input reaches end
of file (its parent, the test process, closed it or died) and SIGKILLs the children it still
has then, so that nothing it forked outlives the test session.

What may be preloaded: modules whose import starts no thread that a fork would lose
halfway and initialises no gRPC core (importing grpc does neither; creating a channel or a
server does, and that happens only in the child). Never the module a child runs with
``-m``: runpy would find it imported already.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any

#: The largest request (argv, environment, working directory) in bytes.
MAX_REQUEST = 1 << 20
#: The most descriptors one request may carry (stdin, stdout, stderr and pass_fds).
MAX_FDS = 64


def main(socket_path: str, preload: list[str]) -> None:
    """Import `preload`, listen on `socket_path`, say "ready" on stdout and serve until stdin
    closes."""
    for module in preload:  # the point of this process: imported once, before any fork
        importlib.import_module(module)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake the loop

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()

    running = True
    while running:
        for key, _ in selector.select():
            if key.data == "accept":
                connection, _ = listener.accept()
                pid = _spawn(connection, [listener, *children.values()], wake_read, wake_write)
                if pid is None:
                    connection.close()
                else:
                    children[pid] = connection
            elif key.data == "child":
                os.read(wake_read, 4096)
                _reap(children)
            elif not os.read(sys.stdin.fileno(), 4096):
                running = False
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    listener.close()
    os.unlink(socket_path)


def _reap(children: dict[int, socket.socket]) -> None:
    """Report every child that has exited to the connection that asked for it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            # OSError: the client is gone (its Popen was dropped), nobody to tell.
            with contextlib.suppress(OSError):
                connection.send(json.dumps({"status": status}).encode())
            connection.close()


def _spawn(
    connection: socket.socket, inherited: list[socket.socket], wake_read: int, wake_write: int
) -> int | None:
    """Read one request from `connection`, fork its child and answer its pid."""
    try:
        data, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, MAX_FDS)
        request: dict[str, Any] = json.loads(data)
    except (OSError, ValueError) as error:
        sys.stderr.write(f"zygote: bad request: {error}\n")
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        for sock in inherited:
            sock.close()
        _run_child(request, fds, connection, wake_read, wake_write)
    for fd in fds:
        os.close(fd)
    connection.send(json.dumps({"pid": pid}).encode())
    return pid


def _run_child(
    request: dict[str, Any], fds: list[int], connection: socket.socket, *wake: int
) -> None:
    """Become the requested process: descriptors, session, environment, then the script."""
    code = 1
    try:
        connection.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        elif request["process_group"] is not None:
            os.setpgid(0, request["process_group"])
        # Move the received descriptors above every target number, then onto their targets
        # (a received descriptor may carry the number another one is bound for).
        targets: list[int] = request["targets"]
        above = max([*targets, *fds]) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        for source, target in zip(moved, targets, strict=True):
            os.dup2(source, target)  # inheritable, as Popen leaves stdio and pass_fds
        keep = set(targets)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep and fd > 2:
                with contextlib.suppress(OSError):  # the descriptor of the listing itself
                    os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_python(request["argv"], request["cwd"])
    except BaseException:  # the child's own failure, as Python would print it
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_python(argv: list[str], cwd: str) -> int:
    """Run `argv` (what follows the interpreter: ``SCRIPT ARGS`` or ``-m MODULE ARGS``) the
    way the interpreter's main does, shutdown included; return the exit status."""
    import atexit
    import random
    import runpy
    import threading

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # The interpreter chooses its buffering at start-up from -u and whether stdout is a tty.
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    elif os.isatty(1):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    status = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = cwd
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        status = 128 + signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as exit does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return status


def _exit_status(code: object) -> int:
    """The status `sys.exit(code)` gives a process: None is 0, an int itself, else 1 (printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
