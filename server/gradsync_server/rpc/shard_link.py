"""A coordinator shard's control stream to its leader (`Coordinator.ShardLink`).

The shard registers (`ShardRegister`: version, advertised address, chunk
size, message limit), then follows the leader's job views, aborts and job
ends, sends its counters (`ShardStats`) every heartbeat interval as its sign
of life, and reports the worker messages it refused (`ShardRejected`).

A refusal at registration (a version or configuration mismatch, one shard
too many, a wrong shard token) is final: `run` returns the leader's message
and the process exits 2 with it, since retrying cannot fix a flag. ALREADY_EXISTS
is not: a shard restarted at its address may be faster than the leader's
notice that its predecessor is gone, so it tries again until that happens.
Anything else that ends the stream (the leader unreachable, its stream
ending, silence beyond the heartbeat timeout) means the leader is lost: every data stream ends
UNAVAILABLE with reason SHARD_LOST, every job is forgotten, and the shard
registers again with a growing pause, for as long as the process lives.
Every wait is bounded.

The stream itself (channel, call, reader, writer, bounds, cancellation) is a
`gradsync_proto.net.stream_client.StreamClient`, as the worker's streams are.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from gradsync_proto import __version__
from gradsync_proto.net.addresses import AddressRotation
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure
from gradsync_proto.net.stream_client import EndKind, StreamClient, StreamEnded
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.defaults import UNREACHABLE_REPORT_PERIOD_S
from gradsync_server.rpc.servicer import STATUS_BY_CODE
from gradsync_server.rpc.shard_role import ShardRole

log = logging.getLogger("gradsync.shard")

METHOD = "/gradsync.v1.Coordinator/ShardLink"
#: Status codes that refuse a registration for good (a flag must change); any other
#: failure is the leader being away, and the shard tries again.
REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
#: First pause before registering again after losing the leader.
_FIRST_BACKOFF_S = 0.1
#: Bound on the wait for the stats pump to end once cancelled.
TASK_END_TIMEOUT_S = 5.0


class Refused(Exception):
    """The leader refused the registration; `message` names the flag and both values."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Unreachable(Exception):
    """The stream failed UNAVAILABLE before the leader answered: perhaps TLS, not the network."""


