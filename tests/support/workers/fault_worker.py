"""One rank of a fault-tolerance test job; reports how it ended as JSON.

It trains `scenarios.MixedModel` on the step-indexed batches of
`scenarios.rank_batch`, resuming at `model.step`, so a run that is killed and
resumed from a checkpoint must end with exactly the parameters of an
uninterrupted run. Fault injection (one per run, chosen by flags):
  --sleep-at STEP:SECONDS   stall before the backward of STEP (a straggler)
  --kill-at STEP            SIGKILL itself during the backward of STEP, after
                            the first bucket was uploaded and before the rest
  --stop-at STEP            the same moment, but SIGSTOP (frozen: its process and
                            sockets stay, its heartbeats stop; SIGCONT wakes it)
  --stall-mid-backward STEP:SECONDS
                            the same moment, but stall (bucket 0 uploaded, the rest
                            not: bucket 0's average may land on every rank meanwhile)
  --nan-at STEP             put a NaN in the last element of bucket 1's last
                            gradient during the backward of STEP (a diverged rank)
  --drift-at STEP           once per process, before the forward of STEP, add 1e-3 to
                            the first parameter outside the optimizer (a training loop
                            that edits its own weights: this rank's state leaves the
                            others', which only a coordinator restart compares)
With --skip-aborted, an aborted step is skipped (its error noted in "aborts");
with --skip-nonfinite, a step whose averaged gradients hold NaN/Inf skips its
optimizer step (as torch's GradScaler does), noted in "nonfinite_steps".
Output: {"status": "ok" | error class name, "message", "step", "elapsed_s",
         "params": {name: list}} in --out; exit code 0, or 3 on a GradSyncError.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
import torch
from support import scenarios


class _StepsResent(logging.Handler):
    """Notes the steps the client says it uploaded again (`Reducer.resend`)."""

    def __init__(self, steps: list[int]) -> None:
        super().__init__(logging.WARNING)
        self._steps = steps

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"uploading step (\d+) again", record.getMessage())
        if found:
            self._steps.append(int(found.group(1)))


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sleep-at", default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--stall-mid-backward", default=None)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--reconnect-timeout-s", type=float, default=60.0)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--skip-aborted", action="store_true")
    parser.add_argument("--nan-at", type=int, default=None)
    parser.add_argument("--skip-nonfinite", action="store_true")
    parser.add_argument("--drift-at", type=int, default=None)
    args = parser.parse_args()
    rank, world = args.rank, args.world_size
    module = scenarios.MixedModel(seed=rank)
    contributors: list[int] = []
    restarts: list[int] = []
    computed = [0]  # forward/backward passes this process ran (recomputed ones included)
    restart_causes: list[str] = []
    resent: list[int] = []  # steps uploaded again to a restarted coordinator
    logging.getLogger("gradsync.client").addHandler(_StepsResent(resent))
    skipped: list[int] = []
    aborts: list[dict[str, object]] = []
    nonfinite_steps: list[int] = []
    report: dict[str, object] = {
        "status": "ok",
        "message": "",
        "step": 0,
        "contributors": contributors,
        "restarts": restarts,
        "computed": computed,
        "restart_causes": restart_causes,
        "resent": resent,
        "skipped": skipped,
        "aborts": aborts,
        "nonfinite_steps": nonfinite_steps,
        "drifted": [],
    }
    started = time.monotonic()
    try:
        model = gradsync.DistributedDataParallel(
            module,
            coordinator=args.coordinator,
            rank=rank,
            world_size=world,
            bucket_cap_mb=0.01,
            first_bucket_mb=0.002,
            timeout_s=args.timeout_s,
            join_timeout_s=args.timeout_s,
            metrics_port=args.metrics_port,
            trace_path=args.trace,
            reconnect_timeout_s=args.reconnect_timeout_s,
        )
        optimizer = scenarios.make_optimizer(model)
        model.register_optimizer(optimizer)
        sleep_step, sleep_s = (
            (int(args.sleep_at.split(":")[0]), float(args.sleep_at.split(":")[1]))
            if args.sleep_at
            else (-1, 0.0)
        )
        report["buckets"] = [list(plan.parameter_indices) for plan in model.bucket_plans]
        for at, signum in ((args.kill_at, signal.SIGKILL), (args.stop_at, signal.SIGSTOP)):
            if at is None:
                continue
            # The second bucket's last gradient: by then bucket 0 is on its way.
            victim = model.bucket_plans[1].parameter_indices[-1]
            target = list(module.parameters())[victim]

            def signal_hook(_: object, at: int = at, signum: int = signum) -> None:
                if model.step == at:
                    time.sleep(0.3)  # let bucket 0's chunks leave
                    os.kill(os.getpid(), signum)

            target.register_post_accumulate_grad_hook(signal_hook)
        if args.stall_mid_backward is not None:
            step_text, seconds_text = args.stall_mid_backward.split(":")
            stall_step, stall_s = int(step_text), float(seconds_text)
            victim = model.bucket_plans[1].parameter_indices[-1]

            def stall_hook(_: object) -> None:
                if model.step == stall_step:
                    time.sleep(stall_s)

            list(module.parameters())[victim].register_post_accumulate_grad_hook(stall_hook)
        if args.raise_at is not None:
            # An exception in the middle of backward, after bucket 0 was uploaded
            # (like an out-of-memory error on a GPU).
            victim = model.bucket_plans[1].parameter_indices[-1]

            def failing_hook(grad: object) -> object:
                if model.step == args.raise_at:
                    raise RuntimeError("simulated out of memory")
                return grad

            list(module.parameters())[victim].register_hook(failing_hook)
        if args.nan_at is not None:
            victim = model.bucket_plans[1].parameter_indices[-1]

            def nan_hook(grad: torch.Tensor) -> torch.Tensor:
                if model.step != args.nan_at:
                    return grad
                poisoned = grad.clone()
                poisoned.view(-1)[-1] = float("nan")
                return poisoned

            list(module.parameters())[victim].register_hook(nan_hook)
        with model:
            while model.step < args.steps:
                step = model.step
                if step == args.drift_at and not report["drifted"]:
                    with torch.no_grad():
                        next(module.parameters()).add_(1e-3)
                    report["drifted"] = [step]
                optimizer.zero_grad()
                x, y = scenarios.rank_batch(step, world, rank)
                try:
                    # forward() broadcasts rank 0's buffers: it can lose the coordinator too.
                    loss = scenarios.loss_fn(model(x), y)
                    if step == sleep_step:
                        time.sleep(sleep_s)
                    computed[0] += 1
                    loss.backward()
                except gradsync.CoordinatorRestartedError as exc:
                    restarts.append(model.step)
                    restart_causes.append(f"{exc.__cause__}")
                    continue  # nothing was applied: redo from the restored step
                except gradsync.StepAbortedError as exc:
                    if not args.skip_aborted:
                        raise
                    skipped.append(step)
                    aborts.append(
                        {
                            "class": type(exc).__name__,
                            "step": exc.step,
                            "bucket": exc.bucket_index,
                            "culprit": getattr(exc, "culprit_rank", None),
                            "message": str(exc),
                        }
                    )
                    continue  # the step was abandoned everywhere: skip its update
                except RuntimeError as exc:
                    if "simulated out of memory" not in str(exc):
                        raise
                    model.abandon_step("simulated out of memory")
                    skipped.append(step)
                    continue
                grads = [p.grad for p in module.parameters() if p.grad is not None]
                if args.skip_nonfinite and not all(bool(g.isfinite().all()) for g in grads):
                    nonfinite_steps.append(step)  # GradScaler would skip this update too
                else:
                    optimizer.step()
                report["step"] = model.step
                contributors.append(model.last_contributors)
                time.sleep(args.step_delay_s)
    except gradsync.GradSyncError as exc:
        report.update(status=type(exc).__name__, message=str(exc), step=exc.step)
    report["elapsed_s"] = time.monotonic() - started
    report["params"] = {n: p.detach().tolist() for n, p in module.named_parameters()}
    args.out.write_text(json.dumps(report))
    return 0 if report["status"] == "ok" else 3


if __name__ == "__main__":
    sys.exit(main())
