"""A worker's heartbeats on the connection that carries no gradient bytes.

On a slow link a worker's frame socket can hold seconds of gradient bytes in
its send queue; a Heartbeat on the Sync stream waits behind them, and the
coordinator would declare a busy rank dead. So, once the Welcome issued the
rank's session secret and while the Sync stream runs on frames, every
heartbeat also goes as a unary `Coordinator.Beat` call on the frame pipe's
gRPC side channel (`StreamClient.side_channel`, open anyway for keepalive
pings), which no bulk data travels on. Each beat carries a sequence and a MAC
keyed with the session (`gradsync_proto.auth.beat_proof`): the coordinator
counts it only when both check out.

On the gRPC pipe (no frame port) the Sync stream's Heartbeat is the only one,
as before. A coordinator without `Beat` (UNIMPLEMENTED) turns this off; any
other failure is logged and the next interval tries again. At most one call
is in flight, bounded by the heartbeat interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from gradsync_proto import auth
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.stream_client import StreamClient
from gradsync_proto.v1 import gradsync_pb2 as pb

log = logging.getLogger("gradsync.client")

__all__ = ["BEAT_METHOD", "SideBeats"]

BEAT_METHOD = "/gradsync.v1.Coordinator/Beat"


class SideBeats:
    """Sends `Beat`s for one Sync stream (all on its loop).

    Args:
        stream: the Sync stream (its side channel carries the beats).
        rank: this worker's rank.
        security: the token every call presents.
        welcome: the Welcome once there is one (its job, rank and session).
        step: the step to report.
    """

    def __init__(
        self,
        stream: StreamClient,
        rank: int,
        security: ChannelSecurity,
        welcome: Callable[[], pb.Welcome | None],
        step: Callable[[], int],
    ) -> None:
        self._stream = stream
        self._rank = rank
        self._security = security
        self._welcome = welcome
        self._step = step
        self._sequence = 0
        self._in_flight: asyncio.Task[None] | None = None
        #: False once the coordinator said it has no `Beat`.
        self.enabled = True
        #: Beats the coordinator accepted (for tests and logs).
        self.accepted = 0

    def beat(self, timeout_s: float) -> bool:
        """Start one beat if it can go now; whether it was started."""
        if not self.enabled or (self._in_flight is not None and not self._in_flight.done()):
            return False
        welcome = self._welcome()
        channel = self._stream.side_channel
        if welcome is None or not welcome.session or channel is None:
            return False
        self._sequence += 1
        step = self._step()
        request = pb.BeatRequest(
            job_id=welcome.job_id,
            rank=self._rank,
            sequence=self._sequence,
            step=step,
            proof=auth.beat_proof(
                welcome.session, welcome.job_id, self._rank, self._sequence, step
            ),
        )
        self._in_flight = asyncio.create_task(self._call(channel, request, timeout_s))
        return True

    async def _call(
        self, channel: grpc.aio.Channel, request: pb.BeatRequest, timeout_s: float
    ) -> None:
        call = channel.unary_unary(
            BEAT_METHOD,
            request_serializer=pb.BeatRequest.SerializeToString,
            response_deserializer=pb.BeatReply.FromString,
        )
        try:
            await call(request, metadata=self._security.metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.enabled = False
                log.info(
                    "rank %d: the coordinator has no Beat; heartbeats ride the Sync stream only",
                    request.rank,
                )
            else:
                log.debug(
                    "rank %d: beat %d: %s %s",
                    request.rank,
                    request.sequence,
                    exc.code().name,
                    exc.details(),
                )
            return
        except Exception as exc:  # the channel closed under the call (the stream ended)
            log.debug("rank %d: beat %d failed: %r", request.rank, request.sequence, exc)
            return
        self.accepted += 1

    async def stop(self) -> None:
        """Cancel a beat in flight and wait for it."""
        task, self._in_flight = self._in_flight, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
