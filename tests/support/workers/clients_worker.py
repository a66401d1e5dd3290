"""One rank of a training script written for a client of torch.distributed, run
unchanged over "gloo" or "gradsync".

Every scenario trains a tiny model for a few steps on data that depends on the rank
and saves every parameter (the full tensor, gathered where it is sharded) as
"param/<name>". The rendezvous is c10d's `env://` (torch's TCPStore at MASTER_ADDR /
MASTER_PORT); gradsync's groups join the coordinator at $GRADSYNC_COORDINATOR.
Scenarios:

- fsdp: FSDP2 (`fully_shard`) of a two-layer transformer (the one the FSDP2 benchmark
  trains, `gradsync_bench.fsdp_worker.transformer`) over the default group.
- hsdp: FSDP2 on a 2-D DeviceMesh (replicate x shard, W = 4), both dimensions on the
  backend: HSDP.
- lightning: a PyTorch Lightning `Trainer` with
  `DDPStrategy(process_group_backend=...)`, one device per process, each process
  started apart as a node, as torchrun would start it (its environment variables).
- accelerate: a Hugging Face Accelerate training loop; the process group is made
  with the backend before the `Accelerator` (see docs/backend.md for why).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gradsync_bench.fsdp_worker import D_MODEL, SEQ, transformer
from torch import nn

STEPS = 3
BATCH = 4


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=generator)
    return x, torch.randn(BATCH, SEQ, 1, generator=generator)


def save_params(model: nn.Module, saved: dict[str, np.ndarray], prefix: str = "param") -> None:
    for name, parameter in model.named_parameters():
        data = parameter.detach()
        if hasattr(data, "full_tensor"):  # a DTensor shard: gather the whole tensor
            data = data.full_tensor()
        saved[f"{prefix}/{name}"] = data.float().numpy().copy()


def save_groups(groups: dict[str, Any], saved: dict[str, np.ndarray]) -> None:
    """The backend and, on gradsync, the job and the number of operations of each group."""
    for name, group in groups.items():
        saved[f"backend/{name}"] = np.array(dist.get_backend(group))
        if hasattr(group, "operations_completed"):
            saved[f"ops/{name}"] = np.array(group.operations_completed)
            saved[f"job/{name}"] = np.array(group.job_id)


def run_fsdp(rank: int, world: int, saved: dict[str, np.ndarray], *, hsdp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        saved["mesh_groups"] = np.array([mesh.get_group(d).size() for d in range(2)])
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = transformer()
    save_params(model, saved, "init")
    for layer in model[:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    save_params(model, saved)
    if hsdp:
        save_groups({"replicate": mesh.get_group(0), "shard": mesh.get_group(1)}, saved)
    else:
        save_groups({"world": mesh.get_group()}, saved)


def run_lightning(backend: str, world: int, saved: dict[str, np.ndarray]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.wrapped = ""

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            x, y = data
            self.wrapped = type(self.trainer.strategy.model).__name__
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(32, 6, generator=generator), torch.randn(32, 1, generator=generator)
    )
    module = Regression()
    save_params(module, saved, "init")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=DDPStrategy(process_group_backend=backend, timeout=timedelta(seconds=60)),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Lightning adds a DistributedSampler: each rank trains on its own half.
    trainer.fit(module, DataLoader(data, batch_size=4))
    saved["wrapped"] = np.array(module.wrapped)  # what trained it
    saved["world_seen"] = np.array(trainer.world_size)
    save_groups({"world": dist.group.WORLD}, saved)
    save_params(module, saved)


def run_accelerate(backend: str, saved: dict[str, np.ndarray]) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    # On CPU, Accelerate picks gloo itself and refuses any other backend name
    # (`InitProcessGroupKwargs(backend=...)`); it takes a process group made beforehand.
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    accelerator = Accelerator(cpu=True)
    saved["distributed_type"] = np.array(accelerator.distributed_type.value)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    save_params(model, saved, "init")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(32, 6, generator=generator), torch.randn(32, 1, generator=generator)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    saved["wrapped"] = np.array(type(model).__name__)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    metric = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), "sum")
    saved["metric"] = metric.numpy()
    saved["world_seen"] = np.array(accelerator.num_processes)
    save_groups({"world": dist.group.WORLD}, saved)
    save_params(accelerator.unwrap_model(model), saved)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "gradsync"], required=True)
    parser.add_argument(
        "--scenario", choices=["fsdp", "hsdp", "lightning", "accelerate"], required=True
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="the gradsync coordinator")
    parser.add_argument("--master-port", type=int, required=True, help="torch's TCPStore")
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # The clients' own notices (deprecations, hints about workers and loggers) are not ours.
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    time.sleep(args.start_delay_s)
    rank, world = args.rank, args.world_size
    # What torchrun sets for a process that is alone on its node.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        NODE_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.master_port),
        TORCHELASTIC_RUN_ID="clients",
        OMP_NUM_THREADS="1",
        GRADSYNC_COORDINATOR=args.coordinator,
    )
    if args.backend == "gradsync":
        import gradsync.distributed  # noqa: F401  (registers the backend)
    saved: dict[str, np.ndarray] = {}
    if args.scenario in ("fsdp", "hsdp"):
        dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
        run_fsdp(rank, world, saved, hsdp=args.scenario == "hsdp")
    elif args.scenario == "lightning":
        run_lightning(args.backend, world, saved)
    else:
        run_accelerate(args.backend, saved)
    np.savez(args.out, **saved)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
