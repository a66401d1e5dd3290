"""Who belongs to a job: members, rejoining newcomers, the reference signature, the epoch.

Membership is the authority every other part of the job consults (architecture
invariants 1 and 2): which ranks are in the current epoch, which restarted ranks
wait to be healed, and the model signature every rank must match. It owns the
rules of admission (world size, one live incarnation per rank, identical
signatures) and raises `RejectedMessage` with both values when a rank breaks
them; the job decides what a refusal means for everyone else. Pure logic, no
gRPC, no asyncio.

The job's local groups (`host_groups`) live here too: they are formed from
the members' host ids when the job starts (`form_local_groups`), and follow
the members afterwards (a rank that rejoins is flat).

Each admission gets a fresh session secret (`SESSION_BYTES` random bytes), sent
to that rank alone in its Welcome and to the coordinator shards in the job view:
a rank's rejoin gets a new one, so the streams of the old session are refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server import defaults
from gradsync_server.control import restart, signature as signatures
from gradsync_server.dataplane.actions import Member
from gradsync_server.dataplane.host_groups import (
    LocalGroups,
    form_groups,
    group_secrets,
    local_world_size_problems,
)
from gradsync_server.dataplane.screening import check_screen, step_screen_problem, stricter
from gradsync_server.errors import RejectedMessage

#: Length of a session secret (Welcome.session).
SESSION_BYTES = 32


class Membership:
    """Members and newcomers of one job, and its membership epoch.

    Args:
        job_id: the job's name (for messages).
        world_size: ranks the job needs.
        clock: monotonic time source (injectable for tests).
    """

    def __init__(
        self,
        job_id: str,
        world_size: int,
        clock: Callable[[], float],
        screen_floor: str = defaults.SCREEN,
    ) -> None:
        self.job_id = job_id
        #: The coordinator's `--screen` floor: a job runs under it when it is stricter.
        self.screen_floor = check_screen(screen_floor)
        self.world_size = world_size
        self._clock = clock
        self.epoch = 0
        self.members: dict[int, Member] = {}
        #: Restarted ranks waiting to be healed with a live rank's state (elastic).
        self.newcomers: dict[int, Member] = {}
        #: Newcomers whose direct heal failed: their state must come through us.
        self.heal_relayed: set[int] = set()
        #: The signature every rank must match, and the rank it came from.
        self.signature: pb.ModelSignature | None = None
        self._reference_rank: int | None = None
        #: The local groups (hierarchical aggregation); none until the job starts.
        self.groups = LocalGroups()
        #: Each group's secret by leader, as announced in the Welcomes.
        self._local_secrets: dict[int, bytes] = {}

    # ------------------------------------------------------------ admission
    def check_join(self, rank: int, join: pb.Join) -> None:
        """The checks every Join passes whatever the job's state.

        Raises:
            RejectedMessage: wrong world size, or the rank is already connected.
        """
        if join.world_size != self.world_size:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} joined job '{self.job_id}' with world size {join.world_size}, "
                f"but the coordinator runs world size {self.world_size}",
            )
        member = self.members.get(rank) or self.newcomers.get(rank)
        if member is not None:
            raise RejectedMessage(
                Code.ALREADY_EXISTS,
                f"rank {rank} of job '{self.job_id}' is already connected (incarnation "
                f"{member.incarnation}, joined {self._clock() - member.joined_at:.1f}s ago); "
                f"incarnation {join.incarnation} cannot claim it too",
            )
        if join.HasField("position"):
            restart.check_position(rank, join.position)

    def admit(self, rank: int, join: pb.Join) -> str | None:
        """Add `rank` to an assembling job.

        Returns:
            None, or how its signature differs from the reference (the whole
            job must then be refused: the ranks cannot train one model).

        Raises:
            RejectedMessage: the signature is malformed (only this rank is refused).
        """
        signatures.validate(rank, join.signature)
        self.members[rank] = self._member(rank, join)
        if self.signature is None or self._reference_rank is None:
            self.signature = join.signature
            self._reference_rank = rank
            return None
        return signatures.first_difference(
            self._reference_rank, self.signature, rank, join.signature
        )

    def admit_newcomer(self, rank: int, join: pb.Join) -> None:
        """Park a restarted rank that joins a running job until it is healed.

        Raises:
            RejectedMessage: its signature differs from the job's.
        """
        if self.signature is None or self._reference_rank is None:
            raise RuntimeError("a running job always has a reference signature")
        difference = signatures.first_difference(
            self._reference_rank, self.signature, rank, join.signature
        )
        if difference is not None:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} cannot rejoin: model signatures differ: {difference}",
            )
        self.newcomers[rank] = self._member(rank, join)
        if join.heal_relayed:
            self.heal_relayed.add(rank)

    def promote_newcomers(self) -> list[int]:
        """Make every waiting newcomer a member and start a new epoch; return them."""
        promoted = sorted(self.newcomers)
        for rank in promoted:
            self.members[rank] = self.newcomers.pop(rank)
            self.heal_relayed.discard(rank)
            self.groups.make_flat(rank)  # v1: a rejoining rank is flat
        self.epoch += 1
        return promoted

    def _member(self, rank: int, join: pb.Join) -> Member:
        # One shared copy per job: a member whose signature equals the reference keeps
        # the reference, not its own (a 1 MB Join cost 13.6 MiB per member as parsed
        # protobuf objects).
        signature = join.signature
        if self.signature is not None and signature == self.signature:
            signature = self.signature
        return Member(
            rank,
            join.incarnation,
            signature,
            self._clock(),
            session=secrets.token_bytes(SESSION_BYTES),
            host_id=join.host_id,
            local_world_size=join.local_world_size,
            position=join.position if join.HasField("position") else None,
            collective_resume=(
                int(join.collective_resume.sequence) if join.HasField("collective_resume") else None
            ),
        )

    # --------------------------------------------------------- local groups
    def form_local_groups(self) -> str | None:
        """Group the members by host id (at the job's start).

        Returns:
            Why the job is refused when the members' LOCAL_WORLD_SIZE does not
            match the groups (the launcher and the host ids disagree), or a per-step
            job's screen needs flat ranks; None when fine.
        """
        host_ids = {rank: member.host_id for rank, member in self.members.items()}
        groups = form_groups(host_ids)
        told = {rank: member.local_world_size for rank, member in self.members.items()}
        problems = local_world_size_problems(host_ids, told, groups)
        if problems:
            return (
                f"job '{self.job_id}' refused: the local groups formed from Join.host_id do not "
                f"match LOCAL_WORLD_SIZE: {'; '.join(problems)} (give every process of a host "
                "the same host id, or pass hierarchical=False)"
            )
        self.groups.replace(groups)
        self._local_secrets = group_secrets(groups)
        problem = step_screen_problem(self.resolved_screen(), bool(self.groups.groups()))
        return None if problem is None else f"job '{self.job_id}' refused: {problem}"

    def check_posted(self, rank: int, posted: pb.LocalPosted) -> None:
        """A member's LocalPosted names its local group's bucket.

        Raises:
            RejectedMessage: from a flat rank, or naming a bucket the model lacks.
        """
        buckets = len(self.signature.buckets) if self.signature is not None else 0
        if not self.groups.group_of(rank) or posted.bucket_index >= buckets:
            raise RejectedMessage(
                Code.INVALID_ARGUMENT,
                f"rank {rank} reported bucket {posted.bucket_index} of step {posted.step} "
                f"posted in a local group, but it is in none or the model has {buckets} buckets",
            )

    def local_group_of(self, rank: int) -> tuple[tuple[int, ...], bytes]:
        """`rank`'s local group and its secret for the Welcome; ((), b"") when flat."""
        group = self.groups.group_of(rank)
        if len(group) < 2:
            return (), b""
        return group, self._local_secrets.get(group[0], b"")

    def session_of(self, rank: int) -> bytes:
        """The session secret issued to `rank` (member or newcomer); b"" if unknown."""
        member = self.members.get(rank) or self.newcomers.get(rank)
        return member.session if member is not None else b""

    def welcome(
        self, rank: int, message: pb.CoordinatorMessage, payload_endpoint: tuple[str, str] | None
    ) -> None:
        """Make the job's Welcome `rank`'s own: its session secret and its local group.

        A same-host local leader is told the payload socket of `payload_endpoint`
        (its name, the coordinator's host id; None: off or sharded): only a leader
        uploads (and gets averages), and only an unsharded coordinator holds whole
        buckets to read from one segment.
        """
        welcome = message.welcome
        welcome.session = self.session_of(rank)
        local_ranks, welcome.local_secret = self.local_group_of(rank)
        welcome.local_ranks.extend(local_ranks)
        member = self.members.get(rank)
        if payload_endpoint is None or not local_ranks or local_ranks[0] != rank:
            return
        name, coordinator_host = payload_endpoint
        if member is not None and member.host_id == coordinator_host:
            welcome.payload_socket = name

    # --------------------------------------------------------------- leaving
    def remove(self, rank: int, assembling: bool) -> bool:
        """Forget `rank`; return True if it was a member (not a newcomer, not unknown).

        While the job assembles, the reference signature follows the members:
        it is dropped with the last one, and passes to the lowest remaining
        rank when its owner leaves.
        """
        if self.newcomers.pop(rank, None) is not None:
            self.heal_relayed.discard(rank)
            return False
        if self.members.pop(rank, None) is None:
            return False
        if assembling and not self.members:
            self.signature = None
            self._reference_rank = None
        elif assembling and rank == self._reference_rank:
            first = min(self.members)
            self.signature = self.members[first].signature
            self._reference_rank = first
        return True

    # ----------------------------------------------------------------- views
    def ranks(self) -> tuple[int, ...]:
        """Members of the current epoch, ascending."""
        return tuple(sorted(self.members))

    def complete(self) -> bool:
        """True once every rank of the world has joined."""
        return len(self.members) >= self.world_size

    def set_peer(self, rank: int, peer: str) -> None:
        """Remember the network address of `rank` (member or newcomer), for status."""
        member = self.members.get(rank) or self.newcomers.get(rank)
        if member is not None:
            member.peer = peer

    def changed_message(self, step: int, reason: str) -> pb.CoordinatorMessage:
        """The MembershipChanged broadcast of the current epoch."""
        return pb.CoordinatorMessage(
            membership=pb.MembershipChanged(
                membership_epoch=self.epoch, ranks=list(self.ranks()), step=step, reason=reason
            )
        )

    def resolved_outer(self) -> pb.OuterOptimizer | None:
        """The job's outer optimizer (None: none yet, or not DiLoCo), its `screen` the policy
        the job runs under: its own, or the `--screen` floor if that is stricter."""
        signature = self.signature
        if signature is None or not signature.HasField("outer"):
            return None
        outer = pb.OuterOptimizer()
        outer.CopyFrom(signature.outer)
        outer.screen = stricter(check_screen(outer.screen), self.screen_floor).value
        return outer

    def resolved_screen(self) -> str:
        """A per-step job's screen policy: its own, or the `--screen` floor if that is
        stricter ("" for a DiLoCo job, whose policy is its outer optimizer's)."""
        signature = self.signature
        if signature is None or signature.HasField("outer"):
            return ""
        return stricter(check_screen(signature.screen), self.screen_floor).value

    def view(
        self, start_step: int, out_of_inputs: set[int], chunk_bytes: int, shard_count: int
    ) -> pb.ShardJobView:
        """The job as its data planes know it: the whole (small) membership, the layout."""
        signature = self.signature
        return pb.ShardJobView(
            job_id=self.job_id,
            world_size=self.world_size,
            membership_epoch=self.epoch,
            members=[
                pb.ShardMember(rank=rank, incarnation=member.incarnation, session=member.session)
                for rank, member in sorted(self.members.items())
            ],
            out_of_inputs=sorted(r for r in out_of_inputs if r in self.members),
            start_step=start_step,
            buckets=list(signature.buckets) if signature is not None else [],
            outer=self.resolved_outer(),
            screen=self.resolved_screen(),
            chunk_bytes=chunk_bytes,
            shard_count=shard_count,
            local_groups=[pb.LocalGroup(ranks=g) for g in self.groups.groups()],
        )
