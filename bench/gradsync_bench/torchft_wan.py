"""torchft's DiLoCo beside gradsync's on the emulated WAN (the wan and churn suites).

torchft (PyTorch's fault-tolerant training library, pinned in the bench extra) runs
DiLoCo as replica groups that agree on a quorum through a *lighthouse* and average their
pseudo-gradients with a gloo all-reduce among themselves (a ring: no hub carries the
traffic). Here every worker host is one replica group of one process, and the lighthouse
runs on the coordinator host, where gradsync's coordinator runs for gradsync's rows:

* `lighthouse` starts ``torchft_lighthouse`` on that host (quorum of all W replicas).
* `TorchftDiLoCo` sets up one replica group in a rank process: its own TCPStore on its
  host's address (the quorum hands it to the other groups for the gloo rendezvous), a
  `torchft.Manager` advertising that address, and `torchft.local_sgd.DiLoCo` over the whole
  model, with the same outer optimizer as gradsync's DiLoCo (SGD, Nesterov momentum).

Configuration owed to torchft's side: one flat bucket (``use_bucketization=True``, whose
default bucket holds the whole model), fp32 pseudo-gradients (``should_quantize``'s kernels
are Triton's, GPU only), no overlap (``fragment_sync_delay=0``), the initial parameters
identical by seed on every rank (``init_sync=False``), a quorum with the lighthouse at
every round (DiLoCo needs the synchronous quorum), the backup copy on the CPU.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync_bench.netns import Cluster

#: The lighthouse's port on the coordinator host.
LIGHTHOUSE_PORT = 29510
#: Each replica group's TCPStore port on its own host.
STORE_PORT = 29520
#: How long the lighthouse waits for late replicas before forming a quorum without them.
JOIN_TIMEOUT_MS = 60_000
#: How long the lighthouse keeps a replica without heartbeats in the quorum (its default).
HEARTBEAT_TIMEOUT_MS = 5_000
#: Allowed for the lighthouse to start listening.
LIGHTHOUSE_START_S = 60.0


def lighthouse_command(world_size: int) -> list[str]:
    """The lighthouse's command line: a quorum needs all `world_size` replica groups.

    The binary is the one installed beside this interpreter (a virtual environment's
    scripts folder), else the one on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return [
        str(beside)
        if beside.exists()
        else shutil.which("torchft_lighthouse") or "torchft_lighthouse",
        "--bind",
        f"0.0.0.0:{LIGHTHOUSE_PORT}",
        "--min_replicas",
        str(world_size),
        "--join_timeout_ms",
        str(JOIN_TIMEOUT_MS),
        "--heartbeat_timeout_ms",
        str(HEARTBEAT_TIMEOUT_MS),
    ]


def lighthouse_address(cluster: Cluster, host: str) -> str:
    """The URL the managers reach the lighthouse on `host` at."""
    return f"http://{cluster.address(host)}:{LIGHTHOUSE_PORT}"


@contextlib.contextmanager
def lighthouse(cluster: Cluster, host: str, world_size: int) -> Iterator[str]:
    """Run the lighthouse on `host` while the block runs; yields its address.

    Raises:
        RuntimeError: the lighthouse exited or did not listen within LIGHTHOUSE_START_S
            (with its output).
    """
    process = cluster.popen(
        host,
        lighthouse_command(world_size),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    probe = cluster.command(host, ["bash", "-c", f"echo > /dev/tcp/127.0.0.1/{LIGHTHOUSE_PORT}"])
    while subprocess.run(probe, capture_output=True, timeout=10).returncode != 0:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = process.communicate(timeout=10)[0]
            raise RuntimeError(
                f"torchft lighthouse on {host} (exit {process.poll()}) not listening on "
                f"port {LIGHTHOUSE_PORT} after {LIGHTHOUSE_START_S:g} s: {output[-2000:]}"
            )
        time.sleep(0.2)
    try:
        yield lighthouse_address(cluster, host)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


class TorchftDiLoCo:
    """One torchft replica group (one process) training `model` with DiLoCo.

    Enter it before the training loop: torchft's DiLoCo hooks `inner`'s ``step``, which then
    synchronizes every `sync_every` calls (blocking, one all-reduce of the whole model).
    `rounds` counts the committed synchronizations (the manager's step).
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        *,
        rank: int,
        world_size: int,
        address: str,
        lighthouse: str,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        timeout_s: float,
    ) -> None:
        from torch._C._distributed_c10d import TCPStore
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=timeout_s)
        # The replica group's own store; the quorum names it to the other groups, so it
        # listens on the host's address, not on loopback.
        self.store = TCPStore(
            host_name=address,
            port=STORE_PORT,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
        )
        self.model = model
        self.inner = inner
        self.outer = torch.optim.SGD(
            model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True
        )
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=world_size,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=60),
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=STORE_PORT,
            lighthouse_addr=lighthouse,
            replica_id=f"wan{rank}",
            hostname=address,
            init_sync=False,
        )
        self.diloco = DiLoCo(
            self.manager,
            [model],
            inner,
            self.outer,
            sync_every=sync_every,
            pin_memory=False,
            use_bucketization=True,
        )

    def _state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner.state_dict()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])

    @property
    def rounds(self) -> int:
        """Synchronizations committed so far."""
        return int(self.manager.current_step())

    def __enter__(self) -> TorchftDiLoCo:
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.diloco.__exit__(None, None, None)

    def close(self) -> None:
        """Stop the manager's server and its threads."""
        self.manager.shutdown(wait=False)
