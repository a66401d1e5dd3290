"""What the contribution screen costs a per-step (DDP) job at the coordinator, in one process.

Feeds W ranks' chunks of one float32 bucket through a real `OpenStep` (the
coordinator's data plane, no network) for a few steps and reports the time per
step and the bytes held at the peak, for: no screen (the data plane as an
unscreened job ran it), "report" (the default: norms taken while folding) and
the policies that hold every contribution of a chunk ("exclude",
"trimmed_mean"). Rounds are interleaved (A B C D A B C D ...) so that a loaded
machine weighs on every variant alike; the median is printed.

    python scripts/screen_ddp_cost.py --mb 25 --world 4 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.dataplane.open_step import OpenStep
from gradsync_server.dataplane.plane import MembershipView, PlaneMember

VARIANTS = ("none", "report", "exclude", "trimmed_mean")


def one_step(
    variant: str, world: int, payloads: list[bytes], chunk_bytes: int
) -> tuple[float, int]:
    """Seconds to fold one step of every rank's bucket, and the peak bytes held."""
    members = {r: PlaneMember(r, f"inc-{r}") for r in range(world)}
    budget = ByteBudget(1 << 34)
    step = OpenStep(MembershipView("job", 0, members), chunk_bytes, budget, lambda: 0.0, None)
    elements = len(payloads[0]) // 4
    screen = "report" if variant == "none" else variant
    signature = pb.ModelSignature(
        buckets=[pb.BucketSpec(dtype=pb.DTYPE_FLOAT32, num_elements=elements)], screen=screen
    )
    step.configure(signature, 0)
    if variant == "none":  # the data plane without a screen, as before per-step screening
        step.screen = None
        step._step_screen = False
    views = [memoryview(p) for p in payloads]
    peak = 0
    started = time.perf_counter()
    for offset in range(0, len(payloads[0]), chunk_bytes):
        for rank in range(world):
            header = ChunkHeader(step=0, bucket_index=0, offset=offset, dtype=pb.DTYPE_FLOAT32)
            step.accept(rank, header, views[rank][offset : offset + chunk_bytes])
            peak = max(peak, budget.used)
    elapsed = time.perf_counter() - started
    if step.steps_completed != 1:
        raise RuntimeError(f"{variant}: the step did not complete")
    return elapsed, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=25.0)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    elements = int(args.mb * 2**20) // 4
    base = rng.standard_normal(elements).astype(np.float32)
    payloads = [
        (base + 0.5 * rng.standard_normal(elements).astype(np.float32)).tobytes()
        for _ in range(args.world)
    ]
    chunk_bytes = int(args.chunk_mb * 2**20)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, int] = {}
    for _ in range(args.steps):
        for variant in VARIANTS:
            seconds, peak = one_step(variant, args.world, payloads, chunk_bytes)
            times[variant].append(seconds)
            peaks[variant] = peak
    none = statistics.median(times["none"])
    print(
        f"{args.mb:g} MB float32 bucket, W = {args.world}, {args.chunk_mb:g} MiB chunks, "
        f"{args.steps} interleaved steps (median)"
    )
    print("| screen | ms per step | x no screen | peak bytes held (MiB) |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        held = peaks[variant] / 2**20
        print(f"| {variant} | {median * 1e3:.2f} | {median / none:.3f} | {held:.1f} |")


if __name__ == "__main__":
    main()
