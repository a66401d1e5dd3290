"""Who has delivered what in the open step, and since when (pure logic).

The coordinator sees every chunk, so it can say which rank a step is waiting
for and for which buckets, and how late each rank's buckets arrive relative
to the first rank's. `gradsync status`, the stall warning and the per-rank
lag metric all read this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class StepProgress:
    """Delivery bookkeeping of one job's open step.

    Args:
        chunks_per_bucket: how many chunks make up each bucket (at a coordinator
            shard: the chunks of its byte range; 0 for a bucket of which it holds
            nothing, which then never counts as delivered or late).
        clock: monotonic time source (injectable for tests).
    """

    def __init__(self, chunks_per_bucket: list[int], clock: Callable[[], float]) -> None:
        self._chunks_per_bucket = chunks_per_bucket
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget the step (it completed or was abandoned)."""
        self._delivered: dict[tuple[int, int], int] = {}
        self._first_done: dict[int, float] = {}
        self._bucket_started: dict[int, float] = {}
        #: Chunks per bucket in this step where a 16-bit wire dtype shrank them.
        self._needed: dict[int, int] = {}
        self.started_at: float | None = None
        self.stall_warned = False

    def record(self, rank: int, bucket_index: int, chunks: int | None = None) -> float | None:
        """Count one accepted chunk.

        `chunks` is how many chunks the bucket has in this step when that
        differs from the layout's (a comm hook sends it in a 16-bit wire dtype).

        Returns:
            When this chunk completes `rank`'s delivery of the bucket: how many
            seconds after the first rank completed it (0.0 for the first rank).
            Otherwise None.
        """
        now = self._start(bucket_index)
        key = (bucket_index, rank)
        if chunks is not None:
            self._needed[bucket_index] = chunks
        needed = self._chunks_needed(bucket_index)
        count = self._delivered.get(key, 0)
        if count >= needed:
            return None  # already complete (a member's `record_posted`)
        count += 1
        self._delivered[key] = count
        if count != needed:
            return None
        first = self._first_done.setdefault(bucket_index, now)
        return now - first

    def record_posted(self, rank: int, bucket_index: int) -> float | None:
        """A local group's member has its bucket ready in shared memory (`LocalPosted`).

        Counts as that rank's delivery of the whole bucket, so a late member of a
        group is named although only its leader uploads; the leader's chunks later
        add nothing for it. Returns the lag as `record` does.
        """
        needed = self._chunks_needed(bucket_index)
        if needed == 0 or self._delivered.get((bucket_index, rank), 0) >= needed:
            return None
        now = self._start(bucket_index)
        self._delivered[(bucket_index, rank)] = needed
        return now - self._first_done.setdefault(bucket_index, now)

    def _start(self, bucket_index: int) -> float:
        """Now, noted as the step's and the bucket's start if they had none."""
        now = self._clock()
        if self.started_at is None:
            self.started_at = now
        self._bucket_started.setdefault(bucket_index, now)
        return now

    def _chunks_needed(self, bucket_index: int) -> int:
        return self._needed.get(bucket_index, self._chunks_per_bucket[bucket_index])

    def delivered_any(self, rank: int) -> bool:
        """True if `rank` has delivered any chunk of the open step."""
        return any(r == rank for _, r in self._delivered)

    def delivered_all(self, rank: int) -> bool:
        """True if `rank` has delivered every chunk of every bucket of the open step."""
        return all(
            self._delivered.get((bucket_index, rank), 0) >= self._chunks_needed(bucket_index)
            for bucket_index in range(len(self._chunks_per_bucket))
        )

    def bucket_age(self, bucket_index: int) -> float:
        """Seconds since the bucket's first chunk arrived (its round trip once averaged)."""
        started = self._bucket_started.get(bucket_index)
        return 0.0 if started is None else self._clock() - started

    def age(self) -> float:
        """Seconds since the open step's first chunk (0 when nothing arrived yet)."""
        return 0.0 if self.started_at is None else self._clock() - self.started_at

    def late_ranks(self, ranks: Iterable[int]) -> dict[int, list[int]]:
        """Ranks missing buckets that at least one other rank has fully delivered."""
        late: dict[int, list[int]] = {}
        for bucket_index in sorted(self._first_done):
            needed = self._chunks_needed(bucket_index)
            for rank in ranks:
                if self._delivered.get((bucket_index, rank), 0) < needed:
                    late.setdefault(rank, []).append(bucket_index)
        return late
