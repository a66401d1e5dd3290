"""`gradsync serve --shards S` supervises its local shard processes; the shard flags are checked.

Real processes: the leader starts S-1 `gradsync shard` children, restarts one
that is SIGKILLed at the same port (it keeps its index), and leaves none
behind when it stops. A leader whose shards never come exits 1 naming them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import children_of, running
from support.shards import shard_statuses, wait_for_shards


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.timeout(120)
def test_local_shards_are_restarted_at_their_port_and_stopped_with_the_leader(
    coordinator_factory,
) -> None:
    leader = coordinator_factory(2, "--shards", "3", "--heartbeat-timeout", "2")
    shards = wait_for_shards(leader.address, 3, 60)
    before = {s.index: s.address for s in shards}
    assert before[0] == "" and all(before[i].startswith("127.0.0.1:") for i in (1, 2))
    children = children_of(leader.process.pid)
    assert len(children) == 2
    victim = children[0]
    os.kill(victim, signal.SIGKILL)
    # The leader notices, restarts it at the same port, and it gets its index back.
    wait_until(
        lambda: (
            victim not in children_of(leader.process.pid)
            and len(children_of(leader.process.pid)) == 2
        ),
        30,
        "a restarted shard process",
    )
    after = {s.index: s.address for s in wait_for_shards(leader.address, 3, 60)}
    assert after == before
    survivors = children_of(leader.process.pid)
    code, stderr = leader.stop()
    assert code == 0, stderr
    assert "exited with code -9; restarting it at the same port" in stderr
    assert not [child for child in survivors if Path(f"/proc/{child}").exists()]


@pytest.mark.timeout(60)
def test_a_leader_whose_shards_never_register_exits_1_naming_them(coordinator_factory) -> None:
    leader = coordinator_factory(2, "--wait-for-shards", "2", "--shard-wait-timeout", "1.5")
    assert [s.alive for s in shard_statuses(leader.address)] == [True, False, False]
    code, stderr = leader.stop(signal_first=False)
    assert code == 1, stderr
    assert "--shard-wait-timeout 1.5s" in stderr
    assert "waiting for 2 of 2 shards (--wait-for-shards 2)" in stderr


@pytest.mark.timeout(60)
def test_shards_and_wait_for_shards_cannot_be_combined() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync.cli",
            "serve",
            "--world-size",
            "2",
            "--port",
            "0",
            "--shards",
            "2",
            "--wait-for-shards",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2
    assert "--shards 2 and --wait-for-shards 1 cannot be combined" in done.stderr


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(120)
def test_local_shards_die_with_a_sigkilled_leader_and_free_their_ports(
    coordinator_factory,
) -> None:
    """A leader SIGKILLed runs no cleanup: its children hear of it from the kernel
    (PR_SET_PDEATHSIG) or their own watch of the parent pid, and stop, so a leader
    restarted at that port can start its own shards there."""
    leader = coordinator_factory(2, "--shards", "3", "--heartbeat-timeout", "2")
    shards = wait_for_shards(leader.address, 3, 60)
    ports = [int(s.address.rsplit(":", 1)[1]) for s in shards if s.index > 0]
    children = children_of(leader.process.pid)
    assert len(children) == 2 and len(ports) == 2
    killed_at = time.monotonic()
    leader.process.kill()
    leader.process.wait()
    wait_until(
        lambda: not [child for child in children if running(child)],
        10,
        f"the orphaned shards {children} to exit",
    )
    gone_s = time.monotonic() - killed_at
    assert gone_s < 3.0, f"the shards outlived their leader by {gone_s:.2f}s"
    assert all(_port_is_free(port) for port in ports), ports
    print(f"both shards exited {gone_s:.2f}s after SIGKILL of their leader; ports {ports} free")


@pytest.mark.timeout(60)
def test_a_shard_whose_parent_pid_is_not_its_parent_stops_at_once(tmp_path: Path) -> None:
    """The fallback of the parent-death signal (other systems, a parent dead before the
    prctl): `--parent-pid` names a process that is not our parent, so the watch sees a
    "reparented" shard at its first look and stops it cleanly."""
    from gradsync_proto.net.launch import free_port
    from support.shards import ShardProcess

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        shard = ShardProcess(
            f"127.0.0.1:{free_port()}",
            free_port(),
            tmp_path / "shard.log",
            "--parent-pid",
            str(stranger.pid),
        )
        try:
            code = shard.process.wait(timeout=30)
        finally:
            shard.stop()
    finally:
        stranger.kill()
        stranger.wait()
    assert code == 0, shard.log()
    assert f"the parent process {stranger.pid} is gone" in shard.log(), shard.log()
