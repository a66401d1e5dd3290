"""One replica group of torchft's churn soak (`gradsync_bench.churn_torchft`), one process.

The same model, data, loss and optimizer as gradsync's churn worker (`churn_worker`:
`ChurnModel`, `rank_batch`, SGD with momentum), trained per step with torchft's `Manager`:
a quorum through the lighthouse before every step (synchronous, so that the step number
that picks the batch is the healed one), the gradients averaged by the manager's gloo
all-reduce among the participating groups in one flat buffer (torchft's DDP wrapper, on
CPU with gloo, raised an AssertionError in its communication hook when a peer died
mid-step, which ends the process), and the update applied only when the manager commits.
A restarted process joins the next quorum and is healed from a live group (torchft's
checkpoint transport) before it trains.

The log has the events and fields of `churn_worker`'s, so `churn_checks` reads it:
  {"e": "start" | "joined" | "submit" | "applied" | "final", ...}  as in churn_worker
  {"e": "restart", "s", "t", "why"}  torchft did not commit step s (an all-reduce or the
                                      quorum failed): nothing was applied, s is computed again
  {"e": "error", "s", "t", "class", "message"}  an exception ends the process (exit 3)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradsync_bench.churn_worker import (
    ChurnModel,
    _Log,
    digest,
    loss_fn,
    make_optimizer,
    rank_batch,
)
from gradsync_bench.procs import stop_step

if TYPE_CHECKING:
    from torchft.manager import Manager


def average_gradients(manager: Manager, module: nn.Module) -> None:
    """Average the gradients over the quorum's groups in one flat all-reduce (one bucket).

    A failed all-reduce leaves them unusable and makes the manager's commit fail; the
    step is then computed again."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lighthouse", required=True, help="http://host:port")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--final", type=Path, required=True)
    parser.add_argument("--compute-s", type=float, default=0.02)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--quorum-timeout-s", type=float, default=60.0)
    parser.add_argument("--quorum-retries", type=int, default=0)
    parser.add_argument("--incarnation", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    log = _Log(args.log)
    log.write("start", rank=args.rank, pid=os.getpid())
    step = 0
    try:
        from torch._C._distributed_c10d import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        # Every process starts from weights of its own: the first quorum heals them
        # (init_sync) from the live groups, or, at the job's start, from one of them.
        module = ChurnModel(seed=args.rank + 1000 * (args.incarnation - 1))
        optimizer = make_optimizer(module)
        timeout = timedelta(seconds=args.timeout_s)
        store = TCPStore(
            host_name="127.0.0.1",
            port=args.store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )

        def state_dict() -> dict[str, Any]:
            return {"model": module.state_dict(), "optim": optimizer.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])

        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=args.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
            connect_timeout=timedelta(seconds=60),
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=args.store_port,
            lighthouse_addr=args.lighthouse,
            replica_id=f"churn{args.rank}",
            quorum_retries=args.quorum_retries,
            hostname="127.0.0.1",
        )
        expected: int | None = None
        while True:
            stop = stop_step(args.stop_file)
            if stop is not None and manager.current_step() >= stop:
                break
            manager.start_quorum()  # blocks: quorum, then healing when behind
            step = manager.current_step()
            if step != expected:  # the first quorum, or healed to the live groups' step
                log.write("joined", s=step)
            optimizer.zero_grad()
            x, y = rank_batch(step, args.rank)
            log.write("submit", s=step)
            time.sleep(args.compute_s)  # the compute of a real model's step
            loss = loss_fn(module(x), y)
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            average_gradients(manager, module)
            if manager.should_commit():
                optimizer.step()
                log.write("applied", s=step, c=manager.num_participants(), d=digest(module)[:16])
                expected = step + 1
            else:
                log.write("restart", s=step, why=f"not committed: {manager.errored()}"[:300])
                expected = step
        torch.save(module.state_dict(), args.final)
        log.write("final", s=manager.current_step(), digest=digest(module))
        manager.shutdown(wait=False)
        del store
    except Exception as exc:
        traceback.print_exc()
        log.write("error", s=step, **{"class": type(exc).__name__, "message": str(exc)[:500]})
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
