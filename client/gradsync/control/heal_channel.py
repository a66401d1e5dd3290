"""A donor's live state straight to the rank it heals, over an abstract Unix socket, raw.

Why: through the coordinator a healing state crossed gRPC twice in 1 MiB
messages, pickled (`torch.save`), assembled whole on the coordinator and
queued whole for the joiner: 0.07 GB/s for 270 MB here, and above the
coordinator's per-worker outbox cap (128 MiB) the joiner was dropped. When
the coordinator is on this host (a loopback address), donor and joiner are
too, so the donor offers its state on a local socket instead: it serves it
at the step boundary (`StateOffer`), and its heal upload through the
coordinator is only a small *offer* (this module's `OFFER_MAGIC`, socket
name, the donor's pid, one-time token, size), relayed, checked and budgeted
like any heal blob. The joiner connects, presents the token, and reads the
raw state (`gradsync.control.raw_state`) straight into its own parameters
where they fit (`fetch`'s `into`), else into new tensors.

The donor does not wait for the transfer at its step boundary: it serves its
live parameters and optimizer state (buffers, which a forward pass may
change, are copied at the boundary) while it computes the step the joiner
enters, and waits for the transfer only where its tensors would change
(`release`, at the end of that step's backward, before `optimizer.step()`).
The step cannot complete before the joiner has read the state and
contributed, so the others wait for the transfer and nothing more.

Trust: the socket is abstract (no file; per network namespace, like
loopback) and its name, random, shows in /proc/net/unix to every local
user. The donor therefore checks each peer's uid (SO_PEERCRED) the moment
it accepts it and closes a foreign one before reading anything; peers of
its own uid are watched together, each with `TOKEN_DEADLINE_S` to present
the token (32 random bytes, compared in constant time), so a silent one
holds nothing but its own descriptor; and only a peer that presented the
token takes the lock that `release` waits on. The offer came over the
joiner's authenticated session, so the joiner trusts what it names: it
talks only to the process the offer names (the listener's pid and uid by
SO_PEERCRED, checked before the token is sent) and reads at most its limit.
The donor serves until its deadline and then drops the snapshot. Every
socket operation is bounded.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradsync.control import raw_state
from gradsync.local.local_rendezvous import peer_credentials

log = logging.getLogger("gradsync.client")

OFFER_MAGIC = b"GSHEAL2\n"
#: The largest offer a joiner reads (it is a few hundred bytes).
MAX_OFFER_BYTES = 4096
_TOKEN_BYTES = 32
#: Bytes per recv_into/sendall call: large, so that the loop costs nothing per byte.
#: The socket buffers are left to the kernel's autotuning: fixed 4 MiB ones measured the
#: same here (median of 5 transfers of 512 MB: 1.93 GB/s fixed, 1.92 GB/s autotuned).
_IO_BYTES = 16 << 20
#: How long a peer has, from its connect, to present the token (a joiner sends it at once).
TOKEN_DEADLINE_S = 3.0
#: Peers of the donor's uid waiting to present a token at once (one more: the oldest goes).
_MAX_PENDING = 64
_BACKLOG = 128
#: How often the serving loop looks at its deadlines and its stop flag.
_POLL_S = 0.2
#: The socket names a donor gives (abstract: no file).
_NAME = re.compile(r"gradsync-heal-[0-9a-f]{32}")
#: How long `release` waits for a transfer in progress before it cuts it off.
_TRANSFER_WAIT_S = 30.0


class HealChannelError(RuntimeError):
    """The direct transfer failed (connection, token, timeout or a malformed state)."""


def is_offer(blob: bytes | bytearray) -> bool:
    """True when a heal blob is an offer of this module rather than a state."""
    return bytes(blob[: len(OFFER_MAGIC)]) == OFFER_MAGIC


class StateOffer:
    """The donor's end: `state` served on an abstract Unix socket until `serve_s` passes.

    The live tensors are served first, while the donor computes; the donor
    calls `release` (or `settle`, which waits for a joiner to come first)
    before it changes them. A joiner that came and was served ends the
    offer then; one that has not come yet gets a snapshot (one copy), served
    until the deadline.

    Args:
        state: the state dict tree (module and optimizer state), not copied: the donor
            must not change its tensors until `release` or `settle` returns.
        serve_s: how long joiners may come for it (they join within their Welcome's
            timeout); the snapshot is dropped then, or at `close`.
    """

    def __init__(self, state: Any, serve_s: float) -> None:
        self._prefix, self._tensors = raw_state.encode(state)
        self.total_bytes = len(self._prefix) + sum(
            t.numel() * t.element_size() for t in self._tensors
        )
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        self._deadline = time.monotonic() + serve_s
        self._stop = threading.Event()
        #: Set once a joiner presented the token (its transfer runs under `_serving`).
        self._joined = threading.Event()
        #: Held while a joiner that presented the token is served, so that `release`
        #: swaps tensors between two.
        self._serving = threading.Lock()
        #: The connection being served (so that `release` can cut off a stuck one).
        self._conn: socket.socket | None = None
        self._conn_lock = threading.Lock()
        #: A joiner was sent the whole state; `release` ran.
        self._served = False
        self._released = False
        self.name = f"gradsync-heal-{secrets.token_hex(16)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.name)
        self._sock.listen(_BACKLOG)
        self._sock.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="gradsync-heal-offer", daemon=True)
        self._thread.start()

    def offer(self) -> bytes:
        """The small blob the coordinator relays to the joiners instead of the state."""
        fields = {"socket": self.name, "pid": os.getpid(), "token": self._token.hex()}
        fields["total_bytes"] = self.total_bytes
        return OFFER_MAGIC + json.dumps(fields).encode()

    def settle(self, wait_s: float) -> bool:
        """Wait (at most `wait_s`) for a first joiner to come, then release the live tensors
        and serve a snapshot to any other joiner (ranks a restarted coordinator heals may
        come one after the other). Return whether a joiner came."""
        came = self._joined.wait(wait_s)
        self.release(wait_s=_TRANSFER_WAIT_S, snapshot=True)
        return came

    def release(self, wait_s: float, snapshot: bool = False) -> None:
        """Make the live tensors the donor's again (call it before they change; idempotent).

        Waits (at most `wait_s`) for a transfer in progress to end; past that
        its connection is shut, so that the joiner reads an error rather than
        a state torn by the donor's next step. Only a peer that presented the
        token can be in a transfer: a stranger's connection holds nothing
        here. Then, if a joiner was served and no `snapshot` is asked for, the
        offer ends (at the end of the step the newcomers enter: they all read
        it before the step could complete); else a snapshot (one copy) serves
        until the deadline.
        """
        if self._released:
            return
        self._released = True
        held = self._serving.acquire(timeout=wait_s)
        if not held:
            with self._conn_lock:
                if self._conn is not None:
                    log.warning("heal offer: a transfer still ran after %gs; cut off", wait_s)
                    with contextlib.suppress(OSError):
                        self._conn.shutdown(socket.SHUT_RDWR)
            held = self._serving.acquire(timeout=_TRANSFER_WAIT_S)
        if not held:  # the serving thread is stuck past a shut socket: serve nothing more
            self._stop.set()
            return
        try:
            if self._served and not snapshot:
                self._stop.set()
                self._tensors = []
            else:
                with torch.no_grad():
                    self._tensors = [t.clone() for t in self._tensors]
        finally:
            self._serving.release()
        if self._stop.is_set():  # its socket closes within a poll interval
            self.close()

    def close(self) -> None:
        """Stop serving and drop the snapshot (idempotent; bounded)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        """Accept peers and collect their tokens, all at once; hand a token's holder on."""
        selector = selectors.DefaultSelector()
        pending: dict[socket.socket, tuple[float, bytearray]] = {}
        foreign: set[int] = set()
        try:
            selector.register(self._sock, selectors.EVENT_READ, None)
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                for key, _ in selector.select(timeout=_POLL_S):
                    if key.data is None:
                        self._accept(selector, pending, foreign)
                    else:
                        self._read_token(key.fileobj, selector, pending)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, (until, _) in pending.items() if until < now]:
                    log.warning(
                        "heal offer: a peer presented no token within %gs; closed",
                        TOKEN_DEADLINE_S,
                    )
                    self._drop(conn, selector, pending)
        except OSError as exc:
            log.warning("heal offer: serving stopped: %s", exc)
        finally:
            for conn in list(pending):
                self._drop(conn, selector, pending)
            selector.close()
            self._sock.close()
            self._stop.set()  # a token's holder still queued for the lock is sent nothing
            self._tensors = []  # the snapshot's memory goes back (after a transfer under way)

    def _accept(
        self,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, tuple[float, bytearray]],
        foreign: set[int],
    ) -> None:
        """Take the queued peers: another uid's is closed unread; the oldest over the cap goes."""
        for _ in range(_BACKLOG):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            _, uid, _ = peer_credentials(conn)
            if uid != os.getuid():
                if uid not in foreign:  # once per uid: a stranger cannot flood the log
                    foreign.add(uid)
                    log.warning("heal offer: refused a peer of uid %d (not %d)", uid, os.getuid())
                conn.close()
                continue
            if len(pending) >= _MAX_PENDING:
                self._drop(next(iter(pending)), selector, pending)
            conn.setblocking(False)
            pending[conn] = (time.monotonic() + TOKEN_DEADLINE_S, bytearray())
            selector.register(conn, selectors.EVENT_READ, conn)

    def _read_token(
        self,
        conn: socket.socket,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, tuple[float, bytearray]],
    ) -> None:
        """Read what a peer sent of its token; a whole one is checked, then served apart."""
        received = pending[conn][1]
        try:
            chunk = conn.recv(_TOKEN_BYTES - len(received))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn, selector, pending)
            return
        received += chunk
        if len(received) < _TOKEN_BYTES:
            return
        selector.unregister(conn)
        del pending[conn]
        if not hmac.compare_digest(bytes(received), self._token):
            log.warning("heal offer: a peer presented a wrong token; refused")
            conn.close()
            return
        self._joined.set()
        threading.Thread(
            target=self._transfer, args=(conn,), name="gradsync-heal-send", daemon=True
        ).start()

    @staticmethod
    def _drop(
        conn: socket.socket,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, tuple[float, bytearray]],
    ) -> None:
        selector.unregister(conn)
        del pending[conn]
        conn.close()

    def _transfer(self, conn: socket.socket) -> None:
        """Send the state to a peer that presented the token (one at a time, under the lock)."""
        with conn, self._serving:
            if self._stop.is_set():
                return
            with self._conn_lock:
                self._conn = conn
            try:
                self._served |= self._send(conn)
            finally:
                with self._conn_lock:
                    self._conn = None

    def _send(self, conn: socket.socket) -> bool:
        started = time.monotonic()
        try:
            conn.setblocking(True)
            conn.settimeout(_TRANSFER_WAIT_S)
            conn.sendall(self._prefix)
            for tensor in self._tensors:
                view = raw_state.tensor_bytes(tensor) if tensor.numel() else memoryview(b"")
                for offset in range(0, len(view), _IO_BYTES):
                    conn.sendall(view[offset : offset + _IO_BYTES])
        except OSError as exc:
            log.warning("heal offer: a transfer failed: %s", exc)
            return False
        seconds = time.monotonic() - started
        log.info(
            "heal offer: sent %d bytes in %.3f s (%.2f GB/s, local socket)",
            self.total_bytes,
            seconds,
            self.total_bytes / max(seconds, 1e-9) / 1e9,
        )
        return True


