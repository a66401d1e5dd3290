"""One rank of a torch.distributed script, run unchanged over "gloo" or "gradsync".

The process group comes from `init_process_group(backend, init_method="env://")`
(torch's TCPStore at MASTER_ADDR / MASTER_PORT; gradsync's groups join the
coordinator at $GRADSYNC_COORDINATOR), or with `--rendezvous gradsync` from
`init_method="gradsync://<coordinator>"` (the coordinator's store; no MASTER_*
and no $GRADSYNC_COORDINATOR). Scenarios:

- ddp: stock `torch.nn.parallel.DistributedDataParallel` trains the given zoo cases;
  every state-dict entry is saved as "case/name"; over "gradsync", the default
  group's host group (its ranks, ops, bytes uploaded) when it has one.
- usage: a training loop with `DistributedSampler()` (no arguments), a loss metric
  summed by `dist.all_reduce` and `dist.barrier()` after every epoch; then every
  collective on small tensors, each result saved under the op's name; then two
  overlapping `new_group`s of two ranks each (W = 3), an all-reduce and an
  all-gather in each, with the default group used in between.
- kill: rank 1 kills itself while rank 0 waits on an all-reduce; rank 0 saves the
  error and how long it took.
- ddp_kill: rank 1 kills itself at the third step of stock DDP; rank 0 saves what its
  backward pass raised and how long it took.
- wire: stock DDP with the 16-bit wire of `--wire-dtype` (set as $GRADSYNC_WIRE_DTYPE);
  beside it, this one process computes the same training over every rank's batches,
  once with the wire's rounding (each rank's gradient share rounded, summed in float32
  in rank order, the sum rounded) and once exactly. Then, on a group without the wire
  (`GradsyncOptions(wire_dtype=torch.float32)`), the ranks all-reduce tensors of
  different shapes; and a third group, whose rank 1 asks for another wire, all-reduces
  once. Both errors are saved.
- shards: for a sharded coordinator (W = 2): stock DDP trains an MLP whose one gradient
  bucket (132 KB) is large enough to be spread over the shards, then the ranks
  all-reduce an 80 KB tensor with every reduce op, all-gather it and reduce-scatter
  twice its size; over "gradsync" also AVG and
  PREMUL_SUM, how many ranges the group sent to shards, and last an all-reduce whose
  size differs between the ranks (the error saved).
- ddp_steps: stock DDP trains a small MLP for `--steps` steps, `--step-delay-s` apart,
  writing the step it finished to `<out>.progress` (a test kills the coordinator
  meanwhile); saves the parameters and, over "gradsync", how often the group reconnected
  and how many collectives it sent again.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import zoo


def run_ddp(cases: list[str], rank: int, saved: dict[str, np.ndarray]) -> None:
    for name in cases:
        case = zoo.CASES[name]
        model = case.build(rank)
        wrapped = nn.parallel.DistributedDataParallel(model, **case.ddp_options)
        zoo.train(case, model, wrapped, rank)
        for key, tensor in model.state_dict().items():
            saved[f"{name}/{key}"] = tensor.detach().float().numpy().copy()
    host = getattr(dist.group.WORLD, "host", None)
    if host is not None:
        saved["host_members"] = np.array(host.members)
        saved["host_ops"] = np.array(host.ops)
        saved["host_uploaded_bytes"] = np.array(host.uploaded_bytes)


def run_script(rank: int, saved: dict[str, np.ndarray]) -> None:
    """What a user's script does with the process group besides DDP."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    generator = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.randn(22, 6, generator=generator), torch.randn(22, 1, generator=generator)
    )
    sampler = DistributedSampler(data)  # rank and size from the default group
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, seen = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in DataLoader(data, batch_size=4, sampler=sampler):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(x), float(len(x))])
        dist.all_reduce(total)  # the metric over every rank
        losses.append(float(total[0] / total[1]))
        seen.append(float(total[1]))
        dist.barrier()
    saved["losses"] = np.array(losses)
    saved["samples_seen"] = np.array(seen)
    saved["indices"] = np.array(list(iter(sampler)))
    for key, tensor in model.module.state_dict().items():
        saved[f"model/{key}"] = tensor.detach().numpy().copy()


