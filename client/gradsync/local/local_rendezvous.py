"""How the ranks of one host find each other: an abstract Unix socket, a secret, a segment fd.

The coordinator tells every member of a local group (hierarchical
aggregation) the group's ranks and a random secret in its Welcome. The
leader (lowest rank) listens on the abstract Unix socket
"\\0gradsync-" + sha256(job id, secret)[:32]: abstract, so there is no file
to clean up after a crash, and per network namespace, like the host id
(`gradsync_proto.host`). Each follower connects (retrying until the join
deadline: the leader may still be joining) and sends its rank and the
secret; the leader admits it only with the right secret
(`hmac.compare_digest`) and a peer uid equal to its own (SO_PEERCRED), and
refuses anyone else with a message saying why.

The name is not secret (any local user reads it in /proc/net/unix), so the
leader must not let a stranger hold up the group: it checks the uid right at
accept and closes a foreign peer before reading from it, serves every pending
peer at once in one poll loop, each with its own short deadline to say HELLO
(a silent peer delays nobody and is then dropped), and listens with a backlog
that has room for strangers besides the group.

Once every follower is in, the leader creates the segment
(`gradsync.local.local_segment`) and passes its descriptor to each with
SCM_RIGHTS; a segment that does not fit is reported to every follower
before the leader raises, so every member raises the same
`SharedMemoryError`. Every wait here is bounded by the deadline.

Messages are SOCK_SEQPACKET datagrams: the kernel keeps their boundaries, so
the framing is one fixed header (`struct`) and an optional tail.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import time
from dataclasses import dataclass

from gradsync.errors import GradSyncError, SharedMemoryError, SyncTimeoutError
from gradsync.local.local_segment import SegmentLayout, create_segment

log = logging.getLogger("gradsync.client")

#: kind, number (a bucket index or a rank), step, value; then an optional tail.
HEADER = struct.Struct("<BxxxIQQ")
#: Largest message: a header and a tail (an error's text, a REDUCE's covered list).
MAX_MESSAGE_BYTES = 1 << 16
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: How often a follower retries a leader that is not listening yet (or whose queue is full).
_CONNECT_RETRY_S = 0.05
#: How long an accepted peer of the leader's uid has to say HELLO before it is dropped. A
#: follower sends its HELLO right after connecting, so this only bounds a silent stranger;
#: the other peers are served meanwhile, so it delays nobody.
_HELLO_TIMEOUT_S = 2.0
#: The least listen backlog (and most connections accepted per wake-up): the group plus a
#: crowd of strangers, since anyone on the host can read the name and connect.
_MIN_BACKLOG = 64


class Kind(enum.IntEnum):
    """What a local message says (see `gradsync.local.local_group` for the step messages)."""

    HELLO = 1  # follower -> leader: number = rank, tail = the group's secret
    REFUSED = 2  # leader -> follower: tail = why
    SEGMENT = 3  # leader -> follower: value = the segment's size; carries its fd
    ERROR = 4  # leader -> follower: value 1 = shared memory, tail = the error's text
    POSTED = 5  # member -> leader: number = bucket, value = dtype: in my slot
    REDUCE = 6  # leader -> member: number = bucket, value = dtype, tail = covered slots
    REDUCED = 7  # member -> leader: number = bucket: my share is summed
    AVERAGED = 8  # leader -> member: value = contributors: averages in the result
    COPIED = 9  # member -> leader: I copied the averages of `step` out
    BYE = 10  # either way: closing on purpose
    EXCLUDE = 11  # leader's training thread -> its I/O thread: number = slot
    EXCLUDED = 12  # leader -> member: the coordinator dropped you; sum nothing more


def frame(kind: Kind, number: int = 0, step: int = 0, value: int = 0, tail: bytes = b"") -> bytes:
    """One message's bytes."""
    return HEADER.pack(kind, number, step, value) + tail


def parse(raw: bytes) -> tuple[int, int, int, int, bytes]:
    """(kind, number, step, value, tail) of a message.

    Raises:
        GradSyncError: the message is shorter than a header.
    """
    if len(raw) < HEADER.size:
        raise GradSyncError(
            f"a local peer sent a {len(raw)}-byte message (a header is {HEADER.size})"
        )
    kind, number, step, value = HEADER.unpack_from(raw)
    return kind, number, step, value, raw[HEADER.size :]


def socket_name(job_id: str, secret: bytes) -> bytes:
    """The group's abstract socket address (leading NUL: no file)."""
    digest = hashlib.sha256(job_id.encode() + b"\0" + secret).hexdigest()[:32]
    return b"\0gradsync-" + digest.encode()


def _seqpacket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


@dataclass
class Formed:
    """A formed group's connections: the leader's to each follower (by slot), or the leader."""

    peers: dict[int, socket.socket]
    segment_fd: int
    #: The segment's size as the leader created it.
    segment_bytes: int


