"""One rank of the wan suite: train the char transformer with one synchronization method.

Launched by `gradsync_bench.wan` on an emulated worker host (a network namespace whose
eth0 is shaped). Every method trains the same model on the same rank's batches with the
same inner optimizer (AdamW); they differ only in how the ranks synchronize:

  nosync           no communication at all: the compute-only reference (100 % utilization).
  ddp-gloo         torch.nn.parallel.DistributedDataParallel over gloo, every step.
  gradsync-ddp     gradsync.DistributedDataParallel, every step.
  diloco-hH-WIRE   gradsync.DiLoCo, sync_every=H, fp32 or int8 pseudo-gradients.
  streaming-fF-... gradsync.DiLoCo with fragments=F and overlap_steps (int8).
  diloco-h50-topk2 gradsync.DiLoCo on the sparse 2-bit wire (`gradsync.SparseWire`), with
                   the library's outer settings for it (lr 1.0, no momentum).
  torchft-hH-fp32  torchft's DiLoCo, one replica group per host (`gradsync_bench.torchft_wan`).

The timed window starts after a barrier of all ranks (files in the shared work folder:
the namespaces share the file system) and after one untimed forward/backward (no
optimizer step, so every method starts from the same parameters). It counts `--steps`
inner steps; a streaming round still in flight at the end is collected inside it. The
rank reads its host's eth0 byte counters at both ends of the window and writes one JSON
record: seconds, bytes, the client's own byte counts, the seconds each synchronizing step
blocked (optimizer step and synchronization, at every H-th step) and when it began, for
DiLoCo each round's timeline (upload start and answer per fragment) and how long each
merge blocked, the training losses and the held-out loss of its final model. At the
window's end it leaves a marker file (`<method>-end.<rank>`) beside the start barrier's, for
a profiler that samples only the window (`gradsync_bench.wan_profile`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync_bench import wan_task
from gradsync_bench.procs import exit_now, link_bytes
from gradsync_bench.train_worker import leave

#: How long a rank waits at the start barrier for the others (they import torch on 2 cores).
BARRIER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Method:
    """A synchronization method of the scorecard."""

    name: str
    #: "nosync", "ddp-gloo", "gradsync-ddp", "diloco" or "torchft" (torchft's DiLoCo).
    kind: str
    sync_every: int = 1
    int8: bool = False
    fragments: int = 1
    overlap_steps: int = 0
    #: The new global parameters come back as an int8 change of the ranks' copy
    #: (`answer_dtype=torch.int8`) instead of in float32.
    compact_answer: bool = False
    #: > 0: the sparse 2-bit wire at this density both ways (`gradsync.SparseWire`).
    sparse_density: float = 0.0

    @property
    def every_step(self) -> bool:
        return self.kind in ("ddp-gloo", "gradsync-ddp")

    @property
    def uses_coordinator(self) -> bool:
        return self.kind in ("gradsync-ddp", "diloco")

    @property
    def uses_lighthouse(self) -> bool:
        return self.kind == "torchft"


#: Every method, in table order.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("nosync", "nosync"),
        Method("ddp-gloo", "ddp-gloo"),
        Method("gradsync-ddp", "gradsync-ddp"),
        Method("diloco-h10-fp32", "diloco", sync_every=10),
        Method("diloco-h10-int8", "diloco", sync_every=10, int8=True),
        Method("diloco-h50-fp32", "diloco", sync_every=50),
        Method("diloco-h50-int8", "diloco", sync_every=50, int8=True),
        Method(
            "streaming-f4-int8", "diloco", sync_every=50, int8=True, fragments=4, overlap_steps=5
        ),
        Method("diloco-h50-int8x2", "diloco", sync_every=50, int8=True, compact_answer=True),
        Method(
            "streaming-f4-int8x2",
            "diloco",
            sync_every=50,
            int8=True,
            fragments=4,
            overlap_steps=5,
            compact_answer=True,
        ),
        Method("diloco-h100-int8x2", "diloco", sync_every=100, int8=True, compact_answer=True),
        Method("diloco-h50-topk2", "diloco", sync_every=50, sparse_density=0.02),
        Method("torchft-h50-fp32", "torchft", sync_every=50),
        Method("torchft-h10-fp32", "torchft", sync_every=10),
    )
}


def barrier(folder: Path, name: str, rank: int, world_size: int) -> None:
    """Wait until every rank has reached `name` (a file per rank in the shared folder).

    Raises:
        TimeoutError: a rank did not arrive within BARRIER_TIMEOUT_S (naming which).
    """
    (folder / f"{name}.{rank}").write_text("")
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while True:
        missing = [r for r in range(world_size) if not (folder / f"{name}.{r}").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: ranks {missing} never reached barrier {name!r}")
        time.sleep(0.01)


def wrap(method: Method, model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """(the module to forward, the object holding the synchronization, or None)."""
    if method.kind == "ddp-gloo":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{args.gloo}",
            rank=args.rank,
            world_size=args.world_size,
        )
        return nn.parallel.DistributedDataParallel(model), None
    if method.kind == "nosync":
        return model, None
    import gradsync

    if method.kind == "gradsync-ddp":
        ddp = gradsync.DistributedDataParallel(
            model, hierarchical=False, **job_options(method, args)
        )
        return ddp, ddp
    return model, None  # DiLoCo wraps the inner optimizer too: see main


def job_options(method: Method, args: argparse.Namespace) -> dict[str, Any]:
    """The gradsync job options of every method that runs one (DDP or DiLoCo)."""
    return dict(
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        job_id=f"wan-{method.name}",
        timeout_s=900,
        join_timeout_s=300,
    )


def client_bytes_sent(ddp: Any, diloco: Any) -> int | None:
    """What gradsync itself counts as uploaded (every fragment's job), None for the
    methods gradsync does not run."""
    if diloco is not None:
        return sum(int(fragment.ddp.bytes_sent) for fragment in diloco.fragments)
    return int(ddp.bytes_sent) if ddp is not None else None


def round_timeline(
    diloco: Any, step: int, started: float, seen: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The rounds (per fragment) finished since the ones in `seen`: when each started
    uploading and got its answer, in seconds from the timed window's start, and its bytes."""
    rounds = []
    for index, fragment in enumerate(diloco.fragments):
        if fragment.in_flight or not fragment.last_round_finished:
            continue
        begin = round(fragment.last_round_started - started, 4)
        if begin < 0 or any(r["fragment"] == index and r["start_s"] == begin for r in seen):
            continue
        rounds.append(
            {
                "fragment": index,
                "merged_at_step": step,
                "start_s": begin,
                "answer_s": round(fragment.last_round_finished - started, 4),
                "sent_bytes": fragment.last_round_bytes,
                "received_bytes": fragment.last_round_received,
            }
        )
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=sorted(METHODS), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--gloo", default="", help="host:port of gloo's rendezvous (rank 0)")
    parser.add_argument("--lighthouse", default="", help="torchft's lighthouse URL")
    parser.add_argument("--address", default="", help="this host's address (torchft)")
    parser.add_argument("--link-stats", default="eth0")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    method = METHODS[args.method]

    corpus = wan_task.read_corpus()
    text, held_out = wan_task.split(corpus, args.rank, args.world_size)
    batches = wan_task.Batches(text, args.batch, args.context, args.rank)
    model = wan_task.build_model(args.context)
    forward, ddp = wrap(method, model, args)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diloco = None
    if method.kind == "diloco":
        import gradsync

        sparse = method.sparse_density > 0
        wire: torch.dtype | gradsync.SparseWire | None = (
            gradsync.SparseWire(method.sparse_density)
            if sparse
            else torch.int8
            if method.int8
            else None
        )
        diloco = gradsync.DiLoCo(
            model,
            inner,
            sync_every=method.sync_every,
            outer_lr=1.0 if sparse else 0.7,
            outer_momentum=None if sparse else 0.9,
            wire_dtype=wire,
            fragments=method.fragments,
            overlap_steps=method.overlap_steps,
            answer_dtype=torch.int8 if method.compact_answer else None,
            **job_options(method, args),
        )
    torchft = None
    if method.kind == "torchft":
        from gradsync_bench.torchft_wan import TorchftDiLoCo

        torchft = TorchftDiLoCo(
            model,
            inner,
            rank=args.rank,
            world_size=args.world_size,
            address=args.address,
            lighthouse=args.lighthouse,
            sync_every=method.sync_every,
            outer_lr=0.7,
            outer_momentum=0.9,
            timeout_s=900,
        )

    # Warm-up: one forward/backward (allocations, gloo's and gradsync's first bucket
    # exchange); no optimizer step, so every method starts from the same parameters.
    inner.zero_grad()
    inputs, targets = batches.next()
    torch.autograd.backward(wan_task.loss_of(forward, inputs, targets))
    inner.zero_grad()
    batches = wan_task.Batches(text, args.batch, args.context, args.rank)

    barrier(args.workdir, f"{method.name}-start", args.rank, args.world_size)
    link_before = link_bytes(args.link_stats)
    client_before = client_bytes_sent(ddp, diloco)
    round_bytes: list[int] = []
    round_seconds: list[float] = []
    if torchft is not None:
        torchft.__enter__()  # hooks inner.step: every H-th call synchronizes
    losses: list[list[float]] = []
    pending: list[float] = []
    timeline: list[dict[str, Any]] = []
    # [step, seconds] of every DiLoCo.step that merged a round (its exposed wait).
    merge_seconds: list[list[float]] = []
    # When each synchronizing step's optimizer step began, seconds from the window's start.
    sync_started: list[float] = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inner.zero_grad()
        inputs, targets = batches.next()
        loss = wan_task.loss_of(forward, inputs, targets)
        torch.autograd.backward(loss)
        stepped = time.perf_counter()
        inner.step()
        # `last_round_bytes` (the latest round's upload, every fragment's together) is
        # one round's only without fragments.
        merging = time.perf_counter()
        if diloco is not None and diloco.step():
            if len(diloco.fragments) == 1:
                round_bytes.append(diloco.last_round_bytes)
            merge_seconds.append([step, time.perf_counter() - merging])
            timeline.extend(round_timeline(diloco, step, started, timeline))
        if method.kind not in ("nosync", "ddp-gloo", "gradsync-ddp") and (
            step % method.sync_every == 0
        ):
            round_seconds.append(time.perf_counter() - stepped)
            sync_started.append(stepped - started)
        pending.append(float(loss.detach()))
        if step % args.log_every == 0 or step == args.steps:
            losses.append([step, sum(pending) / len(pending)])
            pending = []
    if diloco is not None:
        # A streaming round started at the last steps is part of the work: collect it.
        for fragment in diloco.fragments:
            if fragment.in_flight:
                fragment.apply(diloco.mixing)
    if torchft is not None:
        torchft.__exit__()
        if torchft.rounds != args.steps // method.sync_every:
            raise RuntimeError(
                f"rank {args.rank}: torchft committed {torchft.rounds} rounds in "
                f"{args.steps} steps, expected {args.steps // method.sync_every}"
            )
    seconds = time.perf_counter() - started
    # The timed window's end, for a profiler that samples only inside it (`wan_profile`).
    (args.workdir / f"{method.name}-end.{args.rank}").write_text("")
    if diloco is not None:
        timeline.extend(round_timeline(diloco, args.steps, started, timeline))
    link_after = link_bytes(args.link_stats)
    client_after = client_bytes_sent(ddp, diloco)
    client_sent = (
        None if client_after is None or client_before is None else client_after - client_before
    )
    record: dict[str, Any] = {
        "method": method.name,
        "rank": args.rank,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "seconds": seconds,
        "link_tx": link_after["tx"] - link_before["tx"],
        "link_rx": link_after["rx"] - link_before["rx"],
        "client_bytes_sent": client_sent,
        "round_bytes_sent": round_bytes,
        "round_seconds": round_seconds,
        "round_timeline": timeline,
        "merge_seconds": merge_seconds,
        "sync_started_s": sync_started,
        "losses": losses,
        "held_out_loss": wan_task.held_out_loss(model, held_out, args.context),
        "parameter_bytes": wan_task.parameter_bytes(model),
    }
    (args.workdir / f"{method.name}-rank{args.rank}.json").write_text(json.dumps(record))
    leave([diloco, ddp, torchft], gloo=method.kind == "ddp-gloo")


if __name__ == "__main__":
    main()
    exit_now()
