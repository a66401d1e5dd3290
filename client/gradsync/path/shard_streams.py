"""A worker's data streams to the coordinator's shards 1..S-1 (on the transport's loop).

With a sharded coordinator the Welcome lists every shard; shard i aggregates
byte range i of every bucket. The worker keeps its Sync stream to the leader
(shard 0, range 0 and everything else) and opens one `Shard.Data` stream per
other shard, introduced by a `ShardHello` naming the job, rank, incarnation
and shard index and presenting the session secret of this rank's Welcome, so
that a shard admits only members the leader announced, on their own session.
Each stream has its own outgoing queue, so every range of a bucket is sent in
parallel, and the averages it returns land in the transport's `Inbox` like
the leader's (offsets are absolute).

A stream that fails is reported to the `Inbox` as a `ShardUnavailableError`
naming the shard, its address and gRPC's words, and is not raised at once: the
leader is the one authority on shard loss. It ends every rank's Sync stream with
END_REASON_SHARD_LOST, so that every rank sees the same error; raising at once
would close this rank's leader stream first, and its peers would see a lost peer
instead of a lost shard. `ShardFault` (the inbox holds one under its lock) keeps
the first such failure and says when the grace (3 heartbeat intervals plus a
margin, from the failure) is over; only then do waits raise it themselves.
Connecting is bounded too: a shard that does not accept the connection in time
counts as failed.
Streams are closed with a Leave (bounded), then cancelled, so that closing a
transport leaves no task, channel or thread behind. Each stream is a
`gradsync_proto.net.stream_client.StreamClient` whose pipe a `FrameDiscovery`
picks, as the Sync stream's is: frames where the shard offers a frame port,
gRPC where it does not (`on_message` then runs on the loop, or on the frame
socket's reader thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from gradsync_proto import auth, chunking
from gradsync_proto.codec import ChunkHeader, decode_gradient, header_of
from gradsync_proto.codes import Code
from gradsync_proto.net.address import Address, parse_address
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.frame_stream import FrameDiscovery
from gradsync_proto.net.stream_client import EndKind, StreamClient, StreamEnded
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync import defaults
from gradsync.errors import ShardUnavailableError
from gradsync.path.bucket_uploads import RangeUpload

log = logging.getLogger("gradsync.client")

#: Largest message the client accepts or sends: a chunk of the largest size a
#: coordinator may be configured with (64 MiB) plus its header. The coordinator's
#: own limit (announced in Welcome) is the binding one for uploads.
CLIENT_MAX_MESSAGE_BYTES = 64 * defaults.MIB + chunking.HEADER_SLACK_BYTES
SHARD_DATA_METHOD = "/gradsync.v1.Shard/Data"
#: How long closing waits for a shard to answer a Leave before cancelling.
LEAVE_TIMEOUT_S = 2.0


#: A ping every 1 s; its ack is awaited `keepalive_timeout_s` (a frozen coordinator is
#: found within that plus 1 s).
KEEPALIVE_TIME_MS = 1_000
#: Overrides `defaults.KEEPALIVE_TIMEOUT_S` (seconds), read when a channel is made.
ENV_KEEPALIVE_TIMEOUT_S = "GRADSYNC_KEEPALIVE_TIMEOUT_S"

#: Told (stream index, step, dtype, payload bytes) of every averaged chunk a stream brings.
Answered = Callable[[int, int, int, int], None]
#: Told (shard index, chunk) of every collective result chunk a stream brings.
CollectiveArrived = Callable[[int, pb.CollectiveChunk], None]
#: Told of every stream that failed (besides the inbox), on the thread that learns it.
StreamFailed = Callable[[ShardUnavailableError], None]


class Inbox(Protocol):
    """Where the shard streams' averages and failures go (`gradsync.control.inbox.Inbox`)."""

    shard_grace_margin_s: float

    @property
    def heartbeat_interval_s(self) -> float | None:
        """The heartbeat interval the coordinator asked for, once it said (else None)."""
        ...

    def on_averaged_chunk(self, chunk: ChunkHeader, payload: memoryview, source: str) -> None:
        """Take in an averaged chunk from shard `source`'s data stream."""

    def protocol_fault(self, what: str, source: str | None = None) -> None:
        """Record that the coordinator sent something invalid."""

    def shard_failed(self, error: ShardUnavailableError) -> None:
        """Record a failed shard data stream."""


