"""W ranks of stock c10d over "gradsync": each issues N async all_reduces of a 64 KiB
tensor back to back, then waits for all (as DDP does with a step's buckets), against
the same N one after the other. Prints rank 0's milliseconds per op, 3 repetitions.

Usage: python burst.py W N (with the project's PYTHONPATH); starts its own coordinator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def launch(world: int, count: int) -> None:
    from gradsync_bench.procs import stop_process
    from gradsync_proto.net.launch import free_port, local_launch, start_coordinator

    coordinator, port = start_coordinator(world, launch=local_launch)
    master_port = str(free_port())
    try:
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                BURST_RANK=str(rank),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master_port,
                GRADSYNC_COORDINATOR=f"127.0.0.1:{port}",
                OMP_NUM_THREADS="1",
            )
            argv = [sys.executable, __file__, str(world), str(count)]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        stop_process(coordinator)
    print(outputs[0].strip())


def rank_main(world: int, count: int) -> None:
    import gradsync.distributed  # noqa: F401  (registers the backend)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gradsync")
    tensors = [torch.ones(16384) for _ in range(count)]
    for tensor in tensors[:4]:
        dist.all_reduce(tensor)
    dist.barrier()
    result: dict[str, list[float]] = {"burst_ms_per_op": [], "serial_ms_per_op": []}
    for _ in range(3):
        started = time.perf_counter()
        works = [dist.all_reduce(tensor, async_op=True) for tensor in tensors]
        for work in works:
            work.wait()
        burst = time.perf_counter() - started
        started = time.perf_counter()
        for tensor in tensors:
            dist.all_reduce(tensor)
        serial = time.perf_counter() - started
        result["burst_ms_per_op"].append(round(burst / count * 1e3, 3))
        result["serial_ms_per_op"].append(round(serial / count * 1e3, 3))
    assert torch.equal(tensors[0], torch.full((16384,), float(world) ** 7))
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, ops = int(sys.argv[1]), int(sys.argv[2])
    if os.environ.get("BURST_RANK") is None:
        launch(world_size, ops)
    else:
        rank_main(world_size, ops)