def run_ops(rank: int, world: int, saved: dict[str, np.ndarray]) -> None:
    def mine(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
        return (values * (rank + 1) - rank).to(dtype)

    for name, op in (
        ("sum", dist.ReduceOp.SUM),
        ("min", dist.ReduceOp.MIN),
        ("max", dist.ReduceOp.MAX),
        ("product", dist.ReduceOp.PRODUCT),
    ):
        tensor = mine(3, 2)
        dist.all_reduce(tensor, op=op)
        saved[f"all_reduce_{name}"] = tensor.numpy()
    ints = mine(4, dtype=torch.int64)
    dist.all_reduce(ints)
    saved["all_reduce_int64"] = ints.numpy()
    coalesced = [mine(2), mine(3)]
    dist.all_reduce_coalesced(coalesced)
    saved["all_reduce_coalesced"] = torch.cat(coalesced).numpy()
    pending = dist.all_reduce(mine(5), async_op=True)
    future_values = pending.get_future().wait()
    saved["all_reduce_async"] = future_values[0].numpy()
    root = world - 1
    tensor = mine(4)
    dist.broadcast(tensor, src=root)
    saved["broadcast"] = tensor.numpy()
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, mine(3))
    saved["all_gather"] = torch.stack(gathered).numpy()
    into = torch.zeros(world * 3)
    dist.all_gather_into_tensor(into, mine(3))
    saved["all_gather_into_tensor"] = into.numpy()
    part = torch.zeros(2)
    dist.reduce_scatter_tensor(part, mine(2 * world))
    saved["reduce_scatter_tensor"] = part.numpy()
    listed = torch.zeros(2)
    dist.reduce_scatter(listed, [mine(2) + i for i in range(world)])
    saved["reduce_scatter"] = listed.numpy()
    gather_list = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(mine(2), gather_list, dst=0)
    if gather_list is not None:
        saved["gather"] = torch.stack(gather_list).numpy()
    scattered = torch.zeros(2)
    dist.scatter(scattered, [mine(2) * (i + 1) for i in range(world)] if rank == 0 else None, src=0)
    saved["scatter"] = scattered.numpy()
    swapped = torch.zeros(world * 2)
    dist.all_to_all_single(swapped, mine(world * 2))
    saved["all_to_all_single"] = swapped.numpy()
    reduced = mine(3)
    dist.reduce(reduced, dst=0)
    if rank == 0:
        saved["reduce"] = reduced.numpy()
    dist.barrier()
    if dist.get_backend() == "gradsync":  # ops gloo does not have, checked against sums
        tensor = mine(3, 2)
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        saved["gradsync_avg"] = tensor.numpy()
        tensor = mine(3, 2)
        dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.5))
        saved["gradsync_premul_sum"] = tensor.numpy()
        half = mine(4, dtype=torch.bfloat16)
        dist.all_reduce(half)
        saved["gradsync_bf16"] = half.float().numpy()
        try:
            dist.all_reduce(mine(2, dtype=torch.int64), op=dist.ReduceOp.BAND)
        except ValueError as exc:
            saved["gradsync_band_error"] = np.array(str(exc))
        try:
            dist.send(mine(2), dst=(rank + 1) % world)
        except RuntimeError as exc:
            saved["gradsync_send_error"] = np.array(str(exc))
        saved["operations_completed"] = np.array(dist.group.WORLD.operations_completed)
        saved["job_id"] = np.array(dist.group.WORLD.job_id)


def run_groups(rank: int, saved: dict[str, np.ndarray]) -> None:
    """Subgroups of a world of 3."""
    head = dist.new_group([0, 1])  # every rank creates every group, in the same order
    tail = dist.new_group([1, 2])
    for name, group, members in (("head", head, (0, 1)), ("tail", tail, (1, 2))):
        if rank in members:
            tensor = torch.tensor([rank + 1.0, 10.0 * rank])
            dist.all_reduce(tensor, group=group)
            saved[f"{name}_sum"] = tensor.numpy()
            parts = [torch.zeros(1) for _ in members]
            dist.all_gather(parts, torch.tensor([float(rank)]), group=group)
            saved[f"{name}_gather"] = torch.cat(parts).numpy()
            saved[f"{name}_rank"] = np.array(dist.get_rank(group))
        world = torch.tensor([1.0])
        dist.all_reduce(world)
        saved[f"world_after_{name}"] = world.numpy()
    dist.barrier()


