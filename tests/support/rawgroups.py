"""Hand-driven ranks of a job with local groups (hierarchical aggregation), over gRPC."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.rawclient import BUCKET_BYTES, CHUNK, RawWorker, signature

#: Ranks 0 and 1 on one host, rank 2 flat (no host id).
HOSTS = {0: "host-a", 1: "host-a", 2: ""}


def join_message(
    rank: int, host_id: str, world_size: int, local_world_size: int = 0
) -> pb.WorkerMessage:
    return pb.WorkerMessage(
        join=pb.Join(
            job_id="job",
            rank=rank,
            world_size=world_size,
            signature=signature(),
            incarnation=f"test-{rank}",
            host_id=host_id,
            local_world_size=local_world_size,
        )
    )


async def hier_job(
    channel: grpc.aio.Channel, hosts: Mapping[int, str] = HOSTS
) -> tuple[list[RawWorker], list[pb.Welcome]]:
    """Workers of an assembled job (rank 0's state broadcast done) and their Welcomes."""
    workers = [RawWorker(channel) for _ in hosts]
    for rank, worker in enumerate(workers):
        await worker.send(join_message(rank, hosts[rank], len(hosts)))
    welcomes = [(await worker.expect_kind("welcome")).welcome for worker in workers]
    state = bytes(BUCKET_BYTES + 8)
    for offset in range(0, len(state), CHUNK):
        chunk = pb.StateChunk(offset=offset, payload=state[offset : offset + CHUNK])
        await workers[0].send(pb.WorkerMessage(state=chunk))
    for worker in workers[1:]:
        for _ in range(0, len(state), CHUNK):
            await worker.expect_kind("state")
    return workers, welcomes
