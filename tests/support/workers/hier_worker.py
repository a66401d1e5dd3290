"""One rank of a hierarchical-aggregation test job; reports how it ended as JSON.

It trains `scenarios.MixedModel` (or, with --width, a wider two-layer MLP whose
gradients dwarf the protocol's own bytes) on the step-indexed batches of
`scenarios.rank_batch`. The emulated host and the shared-memory directory come
from the environment the test gives it ($GRADSYNC_HOST_ID, $GRADSYNC_SHM_DIR).
  --runs hier,flat,hier+view  one job after the other in this process (torch is
                              imported once), job ids <--job-id>-<index>:
                              hierarchical=True/False/"auto"; options: +view
                              (gradient_as_bucket_view=True), +kill (this run
                              obeys --kill-at), +tiny ($GRADSYNC_SHM_DIR is
                              --tiny-shm-dir for this run); "backend" is stock
                              torch DDP over the c10d backend "gradsync" (rendezvous
                              gradsync://<coordinator>, its default layout: a host
                              group per host), job id <--job-id>-<index>.pg-world
  --kill-at STEP              in a +kill run, SIGKILL itself during the backward of
                              STEP, after bucket 0 was handed on and before the rest
  --link-stats IFACE          record IFACE's tx/rx byte counters after a barrier
                              that follows construction and after the last step
                              ("link_start", "link_end"): the training's traffic
Output in --out: {"runs": [{"run", "status": "ok" | error class name, "message",
"step", "local_ranks" (the local group formed, [] when flat), "contributors",
"bytes_sent", "seconds_per_step", "params": {name: list}}]};
written after every run; exit code 0, or 3 if a run ended with a GradSyncError.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
import torch
from support import scenarios
from torch import nn


class WideModel(nn.Module):
    """Two float32 layers, `width` wide: megabytes of gradients for byte-counting tests."""

    def __init__(self, seed: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = nn.Linear(scenarios.IN_FEATURES, width)
        self.out = nn.Linear(width, scenarios.OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def link_bytes(interface: str) -> dict[str, int]:
    """Bytes this (emulated) host has sent and received on `interface` so far."""
    statistics = Path("/sys/class/net") / interface / "statistics"
    return {
        direction: int((statistics / f"{direction}_bytes").read_text())
        for direction in ("tx", "rx")
    }


RUN_KINDS = {"hier": True, "flat": False, "auto": "auto"}
RUN_OPTIONS = {"view", "kill", "tiny", "observe"}


def parse_run(spec: str) -> tuple[bool | str, set[str]]:
    """A run's `hierarchical=` argument and options: "hier+view+kill" -> (True, {...})."""
    kind, *options = spec.split("+")
    if kind not in RUN_KINDS or not set(options) <= RUN_OPTIONS:
        raise SystemExit(
            f"bad run {spec!r}: use hier|flat|auto, then +view, +kill, +tiny, +observe"
        )
    return RUN_KINDS[kind], set(options)


def train_backend(args: argparse.Namespace, job_id: str) -> dict[str, object]:
    """A "backend" run: the same training as stock DDP over "gradsync"; the run's report
    (with "host_members": the ranks of this rank's host group, [] when flat)."""
    import torch.distributed as dist
    from gradsync.distributed import GradsyncOptions

    rank, world = args.rank, args.world_size
    module: nn.Module = (
        WideModel(rank, args.width) if args.width else scenarios.MixedModel(seed=rank)
    )
    report: dict[str, object] = {"run": "backend", "status": "ok", "message": "", "step": 0}
    started = time.monotonic()
    try:
        dist.init_process_group(
            "gradsync",
            init_method=f"gradsync://{args.coordinator}",
            rank=rank,
            world_size=world,
            pg_options=GradsyncOptions(job_id=job_id),
        )
        host = getattr(dist.group.WORLD, "host", None)  # (the process group's own)
        report["local_ranks"] = [] if host is None else list(host.members)
        model = nn.parallel.DistributedDataParallel(module)  # (broadcasts rank 0's state)
        optimizer = scenarios.make_optimizer(model)
        if args.link_stats:
            dist.barrier()  # every rank constructed: the window holds training only
            report["link_start"] = link_bytes(args.link_stats)
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = scenarios.rank_batch(step, world, rank)
            scenarios.loss_fn(model(x), y).backward()
            optimizer.step()
            report["step"] = step + 1
        if args.link_stats:
            report["link_end"] = link_bytes(args.link_stats)
        dist.destroy_process_group()
    except (RuntimeError, gradsync.GradSyncError) as exc:
        report.update(status=type(exc).__name__, message=str(exc))
    report["elapsed_s"] = time.monotonic() - started
    report["params"] = {n: p.detach().tolist() for n, p in module.named_parameters()}
    return report


