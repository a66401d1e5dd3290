"""One rank of the DDP parity zoo: trains every requested case under torch DDP or gradsync.

Both modes run in the same process layout and write the same file: for each
case, every entry of the model's state dict (parameters and buffers) after
training, keyed "case/name". The test compares the two modes' files.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import zoo


def wrap_ddp(case: zoo.Case, model: nn.Module) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if case.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    wrapped = nn.parallel.DistributedDataParallel(model, **case.ddp_options)
    if case.comm_hook == "fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return wrapped, model


def wrap_gradsync(case: zoo.Case, model: nn.Module, args: argparse.Namespace) -> Any:
    import gradsync

    if case.sync_batchnorm:
        model = gradsync.convert_sync_batchnorm(model)
    wrapped = gradsync.DistributedDataParallel(
        model,
        coordinator=args.coordinator,
        rank=args.rank,
        world_size=args.world_size,
        job_id=f"zoo-{case.name}",
        timeout_s=60,
        join_timeout_s=60,
        # Neither a comm hook nor join() runs inside a local group, and every rank of
        # this test shares one host: such cases aggregate flat.
        hierarchical="auto" if case.comm_hook is None and not zoo.is_uneven(case) else False,
        **case.ddp_options,
    )
    if case.comm_hook == "fp16":
        wrapped.register_comm_hook(None, gradsync.hooks.fp16_compress_hook)
    return wrapped, model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "gradsync"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", help="gradsync: host:port; ddp: a tcp:// init method")
    parser.add_argument("--cases", required=True, help="comma-separated zoo case names")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # Warnings are errors here (run_ranks sets PYTHONWARNINGS=error), except torch's
    # deprecation notices about its own internals, which torch.compile and DDP
    # trigger by themselves and which no code of ours can fix.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")
    torch.set_num_threads(1)
    if args.mode == "ddp":
        dist.init_process_group(
            "gloo", init_method=args.coordinator, rank=args.rank, world_size=args.world_size
        )
    saved: dict[str, np.ndarray] = {}
    for name in args.cases.split(","):
        case = zoo.CASES[name]
        model = case.build(args.rank)
        if args.mode == "ddp":
            wrapped, model = wrap_ddp(case, model)
        else:
            wrapped, model = wrap_gradsync(case, model, args)
        zoo.train(case, model, wrapped, args.rank)
        for key, tensor in model.state_dict().items():
            saved[f"{name}/{key}"] = tensor.detach().float().numpy().copy()
        if args.mode == "gradsync":  # gradient bytes this rank put on the wire
            saved[f"meta/{name}/bytes_sent"] = np.array(wrapped.bytes_sent)
        close = getattr(wrapped, "close", None)
        if close is not None:
            close()
    np.savez(args.out, **saved)
    if args.mode == "ddp":
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
