"""Worker-side configuration: arguments and env vars -> one frozen object.

Environment variables are read when a `ClientConfig` is resolved (at
construction of the model wrapper), never at import time. Default values come
from `gradsync_proto.defaults`, the one place every default is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gradsync_proto.net.addresses import parse_addresses

from gradsync import defaults
from gradsync.defaults import MIB

#: Coordinator address ("host:port"), used when `coordinator=` is not given.
ENV_COORDINATOR = "GRADSYNC_COORDINATOR"
#: Job id, used when `job_id=` is not given.
ENV_JOB_ID = "GRADSYNC_JOB_ID"
#: torchrun's rank variables.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
#: torchrun's place of a worker among those of its host, and their number.
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

__all__ = [
    "ENV_COORDINATOR",
    "ENV_JOB_ID",
    "ENV_LOCAL_RANK",
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_RANK",
    "ENV_WORLD_SIZE",
    "MIB",
    "ClientConfig",
]


@dataclass(frozen=True)
class ClientConfig:
    """Resolved settings of one worker.

    Attributes:
        coordinator: "host:port" (or "[ipv6]:port") of the coordinator, or a comma list
            of them (an active coordinator and standbys), checked at construction by
            `gradsync_proto.net.addresses.parse_addresses`.
        rank: this worker's rank, 0 <= rank < world_size.
        world_size: number of ranks in the job.
        job_id: name shared by all ranks of one training job.
        bucket_cap_bytes: cap of every bucket but the first.
        first_bucket_cap_bytes: cap of the first bucket.
        timeout_s: bound on each wait for a step's averaged gradients.
        join_timeout_s: bound on the wait for all ranks to join (and the broadcast).
        hierarchical: send this host's id in Join, so that the coordinator may
            group this rank with the others of its host (hierarchical aggregation).
        local_rank: this worker's index among its host's workers (LOCAL_RANK), if known.
        local_world_size: the number of workers on this host (LOCAL_WORLD_SIZE);
            0 = not known. The coordinator checks it against the group it forms.
    """

    coordinator: str
    rank: int
    world_size: int
    job_id: str = defaults.JOB_ID
    bucket_cap_bytes: int = int(defaults.BUCKET_CAP_MB * MIB)
    first_bucket_cap_bytes: int = int(defaults.FIRST_BUCKET_MB * MIB)
    timeout_s: float = defaults.TIMEOUT_S
    join_timeout_s: float = defaults.JOIN_TIMEOUT_S
    hierarchical: bool = False
    local_rank: int | None = None
    local_world_size: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is out of range for world_size {self.world_size} "
                f"(valid ranks 0..{self.world_size - 1})"
            )
        try:
            parse_addresses(self.coordinator)
        except ValueError as exc:
            raise ValueError(f"coordinator: {exc}") from None
        for name, size in (
            ("bucket_cap_mb", self.bucket_cap_bytes),
            ("first_bucket_mb", self.first_bucket_cap_bytes),
        ):
            if size <= 0:
                raise ValueError(f"{name} must be positive, got {size / MIB:g} MiB")
        for name, seconds in (
            ("timeout_s", self.timeout_s),
            ("join_timeout_s", self.join_timeout_s),
        ):
            # NaN fails `> 0` too; infinity would make a wait unbounded.
            if not 0 < seconds < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds}")
        if not self.job_id:
            raise ValueError("job_id must not be empty")
        if self.local_world_size < 0:
            raise ValueError(f"local_world_size must be >= 0, got {self.local_world_size}")
        if self.local_rank is not None and not (
            0 <= self.local_rank < (self.local_world_size or self.local_rank + 1)
        ):
            raise ValueError(
                f"local_rank {self.local_rank} is out of range for local_world_size "
                f"{self.local_world_size}"
            )

    @classmethod
    def resolve(
        cls,
        coordinator: str | None,
        rank: int | None,
        world_size: int | None,
        job_id: str | None = None,
        bucket_cap_mb: float = defaults.BUCKET_CAP_MB,
        first_bucket_mb: float = defaults.FIRST_BUCKET_MB,
        timeout_s: float = defaults.TIMEOUT_S,
        join_timeout_s: float = defaults.JOIN_TIMEOUT_S,
        environ: Mapping[str, str] | None = None,
        *,
        hierarchical: bool = False,
        local_rank: int | None = None,
        local_world_size: int | None = None,
    ) -> ClientConfig:
        """Fill unset arguments from the environment (torchrun's RANK / WORLD_SIZE,
        LOCAL_RANK / LOCAL_WORLD_SIZE).

        Raises:
            ValueError: a required setting is missing or invalid.
        """
        env = os.environ if environ is None else environ
        address = coordinator or env.get(ENV_COORDINATOR)
        if not address:
            raise ValueError(
                f"no coordinator address: pass coordinator='host:port' or set {ENV_COORDINATOR}"
            )
        if not coordinator:
            try:
                parse_addresses(address)
            except ValueError as exc:
                raise ValueError(f"${ENV_COORDINATOR}: {exc}") from None
        return cls(
            coordinator=address,
            rank=_int_setting("rank", rank, env, ENV_RANK),
            world_size=_int_setting("world_size", world_size, env, ENV_WORLD_SIZE),
            job_id=job_id or env.get(ENV_JOB_ID) or defaults.JOB_ID,
            bucket_cap_bytes=int(bucket_cap_mb * MIB),
            first_bucket_cap_bytes=int(first_bucket_mb * MIB),
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            hierarchical=hierarchical,
            local_rank=_optional_int("local_rank", local_rank, env, ENV_LOCAL_RANK),
            local_world_size=_optional_int(
                "local_world_size", local_world_size, env, ENV_LOCAL_WORLD_SIZE
            )
            or 0,
        )


def _int_setting(name: str, value: int | None, env: Mapping[str, str], var: str) -> int:
    setting = _optional_int(name, value, env, var)
    if setting is None:
        raise ValueError(f"{name} is not set: pass {name}= or set {var} (torchrun does)")
    return setting


def _optional_int(name: str, value: int | None, env: Mapping[str, str], var: str) -> int | None:
    if value is not None:
        return int(value)
    raw = env.get(var, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an integer") from None
