"""gradient_as_bucket_view=True against torch DDP (gloo): every `.grad`, every step, bitwise.

Both wrappers run the loops of `workers/bucket_view_worker.py` in two real
worker processes with the same seeds and data: `zero_grad` with and without
`set_to_none`, a parameter no rank uses and one only some ranks use in some
steps (Adam), a rank-dependent `.grad` user code gives a parameter no rank
uses, `no_sync` accumulation, and the fp16 comm hook. After each step's
synchronized backward, which gradients are None, their values, and the
number of storages they live in (one per bucket: they are views into it)
must equal DDP's, and so must the trained parameters: bitwise at W=2 (DDP
halves each gradient before summing, gradsync sums then halves; halving is
exact, so both round identically).

Both ranks run on this host, so with the default `hierarchical="auto"` the
full-precision cases sum in a local group (the bucket's flat tensor is what
goes into shared memory and what the averages are copied back into), and the
fp16 case (`wire_dtype`, flat by design) goes through the flat path.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gradsync_proto.net.launch import free_port
from support.processes import WORKERS, CoordinatorProcess, run_ranks

WORKER = WORKERS / "bucket_view_worker.py"
WORLD_SIZE = 2

pytestmark = pytest.mark.timeout(120)


def test_bucket_views_match_torch_ddp_grad_for_grad(
    tmp_path: Path, coordinator_factory: Callable[..., CoordinatorProcess]
) -> None:
    addresses = {
        "ddp": f"tcp://127.0.0.1:{free_port()}",
        "gradsync": coordinator_factory(WORLD_SIZE).address,
    }

    def run(mode: str) -> list[dict[str, np.ndarray]]:
        out = tmp_path / mode
        out.mkdir()
        ranks: list[dict[str, np.ndarray]] = run_ranks(
            WORKER, addresses[mode], WORLD_SIZE, out, "--mode", mode, timeout_s=90
        )
        return ranks

    # Both modes at once: the run is mostly process start-up.
    with ThreadPoolExecutor(2) as pool:
        outputs = dict(zip(addresses, pool.map(run, addresses), strict=True))
    for rank in range(WORLD_SIZE):
        ddp, ours = outputs["ddp"][rank], outputs["gradsync"][rank]
        assert sorted(ours) == sorted(ddp), "different gradients are None than under DDP"
        for key in sorted(ddp):
            assert np.array_equal(ours[key], ddp[key]), (
                f"rank {rank}: {key} differs from torch DDP (gradient_as_bucket_view=True): "
                f"max abs difference {np.abs(ours[key] - ddp[key]).max()}"
            )
    # The cases do exercise what they claim: a never-used parameter keeps None, the
    # gradients are views into one bucket, and the stray .grad is averaged.
    ours = outputs["gradsync"][0]
    assert ours["unused_adam/step0/grad_is_none/never.weight"]
    assert int(ours["set_to_none/step1/storages"]) == 1
    assert np.all(ours["stray_grad/step1/grad/never.weight"] == 1.5)