WIRE_STEPS = 3


def wire_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def run_wire(rank: int, world: int, saved: dict[str, np.ndarray]) -> None:
    from gradsync.distributed import GradsyncOptions

    wire = getattr(torch, os.environ["GRADSYNC_WIRE_DTYPE"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    references = {"rounded": copy.deepcopy(model), "exact": copy.deepcopy(model)}
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.1)
        for name, m in (("ours", model), *references.items())
    }
    for step in range(WIRE_STEPS):
        optimizers["ours"].zero_grad()
        x, y = wire_batch(rank, step)
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizers["ours"].step()
        for name, reference in references.items():
            shares = []  # every rank's gradient, divided by the world size as DDP does
            for other in range(world):
                reference.zero_grad()
                x, y = wire_batch(other, step)
                nn.functional.mse_loss(reference(x), y).backward()
                shares.append([p.grad / world for p in reference.parameters()])
            for index, parameter in enumerate(reference.parameters()):
                if name == "exact":
                    parameter.grad = sum(share[index] for share in shares)
                    continue
                total = shares[0][index].to(wire).float()  # widened, summed in rank order
                for share in shares[1:]:
                    total = total + share[index].to(wire).float()
                parameter.grad = total.to(wire).float()  # the answer, in the wire's type
            optimizers[name].step()
    for name, module in (("ours", model), *references.items()):
        for key, tensor in module.state_dict().items():
            saved[f"{name}/{key}"] = tensor.detach().numpy().copy()
    saved["elements"] = np.array(sum(p.numel() for p in model.parameters()))
    exact = dist.new_group(pg_options=GradsyncOptions(wire_dtype=torch.float32))
    dist.all_reduce(torch.ones(2), group=exact)  # a first one that matches
    failed(dist.all_reduce(torch.ones(2 + rank), group=exact, async_op=True), "shape", saved)
    other_wire = torch.float16 if rank == 1 else None  # rank 0 keeps the variable's
    group = dist.new_group(pg_options=GradsyncOptions(wire_dtype=other_wire))
    failed(dist.all_reduce(torch.ones(3), group=group, async_op=True), "wire", saved)


def failed(work: dist.Work, name: str, saved: dict[str, np.ndarray]) -> None:
    """Save what waiting for `work` raised, as `name`_error and `name`_error_type."""
    try:
        work.wait()
    except Exception as exc:  # what c10d hands back, whatever its class
        saved[f"{name}_error"] = np.array(str(exc))
        saved[f"{name}_error_type"] = np.array(type(exc).__name__)


def run_kill(rank: int, saved: dict[str, np.ndarray]) -> None:
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    try:
        work.wait()
    except Exception as exc:
        saved["error"] = np.array(str(exc))
        saved["error_type"] = np.array(type(exc).__name__)
    saved["failed_after_s"] = np.array(time.monotonic() - started)


def run_ddp_kill(rank: int, saved: dict[str, np.ndarray]) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    for step in range(5):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            model(torch.randn(4, 8)).sum().backward()
        except Exception as exc:
            saved["error"] = np.array(str(exc))
            saved["error_type"] = np.array(type(exc).__name__)
            saved["failed_after_s"] = np.array(time.monotonic() - started)
            saved["failed_at_step"] = np.array(step)
            return