def train(args: argparse.Namespace, spec: str, job_id: str) -> dict[str, object]:
    """One job: build the model, train --steps steps; the run's report."""
    if spec == "backend":
        return train_backend(args, job_id)
    hierarchical, options = parse_run(spec)
    rank, world = args.rank, args.world_size
    if "tiny" in options:
        os.environ["GRADSYNC_SHM_DIR"] = str(args.tiny_shm_dir)
    elif args.tiny_shm_dir is not None:
        os.environ.pop("GRADSYNC_SHM_DIR", None)
    module: nn.Module = (
        WideModel(rank, args.width) if args.width else scenarios.MixedModel(seed=rank)
    )
    contributors: list[int] = []
    report: dict[str, object] = {
        "run": spec,
        "status": "ok",
        "message": "",
        "step": 0,
        "contributors": contributors,
    }
    started = time.monotonic()
    model = None
    try:
        model = gradsync.DistributedDataParallel(
            module,
            coordinator=args.coordinator,
            rank=rank,
            world_size=world,
            job_id=job_id,
            bucket_cap_mb=0.01 if not args.width else 1.0,
            first_bucket_mb=0.002 if not args.width else 0.25,
            timeout_s=args.timeout_s,
            join_timeout_s=args.timeout_s,
            gradient_as_bucket_view="view" in options,
            hierarchical=hierarchical,
            # +observe: a Chrome trace and a real /metrics endpoint, scraped below.
            trace_path=args.out.with_name(f"trace-{job_id}-{rank}.json")
            if "observe" in options
            else None,
            metrics_port=0 if "observe" in options else None,
        )
        # Introspection for the tests (no public API says it): the local group formed.
        group = model._session.local_group
        report["local_ranks"] = [] if group is None else list(group.ranks)
        optimizer = scenarios.make_optimizer(model)
        if args.kill_at is not None and "kill" in options:
            # The second bucket's last gradient: by then bucket 0 is on its way.
            victim = model.bucket_plans[1].parameter_indices[-1]

            def kill_hook(_: object) -> None:
                if model is not None and model.step == args.kill_at:
                    time.sleep(0.3)  # let bucket 0 leave
                    os.kill(os.getpid(), signal.SIGKILL)

            list(module.parameters())[victim].register_post_accumulate_grad_hook(kill_hook)
        if args.link_stats:
            model.barrier()  # every rank constructed: the window holds training only
            report["link_start"] = link_bytes(args.link_stats)
        first_step_at = time.monotonic()
        with model:
            while model.step < args.steps:
                optimizer.zero_grad(set_to_none=True)
                x, y = scenarios.rank_batch(model.step, world, rank)
                scenarios.loss_fn(model(x), y).backward()
                optimizer.step()
                report["step"] = model.step
                contributors.append(model.last_contributors)
                time.sleep(args.step_delay_s)
            report["seconds_per_step"] = (time.monotonic() - first_step_at) / max(1, args.steps)
            if "observe" in options:
                report.update(observe(model, rank))
            if args.link_stats:
                report["link_end"] = link_bytes(args.link_stats)
    except gradsync.GradSyncError as exc:
        report.update(status=type(exc).__name__, message=str(exc), step=getattr(exc, "step", None))
    report["elapsed_s"] = time.monotonic() - started
    report["bytes_sent"] = model.bytes_sent if model is not None else 0
    report["params"] = {n: p.detach().tolist() for n, p in module.named_parameters()}
    return report


def observe(model: gradsync.DistributedDataParallel, rank: int) -> dict[str, object]:
    """+observe: rank 0 checkpoints through the coordinator; every rank scrapes its own
    /metrics over HTTP (the samples the tests look for)."""
    found: dict[str, object] = {}
    if rank == 0:
        found["checkpoint_step"] = model.save_checkpoint(wait=True)
    # Nobody leaves before rank 0's checkpoint is in: a job whose other ranks have gone
    # is finishing, and refuses it (a race a fast follower used to win now and then).
    model.barrier()
    server = model._instruments.server  # introspection: the port it bound
    assert server is not None
    with urllib.request.urlopen(server.url, timeout=10) as response:
        text = response.read().decode()
    found["metrics"] = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])  # one series each: rank="r"
        for line in text.splitlines()
        if line.startswith(("gradsync_worker_local_", "gradsync_worker_host_sent"))
    }
    return found


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--runs", default="auto", help="comma-separated: hier|flat|auto[+opts]")
    parser.add_argument("--tiny-shm-dir", type=Path, default=None, help="for +tiny runs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--width", type=int, default=0, help="0: scenarios.MixedModel")
    parser.add_argument("--job-id", default="hier")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument(
        "--link-stats", default=None, help="interface whose byte counters each run records"
    )
    args = parser.parse_args()
    runs = []
    for index, spec in enumerate(args.runs.split(",")):
        runs.append(train(args, spec, f"{args.job_id}-{index}"))
        # After every run: a rank killed in a later run keeps its earlier reports.
        args.out.write_text(json.dumps({"runs": runs}))
    return 0 if all(run["status"] == "ok" for run in runs) else 3


if __name__ == "__main__":
    sys.exit(main())
