"""One rank of the churn soak (`gradsync_bench.churn`): trains and logs every step.

The model and data are deterministic: the parameters start as `ChurnModel(0)`
(rank 0's, broadcast at start; a restarted rank starts from other weights and
must be healed to the live state), and the batch of (rank, step) is a pure
function of both (`rank_batch`). So the whole run can be replayed in one
process from the log alone (`churn_checks.replay`).

The log is one JSON object per line, written unbuffered so that a SIGKILL
loses nothing that happened before it:
  {"e": "start", "rank", "pid", "t"}                      process started
  {"e": "joined", "s", "t"}                               DDP built (joined, healed)
  {"e": "submit", "s", "t"}                               about to compute step s
  {"e": "applied", "s", "c", "d", "t"}                    step s applied, c contributors,
                                                          d: the first 16 hex digits of the
                                                          parameters' digest after it
  {"e": "restart", "s", "t", "why"}                       coordinator restarted: redo s
  {"e": "aborted", "s", "next", "t", "why"}               step s abandoned by every rank
  {"e": "error", "s", "t", "class", "message"}            a GradSyncError ends the process
  {"e": "final", "s", "t", "digest"}                      stopped at the stop step
An aborted step (StepAbortedError: abandoned for every rank) is skipped, no
update, as the library's docs ask of a training loop. A rank that gets any
other GradSyncError (e.g. it was SIGSTOPped long enough for the
elastic policy to drop it, then woken) logs it and exits 3: its supervisor
starts a new process, which rejoins and is healed like a killed rank's.
Training stops at the step written in --stop-file (the bench writes it once
every rank is live again), and the parameters are saved to --final.

`--ballast-mb` adds a frozen parameter of that size: in every state a donor
sends (and in the start broadcast), never in a gradient, so a test can make
healing slow without changing the arithmetic (the digests leave it out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from gradsync_bench.procs import stop_step

IN_FEATURES = 32
OUT_FEATURES = 8
HIDDEN = 64
BATCH_PER_RANK = 16
LR = 0.01
MOMENTUM = 0.9


class ChurnModel(nn.Module):
    """A small MLP: one gradient bucket (`bucket_layout`).

    Unsharded, a rank's contribution to a step is all or nothing; with coordinator
    shards, each shard averages its element range of the bucket on its own.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = nn.Linear(IN_FEATURES, HIDDEN)
        self.middle = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.out(torch.tanh(self.middle(torch.tanh(self.hidden(x)))))
        return output


def bucket_layout(grads: list[torch.Tensor]) -> torch.Tensor:
    """The model's gradients as its one bucket holds them: in reverse registration order.

    (The wrapper buckets in the order backward produces gradients, the reverse of
    registration; the bucket also carries the presence vector, one float per
    parameter, after the gradients: `bucket_elements` counts it.)
    """
    return torch.cat([grad.reshape(-1) for grad in reversed(grads)])


def bucket_elements(module: nn.Module) -> int:
    """Elements of the one bucket: the gradients and the presence vector after them."""
    parameters = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() for p in parameters) + len(parameters)


def unflatten(flat: torch.Tensor, parameters: list[nn.Parameter]) -> list[torch.Tensor]:
    """`bucket_layout` undone: one tensor per parameter, in registration order."""
    out: list[torch.Tensor] = []
    start = 0
    for parameter in reversed(parameters):
        stop = start + parameter.numel()
        out.append(flat[start:stop].view_as(parameter).clone())
        start = stop
    return out[::-1]


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `rank` at `step`: a pure function of both (any world size)."""
    generator = torch.Generator().manual_seed(1_000_003 * step + 7919 * rank + 17)
    x = torch.randn(BATCH_PER_RANK, IN_FEATURES, generator=generator)
    y = torch.randn(BATCH_PER_RANK, OUT_FEATURES, generator=generator)
    return x, y


def loss_fn(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return ((prediction - target) ** 2).mean()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: state that must evolve identically on every replica."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def digest(module: nn.Module) -> str:
    """SHA-256 of the trained parameters' bytes: equal digests are bitwise equal replicas.

    A frozen parameter (the ballast) is left out: it never changes, and hashing it
    after every step would cost more than the step.
    """
    hasher = hashlib.sha256()
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        hasher.update(name.encode())
        hasher.update(parameter.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


class _Log:
    """Line-at-a-time JSON log; every line reaches the OS before the next step."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"e": event, "t": time.time(), **fields}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--final", type=Path, required=True)
    parser.add_argument("--compute-s", type=float, default=0.02)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--reconnect-timeout-s", type=float, default=60.0)
    parser.add_argument("--incarnation", type=int, default=1)
    parser.add_argument("--ballast-mb", type=float, default=0.0)
    args = parser.parse_args()
    import gradsync

    torch.set_num_threads(1)  # the replay's arithmetic, bit for bit (and two cores here)
    log = _Log(args.log)
    log.write("start", rank=args.rank, pid=os.getpid())
    # The first process of rank 0 holds the job's initial weights (ChurnModel(0), broadcast
    # at start); every other process starts from weights of its own, which healing must
    # overwrite with the live state.
    module = ChurnModel(seed=args.rank + 1000 * (args.incarnation - 1))
    if args.ballast_mb > 0:
        floats = int(args.ballast_mb * (1 << 20)) // 4
        module.ballast = nn.Parameter(torch.zeros(floats), requires_grad=False)
    step = 0
    try:
        model = gradsync.DistributedDataParallel(
            module,
            coordinator=args.coordinator,
            rank=args.rank,
            world_size=args.world_size,
            bucket_cap_mb=25.0,
            first_bucket_mb=25.0,
            timeout_s=args.timeout_s,
            join_timeout_s=args.timeout_s,
            reconnect_timeout_s=args.reconnect_timeout_s,
            hierarchical=False,
            log_every_steps=10**9,
        )
        optimizer = make_optimizer(model)
        model.register_optimizer(optimizer)
        with model:
            log.write("joined", s=model.step)
            while True:
                step = model.step
                stop = stop_step(args.stop_file)
                if stop is not None and step >= stop:
                    break
                optimizer.zero_grad()
                x, y = rank_batch(step, args.rank)
                log.write("submit", s=step)
                time.sleep(args.compute_s)  # the compute of a real model's step
                try:
                    loss = loss_fn(model(x), y)
                    loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                except gradsync.CoordinatorRestartedError as exc:
                    log.write("restart", s=model.step, why=f"{exc.__cause__}")
                    continue  # nothing was applied: go on from the step the job is at
                except gradsync.StepAbortedError as exc:
                    # Abandoned for every rank (the library's contract): skip its update,
                    # as a training loop should, and go on with the next step.
                    log.write("aborted", s=step, next=model.step, why=str(exc)[:300])
                    continue
                optimizer.step()
                log.write("applied", s=step, c=model.last_contributors, d=digest(module)[:16])
            torch.save(module.state_dict(), args.final)
            log.write("final", s=model.step, digest=digest(module))
    except gradsync.GradSyncError as exc:
        log.write("error", s=step, **{"class": type(exc).__name__, "message": str(exc)})
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