def lead(
    job_id: str,
    ranks: list[int],
    secret: bytes,
    layout: SegmentLayout,
    deadline: float,
    directory: str,
) -> Formed:
    """Admit every follower of `ranks` (ranks[0] is this leader), then hand out the segment.

    Raises:
        SyncTimeoutError: a follower did not arrive by `deadline` (names them).
        SharedMemoryError: the segment does not fit (every follower was told).
        GradSyncError: the socket address is taken, or accepting a peer failed.
    """
    rank = ranks[0]
    listener = _seqpacket()
    peers: dict[int, socket.socket] = {}
    try:
        try:
            listener.bind(socket_name(job_id, secret))
        except OSError as exc:
            raise GradSyncError(
                f"cannot open the local group's socket ({exc.strerror}): is another "
                f"process of job '{job_id}' leading the same group?",
                rank=rank,
            ) from exc
        # The name is public (/proc/net/unix lists it), so strangers may queue here too:
        # room for them keeps a follower's connect from failing while the leader is busy.
        listener.listen(max(_MIN_BACKLOG, 4 * len(ranks)))
        listener.setblocking(False)
        _gather(listener, ranks, secret, peers, deadline)
    except BaseException:
        for conn in peers.values():
            conn.close()
        raise
    finally:
        listener.close()
    try:
        fd = create_segment(layout.total_bytes, directory)
    except (SharedMemoryError, OSError) as exc:
        text = str(exc) if isinstance(exc, SharedMemoryError) else f"creating it failed: {exc}"
        for conn in peers.values():
            _send_quietly(conn, frame(Kind.ERROR, value=1, tail=text.encode()[:4096]))
            conn.close()
        if isinstance(exc, SharedMemoryError):
            raise SharedMemoryError(text, rank=rank) from None
        raise GradSyncError(f"the local group's shared memory: {text}", rank=rank) from exc
    try:
        for conn in peers.values():
            socket.send_fds(conn, [frame(Kind.SEGMENT, value=layout.total_bytes)], [fd])
            conn.settimeout(None)
    except OSError as exc:
        os.close(fd)
        for conn in peers.values():
            conn.close()
        raise GradSyncError(f"handing the shared segment to a local rank failed: {exc}") from exc
    return Formed(peers, fd, layout.total_bytes)


def _gather(
    listener: socket.socket,
    ranks: list[int],
    secret: bytes,
    peers: dict[int, socket.socket],
    deadline: float,
) -> None:
    """Fill `peers` (slot -> connection) with every follower of `ranks`, by `deadline`.

    One poll loop serves the listener and every accepted peer that has not said
    HELLO yet, each with its own deadline (`_HELLO_TIMEOUT_S`): a peer that stays
    silent then holds nobody up, since the others are read as soon as they speak,
    and is dropped when its time is up. A peer under another uid is closed at accept
    (`_accept_ready`), before anything is read from it. Connections still pending
    when the group is complete, or when this raises, are closed.

    Raises:
        SyncTimeoutError: a follower did not arrive by `deadline` (names them).
        GradSyncError: accepting a connection failed.
    """
    rank = ranks[0]
    #: Accepted, same uid, no HELLO yet -> when it is dropped.
    pending: dict[socket.socket, float] = {}
    warned_uids: set[int] = set()
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ, None)
        try:
            while len(peers) < len(ranks) - 1:
                now = time.monotonic()
                if now >= deadline:
                    missing = [r for slot, r in enumerate(ranks) if slot and slot not in peers]
                    raise SyncTimeoutError(
                        f"local ranks {missing} did not join this host's local group "
                        f"(ranks {ranks}) in time",
                        rank=rank,
                    )
                for conn in [conn for conn, until in pending.items() if until <= now]:
                    log.warning(
                        "rank %d: dropped a local peer that sent no HELLO within %.1f s",
                        rank,
                        _HELLO_TIMEOUT_S,
                    )
                    _unwatch(conn, selector, pending)
                    conn.close()
                wake = min([deadline, *pending.values()])
                for key, _ in selector.select(max(0.0, wake - now)):
                    if key.data is None:
                        until = min(deadline, time.monotonic() + _HELLO_TIMEOUT_S)
                        _accept_ready(listener, selector, pending, until, warned_uids, rank)
                        continue
                    conn = key.data
                    try:
                        raw = conn.recv(MAX_MESSAGE_BYTES)
                    except BlockingIOError:
                        continue
                    except OSError:
                        raw = b""  # reset by the peer: as good as gone
                    _unwatch(conn, selector, pending)
                    slot = _admit(conn, raw, ranks, secret, peers)
                    if slot is None:
                        conn.close()
                    else:
                        # Blocking again, bounded: the segment is sent on it next.
                        conn.settimeout(max(0.01, deadline - time.monotonic()))
                        peers[slot] = conn
        finally:
            for conn in pending:
                conn.close()


