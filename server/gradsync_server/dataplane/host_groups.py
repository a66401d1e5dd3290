"""Local groups (hierarchical aggregation): which ranks share a host, and who uploads for them.

Ranks on one host can sum their gradients through shared memory first and
send one partial sum: the coordinator then receives one upload per host
instead of one per rank. The coordinator decides the groups when a job
assembles, from each rank's `Join.host_id`: ranks with the same non-empty
host_id form a group if there are at least two of them; the lowest rank is the
local leader. Lone ranks and ranks without a host_id are flat. A group is
announced in each member's Welcome (`local_ranks`, `local_secret`).

A *unit* of a reduction is a flat rank or a group, keyed by its leader: only
unit leaders upload gradient chunks, a leader's chunk names in
`covered_ranks` the ranks its partial sum holds (its weight), and only unit
leaders receive the averages. `check_covers` holds the rules a chunk's covers
must follow. Groups are fixed at the job's start, then only shrink: a rank
that rejoins an elastic job later is flat (`make_flat`), and a group whose
leader was lost ends with it (`drop_group`; the job drops its followers too,
since their gradients went through the leader). A dropped follower stays in
its group until it rejoins, so that a contribution of the step it was lost in
that covers it is still accepted. Pure logic, no gRPC, no asyncio.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Collection, Iterable, Mapping, Sequence

from gradsync_proto.codec import ChunkHeader

from gradsync_server.dataplane.chunk_checks import refused
from gradsync_server.text import quoted

#: Longest Join.host_id accepted (it is logged and shown).
MAX_HOST_ID_CHARS = 256
#: Length of a local group's secret (Welcome.local_secret).
LOCAL_SECRET_BYTES = 32


def host_id_problem(rank: int, host_id: str) -> str | None:
    """Why `host_id` cannot be accepted from `rank`'s Join, or None."""
    if len(host_id) <= MAX_HOST_ID_CHARS and host_id.isprintable():
        return None
    return (
        f"rank {rank} sent Join.host_id {quoted(host_id, 40)} ({len(host_id)} characters); "
        f"it must be printable, with at most {MAX_HOST_ID_CHARS} characters"
    )


def form_groups(host_ids: Mapping[int, str]) -> list[tuple[int, ...]]:
    """The local groups of ranks by host id: two or more ranks with the same non-empty one.

    Returns:
        Each group's ranks ascending (the first is its leader), groups by leader.
    """
    by_host: dict[str, list[int]] = {}
    for rank, host_id in host_ids.items():
        if host_id:
            by_host.setdefault(host_id, []).append(rank)
    return sorted(tuple(sorted(ranks)) for ranks in by_host.values() if len(ranks) >= 2)


def local_world_size_problems(
    host_ids: Mapping[int, str],
    local_world_sizes: Mapping[int, int],
    groups: Sequence[Sequence[int]],
) -> list[str]:
    """Ranks whose LOCAL_WORLD_SIZE (when told) is not the size of the group they are in.

    A rank that sent no host_id aggregates flat by its own choice, so its
    LOCAL_WORLD_SIZE is not checked; a lone rank with a host_id is a group of 1.
    """
    group_of = {rank: tuple(group) for group in groups for rank in group}
    problems = []
    for rank in sorted(host_ids):
        told, host_id = local_world_sizes.get(rank, 0), host_ids[rank]
        if not told or not host_id:
            continue
        found = group_of.get(rank, (rank,))
        if told != len(found):
            problems.append(
                f"rank {rank} on host_id {quoted(host_id, 80)} has LOCAL_WORLD_SIZE {told}, "
                f"but the coordinator found {len(found)} rank(s) with that host_id: {list(found)}"
            )
    return problems


def group_secrets(groups: Iterable[Sequence[int]]) -> dict[int, bytes]:
    """A fresh random secret for each group, keyed by its leader."""
    return {group[0]: secrets.token_bytes(LOCAL_SECRET_BYTES) for group in groups}


