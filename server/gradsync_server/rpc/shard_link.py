"""A coordinator shard's control stream to its leader (`Coordinator.ShardLink`).

The shard registers (`ShardRegister`: version, advertised address, chunk
size, message limit), then follows the leader's job views, aborts and job
ends, sends its counters (`ShardStats`) every heartbeat interval as its sign
of life, and reports the worker messages it refused (`ShardRejected`).

A refusal at registration (a version or configuration mismatch, one shard
too many) is final: `run` returns the leader's message and the process exits
2 with it, since retrying cannot fix a flag. Anything else that ends the
stream (the leader unreachable, its stream ending, silence beyond the
heartbeat timeout) means the leader is lost: every data stream ends
UNAVAILABLE with reason SHARD_LOST, every job is forgotten, and the shard
registers again with a growing pause, for as long as the process lives.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from gradsync_proto import __version__
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.rpc.shard_servicer import ShardServicer
from gradsync_server.shard_config import UNREACHABLE_REPORT_PERIOD_S

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
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
_CODE_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}
#: First pause before registering again after losing the leader.
_FIRST_BACKOFF_S = 0.1
#: Bound on the wait for the link's reader and writer to end once cancelled.
TASK_END_TIMEOUT_S = 5.0


class Refused(Exception):
    """The leader refused the registration; `message` names the flag and both values."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Away(Exception):
    """The leader answered the registration with something other than a verdict: retry."""