def _accept_ready(
    listener: socket.socket,
    selector: selectors.BaseSelector,
    pending: dict[socket.socket, float],
    until: float,
    warned_uids: set[int],
    rank: int,
) -> None:
    """Accept the queued connections; refuse one from another uid at once, watch the rest.

    The uid (SO_PEERCRED, the connecting process's credentials) is checked before
    any read, so a stranger's connection is closed as soon as it is accepted and
    cannot make the leader wait on it. It is still told why (without waiting: the
    socket is non-blocking), for a member started under the wrong user by mistake.
    Each foreign uid is logged once: a stranger cannot flood the log. At most a
    backlog's worth is taken per call, so a flood cannot keep the loop from its
    deadlines.

    Raises:
        GradSyncError: accept failed (e.g. out of file descriptors).
    """
    for _ in range(_MIN_BACKLOG):
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            raise GradSyncError(f"accepting a local peer failed: {exc}", rank=rank) from exc
        conn.setblocking(False)
        _, uid, _ = peer_credentials(conn)
        if uid == os.getuid():
            pending[conn] = until
            selector.register(conn, selectors.EVENT_READ, conn)
            continue
        why = f"uid {uid} is not the leader's ({os.getuid()})"
        if uid not in warned_uids:
            warned_uids.add(uid)
            log.warning("rank %d: refused a local peer: %s", rank, why)
        _send_quietly(conn, frame(Kind.REFUSED, tail=why.encode()))
        conn.close()


def _unwatch(
    conn: socket.socket, selector: selectors.BaseSelector, pending: dict[socket.socket, float]
) -> None:
    selector.unregister(conn)
    del pending[conn]


def _admit(
    conn: socket.socket,
    raw: bytes,
    ranks: list[int],
    secret: bytes,
    admitted: dict[int, socket.socket],
) -> int | None:
    """The slot of the follower whose first message is `raw`, or None (told why when it spoke).

    The peer's uid was checked at accept (`_accept_ready`).
    """
    try:
        kind, rank, _, _, tail = parse(raw)
    except GradSyncError:
        return None  # closed or garbled before a whole header: nobody to tell
    why = None
    slot = ranks.index(rank) if rank in ranks[1:] else None
    if kind != Kind.HELLO or not hmac.compare_digest(tail, secret):
        why = "wrong local secret (not a member of this job's group, or another Welcome's)"
    elif slot is None:
        why = f"rank {rank} is not a follower of local group {ranks}"
    elif slot in admitted:
        why = f"rank {rank} is already in the local group"
    if why is not None:
        log.warning("rank %d: refused a local peer claiming rank %d: %s", ranks[0], rank, why)
        _send_quietly(conn, frame(Kind.REFUSED, tail=why.encode()))
        return None
    return slot


def follow(job_id: str, rank: int, ranks: list[int], secret: bytes, deadline: float) -> Formed:
    """Connect to the leader of `ranks` (retrying until `deadline`) and receive the segment.

    Raises:
        SyncTimeoutError: the leader did not answer by `deadline`.
        SharedMemoryError: the leader found too little shared memory.
        GradSyncError: the leader refused this rank, or went away.
    """
    leader = ranks[0]
    name = socket_name(job_id, secret)
    conn = _seqpacket()
    # A timeout makes connect fail at once (EAGAIN) rather than wait unbounded in the
    # kernel when the leader's queue is full; it is retried like a leader not yet there.
    conn.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        while True:
            try:
                conn.connect(name)
                break
            except (ConnectionRefusedError, FileNotFoundError, BlockingIOError):
                if time.monotonic() + _CONNECT_RETRY_S > deadline:
                    raise SyncTimeoutError(
                        f"local leader rank {leader} did not open this host's local group "
                        f"(ranks {ranks}) in time",
                        rank=rank,
                    ) from None
                time.sleep(_CONNECT_RETRY_S)
        conn.sendall(frame(Kind.HELLO, number=rank, tail=secret))
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            raw, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 1)
        except TimeoutError:
            raise SyncTimeoutError(
                f"local leader rank {leader} did not hand out the shared segment in time",
                rank=rank,
            ) from None
        if not raw:
            raise GradSyncError(f"local leader rank {leader} closed the connection", rank=rank)
        kind, _, _, value, tail = parse(raw)
        text = tail.decode(errors="replace")
        if kind == Kind.ERROR:
            cls = SharedMemoryError if value == 1 else GradSyncError
            raise cls(f"local leader rank {leader}: {text}", rank=rank)
        if kind == Kind.REFUSED:
            raise GradSyncError(f"local leader rank {leader} refused this rank: {text}", rank=rank)
        if kind != Kind.SEGMENT or len(fds) != 1:
            raise GradSyncError(
                f"local leader rank {leader} sent message kind {kind} instead of the segment",
                rank=rank,
            )
        conn.settimeout(None)
        return Formed({0: conn}, fds[0], value)
    except BaseException:
        conn.close()
        raise


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """The (pid, uid, gid) of a Unix socket's peer (SO_PEERCRED)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return int(pid), int(uid), int(gid)


def _send_quietly(conn: socket.socket, message: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.send(message)
