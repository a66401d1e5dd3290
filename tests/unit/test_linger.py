"""`Linger` on real sockets: an ended connection stays while its last bytes move, no longer.

The coordinator's side is a real asyncio transport with a small send buffer, so its
last bytes wait in the transport's own buffer as they would behind megabytes on a
slow link; the worker's side is a plain socket read at a set pace on a thread.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from gradsync_server.rpc import linger
from gradsync_server.rpc.linger import Linger, unacknowledged_bytes

PAYLOAD = 2 << 20  # far more than the 4 KiB send buffer and the peer's 16 KiB window


class _Held(asyncio.Protocol):
    def __init__(self) -> None:
        self.lost = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def _reader(sock: socket.socket, pause_s: float, got: list[int], done: threading.Event) -> None:
    """Read 16 KiB at a time, `pause_s` apart, to the end (or a reset)."""
    sock.settimeout(20)
    try:
        while True:
            chunk = sock.recv(16384)
            if not chunk:
                break
            got[0] += len(chunk)
            time.sleep(pause_s)
    except OSError:
        pass
    finally:
        done.set()


async def _ended_connection(pause_s: float | None) -> tuple[int, float, bool]:
    """Write PAYLOAD, half-close, linger; the peer reads at `pause_s` (None: never).

    Returns (bytes the peer got, seconds until the connection ended, it ended by abort).
    """
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.socket()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    peer.connect(server.getsockname())
    ours, _ = server.accept()
    server.close()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ours.setblocking(False)
    transport, protocol = await loop.create_connection(_Held, sock=ours)
    got, done = [0], threading.Event()
    try:
        transport.write(bytes(PAYLOAD))
        transport.write_eof()
        await asyncio.sleep(0.1)  # the loop fills the kernel's send buffer meanwhile
        assert unacknowledged_bytes(transport) > PAYLOAD // 2  # still ours to deliver
        # ...counting what the kernel holds, not only the transport's buffer
        assert unacknowledged_bytes(transport) > transport.get_write_buffer_size()
        started = loop.time()
        watch = Linger(transport)
        if pause_s is not None:
            threading.Thread(target=_reader, args=(peer, pause_s, got, done), daemon=True).start()
        await asyncio.wait_for(protocol.lost, 30)
        took = loop.time() - started
        watch.cancel()
        if pause_s is not None:
            await loop.run_in_executor(None, done.wait, 20)
        return got[0], took, protocol.lost.result() is not None or got[0] < PAYLOAD
    finally:
        transport.abort()
        peer.close()


def test_a_slow_peer_gets_every_last_byte_however_long_it_takes(monkeypatch) -> None:
    monkeypatch.setattr(linger, "LINGER_S", 0.3)
    # 16 KiB per 5 ms at most: 2 MiB take well over 0.6 s, twice the linger.
    got, took, cut = asyncio.run(_ended_connection(0.005))
    assert got == PAYLOAD and not cut
    assert took > 2 * linger.LINGER_S


def test_a_peer_that_reads_nothing_is_cut_once_nothing_moved_for_the_linger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linger, "LINGER_S", 0.3)
    _, took, cut = asyncio.run(_ended_connection(None))
    assert cut
    assert linger.LINGER_S <= took < linger.LINGER_S + 2


def test_a_peer_that_keeps_reading_a_little_is_cut_at_the_total_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes that keep moving, a few KiB at a time, hold the connection no longer than
    `MAX_LINGER_S` in all (the peer here would take over a second for the 2 MiB)."""
    monkeypatch.setattr(linger, "LINGER_S", 0.3)
    monkeypatch.setattr(linger, "MAX_LINGER_S", 0.6)
    got, took, cut = asyncio.run(_ended_connection(0.01))
    assert cut and got < PAYLOAD
    assert linger.MAX_LINGER_S <= took < linger.MAX_LINGER_S + 1
