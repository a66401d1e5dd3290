"""A live fuzzer: random and mutated messages against a real `gradsync serve` process.

This module drives the run: `run_fuzz` starts a coordinator
(`support.fuzz_coordinator.LiveCoordinator`) on loopback, then `Fuzzer` opens
many concurrent raw Sync streams, Status calls and ShardLink streams and
sends what a hostile or broken worker might (the bytes come from
`support.fuzz_messages.Messages`): random bytes, truncated and bit-flipped
protobufs, Joins with mutated fields, gradient chunks with every header field
at its edges, checkpoint, state, collective, abandon and join() messages with
absurd sizes, offsets, steps, epochs and strings. Pairs of streams join the
same fuzz job so that most messages meet a *running* job rather than the
"first message must be a Join" check. Alongside, a well-behaved two-rank job
(`legit`) runs steps and checks every average bit for bit.

Token mode (`token=`): the coordinator is started with $GRADSYNC_TOKEN and
the legit job and most calls present that token; about one call in ten
presents none or a wrong one, and such a call must end UNAUTHENTICATED
without a single reply message.

What it records (`support.fuzz_coordinator.FuzzReport`), for the caller to
assert: every status code (a histogram), violations (UNKNOWN, a non-OK status
without a message, a stream the coordinator ended with OK although the client
neither left nor half-closed, a stream that never ended after the client
half-closed, a Status call failing without a message, a forged log line, an
unauthenticated call answered otherwise than UNAUTHENTICATED or an
authenticated one refused), whether the coordinator is alive, its RSS
(VmRSS) after warm-up, at the end and at its peak, and how many legit steps
completed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from gradsync_proto import auth
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.fuzz_coordinator import FuzzReport, LiveCoordinator, rss_kib, scan_log
from support.fuzz_messages import Messages
from support.rawclient import BUCKET_BYTES, CHUNK, RawWorker, assembled_job, run_step


def is_leave(raw: bytes) -> bool:
    """Whether the coordinator reads `raw` as a Leave.

    Parsed, not matched by its first byte: a mutated message whose last field is a Leave
    is one (the last of a oneof's fields wins), and the coordinator may end that stream OK.
    """
    try:
        return pb.WorkerMessage.FromString(raw).WhichOneof("kind") == "leave"
    except DecodeError:  # not a message at all
        return False


__all__ = ["FuzzReport", "Fuzzer", "LiveCoordinator", "StreamPlan", "fuzz", "run_fuzz"]

SYNC = "/gradsync.v1.Coordinator/Sync"
STATUS = "/gradsync.v1.Coordinator/Status"
SHARD_LINK = "/gradsync.v1.Coordinator/ShardLink"
CLIENT_ARTIFACT = "Internal error from Core"
#: In token mode, the share of calls that present no token or a wrong one.
UNAUTHENTICATED_SHARE = 0.1
#: How long a stream without the token waits after its first message for the refusal.
UNAUTHENTICATED_WAIT_S = 2.0


@dataclass
class StreamPlan:
    job_id: str
    rank: int
    count: int
    join: bool
    broadcast: bool = False
    pair: bool = False


class Fuzzer:
    """Runs the streams, Status calls and the legit job against one coordinator."""

    def __init__(
        self, address: str, report: FuzzReport, seed: int, token: str | None = None
    ) -> None:
        self.address = address
        self.report = report
        self.rng = random.Random(seed)
        self.messages = Messages(self.rng)
        self.token = token
        self._job_counter = 0

    def credentials(self) -> tuple[tuple[tuple[str, str], ...], bool]:
        """The next call's metadata, and whether it carries the coordinator's token.

        Without a token (no token mode) nothing is drawn, so such runs repeat
        exactly. In token mode about one call in ten carries no token, a random
        one, a near miss (one character off, cut short, extended), an empty one
        or the token under another metadata key.
        """
        token = self.token
        if token is None:
            return (), True
        rng = self.rng
        if rng.random() >= UNAUTHENTICATED_SHARE:
            return auth.metadata(token), True
        self.report.unauth_calls += 1
        index = rng.randrange(len(token))
        flipped = "A" if token[index] != "A" else "B"
        wrong = [
            (),
            auth.metadata(base64.urlsafe_b64encode(rng.randbytes(32)).decode().rstrip("=")),
            auth.metadata(token[:index] + flipped + token[index + 1 :]),
            auth.metadata(token[:-1]),
            auth.metadata(token + "A"),
            ((auth.METADATA_KEY, auth.SCHEME),),
            (("x-gradsync-token", auth.SCHEME + token),),
        ]
        return rng.choice(wrong), False

    def judge_unauthenticated(
        self, where: str, code: grpc.StatusCode, details: str, replies: int
    ) -> None:
        """A call without the right token must end UNAUTHENTICATED, with no reply before."""
        report = self.report
        if details == CLIENT_ARTIFACT:
            report.codes["INTERNAL (client wrote after the end)"] += 1
        else:
            report.codes[code.name] += 1
            report.reasons[f"{code.name}: {re.sub(r'[0-9]+', 'N', details)[:70]}"] += 1
        if code is grpc.StatusCode.UNAUTHENTICATED and details.strip() and not replies:
            report.unauth_refused += 1
            return
        report.note(
            f"{where} without the right token: {code.name} {details[:200]!r} after "
            f"{replies} reply message(s) (must be UNAUTHENTICATED, with a message and no reply)"
        )

    async def stream(self, channel: grpc.aio.Channel, plan: StreamPlan, budget: list[int]) -> None:
        """One Sync stream: send `plan.count` messages fast, then see how it ends."""
        metadata, authorized = self.credentials()
        call = channel.stream_stream(
            SYNC, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )(metadata=metadata or None)
        report = self.report
        report.streams += 1
        step = 0

        # The status as the reader saw it end: a write racing the coordinator's end
        # of the stream makes grpc report the call as INTERNAL "Internal error from
        # Core" (a client-side artifact), while the reader still saw the real status.
        ended: list[tuple[grpc.StatusCode, str]] = []
        replies = [0]

        async def read() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    while (message := await call.read()) is not grpc.aio.EOF:
                        assert isinstance(message, bytes)
                        replies[0] += 1
                except grpc.aio.AioRpcError as error:
                    ended.append((error.code(), error.details() or ""))

        reader = asyncio.ensure_future(read())
        outgoing: list[bytes] = []
        if plan.join:
            outgoing.append(self.messages.join(plan.job_id, plan.rank).SerializeToString())
        if plan.broadcast:
            state = bytes(BUCKET_BYTES + 8)
            outgoing += [
                pb.WorkerMessage(
                    state=pb.StateChunk(offset=offset, payload=state[offset : offset + CHUNK])
                ).SerializeToString()
                for offset in range(0, len(state), CHUNK)
            ]
        left = False
        for index in range(plan.count):
            if index < len(outgoing):
                raw = outgoing[index]
            else:
                if self.rng.random() < 0.02:
                    step += 1
                raw = self.messages.next(step, joined=plan.join)
            if call.done() or budget[0] <= 0:
                break
            try:
                await asyncio.wait_for(call.write(raw), timeout=5)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
            except Exception as exc:  # grpc's ExecuteBatchError once the call ended
                if call.done():
                    break
                raise exc
            budget[0] -= 1
            report.messages += 1
            if index == 0 and not authorized:
                # The coordinator refuses a stream without the token once its first message is
                # in. A client that keeps writing races that status, and grpc then reports its
                # own INTERNAL "Internal error from Core" instead: let the refusal arrive (a
                # refusal slower than this shows up as a violation).
                await asyncio.wait([reader], timeout=UNAUTHENTICATED_WAIT_S)
            if index == 0 and plan.join and plan.pair:
                await asyncio.sleep(0.1)  # let the partner join: most messages meet a running job
            left = left or is_leave(raw)
        await asyncio.wait([reader], timeout=0.05)
        half_closed = not call.done()
        if half_closed:
            with contextlib.suppress(Exception):
                await call.done_writing()
            await asyncio.wait([reader], timeout=10)
        if not call.done():
            report.note(
                f"stream of job {plan.job_id} rank {plan.rank}: no status 10 s after half-close"
            )
            call.cancel()
            report.codes["client-cancelled"] += 1
            return
        code = await call.code()
        details = await call.details() or ""
        if ended and details == CLIENT_ARTIFACT:
            code, details = ended[0]
        where = f"stream {plan.job_id}/{plan.rank}"
        if not authorized:
            self.judge_unauthenticated(where, code, details, replies[0])
            return
        if details == CLIENT_ARTIFACT:
            report.codes["INTERNAL (client wrote after the end)"] += 1
            return
        report.codes[code.name] += 1
        report.reasons[f"{code.name}: {re.sub(r'[0-9]+', 'N', details)[:70]}"] += 1
        if code is grpc.StatusCode.UNKNOWN:
            report.note(f"{where}: UNKNOWN status ({details!r})")
        elif code is grpc.StatusCode.INTERNAL:
            # The designed answer to a handler bug (never OK, never silent): still a bug.
            report.note(f"{where}: INTERNAL, a coordinator bug: {details[:300]!r}")
        elif code is not grpc.StatusCode.OK and not details.strip():
            report.note(f"{where}: {code.name} without a message")
        elif code is grpc.StatusCode.UNAUTHENTICATED:
            report.note(f"{where}: UNAUTHENTICATED though it carried the right token (if any)")
        elif code is grpc.StatusCode.OK and not half_closed and not left:
            report.note(
                f"{where}: the coordinator ended the stream with OK ({details!r}) though the "
                "client neither left nor half-closed (a rejected stream must carry its code)"
            )

    async def status_call(self, channel: grpc.aio.Channel) -> None:
        call = channel.unary_unary(
            STATUS, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        rng = self.rng
        request = pb.StatusRequest().SerializeToString()
        if rng.random() < 0.5:
            request = self.messages.garbage(request + b"\x0a\x03abc")
        metadata, authorized = self.credentials()
        self.report.status_calls += 1
        try:
            await asyncio.wait_for(call(request, timeout=5, metadata=metadata or None), timeout=6)
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
            if not authorized:
                self.judge_unauthenticated("Status", code, details, 0)
                return
            self.report.codes[code.name] += 1
            if code is grpc.StatusCode.UNKNOWN or not details.strip():
                self.report.note(f"Status: {code.name} {error.details()!r}")
            elif code is grpc.StatusCode.UNAUTHENTICATED:
                self.report.note("Status: UNAUTHENTICATED though it carried the right token")
            return
        if not authorized:
            self.judge_unauthenticated("Status", grpc.StatusCode.OK, "", 1)
            return
        self.report.codes["OK"] += 1

    async def shard_link_call(self, channel: grpc.aio.Channel) -> None:
        """A ShardLink stream that opens with garbage (a would-be coordinator shard).

        In token mode even the workers' token is the wrong one here: a link needs the
        shard token, which no fuzz call has (`support.fuzz_shards` fuzzes with it).
        """
        metadata, authorized = self.credentials()
        if self.token is not None and authorized:
            self.report.unauth_calls += 1
            authorized = False
        call = channel.stream_stream(
            SHARD_LINK, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )(metadata=metadata or None)
        self.report.status_calls += 1
        register = pb.ShardMessage().SerializeToString()
        replies = 0
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await asyncio.wait_for(call.write(self.messages.garbage(register + b"\x0a\x01x")), 5)
            await asyncio.wait_for(call.done_writing(), 5)
            while (await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
                replies += 1
        if not call.done():
            call.cancel()
            if not authorized:
                self.report.note("ShardLink without the right token: no status within 5 s")
            return
        code, details = await call.code(), await call.details() or ""
        if not authorized:
            self.judge_unauthenticated("ShardLink", code, details, replies)
            return
        self.report.codes[code.name] += 1
        if code in (
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.INTERNAL,
            grpc.StatusCode.UNAUTHENTICATED,
        ) or (code is not grpc.StatusCode.OK and not details.strip()):
            self.report.note(f"ShardLink: {code.name} {details[:200]!r}")

    def plans(self) -> list[StreamPlan]:
        """The next batch: usually a pair that joins one fresh job, sometimes a lone stream."""
        rng = self.rng
        self._job_counter += 1
        job_id = f"fuzz-{self._job_counter % 24}"
        if rng.random() < 0.7:
            count = rng.choice([50, 200, 400])
            return [
                StreamPlan(job_id, 0, count, join=True, broadcast=rng.random() < 0.8, pair=True),
                StreamPlan(job_id, 1, count, join=True, pair=True),
            ]
        return [
            StreamPlan(job_id, rng.choice([0, 1]), rng.choice([1, 3, 20]), join=rng.random() < 0.5)
        ]

    async def lane(self, channel: grpc.aio.Channel, budget: list[int]) -> None:
        """One of the concurrent lanes: batches of streams until the message budget is spent."""
        while budget[0] > 0:
            roll = self.rng.random()
            if roll < 0.05:
                await self.status_call(channel)
                continue
            if roll < 0.06:
                await self.shard_link_call(channel)
                continue
            await asyncio.gather(*(self.stream(channel, plan, budget) for plan in self.plans()))


async def legit_job(
    address: str, report: FuzzReport, stop: asyncio.Event, steps: int, token: str | None = None
) -> None:
    """A well-behaved two-rank job (with the token, if any) that must keep averaging exactly."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            workers: list[RawWorker] = await assembled_job(
                channel, job_id="legit", metadata=auth.metadata(token)
            )
            for step in range(steps):
                await run_step(workers, step)
                report.legit_steps += 1
                if stop.is_set() and step >= 2:
                    break
                await asyncio.sleep(0.01)
            for worker in workers:
                await worker.leave()
        except Exception as exc:  # recorded: the caller asserts on it
            report.legit_error = f"{type(exc).__name__}: {exc}"


