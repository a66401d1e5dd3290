"""DiLoCo across sites: a replica is a site, a group of ranks that trains one model.

`gradsync.DiLoCo(..., replica_group=site_pg, replica=s, replicas=n)` runs the
outer rounds between n sites, each of which trains with its own process group
(`site_pg`, any backend) and its own parallelism inside:

- **Sharded inside** (FSDP2: the model's parameters are DTensors): rank j of
  every site holds the same shards (its `to_local()` pieces), so shard j across
  the sites is one DiLoCo job of n ranks, `<job>.site-rank-<j>` (with fragments,
  `<job>.site-rank-<j>.fragment<i>`), in which site s is rank s. Every rank of a
  site uploads its shards' pseudo-gradients; the coordinator averages each shard
  over the sites, applies the outer optimizer to the global shard it holds and
  answers with it. Wire formats, compact answers, fragments, partial rounds,
  late contributions, weights and coordinator shards work per job, unchanged.
  The shadow parameters are named after the model's parameters and the layout
  (`0:weight[site rank 0 of 2]`), so a site that joins with another layout (another
  number of ranks) is refused by the job's signature check, the message naming
  both layouts.
- **Replicated inside** (DDP or a plain module: every rank holds the same
  values): only the site's rank 0 uploads, in one job of n ranks (`<job>`), and
  the site's other ranks receive the new parameters from it over `site_pg`
  after each round (a broadcast on the fast link inside the site) instead of
  each uploading the same bytes over the slow link to the coordinator.

Every rank of a site must call `step` the same way (the inner loop decides H
identically). Weighted rounds weigh a site by the samples of all its ranks
(summed over `site_pg` when a round starts).

Faults are a site's: a site that loses a rank fails as a whole (its other ranks'
collectives inside the site fail, and they exit), so each job it belonged to
loses that site (`--on-failure elastic` goes on without it). Restarted whole,
its ranks join their jobs again and take the global parameters from the
coordinator at the next round of the other sites; no inner step is recomputed.
Its ranks must be let in at the same round: if the other sites reach a round
boundary between two of them joining, the first waits inside the site for the
other, which waits for the next boundary, until the site's process-group timeout
fails the site (the next restart lets its ranks in together); ranks that did get
in at different rounds refuse to train, naming each one's round
(`SiteLayout.agree_on_round`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.diloco_fragment import Fragment
from gradsync.errors import GradSyncError

__all__ = ["SiteFollower", "SiteFragment", "SiteLayout"]


def _is_sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


class SiteLayout:
    """Where one rank stands in its site, and what it synchronizes.

    Args:
        group: the site's process group (`replica_group`).
        replica: the site's index among the replicas.
        replicas: the number of sites.
        named: the model's trainable parameters, by name.

    Raises:
        ValueError: `replica`/`replicas` missing or out of range, a model mixing sharded
            and replicated parameters, or a rank whose shards are all empty.
    """

    def __init__(
        self,
        group: Any,
        replica: int | None,
        replicas: int | None,
        named: Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        if replica is None or replicas is None:
            raise ValueError(
                "replica_group needs replica= (this site's index) and replicas= (the number "
                f"of sites); got replica={replica!r}, replicas={replicas!r}"
            )
        if not (isinstance(replicas, int) and replicas >= 1 and 0 <= replica < replicas):
            raise ValueError(
                f"replica must be in [0, replicas): got replica={replica!r}, replicas={replicas!r}"
            )
        self.group = group
        self.replica = replica
        self.replicas = replicas
        self.site_rank = dist.get_rank(group)
        self.site_size = dist.get_world_size(group)
        sharded = [_is_sharded(p) for _, p in named]
        if any(sharded) and not all(sharded):
            plain = [name for (name, _), s in zip(named, sharded, strict=True) if not s]
            raise ValueError(
                f"site {replica} rank {self.site_rank}: the model mixes sharded (DTensor) "
                f"and replicated parameters ({plain[:3]} are not sharded); shard all of "
                "them (fully_shard the root module) or none"
            )
        #: FSDP2 inside: every rank uploads its own shards in a job of its own.
        self.sharded = bool(sharded) and all(sharded)
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        #: Bytes of each kept parameter as a whole (where fragments are cut).
        self.full_bytes: list[int] = []
        for name, p in named:
            local = p.to_local().detach() if self.sharded else p  # type: ignore[attr-defined]
            if self.sharded and local.numel() == 0:
                continue  # this rank holds no piece of it (a short first dimension)
            self.names.append(name)
            self.params.append(local)
            self.full_bytes.append(p.numel() * p.element_size())
        if not self.params:
            raise ValueError(
                f"site {replica} rank {self.site_rank}: this rank holds no element of any "
                f"parameter (the model is too small for {self.site_size} ranks)"
            )

    @property
    def uploads(self) -> bool:
        """Whether this rank takes part in the coordinator's rounds itself."""
        return self.sharded or self.site_rank == 0

    def job_id(self, base: str) -> str:
        """The coordinator job of this rank's parameters."""
        return f"{base}.site-rank-{self.site_rank}" if self.sharded else base

    def shadow_names(self, names: Sequence[str]) -> list[str] | None:
        """The names a fragment's shadow parameters carry: the layout, when sharded."""
        if not self.sharded:
            return None
        where = f"[site rank {self.site_rank} of {self.site_size}]"
        return [name.replace(".", ":") + where for name in names]

    def describe(self) -> str:
        kind = "sharded" if self.sharded else "replicated"
        return (
            f"site {self.replica} of {self.replicas}, rank {self.site_rank} of "
            f"{self.site_size} ({kind} inside)"
        )

    def site_weight(self, weight: float) -> float:
        """The samples of every rank of the site together (a collective of the site)."""
        total = torch.tensor([weight], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """The site's rank 0's values of `params`, on every rank of the site."""
        source = dist.get_global_rank(self.group, 0)
        for p in params:
            with torch.no_grad():
                dist.broadcast(p.data, src=source, group=self.group)

    def agree_on_round(self, fragments: Sequence[Fragment]) -> None:
        """Check that every rank of a sharded site was let into its jobs at the same round.

        Raises:
            GradSyncError: the site's ranks joined at different rounds (naming each).
        """
        if not self.sharded:
            return
        steps = torch.tensor([f.ddp.step for f in fragments], dtype=torch.int64)
        gathered = [torch.zeros_like(steps) for _ in range(self.site_size)]
        dist.all_gather(gathered, steps, group=self.group)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            rounds = ", ".join(f"site rank {r}: step {g.tolist()}" for r, g in enumerate(gathered))
            raise GradSyncError(
                f"{self.describe()}: the site's ranks were let into their jobs at different "
                f"rounds ({rounds}), so they hold different rounds' global parameters; "
                "restart the site (its ranks then join at the same round)",
                rank=self.replica,
                step=int(steps[0]),
            )


class SiteFragment(Fragment):
    """A fragment of a rank that uploads: the site weighs the round, and a replicated
    site's rank 0 hands the answer on to the others."""

    def __init__(self, site: SiteLayout, *args: Any, **kwargs: Any) -> None:
        """`site`, then `Fragment`'s arguments."""
        self.site = site
        super().__init__(*args, **kwargs)
        if not site.sharded:
            site.broadcast(self.params)  # the start every site adopted (or the healed one)

    def start(self, seed: bool = False, weight: float = 1.0) -> None:
        if self.weighted and not seed:
            weight = self.site.site_weight(weight)
        super().start(seed=seed, weight=weight)

    def apply(self, mixing: float = 1.0) -> None:
        super().apply(mixing)
        if not self.site.sharded:
            self.site.broadcast(self.params)


class SiteFollower(Fragment):
    """A fragment of a replicated site's rank other than 0: it takes part in the site's
    collectives and gets each round's result from the site's rank 0."""

    def __init__(self, site: SiteLayout, params: Sequence[torch.Tensor], weighted: bool) -> None:
        # No job of its own (Fragment's constructor joins one): only what DiLoCo reads.
        self.site = site
        self.params = list(params)
        self.weighted = weighted
        self._pending = False
        site.broadcast(self.params)

    @property
    def in_flight(self) -> bool:
        return self._pending

    def start(self, seed: bool = False, weight: float = 1.0) -> None:
        if self._pending:
            raise RuntimeError("a round of this fragment is already in flight")
        if self.weighted and not seed:
            self.site.site_weight(weight)
        self._pending = True

    def wait(self) -> list[torch.Tensor]:
        raise RuntimeError("a site's rank other than 0 holds no global parameters")

    def apply(self, mixing: float = 1.0) -> None:
        self._pending = False
        self.site.broadcast(self.params)

    def close(self) -> None:
        self._pending = False
