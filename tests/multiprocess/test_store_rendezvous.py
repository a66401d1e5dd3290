"""torch.distributed's own gloo backend meets through the coordinator's store.

Two real processes build a `CoordinatorStore` and pass it to
`init_process_group("gloo", store=...)`, started apart and in reverse rank
order: they find each other through the coordinator (nothing listens on
rank 0), all_reduce, form a `new_group` and pass a barrier. The keys gloo
left in the job's namespace show that the store was the one used; with a
token, a rank without it is refused.
"""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from gradsync.distributed.store import CoordinatorStore
from gradsync_proto.net.channels import ChannelSecurity
from support.processes import WORKERS, CoordinatorProcess, launch_ranks, reap

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "store_rendezvous_worker.py"
TOKEN = "rendezvous-test-token-0123456789abcdef"


def captured(rank: int, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(120)
def test_gloo_ranks_started_apart_meet_through_the_coordinator_store(tmp_path: Path) -> None:
    world = 2
    coordinator = CoordinatorProcess(world)
    try:
        processes = []
        for rank in reversed(range(world)):  # the higher rank first, the other a second later
            processes += launch_ranks(
                WORKER,
                coordinator.address,
                world,
                lambda r: tmp_path / f"rank{r}.npz",
                "--namespace",
                "rendezvous-job",
                ranks=[rank],
                launch=captured,
            )
            time.sleep(1.0)
        try:
            texts = [process.communicate(timeout=90)[0] for process in processes]
        finally:
            reap(processes)
        assert [p.returncode for p in processes] == [0, 0], "\n".join(texts)
        store = CoordinatorStore(
            coordinator.address,
            namespace="rendezvous-job",
            security=ChannelSecurity(),
            timeout=timedelta(seconds=5),
        )
        keys = store.num_keys()
        other = CoordinatorStore(
            coordinator.address,
            namespace="another-job",
            security=ChannelSecurity(),
            timeout=timedelta(seconds=5),
        ).num_keys()
    finally:
        coordinator.stop()
    assert keys >= world and other == 0  # gloo's rendezvous keys, in this job's namespace
    for rank in range(world):
        out = np.load(tmp_path / f"rank{rank}.npz")
        np.testing.assert_array_equal(out["total"], [3.0, 10.0])
        np.testing.assert_array_equal(out["again"], [3.0])
        assert str(out["backend"]) == "gloo"


@pytest.mark.timeout(60)
def test_a_store_without_the_token_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    coordinator = CoordinatorProcess(2, "--token-file", str(token_file))
    try:
        store = CoordinatorStore(
            coordinator.address,
            namespace="job",
            security=ChannelSecurity(),
            timeout=timedelta(seconds=5),
        )
        with pytest.raises(dist.DistStoreError) as caught:
            store.set("k", "v")
        assert "failed (UNAUTHENTICATED)" in str(caught.value)
        assert "requires a token and the call carried none" in str(caught.value)
        allowed = CoordinatorStore(
            coordinator.address,
            namespace="job",
            security=ChannelSecurity(token=TOKEN),
            timeout=timedelta(seconds=5),
        )
        allowed.set("k", "v")
        assert allowed.get("k") == b"v"
    finally:
        coordinator.stop()
