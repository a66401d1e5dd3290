"""The coordinator's all-reduce alone: `Collectives.accept` over parsed chunks, plus serializing
what it sends (what the coordinator does per DDP bucket, without the sockets).

    PYTHONPATH=TREE/client:TREE/server:TREE/proto python hub_allreduce.py MIB UNITS REPS

UNITS inputs of MIB MiB of float32 (1 MiB chunks, as parsed from the wire: each payload its
own bytes); UNITS = 1 is a host group's leader covering both ranks of W = 2. Prints the best
and median thread CPU ms per collective.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collectives import Collectives
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget

CHUNK = 1 << 20


def main() -> None:
    mib, units, reps = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    total = int(mib * (1 << 20)) // 4 * 4
    world = 2 if units == 1 else units
    engine = Collectives(world, CHUNK, 1 << 30, ByteBudget(1 << 32).for_owner("job"))
    raw = [
        np.random.default_rng(r).standard_normal(total // 4).astype(np.float32).tobytes()
        for r in range(units)
    ]
    covered = list(range(world)) if units == 1 else []
    wires = [
        [
            pb.WorkerMessage(
                collective=pb.CollectiveChunk(
                    sequence=0,
                    op=pb.COLLECTIVE_OP_SUM,
                    dtype=pb.DTYPE_FLOAT32,
                    total_bytes=total,
                    offset=o,
                    payload=raw[r][o : o + CHUNK],
                    covered_ranks=covered if r == 0 else [],
                )
            ).SerializeToString()
            for o in range(0, total, CHUNK)
        ]
        for r in range(units)
    ]
    times = []
    for sequence in range(reps):
        parsed = []
        for r in range(units):
            for w in wires[r]:
                m = pb.WorkerMessage.FromString(w)
                m.collective.sequence = sequence
                parsed.append((r, m.collective))
        start = time.thread_time()
        sent = 0
        for r, chunk in parsed:
            for action in engine.accept(r, chunk, list(range(world))):
                if isinstance(action, Send):
                    message = action.message
                    raw_out = message if isinstance(message, bytes) else message.SerializeToString()
                    sent += len(raw_out)
        times.append((time.thread_time() - start) * 1e3)
        assert sent >= total, sent
    print(
        f"{mib} MiB x {units} inputs: best {min(times):.2f} ms, "
        f"median {statistics.median(times):.2f} ms per collective"
    )


if __name__ == "__main__":
    main()
