"""The client library's failures: precise GradSyncErrors instead of hangs."""

from __future__ import annotations

import threading
import time

import gradsync
import pytest
import torch
from torch import nn


def small_model(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 3))


def test_unreachable_coordinator_raises_within_the_join_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(gradsync.CoordinatorUnavailableError, match="could not reach"):
        gradsync.DistributedDataParallel(
            small_model(), coordinator="127.0.0.1:1", rank=0, world_size=1, join_timeout_s=1.5
        )
    assert time.monotonic() - started < 10


def test_missing_settings_are_value_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSYNC_COORDINATOR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="GRADSYNC_COORDINATOR"):
        gradsync.DistributedDataParallel(small_model(), rank=0, world_size=1)
    monkeypatch.setenv("GRADSYNC_COORDINATOR", "127.0.0.1:1")
    with pytest.raises(ValueError, match="RANK"):
        gradsync.DistributedDataParallel(small_model(), world_size=1)
    with pytest.raises(ValueError, match="out of range"):
        gradsync.DistributedDataParallel(small_model(), rank=2, world_size=2)


def build_in_threads(address: str, modules: list[nn.Module], **kwargs: object) -> list[object]:
    """Construct one wrapper per rank concurrently; return wrappers or exceptions."""
    results: list[object] = [None] * len(modules)

    def build(rank: int) -> None:
        try:
            results[rank] = gradsync.DistributedDataParallel(
                modules[rank],
                coordinator=address,
                rank=rank,
                world_size=len(modules),
                **{"join_timeout_s": 20, "timeout_s": 20, **kwargs},  # type: ignore[arg-type]
            )
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


@pytest.mark.timeout(60)
def test_signature_mismatch_is_reported_to_every_rank(coordinator_factory) -> None:
    coordinator = coordinator_factory(2)
    results = build_in_threads(coordinator.address, [small_model(4), small_model(5)])
    for result in results:
        assert isinstance(result, gradsync.JoinRefusedError), result
        message = str(result)
        assert "0.weight" in message and "[3, 4] float32" in message and "[3, 5] float32" in message


#: Both ranks of these tests share this host: "0" uploads each rank's own gradients,
#: "auto" makes them one local group (only rank 0 uploads, for both).
@pytest.mark.timeout(60)
def test_peer_leaving_mid_job_raises_peer_lost_not_a_hang(coordinator_factory, layout: str) -> None:
    # Hierarchical: the survivor's LocalPosted gets the coordinator's verdict, as a
    # flat upload would, although its local sum waits for the peer that left.
    coordinator = coordinator_factory(2)
    models = build_in_threads(coordinator.address, [small_model(), small_model()])
    assert all(isinstance(m, gradsync.DistributedDataParallel) for m in models)
    survivor, leaver = models  # type: ignore[misc]
    leaver.close()  # type: ignore[attr-defined]
    started = time.monotonic()
    with pytest.raises(gradsync.PeerLostError, match="rank 1 left") as caught:
        survivor(torch.ones(2, 4)).sum().backward()  # type: ignore[operator]
    assert caught.value.step == 0 and caught.value.rank == 0
    assert time.monotonic() - started < 10
    survivor.close()  # type: ignore[attr-defined]
    with pytest.raises(gradsync.ClosedError):
        survivor(torch.ones(2, 4))  # type: ignore[operator]


@pytest.mark.timeout(60)
def test_missing_peer_gives_a_timeout_naming_the_buckets(coordinator_factory, layout: str) -> None:
    coordinator = coordinator_factory(2)
    # The step wait's bound is fixed at construction: 1 s here, not the helper's 20 s.
    models = build_in_threads(coordinator.address, [small_model(), small_model()], timeout_s=1.0)
    assert all(isinstance(m, gradsync.DistributedDataParallel) for m in models), models
    model = models[0]
    expected = {
        # The coordinator's answer never came: 15 gradients and 2 presence values (float32).
        "flat": r"step 0.*bucket 0 \(0/68 bytes\)",
        "hierarchical": r"local sums of step 0 \(bucket 0 not posted by ranks \[1\]",
    }[layout]
    with pytest.raises(gradsync.SyncTimeoutError, match=expected):
        model(torch.ones(2, 4)).sum().backward()  # type: ignore[operator]
    for m in models:
        m.close()  # type: ignore[attr-defined]