class LeaderLink:
    """Registers a shard with its leader and keeps following it.

    Args:
        servicer: the shard's jobs and data streams, which the leader's messages drive.
    """

    def __init__(self, servicer: ShardRole) -> None:
        self._servicer = servicer
        self._config = servicer.config
        #: `--leader a:1,b:2` (a standby leader): the active one is found by trying each.
        self._leaders = AddressRotation(servicer.config.leader)
        config = self._config
        # The shard's own certificate doubles as its client certificate (mTLS leaders),
        # and it presents the shard token, which the workers' token cannot stand in for.
        self._security = ChannelSecurity.resolve(
            config.tls_ca,
            config.tls_cert if config.tls_ca else None,
            config.tls_key if config.tls_ca else None,
            config.shard_token,
            environ={},
        )
        #: Set while the leader has accepted this shard.
        self.registered = asyncio.Event()
        # The current session's: the leader's acceptance (None until then), the
        # stream, and how it ends (a reason, or the exception `_session` raises).
        self._accepted: pb.ShardAccepted | None = None
        self._stream: StreamClient | None = None
        self._outcome: asyncio.Future[str | BaseException] | None = None

    def _register(self) -> pb.ShardMessage:
        config = self._config
        return pb.ShardMessage(
            register=pb.ShardRegister(
                version=__version__,
                advertise=self._servicer.advertise,
                chunk_bytes=config.chunk_bytes or 0,  # 0: the leader's, whatever it is
                max_message_bytes=config.max_message_bytes,
            )
        )

    async def run(self) -> str:
        """Follow the leader until refused; return the leader's refusal message.

        Cancel the task to stop it (the shard shuts down).
        """
        backoff = _FIRST_BACKOFF_S
        loop = asyncio.get_running_loop()
        last_report = -UNREACHABLE_REPORT_PERIOD_S
        while True:
            leader = self._leaders.current()
            try:
                why, accepted = await self._session(leader)
            except Refused as refused:
                log.error("the leader %s refused this shard: %s", leader, refused)
                return refused.message
            if accepted:
                self._servicer.on_leader_lost(why)
                backoff = _FIRST_BACKOFF_S
                log.warning("lost the leader %s (%s); registering again", leader, why)
            elif loop.time() - last_report >= UNREACHABLE_REPORT_PERIOD_S:
                last_report = loop.time()
                log.warning("cannot register with the leader %s (%s); retrying", leader, why)
            # Several leaders (one active, the others standbys answering UNAVAILABLE):
            # try the next one; the pause grows once per pass over all of them.
            self._leaders.advance()
            await asyncio.sleep(backoff)
            if self._leaders.wrapped:
                backoff = min(backoff * 2, self._config.reconnect_backoff_max_s)

    async def _session(self, leader: str) -> tuple[str, bool]:
        """One control stream to `leader`: (why it ended, whether it had accepted the shard).

        Raises:
            Refused: the leader refused the registration.
        """
        config = self._config
        register_timeout_s = config.register_timeout_s
        self._accepted = None
        self._outcome = outcome = asyncio.get_running_loop().create_future()
        # Not wait_for_ready: a leader that is not there fails the call at once
        # (UNAVAILABLE), and a TLS handshake that fails is then named.
        self._stream = stream = StreamClient(
            leader,
            METHOD,
            self._on_message,
            self._on_end,
            security=self._security,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ],
            serializer=pb.ShardMessage.SerializeToString,
            deserializer=pb.LeaderMessage.FromString,
            wait_for_ready=False,
            idle_timeout_s=register_timeout_s,  # the register write and the first answer
            write_timeout_s=register_timeout_s,
            name="leader-link",
        )
        stream.send(self._register())
        stream.start()
        pump = asyncio.ensure_future(self._send_stats(stream))
        try:
            done, _ = await asyncio.wait({outcome, pump}, return_when=asyncio.FIRST_COMPLETED)
            result = done.pop().result()  # the pump only ends by raising
            if isinstance(result, _Unreachable):
                await self._refuse_on_handshake_failure(leader)
                return str(result), False
            if isinstance(result, BaseException):
                raise result
            return result, self._accepted is not None
        finally:
            self.registered.clear()
            pump.cancel()
            await asyncio.wait({pump}, timeout=TASK_END_TIMEOUT_S)
            await stream.close(0)

    def _conclude(self, outcome: str | BaseException) -> None:
        """End the session with a reason (or an exception for `_session`); the first counts."""
        if self._outcome is not None and not self._outcome.done():
            self._outcome.set_result(outcome)

    async def _refuse_on_handshake_failure(self, leader: str) -> None:
        """Raise Refused when TLS, not the network, keeps the leader out of reach.

        A leader that is away is waited for; a certificate that does not fit
        would be retried for ever, so it stops the shard (exit 2) naming the cause.
        """
        failure = await asyncio.to_thread(handshake_failure, leader, self._security)
        if failure is not None:
            raise Refused(
                f"no TLS connection to the leader {leader}: {failure} "
                "(a shard's flags: --tls-ca, and --tls-cert / --tls-key as its client "
                "certificate)"
            )

    def _on_message(self, message: pb.LeaderMessage) -> None:
        """Follow the answer to ShardRegister, then the jobs (loop thread: the reader)."""
        if self._outcome is None or self._outcome.done():
            return  # the session is ending: nothing more to follow
        kind = message.WhichOneof("kind")
        servicer = self._servicer
        if self._accepted is None:
            self._on_answer(message, kind)
        elif kind == "job":
            servicer.on_view(message.job)
        elif kind == "abort":
            servicer.on_abort(message.abort)
        elif kind == "job_end":
            servicer.on_job_end(message.job_end)
        elif kind == "stream_end":
            end = message.stream_end
            code = STATUS_BY_CODE.get(end.code, grpc.StatusCode.UNKNOWN)
            self._conclude(f"it ended the control stream ({code.name}: {end.message})")
        elif kind == "accepted":
            servicer.on_accepted(message.accepted)

    def _on_answer(self, answer: pb.LeaderMessage, kind: str | None) -> None:
        """The leader's first message: acceptance, a refusal, or something else (retry)."""
        if kind == "stream_end":
            end = answer.stream_end
            if STATUS_BY_CODE.get(end.code) in REFUSAL_CODES:
                self._conclude(Refused(end.message))
            else:
                self._conclude(f"the leader ended the stream: {end.message}")
        elif kind != "accepted":
            self._conclude(f"the leader answered ShardRegister with {kind}")
        else:
            accepted = answer.accepted
            self._servicer.on_accepted(accepted)
            self._accepted = accepted
            # From now on the leader's heartbeat timeout bounds its silence and every write.
            assert self._stream is not None
            self._stream.idle_timeout_s = accepted.heartbeat_timeout_s
            self._stream.write_timeout_s = accepted.heartbeat_timeout_s
            self.registered.set()

    def _on_end(self, ended: StreamEnded) -> None:
        """However the stream ended, in the words of the shard's log and its data streams."""
        code = STATUS_BY_CODE.get(ended.code, grpc.StatusCode.UNKNOWN)
        status = f"{code.name}: {ended.details}"
        if ended.kind is EndKind.FAULT and ended.cause is not None:
            self._conclude(ended.cause)  # a handler's bug: raised, as it always was
        elif ended.kind is EndKind.CLOSED:
            self._conclude(ended.details)
        elif self._accepted is None:
            if ended.kind is EndKind.TIMEOUT:
                self._conclude(f"no answer within {self._config.register_timeout_s:g}s")
            elif code in REFUSAL_CODES:
                self._conclude(Refused(ended.details or code.name))
            elif code is grpc.StatusCode.UNAVAILABLE:
                self._conclude(_Unreachable(status))
            else:
                self._conclude(
                    f"the leader ended the stream with {status}" if ended.clean else status
                )
        elif ended.kind is EndKind.TIMEOUT:
            timeout_s = self._accepted.heartbeat_timeout_s
            if ended.bound == "write":
                self._conclude(
                    f"a write to it took longer than the heartbeat timeout of {timeout_s:g}s"
                )
            else:
                self._conclude(f"silent for more than the heartbeat timeout of {timeout_s:g}s")
        else:
            self._conclude("it ended the control stream" if ended.clean else status)

    async def _send_stats(self, stream: StreamClient) -> None:
        """Once accepted: hand over rejections as they come, stats every heartbeat interval."""
        await self.registered.wait()
        assert self._accepted is not None
        interval_s = self._accepted.heartbeat_interval_s
        servicer = self._servicer
        loop = asyncio.get_running_loop()
        next_stats = loop.time()
        while True:
            try:
                message = await asyncio.wait_for(
                    servicer.to_leader.get(), max(0.0, next_stats - loop.time())
                )
            except TimeoutError:
                message = pb.ShardMessage(stats=servicer.stats())
                next_stats = loop.time() + interval_s
            stream.send(message)