class LocalGroups:
    """A job's local groups as they stand (see the module docstring).

    Args:
        groups: each group's ranks, ascending (the first is its leader).
    """

    def __init__(self, groups: Iterable[Sequence[int]] = ()) -> None:
        self._group_of: dict[int, tuple[int, ...]] = {}
        self.replace(groups)

    def replace(self, groups: Iterable[Sequence[int]]) -> None:
        """Forget every group and take `groups` instead (a shard follows its leader)."""
        self._group_of.clear()
        for ranks in groups:
            group = tuple(sorted(ranks))
            for rank in group:
                self._group_of[rank] = group

    def groups(self) -> list[tuple[int, ...]]:
        """Every group, by leader."""
        return sorted(set(self._group_of.values()))

    def group_of(self, rank: int) -> tuple[int, ...]:
        """`rank`'s group, ascending (its leader first); () for a flat rank."""
        return self._group_of.get(rank, ())

    def leader_of(self, rank: int) -> int:
        """The rank that uploads for `rank`: its group's leader, or itself when flat."""
        group = self._group_of.get(rank)
        return rank if group is None else group[0]

    def units(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """The unit leaders among `ranks` (flat ranks and group leaders), ascending."""
        return tuple(sorted(r for r in ranks if self.leader_of(r) == r))

    def followers_of(self, leader: int) -> tuple[int, ...]:
        """The ranks `leader` uploads for besides itself (() when it leads no group)."""
        group = self._group_of.get(leader, ())
        return group[1:] if group and group[0] == leader else ()

    def drop_group(self, leader: int) -> None:
        """`leader` was lost: its group ends (its followers leave the job with it)."""
        for rank in self._group_of.get(leader, ()):
            self._group_of.pop(rank, None)

    def make_flat(self, rank: int) -> None:
        """`rank` rejoined the job: it aggregates flat from now on, outside its old group."""
        group = self._group_of.pop(rank, None)
        if group is None:
            return
        rest = tuple(r for r in group if r != rank)
        if rank == group[0]:
            for other in rest:  # a leaderless group uploads nothing: its ranks are flat
                self._group_of.pop(other, None)
            return
        for other in rest:
            self._group_of[other] = rest


def check_covers(
    rank: int, chunk: ChunkHeader, groups: LocalGroups, open_members: Collection[int] | None
) -> int:
    """The weight of `rank`'s chunk (how many ranks it holds), if its covers are valid.

    Args:
        open_members: the members when the step opened (a rank dropped since
            still counts in a contribution that covers it); None = not checked
            (a coordinator shard: its leader checks it on its own range).

    Raises:
        RejectedMessage: INVALID_ARGUMENT, `rank` is a follower (its leader
            uploads for it), or its `covered_ranks` are not ascending, do not
            start with it, leave its group, or name a rank that was not a member
            when the step opened; or its `nonfinite_ranks` are not ascending
            ranks that it covers.
    """
    step, bucket, covered = chunk.step, chunk.bucket_index, list(chunk.covered_ranks)
    group = groups.group_of(rank)
    where = f"bucket {bucket} of step {step}"
    named = chunk.nonfinite_ranks
    if named and (
        any(a >= b for a, b in itertools.pairwise(named))
        or any(r not in (covered or [rank]) for r in named)
    ):
        raise refused(
            chunk,
            f"rank {rank} sent {where} naming ranks {list(named)} for non-finite gradients, but "
            f"they must be ascending, without repeats, among the ranks it covers "
            f"({covered or [rank]})",
        )
    if group and group[0] != rank:
        raise refused(
            chunk,
            f"rank {rank} sent {where}, but it is a follower in local group {list(group)}: "
            f"only its local leader, rank {group[0]}, uploads gradients for it",
        )
    if not covered:
        return 1
    if not group:
        if covered == [rank]:
            return 1
        problem = f"it aggregates flat (local group [{rank}])"
    elif covered[0] != rank:
        problem = f"they must start with the sender (local group {list(group)})"
    elif any(a >= b for a, b in itertools.pairwise(covered)):
        problem = f"they must be ascending without repeats (local group {list(group)})"
    elif any(r not in group for r in covered):
        outside = [r for r in covered if r not in group]
        problem = f"ranks {outside} are outside its local group {list(group)}"
    elif open_members is not None and any(r not in open_members for r in covered):
        absent = [r for r in covered if r not in open_members]
        problem = (
            f"ranks {absent} were not members when step {step} began "
            f"(local group {list(group)}, members {sorted(open_members)})"
        )
    else:
        return len(covered)
    raise refused(chunk, f"rank {rank} sent {where} covering ranks {covered}, but {problem}")
