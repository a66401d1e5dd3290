"""Fuzzing `Coordinator.ShardLink` past its first message, against a real sharded leader.

The main fuzzer (`support.fuzzing`) only opens ShardLinks with garbage, which
a leader refuses at the door. What a shard may do once *registered* matters
more: a registered shard is trusted with every job's membership, and what it
reports (rejections that abort steps, NaN reports, counters that reach
/metrics and Status) must never crash, stall or mislead the leader. So here
`gradsync serve --wait-for-shards 8` runs with a token and a shard token, two
raw workers keep a job assembled on it, and concurrent fake shards register
(mostly with the shard token; some with the workers' token, none, or a near
miss, which must end UNAUTHENTICATED without a reply) and then send random
`ShardStats`, `ShardRejected` and `ShardNonFinite` messages (ranks, steps,
buckets, codes and reasons at their edges, texts that try to forge log lines,
unknown job ids) or a second `ShardRegister`, and sometimes end with raw garbage.

Afterwards the leader must be alive with no tracebacks or forged lines in its
log, every link must have ended with a status and a message (never UNKNOWN,
never INTERNAL but the client-side write artifact), its RSS must be flat, and
it must still admit a genuine shard and a genuine worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass

import grpc
from gradsync import __version__
from gradsync_proto import auth, chunking
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.fuzz_coordinator import FuzzReport, rss_kib
from support.fuzz_messages import EDGES, Messages
from support.rawclient import CHUNK, RawWorker

LINK = "/gradsync.v1.Coordinator/ShardLink"
#: The artifact grpc-python reports when a write races the end of the call.
CLIENT_ARTIFACT = "Internal error from Core"
#: Codes a rejection may carry (google.rpc.Code numbers, and some that are none).
CODES = [0, 1, 3, 5, 9, 13, 16, 17, 99, 2**32 - 1]


@dataclass
class ShardFuzzer:
    """Concurrent fake shards against one leader (see the module docstring)."""

    address: str
    token: str
    shard_token: str
    report: FuzzReport
    rng: random.Random

    def credentials(self) -> tuple[tuple[tuple[str, str], ...], bool]:
        """Mostly the shard token; one link in five presents something a shard must not."""
        if self.rng.random() >= 0.2:
            return auth.metadata(self.shard_token), True
        self.report.unauth_calls += 1
        near = self.shard_token[:-1] + ("A" if self.shard_token[-1] != "A" else "B")
        return self.rng.choice([(), auth.metadata(self.token), auth.metadata(near)]), False

    def register(self) -> pb.ShardMessage:
        rng = self.rng
        message = pb.ShardRegister(
            version=__version__,
            advertise=f"127.0.0.1:{rng.randrange(1, 40000)}",
            chunk_bytes=CHUNK,
            max_message_bytes=CHUNK + chunking.HEADER_SLACK_BYTES,
        )
        roll = rng.random()
        if roll < 0.1:
            message.version = rng.choice(["", "0.0.0", "x" * 5000])
        elif roll < 0.2:
            message.advertise = rng.choice(["", ":1", "\n" + Messages(rng).text(), "[::1]:0"])
        elif roll < 0.3:
            message.chunk_bytes = rng.choice(EDGES)
        elif roll < 0.35:
            message.max_message_bytes = rng.choice(EDGES)
        return pb.ShardMessage(register=message)

    def follow_up(self) -> bytes:
        """One message a registered (or refused) shard sends next."""
        rng, texts = self.rng, Messages(self.rng)
        job = rng.choice(["legit", "nope", "", "x" * 300, texts.text()])
        rank, step, bucket = rng.choice(EDGES) % 2**32, rng.choice(EDGES), rng.randrange(-3, 9)
        roll = rng.random()
        if roll < 0.3:
            stats = pb.ShardStats(
                bytes_received=rng.choice(EDGES),
                bytes_sent=rng.choice(EDGES),
                buckets_completed=rng.choice(EDGES),
                mean_bucket_s=rng.choice([0.0, -1.0, 1e308, float("nan"), float("inf")]),
                buffered_bytes=rng.choice(EDGES),
                connections=rng.choice(EDGES) % 2**32,
            )
            return pb.ShardMessage(stats=stats).SerializeToString()
        if roll < 0.6:
            rejected = pb.ShardRejected(
                job_id=job,
                rank=rank if rng.random() < 0.5 else rng.randrange(2),
                step=step if rng.random() < 0.5 else rng.randrange(3),
                bucket_index=bucket,
                code=rng.choice(CODES),
                message=texts.text(),
                reason=rng.choice([0, 1, 2, 3, 4, 5, 6, 99]),  # type: ignore[arg-type]
                via_local_leader=rng.random() < 0.3,
            )
            return pb.ShardMessage(rejected=rejected).SerializeToString()
        if roll < 0.8:
            report = pb.ShardNonFinite(
                job_id=job,
                rank=rank if rng.random() < 0.5 else rng.randrange(2),
                step=step,
                bucket_index=max(bucket, 0),
                message=texts.text(),
                via_local_leader=rng.random() < 0.3,
            )
            return pb.ShardMessage(nonfinite=report).SerializeToString()
        return self.register().SerializeToString()  # a second registration

    async def link(self, channel: grpc.aio.Channel, count: int) -> None:
        """One fake shard: register, send `count` follow-ups, half-close, judge the end."""
        metadata, authorized = self.credentials()
        call = channel.stream_stream(
            LINK,
            request_serializer=lambda raw: raw,
            response_deserializer=pb.LeaderMessage.FromString,
        )(metadata=metadata or None)
        report = self.report
        report.streams += 1
        replies, ends = [0], []

        async def read() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                while (message := await call.read()) is not grpc.aio.EOF:
                    replies[0] += message.WhichOneof("kind") != "heartbeat"
                    if message.WhichOneof("kind") == "stream_end":
                        ends.append(message.stream_end)

        reader = asyncio.ensure_future(read())
        outgoing = [self.register().SerializeToString()]
        outgoing += [self.follow_up() for _ in range(count)]
        if self.rng.random() < 0.2:  # bytes that are no ShardMessage end the stream: last
            stats = pb.ShardMessage(stats=pb.ShardStats(connections=1)).SerializeToString()
            outgoing.append(Messages(self.rng).garbage(stats))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            for index, raw in enumerate(outgoing):
                if call.done():
                    break
                await asyncio.wait_for(call.write(raw), 5)
                report.messages += 1
                if index == 0:
                    await asyncio.wait([reader], timeout=0.05)  # a refusal arrives first
            await asyncio.wait_for(call.done_writing(), 5)
        await asyncio.wait([reader], timeout=10)
        if not call.done():
            call.cancel()
            report.note("ShardLink: no status 10 s after half-close")
            return
        code, details = await call.code(), await call.details() or ""
        if ends and details == CLIENT_ARTIFACT:  # the StreamEnd said what the status was
            code = next(c for c in grpc.StatusCode if c.value[0] == ends[0].code)
            details = ends[0].message
        self.judge(code, details, authorized, replies[0])

    def judge(self, code: grpc.StatusCode, details: str, authorized: bool, replies: int) -> None:
        report = self.report
        if details == CLIENT_ARTIFACT:
            report.codes["INTERNAL (client wrote after the end)"] += 1
            return
        report.codes[code.name] += 1
        if not authorized:
            if code is grpc.StatusCode.UNAUTHENTICATED and details and not replies:
                report.unauth_refused += 1
            else:
                report.note(f"ShardLink without the shard token: {code.name} after {replies}")
        elif code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            report.note(f"ShardLink: {code.name} {details[:200]!r}")
        elif code is grpc.StatusCode.UNAUTHENTICATED:
            report.note("ShardLink: UNAUTHENTICATED though it carried the shard token")
        elif code is not grpc.StatusCode.OK and not details.strip():
            report.note(f"ShardLink: {code.name} without a message")

    async def lane(self, channel: grpc.aio.Channel, links: int) -> None:
        for _ in range(links):
            await self.link(channel, self.rng.choice([1, 5, 40, 100]))


async def fuzz_shard_links(
    address: str, token: str, shard_token: str, pid: int, links: int, seed: int, lanes: int = 6
) -> FuzzReport:
    """Fuzz `links` fake shards (in `lanes` concurrent lanes) at the leader at `address`."""
    report = FuzzReport(token=True)
    fuzzer = ShardFuzzer(address, token, shard_token, report, random.Random(seed))
    async with grpc.aio.insecure_channel(address) as channel:
        workers = [RawWorker(channel, auth.metadata(token)) for _ in range(2)]
        for rank, worker in enumerate(workers):
            await worker.join(rank, job_id="legit")
        await fuzzer.lane(channel, 3)  # warm-up
        report.rss_before_kib = report.rss_peak_kib = rss_kib(pid)
        per_lane = max(1, links // lanes)
        sampler = asyncio.ensure_future(_sample(report, pid))
        try:
            await asyncio.gather(*(fuzzer.lane(channel, per_lane) for _ in range(lanes)))
        finally:
            sampler.cancel()
        for worker in workers:
            worker.call.cancel()
    await asyncio.sleep(0.5)
    report.rss_after_kib = rss_kib(pid)
    return report


async def _sample(report: FuzzReport, pid: int) -> None:
    while True:
        report.rss_peak_kib = max(report.rss_peak_kib, rss_kib(pid))
        await asyncio.sleep(0.2)