#: A failed shard stream is raised this long (plus 3 heartbeat intervals) after
#: the failure if the leader has not ended the job by then.
SHARD_GRACE_MARGIN_S = 5.0


def shard_grace_s(heartbeat_interval_s: float | None, margin_s: float) -> float:
    """How long waits keep waiting for the leader after a shard stream failed."""
    return 3 * (heartbeat_interval_s or defaults.HEARTBEAT_INTERVAL_S) + margin_s


class ShardFault:
    """The first failed shard stream of a link, and its grace (no lock: the caller's)."""

    def __init__(self) -> None:
        self.error: ShardUnavailableError | None = None
        self.deadline = 0.0

    def record(self, error: ShardUnavailableError, now: float, grace_s: float) -> bool:
        """Keep `error` if it is the first; return whether it was."""
        if self.error is not None:
            return False
        self.error, self.deadline = error, now + grace_s
        return True

    def due(self, now: float) -> ShardUnavailableError | None:
        """The error to raise now (the grace is over), or None."""
        if self.error is not None and now >= self.deadline:
            return self.error
        return None

    def bound(self, now: float, remaining_s: float) -> float:
        """How long a wait may sleep: until its own deadline or the grace's end."""
        if self.error is None:
            return remaining_s
        return max(0.0, min(remaining_s, self.deadline - now))

    def pending_note(self) -> str:
        """A note for a timeout's message while a failure waits for the leader ("" if none)."""
        if self.error is None:
            return ""
        return f" (a shard failed and the leader has not said why yet: {self.error})"


