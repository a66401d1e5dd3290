"""A resume checkpoint the worker cannot load is a CheckpointMismatchError, not torch's text.

Checkpoints from before model signatures were stored (no digest, no MAC, no token) reach
the worker unchecked by the coordinator; the worker's own check must then name the job,
the step and what is wrong, and never suggest `weights_only=False`. A real `gradsync
serve` process and a real wrapper; the planted checkpoints are written with the store's
own code into its directory, as an old coordinator would have.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import gradsync
import pytest
import torch
from gradsync_server.store.checkpoint import Checkpoint
from gradsync_server.store.checkpoint_file import FileCheckpointStore
from support.processes import CoordinatorProcess
from torch import nn


def plant(directory: Path, job_id: str, payload: bytes, step: int = 7) -> None:
    FileCheckpointStore(directory).save(Checkpoint(job_id, step, 0, payload, {}))


def join(address: str, job_id: str, width: int = 4) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(
        nn.Linear(width, 3),
        coordinator=address,
        rank=0,
        world_size=1,
        job_id=job_id,
        join_timeout_s=20,
        timeout_s=20,
    )


@pytest.mark.timeout(60)
def test_a_resume_blob_that_is_not_this_models_checkpoint_is_a_clear_error(
    tmp_path: Path, coordinator_factory: Callable[..., CoordinatorProcess]
) -> None:
    store = tmp_path / "store"
    plant(store, "garbage", b"\x80\x04not a torch checkpoint at all")
    pickled = io.BytesIO()
    torch.save({"module": {"evil": object}}, pickled)  # needs weights_only=False to load
    plant(store, "pickle", pickled.getvalue())
    other = io.BytesIO()
    torch.save({"module": nn.Linear(5, 3).state_dict(), "optimizer": None, "step": 7}, other)
    plant(store, "other-model", other.getvalue())
    coordinator = coordinator_factory(1, "--checkpoint-store", str(store))

    for job_id, what in (
        ("garbage", "not a gradsync checkpoint"),
        ("pickle", "not a gradsync checkpoint"),
        ("other-model", "does not fit this model"),
    ):
        with pytest.raises(gradsync.CheckpointMismatchError) as caught:
            join(coordinator.address, job_id)
        error = caught.value
        message = str(error)
        assert isinstance(error, gradsync.GradSyncError)
        assert (error.job_id, error.step) == (job_id, 7)
        assert f"job '{job_id}'" in message and "step 7" in message and what in message, message
        assert "weights_only=False" not in message
    assert "size mismatch for weight" in message  # torch's words, on one line

    # A checkpoint of this very model still resumes.
    good = io.BytesIO()
    model = nn.Linear(4, 3)
    torch.save({"module": model.state_dict(), "optimizer": None, "step": 7}, good)
    plant(store, "good", good.getvalue())
    resumed = join(coordinator.address, "good")
    try:
        assert torch.equal(resumed.module.weight, model.weight)
    finally:
        resumed.close()
