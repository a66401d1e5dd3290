"""A real DiLoCo run of the quality task beside its simulation (`-m gradsync_bench.quality_real`).

The quality harness tunes in one process (`gradsync_bench.quality_sim`); this runs one
of its settings for real: a loopback `gradsync serve`, W worker processes, each rank
training `ReplicaTransformer(1)` on its own slice with `gradsync.DiLoCo` (the library's
defaults unless given), the same batches, inner optimizer and schedule as the
simulation. Rank 0 scores its final model on the held-out text; the launcher runs the
simulation of the same setting beside it and writes both into `--out`
(`quality-real-h{H}.json`), with the relative difference.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsync_bench import provenance
from gradsync_bench.procs import flag_args, stop_process, wait_ranks
from gradsync_bench.quality_sim import (
    BATCH,
    CONTEXT,
    ReplicaTransformer,
    Setting,
    Task,
    held_out_loss,
    inner_lr_at,
    replica_losses,
    simulate,
)

#: What `outer_momentum=None` means on a dense (float32, 16-bit or int8) wire, as
#: `gradsync.DiLoCo` documents it; a real run that used another would show up as a
#: difference from the simulation.
DENSE_WIRE_MOMENTUM = 0.5


def library_defaults() -> tuple[float, float]:
    """(outer_lr, outer_momentum) `gradsync.DiLoCo` defaults to on a dense wire."""
    from gradsync import DiLoCo

    parameters = inspect.signature(DiLoCo.__init__).parameters
    momentum = parameters["outer_momentum"].default  # None: the wire's own default
    return parameters["outer_lr"].default, DENSE_WIRE_MOMENTUM if momentum is None else momentum


def worker(args: argparse.Namespace) -> None:
    """One rank: train with `gradsync.DiLoCo` at the library's defaults (H, wire given)."""
    import gradsync
    import torch

    from gradsync_bench import wan_task

    torch.set_num_threads(1)
    task = Task(steps=args.steps, world_size=args.world_size)
    corpus = wan_task.read_corpus()
    text, held_out = wan_task.split(corpus, args.rank, args.world_size)
    batches = wan_task.Batches(text, BATCH, CONTEXT, args.rank, task.seed)
    model = ReplicaTransformer(1)
    inner = torch.optim.AdamW(model.parameters(), lr=task.inner_lr, weight_decay=0.01)
    diloco = gradsync.DiLoCo(
        model,
        inner,
        sync_every=args.sync_every,
        wire_dtype=torch.int8 if args.wire == "int8" else None,
        # Exact answers unless asked: the simulation it is checked against answers exactly.
        answer_dtype=torch.int8 if args.answer == "int8" else None,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        job_id="quality",
        timeout_s=600,
    )
    started = time.perf_counter()
    try:
        for step in range(task.steps):
            for group in inner.param_groups:
                group["lr"] = inner_lr_at(task, step)
            inner.zero_grad()
            inputs, targets = batches.next()
            torch.autograd.backward(
                replica_losses(model, inputs.unsqueeze(0), targets.unsqueeze(0)).sum()
            )
            inner.step()
            diloco.step()
        record = {
            "rank": args.rank,
            "held_out_loss": held_out_loss(model, held_out),
            "seconds": time.perf_counter() - started,
            "rounds": diloco.rounds,
        }
        Path(args.out).write_text(json.dumps(record))
    finally:
        diloco.close()


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """The real run at W ranks and its simulation; the record written to `--out`."""
    from gradsync_proto.net.launch import local_launch, start_coordinator

    outer_lr, momentum = library_defaults()
    # The library's heartbeat timeout unless asked otherwise (a machine whose cores are
    # shared with other work can starve a busy rank's process for seconds).
    extra = (
        []
        if args.heartbeat_timeout_s is None
        else ["--heartbeat-timeout", str(args.heartbeat_timeout_s)]
    )
    coordinator, port = start_coordinator(args.world_size, *extra, launch=local_launch)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="gradsync-quality-") as folder:
            outs = [Path(folder) / f"rank{r}.json" for r in range(args.world_size)]
            processes = [
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "gradsync_bench.quality_real", "--worker"),
                        *flag_args(
                            rank=rank,
                            world_size=args.world_size,
                            steps=args.steps,
                            sync_every=args.sync_every,
                            wire=args.wire,
                            answer=args.answer,
                            coordinator=f"127.0.0.1:{port}",
                            out=outs[rank],
                        ),
                    ],
                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for rank in range(args.world_size)
            ]
            wait_ranks(
                processes,
                args.timeout_s,
                lambda rank, code, err: f"rank {rank} failed (exit {code}): {err[-2000:]}",
            )
            ranks = [json.loads(path.read_text()) for path in outs]
    finally:
        stop_process(coordinator)
    real_s = time.perf_counter() - started
    setting = Setting(
        "diloco", sync_every=args.sync_every, outer_lr=outer_lr, outer_momentum=momentum,
        wire=args.wire,
    )  # fmt: skip
    if args.simulated is None:
        simulated = simulate(setting, Task(steps=args.steps, world_size=args.world_size))
        reference = simulated.held_out_loss
    else:  # the same setting's result from `gradsync_bench.quality` (quality-*.json)
        runs = json.loads(args.simulated.read_text())["runs"]
        reference = next(r["held_out_loss"] for r in runs if r["name"] == setting.name)
    real = ranks[0]["held_out_loss"]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": provenance.commit(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus (shared)",
        "command": provenance.command_line(),
        "setting": setting.name,
        "answer": args.answer,
        "steps": args.steps,
        "world_size": args.world_size,
        "real_held_out_loss": real,
        "real_ranks": ranks,
        "real_seconds": real_s,
        "simulated_held_out_loss": reference,
        "simulated_from": str(args.simulated) if args.simulated else "simulated beside it",
        "relative_difference": real / reference - 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=Task.steps)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--wire", choices=["fp32", "int8"], default="fp32")
    parser.add_argument(
        "--answer",
        choices=["exact", "int8"],
        default="exact",
        help="the answer: exact float32, or int8 changes (needs --wire int8); the "
        "simulation beside it always answers exactly",
    )
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None)
    parser.add_argument(
        "--simulated",
        type=Path,
        default=None,
        help="a quality-*.json holding this setting's simulation (else simulate it here)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    record = launch(args)
    args.out.mkdir(parents=True, exist_ok=True)
    answer = "" if args.answer == "exact" else f"-answer-{args.answer}"
    path = args.out / f"quality-real-h{args.sync_every}-{args.wire}{answer}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "real_ranks"}, indent=1))


if __name__ == "__main__":
    main()
