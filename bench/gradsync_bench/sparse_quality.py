"""Held-out loss of the wan task under DiLoCo: int8 wire and answer against the sparse 2-bit wire.

    python -m gradsync_bench.sparse_quality [--steps 300] [--world 2] [--density 0.02]

The wan scorecard's task (`gradsync_bench.wan_task`: a character-level
transformer on the standard library's source, each rank its slice, the same
held-out tail for all) trained by W real rank processes through a real
`gradsync serve` on loopback, once per method, with the same seeds and
batches: DiLoCo at H = `--sync-every` (default 50), the library's outer
defaults for each wire unless `--outer-lr` / `--outer-momentum` say otherwise
(outer learning rate 1.0; Nesterov momentum 0.5 on the int8 and float32 wires,
none on the sparse wire), with `wire_dtype=torch.int8, answer_dtype=torch.int8` ("int8x2") and
with `wire_dtype=gradsync.SparseWire(density)` ("topk2"), optionally float32
DiLoCo too ("fp32"). Prints per method the held-out loss of rank 0's final
model (every rank holds the same global parameters after the last round),
the bytes up per round per rank as the client counted them, and the ratio of
each loss to the int8 method's. No link shaping: loss, not time, is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gradsync_proto.net.launch import start_coordinator

from gradsync_bench import wan_task
from gradsync_bench.procs import stop_process, wait_ranks

METHODS = ("fp32", "int8x2", "topk2")
WORKER = (sys.executable, "-m", "gradsync_bench.sparse_quality", "--worker")
JOB_TIMEOUT_S = 3600.0


def run_method(method: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train with `method` on `args.world` ranks; return every rank's record."""
    # The library's heartbeat timeout unless asked otherwise (a machine whose cores are
    # shared with other work can starve a busy rank's process for seconds).
    hb = (
        []
        if args.heartbeat_timeout is None
        else ["--heartbeat-timeout", repr(args.heartbeat_timeout)]
    )
    coordinator, port = start_coordinator(args.world, *hb)
    out = Path(args.out)
    common = [
        *("--world", str(args.world), "--steps", str(args.steps)),
        *("--sync-every", str(args.sync_every), "--density", repr(args.density)),
        *(() if args.outer_lr is None else ("--outer-lr", repr(args.outer_lr))),
        *(() if args.outer_momentum is None else ("--outer-momentum", repr(args.outer_momentum))),
        *("--coordinator", f"127.0.0.1:{port}", "--method", method, "--out", str(out)),
        *("--seed", str(args.seed)),
    ]
    ranks = [
        subprocess.Popen([*WORKER, "--rank", str(rank), *common]) for rank in range(args.world)
    ]
    try:
        wait_ranks(ranks, JOB_TIMEOUT_S, lambda r, code, _: f"rank {r} exited with {code}")
    finally:
        stop_process(coordinator)
    return [
        json.loads((out / f"{method}-rank{rank}.json").read_text()) for rank in range(args.world)
    ]


def worker(args: argparse.Namespace) -> None:
    """One rank of one method (see the module docstring)."""
    import gradsync

    torch.set_num_threads(1)
    corpus = wan_task.read_corpus()
    text, held_out = wan_task.split(corpus, args.rank, args.world)
    batches = wan_task.Batches(text, args.batch, args.context, args.rank, seed=args.seed)
    torch.manual_seed(args.seed)
    model = wan_task.build_model(args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    wire: torch.dtype | gradsync.SparseWire | None = {
        "fp32": None,
        "int8x2": torch.int8,
        "topk2": gradsync.SparseWire(args.density),
    }[args.method]
    diloco = gradsync.DiLoCo(
        model,
        inner,
        sync_every=args.sync_every,
        outer_lr=1.0 if args.outer_lr is None else args.outer_lr,
        outer_momentum=args.outer_momentum,
        wire_dtype=wire,
        answer_dtype=torch.int8 if args.method == "int8x2" else None,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world,
        job_id=f"quality-{args.method}",
        timeout_s=600,
    )
    up: list[int] = []
    down: list[int] = []
    started = time.perf_counter()
    with diloco:
        for _ in range(args.steps):
            inner.zero_grad()
            inputs, targets = batches.next()
            torch.autograd.backward(wan_task.loss_of(model, inputs, targets))
            inner.step()
            if diloco.step():
                up.append(diloco.last_round_bytes)
                down.append(diloco.fragments[0].last_round_received)
        record = {
            "method": args.method,
            "rank": args.rank,
            "steps": args.steps,
            "rounds": len(up),
            "seconds": time.perf_counter() - started,
            "round_bytes_up": up,
            "round_bytes_down": down,
            "parameter_bytes": wan_task.parameter_bytes(model),
            "held_out_loss": wan_task.held_out_loss(model, held_out, args.context),
        }
    Path(args.out, f"{args.method}-rank{args.rank}.json").write_text(json.dumps(record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--outer-lr", type=float, default=None, help="default: 1.0")
    parser.add_argument(
        "--outer-momentum", type=float, default=None, help="default: the library's for the wire"
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["int8x2", "topk2"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--seed", type=int, default=0, help="the model's initialisation and the batches' order"
    )
    parser.add_argument("--out", default=".", help="folder for the ranks' records")
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=None, help="the coordinator's (default: its own)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="topk2", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(
        f"wan task, W = {args.world}, {args.steps} steps, H = {args.sync_every}, seed {args.seed}, "
        f"density {args.density}, outer lr {args.outer_lr or 1.0}, momentum "
        f"{'the library default' if args.outer_momentum is None else args.outer_momentum}"
    )
    print(f"{'method':<8}{'held-out':>10}{'vs int8x2':>11}{'up B/round':>13}{'down B/round':>14}")
    rows = {method: run_method(method, args) for method in args.methods}
    base = rows["int8x2"][0]["held_out_loss"] if "int8x2" in rows else None
    for method, records in rows.items():
        first = records[0]
        up = first["round_bytes_up"][-1] if first["round_bytes_up"] else 0
        down = first["round_bytes_down"][-1] if first["round_bytes_down"] else 0
        ratio = f"{first['held_out_loss'] / base:>11.4f}" if base else f"{'':>11}"
        print(f"{method:<8}{first['held_out_loss']:>10.4f}{ratio}{up:>13,}{down:>14,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
