"""A real local Ray cluster for tests: `ray start --head --block` in a session of its own.

The cluster is what a user gets from `ray start` (a GCS, a raylet, worker processes that
Ray forks), not `ray.init()`'s in-driver cluster, so drivers connect to it as they would
to a real one: by address, from separate processes. Three things keep it hermetic:

- Its own token. `ray start` turns token authentication on or off depending on whether
  ~/.ray/auth_token exists, a file every Ray of the user shares, and a client that does
  not pick the token up fails with InvalidAuthToken (`ray status` does not, for one).
  The cluster and its drivers get RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN
  instead (`driver_environment`): the same on every machine, nothing read from ~/.ray.
- Its own ports. `ray start` binds the client server on 10001 by default (and names a
  dashboard port), which a second cluster on the machine would collide with.
- Its own session. Ray puts each worker process in a process group of its own, so
  the `ray start` group is not the whole cluster; every process of the cluster shares
  the session id `start_new_session` gave it, which `stop` empties and then checks.

Never `ray stop`: it ends every Ray cluster of the machine, not just this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsync_proto.net.launch import free_port

#: Bound on `ray start` until its GCS address is written (it starts a GCS and a raylet).
START_TIMEOUT_S = 60.0
#: Bound on the graceful stop (SIGTERM) before every process of the session is killed.
STOP_GRACE_S = 10.0
#: Bound on the wait for the killed processes to be gone.
KILL_TIMEOUT_S = 10.0

#: prctl(2) option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1

TESTS = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies (Linux prctl).

    Its own session keeps `ray start` out of the signals aimed at the test's process
    group, so without this a test process that is killed outright (a CI job's timeout)
    would leave the cluster running for good; SIGTERM makes `ray start` stop it all.
    """
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RayCluster:
    """A head node (`num_cpus` logical CPUs) and any `add_node`s; PYTHONPATH=tests.

    Attributes:
        address: the GCS address ("ip:port") drivers pass to `ray.init(address=...)`.
        temp_dir: Ray's session files (logs under session_*/logs).
    """

    def __init__(self, num_cpus: int = 4, host_id: str = "ray-node-1") -> None:
        # Short on purpose: Ray's unix sockets live below it and a socket path must stay
        # under 108 bytes, which a pytest tmp_path (plus Ray's session_<date>_<pid>) is not.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="gsray-", dir="/tmp"))
        self._token = secrets.token_hex(32)
        self.log_path = self.temp_dir / "ray-start.log"
        port = free_port()
        argv = [
            str(RAY),
            "start",
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            str(num_cpus),
            "--ray-client-server-port",
            str(free_port()),
            "--dashboard-port",
            str(free_port()),
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            str(self.temp_dir),
            "--block",
        ]
        self.process = self._start_node(argv, self.log_path, host_id)
        self.session_id = self.process.pid
        #: The other nodes' `ray start` processes (`add_node`), each a session of its own.
        self.nodes: list[subprocess.Popen[bytes]] = []
        try:
            self.address = self._wait_for_address(port)
        except BaseException:
            self.stop()
            raise

    def _node_environment(self, host_id: str) -> dict[str, str]:
        """A node's environment: the drivers', its own gradsync host id, no drain.

        Ray's workers inherit their raylet's environment, so `GRADSYNC_HOST_ID` makes
        the ranks of each node one host for gradsync, as separate machines would be
        (every node of this cluster shares one machine and network namespace). No drain
        on SIGTERM (Ray waits up to 30 s for busy workers, e.g. a detached actor a failed
        test left): a test cluster has no traffic to protect.
        """
        return self.driver_environment() | {
            "GRADSYNC_HOST_ID": host_id,
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }

    def _start_node(self, argv: list[str], log_path: Path, host_id: str) -> subprocess.Popen[bytes]:
        """Start one `ray start ... --block` in a session of its own, output to `log_path`."""
        with log_path.open("wb") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._node_environment(host_id),
                cwd=self.temp_dir,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )

    def add_node(self, num_cpus: int, host_id: str) -> None:
        """Start one more node (a second raylet on this machine) and wait until it runs."""
        log_path = self.temp_dir / f"node-{len(self.nodes) + 2}.log"
        argv = [
            str(RAY),
            "start",
            "--address",
            self.address,
            "--num-cpus",
            str(num_cpus),
            "--disable-usage-stats",
            "--block",
        ]
        node = self._start_node(argv, log_path, host_id)
        self.nodes.append(node)
        deadline = time.monotonic() + START_TIMEOUT_S
        # `ray start` says so once its raylet has registered with the GCS.
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the node did not start (exit {node.poll()}):\n"
                    + log_path.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.2)

    def driver_environment(self) -> dict[str, str]:
        """The environment of a process that joins this cluster (its drivers, and itself)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = self._token
        return env

    def _wait_for_address(self, port: int) -> str:
        """The GCS address, once `ray start` has written it (just before it blocks)."""
        written = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if written.exists():
                address = written.read_text().strip()
                if address.endswith(f":{port}"):
                    return address
            time.sleep(0.2)
        raise TimeoutError(
            f"ray start wrote no GCS address within {START_TIMEOUT_S:g} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The end of `ray start`'s output (for failure messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no output)"

    def processes(self) -> dict[int, str]:
        """The live (not zombie) processes of the cluster's session, by pid: their cmdline."""
        found: dict[int, str] = {}
        sessions = {self.session_id, *(node.pid for node in self.nodes)}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # Fields after the ")" that ends the command name: state, ppid, pgrp, session.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            state, session = fields[0], int(fields[3])
            if state != "Z" and (session in sessions or str(self.temp_dir) in cmdline):
                found[int(entry.name)] = cmdline.strip()
        return found

    def stop(self) -> dict[int, str]:
        """SIGTERM `ray start`, then SIGKILL whatever of the session is left.

        Only `ray start` gets the SIGTERM: its handler stops the raylet, the workers
        and the GCS in order (about a second). Signalled at once, the whole group
        loses its GCS early and `ray start` hangs on its way out instead.

        Returns:
            The processes still alive after all that (empty when the cluster is gone).
        """
        for process in (*self.nodes, self.process):  # the head last: it holds the GCS
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_GRACE_S)
        # Workers sit in process groups of their own, and `ray start` may hang on its
        # way out: what remains of the session is killed, process by process.
        deadline = time.monotonic() + KILL_TIMEOUT_S
        left = self.processes()
        while left and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=1.0)
            time.sleep(0.1)
            left = self.processes()
        for process in (*self.nodes, self.process):
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def run_driver(
    cluster: RayCluster, out_dir: Path, scenario: str, *extra: str, timeout_s: float
) -> dict[str, Any]:
    """Run one `support.ray_jobs` scenario as a driver process of `cluster`; its JSON result.

    The driver's output goes to `<out_dir>/<scenario>.log`, quoted when it fails.

    Raises:
        AssertionError: the driver exited with an error or wrote no result.
        subprocess.TimeoutExpired: it ran past `timeout_s` (it is killed).
    """
    out = out_dir / f"{scenario}.json"
    log_path = out_dir / f"{scenario}.log"
    argv = [
        sys.executable,
        "-c",
        "from support.ray_jobs import main; main()",
        scenario,
        "--address",
        cluster.address,
        "--out",
        str(out),
        *extra,
    ]
    with log_path.open("wb") as log:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=cluster.driver_environment(),
            cwd=out_dir,
            timeout=timeout_s,
        )
    output = log_path.read_text(errors="replace")
    assert done.returncode == 0 and out.exists(), (
        f"driver {scenario!r} exited with {done.returncode}:\n{output[-6000:]}"
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result