async def fuzz(
    coordinator: LiveCoordinator,
    messages: int,
    seed: int = 0,
    lanes: int = 8,
    legit_steps: int = 1000,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Send `messages` fuzz messages to `coordinator` (see the module docstring)."""
    token = coordinator.token
    report = FuzzReport(log_path=str(coordinator.log_path), token=token is not None)
    pid = coordinator.process.pid
    started = time.monotonic()
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(coordinator.address, options=options) as channel:
        fuzzer = Fuzzer(coordinator.address, report, seed, token)
        warmup = [min(1000, messages // 10)]
        await asyncio.gather(*(fuzzer.lane(channel, warmup) for _ in range(lanes)))
        await asyncio.sleep(0.3)
        report.rss_before_kib = report.rss_peak_kib = rss_kib(pid)
        stop = asyncio.Event()
        legit = asyncio.ensure_future(
            legit_job(coordinator.address, report, stop, legit_steps, token)
        )
        budget = [messages - report.messages]

        async def sample() -> None:
            while True:
                report.rss_peak_kib = max(report.rss_peak_kib, rss_kib(pid))
                if progress is not None:
                    progress(report)
                await asyncio.sleep(0.2)

        sampler = asyncio.ensure_future(sample())
        try:
            await asyncio.gather(*(fuzzer.lane(channel, budget) for _ in range(lanes)))
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(legit, timeout=30)
            sampler.cancel()
    await asyncio.sleep(0.5)
    report.rss_after_kib = rss_kib(pid)
    report.rss_peak_kib = max(report.rss_peak_kib, report.rss_after_kib)
    report.alive = coordinator.process.poll() is None
    report.exit_code = coordinator.process.returncode
    report.duration_s = time.monotonic() - started
    return report


def run_fuzz(
    log_path: Path,
    messages: int,
    seed: int = 0,
    lanes: int = 8,
    token: str | None = None,
    **kwargs: object,
) -> FuzzReport:
    """Start a coordinator, fuzz it with `messages` messages, stop it; return the report.

    With `token`, the coordinator requires it (token mode: see the module docstring).
    """
    coordinator = LiveCoordinator(log_path, token=token)
    try:
        report = asyncio.run(fuzz(coordinator, messages, seed, lanes, **kwargs))  # type: ignore[arg-type]
    finally:
        exit_code = coordinator.stop()
    if report.alive and exit_code not in (0, None):
        report.note(f"coordinator exited {exit_code} on SIGTERM after the run")
    scan_log(report, log_path)
    return report