def channel_options(environ: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """gRPC channel options shared by the leader's and the shards' channels.

    gRPC's reconnect backoff grows to 120 s by default: a worker started long
    before its coordinator would notice it minutes late, so it retries briskly.

    Keepalive pings find a coordinator that is there but frozen (SIGSTOP, a
    paused VM, a dead host whose connections the kernel has not yet reset):
    its kernel still accepts our bytes, so the stream alone would wait for the
    step timeout. gRPC's core answers pings on its own threads, so a
    coordinator busy in Python still answers; one that cannot answer within
    the keepalive timeout ends the stream UNAVAILABLE and the session moves
    on (to a standby that took over, README "Fault tolerance"). The
    coordinator allows pings this frequent (`gradsync_server.app.grpc_options`).

    A ping and its ack queue behind every byte in both socket buffers, so on a
    slow link shared by many ranks a healthy coordinator's ack can take
    seconds: `gradsync bench`'s 8 ranks on one 200 Mbit/s coordinator link
    lost a stream to a 3 s timeout. Hence `defaults.KEEPALIVE_TIMEOUT_S`, and
    `GRADSYNC_KEEPALIVE_TIMEOUT_S` for slower links (README, Known limits).

    Raises:
        ValueError: `GRADSYNC_KEEPALIVE_TIMEOUT_S` is not a number of seconds >= 1.
    """
    timeout_ms = round(keepalive_timeout_s(os.environ if environ is None else environ) * 1000)
    return [
        ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", CLIENT_MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # gRPC >= 1.5x waits for a ping's ack this long (default 1 min), whatever the
        # keepalive timeout says: measured, without it a frozen peer went unnoticed.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.dns_min_time_between_resolutions_ms", 1000),
    ]


def keepalive_timeout_s(environ: Mapping[str, str]) -> float:
    """How long a worker waits for a ping's ack before it gives the coordinator up.

    Raises:
        ValueError: `GRADSYNC_KEEPALIVE_TIMEOUT_S` is set but not a number >= 1.
    """
    raw = environ.get(ENV_KEEPALIVE_TIMEOUT_S)
    if raw is None or raw == "":
        return defaults.KEEPALIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:  # also refuses NaN
        raise ValueError(f"{ENV_KEEPALIVE_TIMEOUT_S}={raw!r}: expected a number of seconds >= 1")
    return value


def shard_target(address: str, leader_target: str) -> str:
    """The gRPC target of a shard announced as `address`.

    ":port" means the host this worker reached the leader at (the leader does
    not know which of its names or addresses a worker used); anything else is
    a full "host:port". IPv6 hosts come out in brackets.

    Raises:
        ValueError: either address is not a usable "host:port".
    """
    if address.startswith(":"):
        port = parse_address(f"placeholder{address}").port
        return str(Address(parse_address(leader_target).host, port))
    return str(parse_address(address))


def shard_targets(shards: Sequence[pb.ShardAddress], leader_target: str) -> dict[int, str]:
    """{index: gRPC target} of every shard but the leader, from Welcome.shards.

    Raises:
        ValueError: the list is not shards 0..S-1 each once, or an address is unusable.
    """
    indexes = sorted(shard.index for shard in shards)
    if indexes != list(range(len(shards))):
        raise ValueError(f"the shard list has indexes {indexes}, expected 0..{len(shards) - 1}")
    targets = {}
    for shard in shards:
        if shard.index == 0:
            continue
        try:
            targets[shard.index] = shard_target(shard.address, leader_target)
        except ValueError as exc:
            raise ValueError(f"shard {shard.index} has address {shard.address!r}: {exc}") from None
    return targets


class ShardStream:
    """One `Shard.Data` stream: a `StreamClient` whose end is a failed shard (loop thread).

    Args:
        streams: the set it belongs to (its inbox, encoder, closing flag, answer
            clock and security are every stream's).
        index: the shard's index.
        target: its gRPC target.
        hello: the stream's first message (WorkerMessage{shard_hello}).
        connect_timeout_s: how long the shard gets to accept the connection.
    """

    def __init__(
        self,
        streams: ShardStreams,
        index: int,
        target: str,
        hello: pb.WorkerMessage,
        connect_timeout_s: float,
    ) -> None:
        self.index = index
        self.target = target
        self._rank = hello.shard_hello.rank
        self._streams = streams
        #: The shard's announcement of why it ends the stream, if it sent one.
        self._end: pb.StreamEnd | None = None
        self.name = f"shard {index} at {target}"
        # wait_for_ready: the shard may still be starting; connect_timeout_s bounds it.
        self._stream = StreamClient(
            target,
            SHARD_DATA_METHOD,
            self._on_message,
            self._on_end,
            security=streams.security,
            options=channel_options(),
            encode=self._messages,
            connect_timeout_s=connect_timeout_s,
            name=f"shard-{index}",
            discovery=FrameDiscovery(CLIENT_MAX_MESSAGE_BYTES),
        )
        self._stream.send(hello)

    def start(self) -> None:
        """Open the channel and the stream (returns at once; must run on the loop)."""
        self._stream.start()

    def put(self, part: object) -> None:
        """Queue a range of a bucket (or another upload) for this shard (loop thread)."""
        self._stream.send(part)

    async def close(self, timeout_s: float) -> None:
        """Say goodbye (bounded), then cancel the stream and close the channel."""
        leave = pb.WorkerMessage(leave=pb.Leave(reason="closed by the worker"))
        await self._stream.close(min(timeout_s, LEAVE_TIMEOUT_S), farewell=leave)

    def _messages(self, item: object) -> Iterator[bytes]:
        if isinstance(item, RangeUpload):
            return self._streams.encode(item)
        if isinstance(item, pb.WorkerMessage):
            return iter((item.SerializeToString(),))
        if self._streams.encode_other is None:
            raise TypeError(f"{self.name}: nothing encodes a {type(item).__name__}")
        return self._streams.encode_other(item)  # a process group's collective input

    def _on_message(self, raw: bytes) -> None:
        fast = decode_gradient(raw)
        if fast is not None:
            header, payload = fast
            self._streams.answered(self.index, header.step, header.dtype, len(payload))
            self._streams.inbox.on_averaged_chunk(header, payload, source=self.name)
            return
        message = pb.CoordinatorMessage.FromString(raw)
        kind = message.WhichOneof("kind")
        if kind == "gradient":
            chunk = message.gradient
            payload = memoryview(chunk.payload)
            self._streams.inbox.on_averaged_chunk(header_of(chunk), payload, self.name)
        elif kind == "collective" and self._streams.on_collective is not None:
            self._streams.on_collective(self.index, message.collective)
        elif kind == "stream_end":
            self._end = message.stream_end  # kept to name the cause with the status
        else:  # the leader's business (heartbeats, membership): nothing for a data stream
            log.debug("rank %s: %s sent %s, ignored", self._rank, self.name, kind)

    def _on_end(self, ended: StreamEnded) -> None:
        """Report a stream that ended while the transport was not closing as a lost shard."""
        if ended.kind is EndKind.CLOSED or ended.closing or self._streams.closing():
            return
        status: Code | None = None
        why = ended.details
        if ended.clean:
            why = "the shard ended the stream"
        elif ended.kind is EndKind.FAULT:
            why = f"unexpected error on the stream: {ended.details}"
        else:
            with contextlib.suppress(ValueError):  # else a code this client does not know
                status = Code(ended.code)
        if status is not None:
            why = f"{status.name}: {why}"
        if self._end is not None and self._end.message:
            why = f"{why} ({self._end.message})"
        error = ShardUnavailableError(
            f"the data stream to {self.name} failed: {why}",
            rank=self._rank,
            code=status,
            shard_index=self.index,
            shard_address=self.target,
        )
        if self._streams.on_failed is not None:
            self._streams.on_failed(error)
        self._streams.inbox.shard_failed(error)


class ShardStreams:
    """The data streams of one link to every shard but the leader (loop thread).

    Args:
        leader_target: the leader's gRPC target (":port" shards share its host).
        inbox: where averages and a stream's failure go.
        encode: the serialized chunks of a range upload (the transport's, so
            both kinds of stream stamp the same chunk size and epoch).
        closing: true once the transport is closing (an end is then no failure).
        answered: told (index, step, dtype, payload bytes) of every averaged chunk
            (the upload pacer's clock, `gradsync.path.pacing`).
        security: TLS and token, as to the leader (shards share its CA and token).
        encode_other: the serialized chunks of any other upload (a process group's
            collective input to a shard's range, `gradsync.distributed.shard_routes`).
        on_collective: told of every collective result chunk a shard sends.
        on_failed: told of every stream that fails (the inbox is told too).
    """

    def __init__(
        self,
        leader_target: str,
        inbox: Inbox,
        encode: Callable[[RangeUpload], Iterator[bytes]],
        closing: Callable[[], bool],
        answered: Answered,
        security: ChannelSecurity | None = None,
        *,
        encode_other: Callable[[object], Iterator[bytes]] | None = None,
        on_collective: CollectiveArrived | None = None,
        on_failed: StreamFailed | None = None,
    ) -> None:
        self.security = security
        self.encode_other = encode_other
        self.on_collective = on_collective
        self.on_failed = on_failed
        self.answered = answered
        self._leader_target = leader_target
        self.inbox = inbox
        self.encode = encode
        self.closing = closing
        self.streams: dict[int, ShardStream] = {}

    def open(self, welcome: pb.Welcome, join: pb.Join) -> None:
        """Open a stream to every shard of `welcome` but the leader, introduced as `join`'s member.

        An unusable shard list is a protocol fault (recorded in the inbox).
        """
        if not welcome.shards:
            return
        try:
            targets = shard_targets(welcome.shards, self._leader_target)
        except ValueError as exc:
            self.inbox.protocol_fault(f"the Welcome's shard list is unusable: {exc}")
            return
        # Connecting gets the same bound as a failed stream's grace: by then the
        # leader has noticed a shard that is not there.
        connect_timeout_s = shard_grace_s(
            self.inbox.heartbeat_interval_s, self.inbox.shard_grace_margin_s
        )
        for index, target in sorted(targets.items()):
            hello = pb.ShardHello(
                job_id=join.job_id,
                rank=join.rank,
                incarnation=join.incarnation,
                shard_index=index,
                # The shard admits the stream only with this shard's derivative of the
                # secret the leader issued to this rank at its Join (the incarnation alone
                # is public: Status shows it; the secret itself never reaches a shard).
                session=auth.shard_session(welcome.session, index),
            )
            hello_message = pb.WorkerMessage(shard_hello=hello)
            stream = ShardStream(self, index, target, hello_message, connect_timeout_s)
            stream.start()
            self.streams[index] = stream
        log.info(
            "rank %d: sharded coordinator, %d shards: %s",
            join.rank,
            len(welcome.shards),
            ", ".join(f"{index} at {target}" for index, target in sorted(targets.items())),
        )

    def send(self, index: int, part: object) -> bool:
        """Queue a range of a bucket (or another upload `encode_other` takes) on shard
        `index`'s stream; return False when none is open (dropped)."""
        stream = self.streams.get(index)
        if stream is None:
            return False
        stream.put(part)
        return True

    async def close(self, timeout_s: float) -> None:
        """Close every stream in parallel (each bounded)."""
        await asyncio.gather(*(stream.close(timeout_s) for stream in self.streams.values()))