class LeaderLink:
    """Registers a shard with its leader and keeps following it.

    Args:
        servicer: the shard's jobs and data streams, which the leader's messages drive.
    """

    def __init__(self, servicer: ShardServicer) -> None:
        self._servicer = servicer
        self._config = servicer.config
        config = self._config
        # The shard's own certificate doubles as its client certificate (mTLS leaders).
        self._security = ChannelSecurity.resolve(
            config.tls_ca,
            config.tls_cert if config.tls_ca else None,
            config.tls_key if config.tls_ca else None,
            config.token,
            environ={},
        )
        #: Set while the leader has accepted this shard.
        self.registered = asyncio.Event()

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
            try:
                why, accepted = await self._session()
            except Refused as refused:
                log.error("the leader %s refused this shard: %s", self._config.leader, refused)
                return refused.message
            if accepted:
                self._servicer.on_leader_lost(why)
                backoff = _FIRST_BACKOFF_S
                log.warning("lost the leader %s (%s); registering again", self._config.leader, why)
            elif loop.time() - last_report >= UNREACHABLE_REPORT_PERIOD_S:
                last_report = loop.time()
                log.warning(
                    "cannot register with the leader %s (%s); retrying", self._config.leader, why
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._config.reconnect_backoff_max_s)

    async def _session(self) -> tuple[str, bool]:
        """One control stream: (why it ended, whether the leader had accepted the shard).

        Raises:
            Refused: the leader refused the registration.
        """
        config = self._config
        channel = self._security.aio_channel(
            config.leader,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
            ],
        )
        accepted = False
        try:
            call = channel.stream_stream(
                METHOD,
                request_serializer=pb.ShardMessage.SerializeToString,
                response_deserializer=pb.LeaderMessage.FromString,
            )(metadata=self._security.metadata)
            try:
                answer = await self._first_answer(call)
                self._servicer.on_accepted(answer)
                accepted = True
                self.registered.set()
                return await self._follow(call, answer), True
            except grpc.aio.AioRpcError as exc:
                if not accepted and exc.code() in REFUSAL_CODES:
                    raise Refused(exc.details() or exc.code().name) from None
                if not accepted and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    await self._refuse_on_handshake_failure()
                return f"{exc.code().name}: {exc.details()}", accepted
            except TimeoutError:
                return f"no answer within {config.register_timeout_s:g}s", accepted
            except _Away as away:
                return str(away), accepted
            finally:
                call.cancel()
        finally:
            self.registered.clear()
            await channel.close()

    async def _refuse_on_handshake_failure(self) -> None:
        """Raise Refused when TLS, not the network, keeps the leader out of reach.

        A leader that is away is waited for; a certificate that does not fit
        would be retried for ever, so it stops the shard (exit 2) naming the cause.
        """
        failure = await asyncio.to_thread(handshake_failure, self._config.leader, self._security)
        if failure is not None:
            raise Refused(
                f"no TLS connection to the leader {self._config.leader}: {failure} "
                "(a shard's flags: --tls-ca, and --tls-cert / --tls-key as its client "
                "certificate)"
            )

    async def _first_answer(self, call: grpc.aio.StreamStreamCall) -> pb.ShardAccepted:
        """Register and read the leader's answer (bounded).

        Raises:
            Refused: the leader refused the registration.
            grpc.aio.AioRpcError, TimeoutError, _Away: the leader is not there (try again).
        """
        timeout_s = self._config.register_timeout_s
        await asyncio.wait_for(call.write(self._register()), timeout_s)
        answer = await asyncio.wait_for(call.read(), timeout_s)
        if answer is grpc.aio.EOF:
            code = await asyncio.wait_for(call.code(), timeout_s)
            details = await asyncio.wait_for(call.details(), timeout_s)
            if code in REFUSAL_CODES:
                raise Refused(details or code.name)
            raise _Away(f"the leader ended the stream with {code.name}: {details}")
        kind = answer.WhichOneof("kind")
        if kind == "stream_end":
            end = answer.stream_end
            if _CODE_BY_VALUE.get(end.code) in REFUSAL_CODES:
                raise Refused(end.message)
            raise _Away(f"the leader ended the stream: {end.message}")
        if kind != "accepted":
            raise _Away(f"the leader answered ShardRegister with {kind}")
        return answer.accepted  # type: ignore[no-any-return]

    async def _follow(self, call: grpc.aio.StreamStreamCall, accepted: pb.ShardAccepted) -> str:
        """Read the leader's messages and write ours until either side fails; return why."""
        reader = asyncio.create_task(self._read(call, accepted.heartbeat_timeout_s))
        writer = asyncio.create_task(
            self._write(call, accepted.heartbeat_interval_s, accepted.heartbeat_timeout_s)
        )
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            # Cancel the call first: a read or write that grpc still holds then ends at
            # once, so the tasks can finish; the wait for them is bounded all the same
            # (a shard stopping must never hang on its leader link).
            call.cancel()
            for task in (reader, writer):
                task.cancel()
            await asyncio.wait({reader, writer}, timeout=TASK_END_TIMEOUT_S)

    async def _read(self, call: grpc.aio.StreamStreamCall, timeout_s: float) -> str:
        servicer = self._servicer
        while True:
            try:
                message = await asyncio.wait_for(call.read(), timeout_s)
            except TimeoutError:
                return f"silent for more than the heartbeat timeout of {timeout_s:g}s"
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            if message is grpc.aio.EOF:
                return "it ended the control stream"
            kind = message.WhichOneof("kind")
            if kind == "job":
                servicer.on_view(message.job)
            elif kind == "abort":
                servicer.on_abort(message.abort)
            elif kind == "job_end":
                servicer.on_job_end(message.job_end)
            elif kind == "stream_end":
                end = message.stream_end
                code = _CODE_BY_VALUE.get(end.code, grpc.StatusCode.UNKNOWN)
                return f"it ended the control stream ({code.name}: {end.message})"
            elif kind == "accepted":
                servicer.on_accepted(message.accepted)

    async def _write(
        self, call: grpc.aio.StreamStreamCall, interval_s: float, timeout_s: float
    ) -> str:
        """Send rejections as they come and stats every `interval_s` (the sign of life)."""
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
            try:
                await asyncio.wait_for(call.write(message), timeout_s)
            except TimeoutError:
                return f"a write to it took longer than the heartbeat timeout of {timeout_s:g}s"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the stream failed under us: the leader is lost
                return f"writing to it failed: {exc}"