def fetch(
    offer: bytes | bytearray,
    limit_bytes: int,
    timeout_s: float,
    into: Callable[[raw_state.Layout], Mapping[int, torch.Tensor]] | None = None,
) -> Any:
    """The joiner's end: read the offered state (a state dict tree).

    Args:
        offer: the blob the coordinator relayed (`StateOffer.offer`).
        limit_bytes: the most tensor bytes to accept (a size in the header is a claim).
        timeout_s: the bound on the whole transfer.
        into: given the checked header, the existing tensors to read into by tensor
            index (`raw_state.read_tensors`); the others are allocated.

    Raises:
        HealChannelError: a malformed offer, a listener that is not the donor the offer
            names, a refused or lost connection, a timeout, or a state that `raw_state`
            refuses.
    """
    name, pid, token = _parse_offer(bytes(offer))
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
            conn.settimeout(timeout_s)
            conn.connect("\0" + name)
            peer_pid, peer_uid, _ = peer_credentials(conn)
            if peer_uid != os.getuid() or peer_pid != pid:
                raise HealChannelError(
                    f"the heal socket {name} is served by pid {peer_pid} (uid {peer_uid}), "
                    f"not the donor the offer names (pid {pid}, uid {os.getuid()}); refused"
                )
            conn.sendall(token)
            length = raw_state.header_length(_recv_exactly(conn, raw_state.PREFIX_BYTES, deadline))
            layout = raw_state.parse_header(_recv_exactly(conn, length, deadline), limit_bytes)
            targets = into(layout) if into is not None else None

            def read_into(target: memoryview) -> None:
                _recv_into(conn, target, deadline)

            return layout.build(raw_state.read_tensors(layout, read_into, targets))
    except raw_state.BadRawState as exc:
        raise HealChannelError(f"the donor's state is not readable: {exc}") from exc
    except OSError as exc:
        raise HealChannelError(f"reading the donor's state from socket {name}: {exc}") from exc


