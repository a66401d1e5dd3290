"""Bytes each way per DiLoCo round on the socket: float32, int8 and the sparse 2-bit wire, W ranks.

    python -m gradsync_bench.sparse_bytes [--mb 4] [--worlds 2 4 8] [--density 0.02]

A real `gradsync serve` and W real rank processes, each training a bias-free
linear layer of `--mb` MiB of float32 parameters with `gradsync.DiLoCo`:
float32 DiLoCo (no wire dtype, the parameters answered in float32), the int8
wire with the int8 compact answer, and `gradsync.SparseWire(density)`. Every
rank connects through a TCP relay (`answer_bytes.CountingRelay`) that counts
the bytes of each direction as they cross the socket (gRPC and HTTP/2
framing, headers and heartbeats included); the coordinator runs without its
frame port and same-host payload path (`--frame-port -1 --no-payload-socket`),
so the chunks cross that connection too.
Joining, rank 0's broadcast and the seed round cost the same for every wire,
so each setting runs twice, with 1 and with 1 + `--extra-rounds` rounds, and
the difference divided by the extra rounds is one round. Prints one row per (W, wire): bytes up and
down per round per rank, and their ratio to float32 DiLoCo's at that W.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from gradsync_proto.net.launch import start_coordinator

from gradsync_bench.answer_bytes import CountingRelay
from gradsync_bench.procs import stop_process, wait_ranks

#: Bound on one job (join, broadcast, seed and the rounds on a loaded CPU).
JOB_TIMEOUT_S = 600.0
#: Inner steps per round (the model's size, not H, decides the bytes).
SYNC_EVERY = 2
WIRES = ("fp32", "int8", "topk2")
#: No frame port, no same-host payload path: every byte crosses the gRPC connection.
NO_FRAMES = ("--frame-port", "-1", "--no-payload-socket")
WORKER = (sys.executable, "-m", "gradsync_bench.sparse_bytes", "--worker")


def run_job(wire: str, world: int, rounds: int, megabytes: int, density: float) -> tuple[int, int]:
    """Bytes (up, down) of one whole job, all ranks together, as the relay counted them."""
    coordinator, port = start_coordinator(world, *NO_FRAMES)
    relay = CountingRelay(port)
    ranks = [
        subprocess.Popen(
            [
                *WORKER,
                *("--rank", str(rank), "--world", str(world)),
                *("--coordinator", f"127.0.0.1:{relay.port}", "--wire", wire),
                *("--rounds", str(rounds), "--mb", str(megabytes), "--density", repr(density)),
            ]
        )
        for rank in range(world)
    ]
    try:
        wait_ranks(ranks, JOB_TIMEOUT_S, lambda _, code, __: f"a rank exited with {code}")
    finally:
        stop_process(coordinator)
        relay.close()
    return relay.up, relay.down


def worker(args: argparse.Namespace) -> None:
    """One rank: DiLoCo with `args.wire` over an `args.mb` MiB linear layer."""
    import gradsync  # the worker's own import: the parent only counts bytes

    side = int((args.mb * 2**20 / 4) ** 0.5)
    torch.manual_seed(args.rank)
    model = torch.nn.Linear(side, side, bias=False)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(100 + args.rank)
    wire: torch.dtype | gradsync.SparseWire | None = {
        "fp32": None,
        "int8": torch.int8,
        "topk2": gradsync.SparseWire(args.density),
    }[args.wire]
    with gradsync.DiLoCo(
        model,
        inner,
        sync_every=SYNC_EVERY,
        wire_dtype=wire,
        answer_dtype=torch.int8 if args.wire == "int8" else None,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world,
        job_id=f"bytes-{args.wire}-{args.rounds}",
        timeout_s=300,
        # Every rank uploads its own, as on separate hosts (a local group would upload
        # once per host for float32; the narrow wires are flat anyway).
        hierarchical=False,
    ) as diloco:
        for _ in range(args.rounds * SYNC_EVERY):
            x = torch.randn(8, side, generator=generator)
            inner.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            inner.step()
            diloco.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=4, help="model size in MiB of float32")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--wires", nargs="+", choices=WIRES, default=list(WIRES))
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--extra-rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    parser.add_argument("--wire", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    side = int((args.mb * 2**20 / 4) ** 0.5)
    print(f"model: {side} x {side} float32 = {side * side * 4:,} bytes; density {args.density}")
    print(
        f"{'W':>3} {'wire':<6}{'up B/round/rank':>17}{'down B/round/rank':>19}"
        f"{'fp32/up':>10}{'fp32/down':>11}",
        flush=True,
    )
    for world in args.worlds:
        fp32: tuple[float, float] | None = None
        for wire in args.wires:
            up_1, down_1 = run_job(wire, world, 1, args.mb, args.density)
            up_n, down_n = run_job(wire, world, 1 + args.extra_rounds, args.mb, args.density)
            up = (up_n - up_1) / args.extra_rounds / world
            down = (down_n - down_1) / args.extra_rounds / world
            if wire == "fp32":
                fp32 = (up, down)
            ratios = f"{fp32[0] / up:>9.1f}x{fp32[1] / down:>10.1f}x" if fp32 is not None else ""
            print(f"{world:>3} {wire:<6}{up:>17,.0f}{down:>19,.0f}{ratios}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
