"""Microseconds per MiB to fold one chunk's contributions on the coordinator (one process).

    PYTHONPATH=server:proto python scripts/fold_passes.py [--dtype f32] [--workers 2] [--runs 400]

A measuring tool for the coordinator's data plane, beside the suites of
`gradsync bench` (which drive only the public library and CLI).

Feeds `--workers` contributions of one 4 MiB chunk, each a read-only view
three bytes into its message (misaligned, as a payload after its header),
through `BucketReduction.add` in rank order until the average comes out,
`--runs` times, and prints the median, 10th and 90th percentile time per MiB
of contributions: the coordinator's fold with no gRPC around it, so that a
change of its passes over each byte shows by itself. `--cpu-time` times with the
process's CPU clock instead of the wall clock (less sensitive to a busy
machine). `--samples FILE` appends every run's figure to FILE, to pool
several interleaved runs of two checkouts.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import numpy as np
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.aggregation import BucketReduction

CHUNK_BYTES = 4 << 20
#: Bytes before the payload in its message: misaligned for every dtype.
HEADER_BYTES = 3
DTYPES = {"f32": pb.DTYPE_FLOAT32, "f16": pb.DTYPE_FLOAT16, "bf16": pb.DTYPE_BFLOAT16}


def contribution(dtype: int, seed: int) -> memoryview:
    """One rank's chunk of standard-normal gradients, misaligned in its message."""
    elements = CHUNK_BYTES // (4 if dtype == pb.DTYPE_FLOAT32 else 2)
    values = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
    if dtype == pb.DTYPE_FLOAT32:
        raw = values.tobytes()
    elif dtype == pb.DTYPE_FLOAT16:
        raw = values.astype("<f2").tobytes()
    else:  # bfloat16: the upper halves
        raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    return memoryview(bytes(HEADER_BYTES) + raw)[HEADER_BYTES:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--samples", default=None)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    payloads = [contribution(dtype, seed) for seed in range(args.workers)]

    def fold() -> None:
        reduction = BucketReduction(range(args.workers), dtype, CHUNK_BYTES, CHUNK_BYTES)
        averaged = None
        for rank, payload in enumerate(payloads):
            averaged = reduction.add(rank, 0, payload)
        if averaged is None:
            raise RuntimeError("the chunk's average did not come out")

    for _ in range(5):  # warm up the allocator and the caches
        fold()
    timer = time.process_time if args.cpu_time else time.perf_counter
    times = timeit.repeat(fold, number=1, repeat=args.runs, timer=timer)
    mib = args.workers * CHUNK_BYTES / (1 << 20)
    per_mib = sorted(seconds / mib * 1e6 for seconds in times)
    if args.samples:
        with open(args.samples, "a") as samples:
            samples.write("".join(f"{us:.2f}\n" for us in per_mib))
    print(
        f"{args.dtype} W={args.workers}: median {statistics.median(per_mib):.1f} us/MiB "
        f"(p10 {per_mib[len(per_mib) // 10]:.1f}, p90 {per_mib[9 * len(per_mib) // 10]:.1f}, "
        f"{args.runs} runs)"
    )


if __name__ == "__main__":
    main()
