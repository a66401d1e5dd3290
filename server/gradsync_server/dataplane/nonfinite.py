"""The `--nonfinite` policy: what a NaN or Inf in a rank's gradient does.

One rank whose loss diverged sends NaN, and an average with one NaN term is
NaN for every rank: DDP applies it silently on every replica. The coordinator
sees every contribution as it sums it, so it is the one place that can name
the culprit. `aggregation.classify` says per chunk whether it holds a NaN or
Inf (one BLAS pass, about half the cost of the add it guards); `OpenStep`
applies the policy:

- "report" (the default): the step goes on (DDP's behaviour: the average is
  NaN/Inf, and a `torch.cuda.amp.GradScaler` on the workers then sees Inf/NaN
  in the averaged gradients and skips the step, as it would under DDP), but the
  contribution is logged (rate-limited, so a NaN storm cannot flood the log),
  counted in `gradsync_nonfinite_contributions_total{rank}`, and shown by
  `gradsync status` (`JobStatus.nonfinite_contributions`, `last_nonfinite`);
- "abort": the step is aborted for every rank (`StepAborted` with reason
  ABORT_REASON_NONFINITE, code ABORTED, `culprit_rank` the sender): each
  worker raises `NonFiniteGradientError` naming that rank, skips its
  optimizer step and trains on; the contribution is logged and counted as
  under "report";
- "allow": nothing is checked or reported (overflow is still guarded).

DiLoCo's outer averages are checked once more, before they are committed
(`NonFiniteGuard.check_average`): finite pseudo-gradients can still give a
non-finite result (the outer step's momentum or parameters overflowing). If
a contribution of that round and bucket held NaN/Inf, its rank was named
already; otherwise no rank is to blame, and the finding is counted and logged
as the average's own (rank -1), the round aborted under "abort" before any of
it is committed (the global parameters and momentum stay as they were).

A contribution is one rank's bucket of one step: a bucket with NaN in many
chunks (or in several shards' ranges) counts once. Code ABORTED rather than
INVALID_ARGUMENT for every rank, the culprit included: no message broke the
protocol, the data was unusable for this step only, and the remedy is the
same for all (skip the step), which is what ABORTED means.

Pure logic (logging only), no gRPC, no asyncio.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gradsync_proto import dtypes
from gradsync_proto.codec import ChunkHeader
from gradsync_proto.codes import Code

from gradsync_server import defaults
from gradsync_server.dataplane.aggregation import count_nonfinite
from gradsync_server.dataplane.observer import StepObserver
from gradsync_server.errors import RejectedMessage


class NonFinitePolicy(enum.StrEnum):
    """The `--nonfinite` policies (their values are the flag's spellings)."""

    #: Sum it, count it, log it, name the rank in status and metrics.
    REPORT = "report"
    #: Refuse the step for every rank, naming the culprit.
    ABORT = "abort"
    #: Check nothing (the fastest; NaN then spreads to every replica).
    ALLOW = "allow"


REPORT, ABORT, ALLOW = NonFinitePolicy.REPORT, NonFinitePolicy.ABORT, NonFinitePolicy.ALLOW
POLICIES = defaults.NONFINITE_POLICIES

#: (step, rank, bucket) keys remembered to count a contribution once when several
#: chunks (or shards) of it hold NaN/Inf.
_KEYS_REMEMBERED = 4096


@dataclass(frozen=True)
class NonFiniteContribution:
    """One chunk of one rank's bucket that held NaN or Inf.

    Attributes:
        job_id: the job.
        rank: the rank that sent it.
        step: the step it was for.
        bucket_index: the bucket.
        offset: the chunk's byte offset in the bucket (as sent; -1 if unknown).
        nonfinite: how many of its elements are NaN or Inf (0 if unknown).
        elements: how many elements it has (0 if unknown: a shard's report).
        where: who saw it ("" at the leader; "shard 2 at host:port" at a shard).
        covered: the ranks a local leader's partial sum holds (() = its own gradient):
            one of them diverged, the coordinator cannot tell which.
        via: the local leader that uploaded `rank`'s gradient in its group's sum, which
            named `rank` as the source (`GradientChunk.nonfinite_ranks`); -1 = `rank`
            sent it itself.
    """

    job_id: str
    rank: int
    step: int
    bucket_index: int
    offset: int
    nonfinite: int
    elements: int
    where: str = ""
    covered: tuple[int, ...] = ()
    via: int = -1

    def describe(self) -> str:
        """Names the rank (and the ranks it covers), step, bucket and the count."""
        if self.rank < 0:  # an outer average of finite contributions (`check_average`)
            return (
                f"the outer average of bucket {self.bucket_index} of round (step) {self.step} "
                f"in job '{self.job_id}' is not finite although no contribution held NaN/Inf "
                f"(ranks {list(self.covered)} contributed): {self.nonfinite} of "
                f"{self.elements} elements of the chunk at byte offset {self.offset}"
                + (f" at {self.where}" if self.where else "")
            )
        sender = f"rank {self.rank}"
        if self.via < 0 and len(self.covered) > 1:  # a group's sum: which member, unknown
            sender += f" (local leader, summing ranks {list(self.covered)})"
        what = (
            f"{sender} sent non-finite gradients (NaN/Inf) for bucket "
            f"{self.bucket_index} of step {self.step} in job '{self.job_id}'"
        )
        if self.via == self.rank:
            what += f" (its own, in the sum of its local group {list(self.covered)})"
        elif self.via >= 0:
            what += f" (through its local leader, rank {self.via}, which uploaded the sum)"
        at = f" at {self.where}" if self.where else ""
        if not self.elements:
            return f"{what} (seen{at})" if at else what
        return (
            f"{what}: {self.nonfinite} of {self.elements} elements of the chunk at byte "
            f"offset {self.offset}{at}"
        )


class NonFiniteRejection(RejectedMessage):
    """Under "abort": the open step is aborted for every rank because `rank` sent NaN/Inf.

    Args:
        rank: the culprit.
        step, bucket_index: what it sent them in.
        message: names the rank, step and bucket (and the count, where known).
    """

    def __init__(self, rank: int, step: int, bucket_index: int, message: str) -> None:
        super().__init__(Code.ABORTED, message, step=step, bucket_index=bucket_index)
        self.rank = rank

    @classmethod
    def of(cls, contribution: NonFiniteContribution) -> NonFiniteRejection:
        """The rejection for `contribution`, saying that the step is aborted for every rank."""
        message = (
            f"{contribution.describe()}; the coordinator runs with --nonfinite abort, so "
            f"step {contribution.step} is aborted for every rank"
        )
        if contribution.rank < 0:
            message += " and nothing of it is committed"
        return cls(contribution.rank, contribution.step, contribution.bucket_index, message)


class NonFiniteLog:
    """A job's non-finite contributions: counted once each, logged at a bounded rate.

    Args:
        clock: monotonic time source (injectable for tests).
        logger: where the warnings go.
        lines: at most this many warnings per `window_s` (the rest are counted and
            the next warning says how many were left out).
        window_s: the rate limit's window.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        logger: logging.Logger,
        lines: int = defaults.NONFINITE_LOG_LINES,
        window_s: float = defaults.NONFINITE_LOG_WINDOW_S,
    ) -> None:
        self._clock = clock
        self._logger = logger
        self._lines = lines
        self._window_s = window_s
        self._window_start = -float("inf")
        self._logged_in_window = 0
        self._suppressed = 0
        self._seen: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        #: Contributions (rank, step, bucket) that held NaN or Inf, each counted once.
        self.count = 0
        #: The latest of them, described (names rank, step and bucket); "" before any.
        self.last = ""

    def record(self, contribution: NonFiniteContribution) -> bool:
        """Count `contribution` (unless its rank, step and bucket were counted); log it.

        Returns:
            True if it was new (counted and maybe logged), False if already counted.
        """
        key = (contribution.step, contribution.rank, contribution.bucket_index)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _KEYS_REMEMBERED:
            self._seen.popitem(last=False)
        self.count += 1
        self.last = contribution.describe()
        self._log(self.last)
        return True

    def ranks_of(self, step: int, bucket_index: int) -> list[int]:
        """The ranks counted for (`step`, `bucket_index`) (recent ones), ascending."""
        return sorted(
            rank
            for (seen_step, rank, bucket) in self._seen
            if seen_step == step and bucket == bucket_index and rank >= 0
        )

    def _log(self, text: str) -> None:
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start, self._logged_in_window = now, 0
        if self._logged_in_window >= self._lines:
            self._suppressed += 1
            return
        self._logged_in_window += 1
        if self._suppressed:
            text += (
                f" ({self._suppressed} more non-finite contributions were not logged; "
                f"{self.count} in all)"
            )
            self._suppressed = 0
        self._logger.warning("%s", text)


class NonFiniteGuard:
    """The `--nonfinite` policy over one job's contributions at one process.

    The open step hands it every contribution `aggregation.examine` found to
    hold NaN or Inf; it counts, logs and exports each once per rank, step and
    bucket, forwards it (a shard's report to its leader), and under "abort"
    refuses the step.

    Args: the open step's (`OpenStep`): the job's id, its policy ("report", "abort" or
    "allow", `NonFinitePolicy`), the clock of the log's rate limit, where the count
    goes, and the shard's index (a shard logs under "gradsync.shard"), name and
    `on_nonfinite`.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(
        self,
        job_id: str,
        policy: str,
        clock: Callable[[], float],
        observer: StepObserver | None,
        shard_index: int = 0,
        shard_name: str = "",
        on_nonfinite: Callable[[NonFiniteContribution], None] | None = None,
    ) -> None:
        self.job_id = job_id
        if policy not in POLICIES:
            raise ValueError(
                f"nonfinite policy must be one of {', '.join(POLICIES)}; got {policy!r}"
            )
        self.policy = NonFinitePolicy(policy)
        # A shard logs its own (with the counts); its leader counts them for status.
        logger = logging.getLogger("gradsync.shard" if shard_index else "gradsync.server")
        self._log = NonFiniteLog(clock, logger)
        self._observer = observer
        self._where = shard_name if shard_index else ""
        self._on_nonfinite = on_nonfinite

    @property
    def count(self) -> int:
        """How many contributions were counted."""
        return self._log.count

    @property
    def last(self) -> str:
        """The latest one's description ("" before the first)."""
        return self._log.last

    def check(
        self, rank: int, chunk: ChunkHeader, payload: memoryview | bytes, wire_dtype: int
    ) -> None:
        """A contribution holds NaN or Inf: report it, or (policy "abort") refuse the step.

        A local leader's sum names the members whose own gradient held it
        (`nonfinite_ranks`, checked to be among its covers): each of them is
        reported as the culprit. Otherwise the sender is. Under "allow" nothing
        is checked.

        Raises:
            NonFiniteRejection: the policy is "abort".
        """
        if self.policy is ALLOW:
            return
        sent = NonFiniteContribution(
            job_id=self.job_id,
            rank=rank,
            step=chunk.step,
            bucket_index=chunk.bucket_index,
            offset=chunk.offset,
            nonfinite=count_nonfinite(payload, wire_dtype),
            elements=len(payload) // dtypes.itemsize(wire_dtype),
            where=self._where,
            covered=chunk.covered_ranks,
        )
        contributions = [
            dataclasses.replace(sent, rank=culprit, via=rank) for culprit in chunk.nonfinite_ranks
        ] or [sent]
        # Under "abort" counted here too; a shard's leader counts it from the ShardRejected.
        for contribution in contributions:
            self.note(contribution, forward=self.policy is not ABORT)
        if self.policy is ABORT:
            raise NonFiniteRejection.of(contributions[0])

    def check_average(
        self,
        step: int,
        bucket_index: int,
        offset: int,
        nonfinite: int,
        elements: int,
        ranks: tuple[int, ...],
    ) -> None:
        """An outer average (or the outer step it makes) about to be committed holds
        `nonfinite` NaN/Inf of its `elements`: name the culprit, count it, or refuse.

        Args:
            step, bucket_index, offset: the round, bucket and chunk (its byte offset).
            nonfinite: the non-finite elements found (0: nothing to do).
            elements: the chunk's elements.
            ranks: the ranks whose contributions it averages.

        Raises:
            NonFiniteRejection: the policy is "abort" (no rank named when no contribution
                held NaN/Inf: rank -1).
        """
        if self.policy is ALLOW or not nonfinite:
            return
        culprits = self._log.ranks_of(step, bucket_index)
        if culprits:  # named and counted as its contribution arrived
            found = NonFiniteContribution(
                self.job_id, culprits[0], step, bucket_index, offset, 0, 0, self._where
            )
        else:  # the average's own
            found = NonFiniteContribution(
                self.job_id, -1, step, bucket_index, offset, nonfinite, elements, self._where, ranks
            )
            self.note(found, forward=False)
        if self.policy is ABORT:
            raise NonFiniteRejection.of(found)

    def note(self, contribution: NonFiniteContribution, forward: bool = True) -> bool:
        """Count, log and export a non-finite contribution (once per rank, step and bucket).

        Args:
            forward: also hand it to `on_nonfinite` (a shard's report to its leader).

        Returns:
            True if it was new.
        """
        if not self._log.record(contribution):
            return False
        if self._observer is not None and contribution.rank >= 0:
            self._observer.observe_nonfinite(contribution.rank)
        if forward and self._on_nonfinite is not None:
            self._on_nonfinite(contribution)
        return True