def run_shards(rank: int, saved: dict[str, np.ndarray]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        data = torch.Generator().manual_seed(1000 * step + rank)
        optimizer.zero_grad()
        wrapped(torch.randn(8, 64, generator=data)).square().mean().backward()
        optimizer.step()
    for key, tensor in model.state_dict().items():
        saved[f"model/{key}"] = tensor.detach().numpy().copy()
    values = torch.arange(20_000, dtype=torch.float32) * (rank + 1) - rank
    ops = ["SUM", "MIN", "MAX", "PRODUCT"]
    if dist.get_backend() == "gradsync":
        ops.append("AVG")
    for name in ops:
        tensor = values.clone()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, name))
        saved[f"all_reduce_{name.lower()}"] = tensor.numpy()
    gathered = torch.empty(2 * len(values))
    dist.all_gather_into_tensor(gathered, values.clone())
    saved["all_gather_into_tensor"] = gathered.numpy()
    scattered = torch.empty(len(values))
    dist.reduce_scatter_tensor(scattered, torch.cat([values, values * 3 - 1]))
    saved["reduce_scatter_tensor"] = scattered.numpy()
    if dist.get_backend() != "gradsync":
        return
    tensor = values.clone()
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(0.5))
    saved["all_reduce_premul_sum"] = tensor.numpy()
    routes = dist.group.WORLD._session.shard_routes
    saved["ranges_sent"] = np.array(-1 if routes is None else routes.ranges_sent)
    failed(dist.all_reduce(torch.ones(20_000 + rank), async_op=True), "mismatch", saved)


def run_ddp_steps(
    rank: int, steps: int, delay_s: float, progress: Path, saved: dict[str, np.ndarray]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        data = torch.Generator().manual_seed(1000 * step + rank)
        optimizer.zero_grad()
        wrapped(torch.randn(4, 8, generator=data)).square().sum().backward()
        optimizer.step()
        progress.write_text(str(step))
        time.sleep(delay_s)
    for key, tensor in model.state_dict().items():
        saved[f"model/{key}"] = tensor.detach().numpy().copy()
    if dist.get_backend() == "gradsync":
        saved["reconnects"] = np.array(dist.group.WORLD.reconnects)
        saved["resent"] = np.array(dist.group.WORLD.collectives_resent)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "gradsync"], required=True)
    parser.add_argument(
        "--scenario",
        choices=["ddp", "usage", "kill", "ddp_kill", "wire", "ddp_steps", "shards"],
        required=True,
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="the gradsync coordinator")
    parser.add_argument("--master-port", type=int, required=True, help="torch's TCPStore")
    parser.add_argument("--cases", default="", help="ddp: comma-separated zoo case names")
    parser.add_argument("--rendezvous", choices=["env", "gradsync"], default="env")
    parser.add_argument("--wire-dtype", default="", help="$GRADSYNC_WIRE_DTYPE for the backend")
    parser.add_argument("--hierarchical", default="", help="$GRADSYNC_HIERARCHICAL")
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=10, help="ddp_steps: steps to train")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="ddp_steps: pause")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # torch's own deprecation notices (DDP, the *_into_tensor names) are not ours to fix.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
    torch.set_num_threads(1)
    time.sleep(args.start_delay_s)
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world_size))
    if args.wire_dtype:
        os.environ["GRADSYNC_WIRE_DTYPE"] = args.wire_dtype
    if args.hierarchical:
        os.environ["GRADSYNC_HIERARCHICAL"] = args.hierarchical
    init_method = f"gradsync://{args.coordinator}"
    if args.rendezvous == "env":
        init_method = "env://"
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(args.master_port),
            GRADSYNC_COORDINATOR=args.coordinator,
        )
    if args.backend == "gradsync":
        import gradsync.distributed  # noqa: F401  (registers the backend)
    from datetime import timedelta

    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group(args.backend, init_method=init_method, timeout=timeout)
    saved: dict[str, np.ndarray] = {"backend": np.array(dist.get_backend())}
    if args.scenario == "ddp":
        run_ddp(args.cases.split(","), args.rank, saved)
    elif args.scenario == "usage":
        run_script(args.rank, saved)
        run_ops(args.rank, args.world_size, saved)
        run_groups(args.rank, saved)
    elif args.scenario == "kill":
        run_kill(args.rank, saved)
    elif args.scenario == "wire":
        run_wire(args.rank, args.world_size, saved)
    elif args.scenario == "shards":
        run_shards(args.rank, saved)
    elif args.scenario == "ddp_steps":
        progress = Path(f"{args.out}.progress")
        run_ddp_steps(args.rank, args.steps, args.step_delay_s, progress, saved)
    else:
        run_ddp_kill(args.rank, saved)
    np.savez(args.out, **saved)
    if args.scenario in ("ddp", "usage", "wire", "ddp_steps", "shards"):
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