def _parse_offer(offer: bytes) -> tuple[str, int, bytes]:
    if len(offer) > MAX_OFFER_BYTES or not is_offer(offer):
        raise HealChannelError(f"not a heal offer ({len(offer)} bytes)")
    try:
        fields = json.loads(offer[len(OFFER_MAGIC) :].decode())
        name, pid, token = str(fields["socket"]), int(fields["pid"]), bytes.fromhex(fields["token"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise HealChannelError(f"a malformed heal offer: {exc}") from None
    if not _NAME.fullmatch(name) or pid <= 0 or len(token) != _TOKEN_BYTES:
        raise HealChannelError(
            f"a heal offer for socket {name[:80]!r} (pid {pid}) refused: only a gradsync "
            f"heal socket, a pid and a {_TOKEN_BYTES}-byte token are accepted"
        )
    return name, pid, token


def _recv_exactly(conn: socket.socket, count: int, deadline: float) -> bytes:
    buffer = bytearray(count)
    _recv_into(conn, memoryview(buffer), deadline)
    return bytes(buffer)


def _recv_into(conn: socket.socket, target: memoryview, deadline: float) -> None:
    filled = 0
    while filled < len(target):
        if time.monotonic() > deadline:
            raise HealChannelError(f"timed out with {filled} of {len(target)} bytes")
        received = conn.recv_into(target[filled:], min(_IO_BYTES, len(target) - filled))
        if not received:
            raise HealChannelError(f"the donor closed after {filled} of {len(target)} bytes")
        filled += received
