"""Strangers on a local group's socket cannot hold up its formation (security review, issue 22).

The rendezvous socket's abstract name is listed in /proc/net/unix, so any
local user can connect to it without knowing the secret. Here a real process
(forked, under another uid or ours) finds the name there and opens silent
connections to it while a real group forms over the real socket; the test
times the formation and asks the stranger when the leader closed each of its
connections. Before the fix the leader read a peer's first message (up to
5 s) before looking at its uid and served peers one at a time, with a backlog
of the group's size: five silent strangers made a 2-rank group time out at
8 s, one made it take 5 s.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
from gradsync.errors import SyncTimeoutError
from gradsync.local.local_group import LocalGroup
from gradsync.local.local_rendezvous import HEADER, socket_name

#: 'nobody': an unprivileged uid that needs no entry in /etc/passwd to be set.
STRANGER_UID = 65534
#: Generous next to the few milliseconds a clean formation takes, far below the old 5 s.
QUICK_S = 3.0
#: How long a stranger waits for the leader to close one of its connections.
STRANGER_PATIENCE_S = 8.0


def _listed(name: bytes) -> bool:
    """Whether /proc/net/unix lists the abstract `name` (shown with '@' for its NUL)."""
    shown = "@" + name[1:].decode()
    with open("/proc/net/unix") as table:
        return any(line.split()[-1] == shown for line in table if len(line.split()) > 7)


def _stranger(name: bytes, uid: int | None, count: int, report: Connection) -> None:
    """In a forked child: become `uid`, find `name`, open `count` silent connections.

    Reports ("connected", how many, uid), then ("closed", [(seconds, what the leader
    said) or None per connection]) once the leader has closed each (or patience ran out).
    """
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    until = time.monotonic() + 10
    while not _listed(name):  # as an attacker finds it: no secret needed
        if time.monotonic() > until:
            report.send(("not listed", 0, os.getuid()))
            return
        time.sleep(0.01)
    opened: list[tuple[socket.socket, float]] = []
    for _ in range(count):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(1.0)  # a full backlog fails at once rather than waiting
        try:
            while True:
                try:
                    conn.connect(name)
                    break
                except ConnectionRefusedError:  # bound, not listening yet
                    if time.monotonic() > until:
                        raise
                    time.sleep(0.01)
        except OSError:
            conn.close()
            continue
        opened.append((conn, time.monotonic()))
    report.send(("connected", len(opened), os.getuid()))
    closed: list[tuple[float, str] | None] = []
    for conn, connected_at in opened:
        said = b""
        try:
            while True:
                conn.settimeout(max(0.01, connected_at + STRANGER_PATIENCE_S - time.monotonic()))
                message = conn.recv(1 << 16)
                if not message:
                    break
                said += message[HEADER.size :]
            closed.append((time.monotonic() - connected_at, said.decode(errors="replace")))
        except OSError:
            closed.append(None)  # still open when patience ran out
        conn.close()
    report.send(("closed", closed))


class _Stranger:
    """A forked stranger process and the pipe it reports on."""

    def __init__(self, name: bytes, uid: int | None, count: int) -> None:
        context = multiprocessing.get_context("fork")
        self._reports, sender = context.Pipe(duplex=False)
        # Forked before any member thread starts: the child copies no running thread.
        self.process = context.Process(target=_stranger, args=(name, uid, count, sender))
        self.process.start()
        sender.close()

    def report(self, timeout_s: float) -> tuple[object, ...]:
        if not self._reports.poll(timeout_s):
            raise AssertionError(f"the stranger said nothing in {timeout_s} s")
        message: tuple[object, ...] = self._reports.recv()
        return message

    def reap(self) -> None:
        self.process.join(STRANGER_PATIENCE_S + 2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._reports.close()


class _Member(threading.Thread):
    """One rank forming the group in a thread; keeps the group (or error) and the time it took."""

    def __init__(
        self, job_id: str, rank: int, ranks: list[int], secret: bytes, timeout_s: float
    ) -> None:
        super().__init__(daemon=True)
        self.form_args = (job_id, rank, ranks, secret)
        self.timeout_s = timeout_s
        self.result: LocalGroup | BaseException | None = None
        self.elapsed_s = float("nan")
        self.start()

    def run(self) -> None:
        job_id, rank, ranks, secret = self.form_args
        started = time.monotonic()
        try:
            self.result = LocalGroup.form(
                job_id=job_id,
                rank=rank,
                ranks=ranks,
                secret=secret,
                bucket_bytes=[4096, 64],
                timeout_s=self.timeout_s,
                heartbeat_interval_s=0.1,
            )
        except BaseException as exc:
            self.result = exc
        self.elapsed_s = time.monotonic() - started

    def finish(self) -> LocalGroup | BaseException | None:
        self.join(self.timeout_s + 5)
        return self.result


def _formed(members: list[_Member]) -> None:
    results = [member.finish() for member in members]
    for member, result in zip(members, results, strict=True):
        assert isinstance(result, LocalGroup), (member.form_args[1], result, member.elapsed_s)


def _close(members: list[_Member]) -> None:
    for member in members:
        member.join(member.timeout_s + 5)
        if isinstance(member.result, LocalGroup):
            member.result.close()


@pytest.mark.skipif(
    os.geteuid() != 0, reason="running a stranger under another uid needs root (os.setuid)"
)
def test_strangers_under_another_uid_are_closed_at_accept_and_hold_nobody_up() -> None:
    job_id, secret = "strangers-uid", secrets.token_bytes(32)
    stranger = _Stranger(socket_name(job_id, secret), STRANGER_UID, 5)
    members = [_Member(job_id, 0, [0, 1], secret, timeout_s=8)]
    try:
        kind, connected, uid = stranger.report(10)
        assert (kind, uid) == ("connected", STRANGER_UID)
        members.append(_Member(job_id, 1, [0, 1], secret, timeout_s=8))
        _formed(members)
        assert members[1].elapsed_s < QUICK_S, f"formation took {members[1].elapsed_s:.2f} s"
        assert connected == 5
        kind, closed = stranger.report(STRANGER_PATIENCE_S + 2)
        assert kind == "closed"
        assert isinstance(closed, list) and len(closed) == 5
        for entry in closed:
            assert entry is not None, closed  # the leader closed every one of them
            seconds, said = entry
            assert seconds < 2.0, closed  # at accept, not after waiting on a read (old: 5 s)
            assert f"uid {STRANGER_UID} is not the leader's" in said
    finally:
        _close(members)
        stranger.reap()


def test_a_silent_peer_of_the_same_uid_holds_nobody_up() -> None:
    job_id, secret = "strangers-silent", secrets.token_bytes(32)
    stranger = _Stranger(socket_name(job_id, secret), None, 1)
    members = [_Member(job_id, 0, [0, 1], secret, timeout_s=8)]
    try:
        assert stranger.report(10)[:2] == ("connected", 1)
        members.append(_Member(job_id, 1, [0, 1], secret, timeout_s=8))
        _formed(members)
        assert members[1].elapsed_s < QUICK_S, f"formation took {members[1].elapsed_s:.2f} s"
        kind, closed = stranger.report(STRANGER_PATIENCE_S + 2)
        assert kind == "closed" and isinstance(closed, list)
        assert closed[0] is not None  # dropped once the group was complete
    finally:
        _close(members)
        stranger.reap()


def test_a_silent_peer_of_the_same_uid_is_dropped_at_its_own_deadline() -> None:
    job_id, secret = "strangers-dropped", secrets.token_bytes(32)
    stranger = _Stranger(socket_name(job_id, secret), None, 1)
    # No follower comes: the leader waits out its deadline, the stranger must not.
    members = [_Member(job_id, 0, [0, 1], secret, timeout_s=4)]
    try:
        assert stranger.report(10)[:2] == ("connected", 1)
        kind, closed = stranger.report(STRANGER_PATIENCE_S + 2)
        assert kind == "closed" and isinstance(closed, list) and closed[0] is not None
        seconds, said = closed[0]
        assert seconds < 3.0, closed  # its own hello deadline, before the leader's 4 s
        assert said == ""  # it never spoke: dropped without a word
        result = members[0].finish()
        assert isinstance(result, SyncTimeoutError) and "[1]" in str(result)
    finally:
        _close(members)
        stranger.reap()


def test_a_crowd_beyond_the_group_size_leaves_room_for_its_members() -> None:
    job_id, secret = "strangers-crowd", secrets.token_bytes(32)
    ranks = [0, 1, 2]
    stranger = _Stranger(socket_name(job_id, secret), None, 20)
    members = [_Member(job_id, 0, ranks, secret, timeout_s=8)]
    try:
        kind, connected, _ = stranger.report(10)
        members += [_Member(job_id, rank, ranks, secret, timeout_s=8) for rank in ranks[1:]]
        _formed(members)
        slowest = max(member.elapsed_s for member in members[1:])
        assert slowest < QUICK_S, f"formation took {slowest:.2f} s"
        assert (kind, connected) == ("connected", 20)  # the backlog had room for them all
    finally:
        _close(members)
        stranger.reap()
