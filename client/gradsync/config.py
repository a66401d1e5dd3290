"""Worker-side configuration: arguments and env vars -> one frozen object.

Environment variables are read when a `ClientConfig` is resolved (at
construction of the model wrapper), never at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Coordinator address ("host:port"), used when `coordinator=` is not given.
ENV_COORDINATOR = "GRADSYNC_COORDINATOR"
#: Job id, used when `job_id=` is not given.
ENV_JOB_ID = "GRADSYNC_JOB_ID"
#: torchrun's rank variables.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"

DEFAULT_JOB_ID = "default"
MIB = 1 << 20


@dataclass(frozen=True)
class ClientConfig:
    """Resolved settings of one worker.

    Attributes:
        coordinator: "host:port" of the coordinator.
        rank: this worker's rank, 0 <= rank < world_size.
        world_size: number of ranks in the job.
        job_id: name shared by all ranks of one training job.
        bucket_cap_bytes: cap of every bucket but the first.
        first_bucket_cap_bytes: cap of the first bucket.
        timeout_s: bound on each wait for a step's averaged gradients.
        join_timeout_s: bound on the wait for all ranks to join (and the broadcast).
    """

    coordinator: str
    rank: int
    world_size: int
    job_id: str = DEFAULT_JOB_ID
    bucket_cap_bytes: int = 25 * MIB
    first_bucket_cap_bytes: int = 1 * MIB
    timeout_s: float = 300.0
    join_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size} "
                f"(valid ranks 0..{self.world_size - 1})"
            )
        if ":" not in self.coordinator:
            raise ValueError(f"coordinator address {self.coordinator!r} must be host:port")
        if self.bucket_cap_bytes <= 0 or self.first_bucket_cap_bytes <= 0:
            raise ValueError("bucket_cap_mb and first_bucket_mb must be positive")
        if self.timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ValueError("timeout_s and join_timeout_s must be positive")
        if not self.job_id:
            raise ValueError("job_id must not be empty")

    @classmethod
    def resolve(
        cls,
        coordinator: str | None,
        rank: int | None,
        world_size: int | None,
        job_id: str | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        timeout_s: float = 300.0,
        join_timeout_s: float = 300.0,
        environ: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        """Fill unset arguments from the environment (torchrun's RANK / WORLD_SIZE).

        Raises:
            ValueError: a required setting is missing or invalid.
        """
        env = os.environ if environ is None else environ
        address = coordinator or env.get(ENV_COORDINATOR)
        if not address:
            raise ValueError(
                f"no coordinator address: pass coordinator='host:port' or set {ENV_COORDINATOR}"
            )
        return cls(
            coordinator=address,
            rank=_int_setting("rank", rank, env, ENV_RANK),
            world_size=_int_setting("world_size", world_size, env, ENV_WORLD_SIZE),
            job_id=job_id or env.get(ENV_JOB_ID) or DEFAULT_JOB_ID,
            bucket_cap_bytes=int(bucket_cap_mb * MIB),
            first_bucket_cap_bytes=int(first_bucket_mb * MIB),
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
        )


def _int_setting(name: str, value: int | None, env: Mapping[str, str], var: str) -> int:
    if value is not None:
        return int(value)
    raw = env.get(var)
    if raw is None:
        raise ValueError(f"{name} is not set: pass {name}= or set {var} (torchrun does)")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an integer") from None
