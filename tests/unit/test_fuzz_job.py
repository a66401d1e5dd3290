"""The coordinator's job state machine under random and mutated message sequences (hypothesis).

A `Job` is pure: the servicer hands it parsed messages and carries out the
actions it returns. This drives one the way the servicer does — joins, state
and gradient chunks, checkpoint and heal chunks, heartbeats, abandons,
collectives, join() notices, leaves, disconnects and silent ranks, from any
rank, with well-formed and mutated fields — and after every message checks
what must hold whatever a hostile worker sends:

- nothing but `RejectedMessage` escapes, and every refusal (a RejectedMessage,
  a Terminate, a StepAborted) carries a non-OK status code and a message;
- every message the job asks to send serializes (no field out of its range);
- an averaged chunk goes out at most once per step, bucket and offset, and is
  the mean of every participant's contribution (none missing, none doubled);
- the byte budget never exceeds its limit, and is back at zero whenever the
  job cannot use it (broken, refused, finishing, nobody left, or torn down).

Deterministic (`derandomize=True`, no database) and bounded, so CI reruns
the same sequences; raise `max_examples` locally to search harder.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gradsync_proto import dtypes
from gradsync_proto.codec import ChunkHeader, decode_gradient
from gradsync_proto.codes import Code
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.job import Job, JobState
from gradsync_server.control.settings import JobSettings
from gradsync_server.dataplane.actions import Action, Persist, ResumeBlob, Send, Terminate
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

CHUNK = 64
#: Two float32 buckets: 40 elements (chunks of 64, 64, 32 bytes) and 10 (one chunk of 40).
BUCKET_ELEMENTS = (40, 10)
BUDGET_LIMIT = 1024  # small, so that budget refusals happen too
HEARTBEAT_TIMEOUT_S = 5.0
U64 = 2**64 - 1


def signature(elements: tuple[int, ...] = BUCKET_ELEMENTS) -> pb.ModelSignature:
    return pb.ModelSignature(
        parameters=[
            pb.TensorSpec(name=f"p{index}", shape=[count], dtype=pb.DTYPE_FLOAT32)
            for index, count in enumerate(elements)
        ],
        buckets=[
            pb.BucketSpec(parameter_indices=[index], dtype=pb.DTYPE_FLOAT32, num_elements=count)
            for index, count in enumerate(elements)
        ],
    )


def contribution(rank: int, step: int) -> float:
    """What `rank` sends for `step`: exact in float16, and distinct per rank, so a
    missing or doubled contribution changes the mean."""
    return float(2**rank + step % 4)


def payload(rank: int, step: int, dtype: int, nbytes: int) -> bytes:
    """`nbytes` of `rank`'s contribution in wire dtype `dtype` (any bytes for the others)."""
    numpy_dtype = {
        pb.DTYPE_FLOAT32: np.float32,
        pb.DTYPE_FLOAT16: np.float16,
        pb.DTYPE_FLOAT64: np.float64,
    }.get(dtype)
    if dtype == pb.DTYPE_INT8:
        return b"\x01" * nbytes  # q = 1: the chunk's scale is the value
    if numpy_dtype is None:
        return bytes(nbytes)
    size = np.dtype(numpy_dtype).itemsize
    values = np.full(nbytes // size + 1, contribution(rank, step), dtype=numpy_dtype)
    return values.tobytes()[:nbytes]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


steps = st.sampled_from([0, 0, 0, 1, -1, 2, U64, 2**63])  # relative to the open step
epochs = st.sampled_from([0, 0, 0, 1, -1, U64])  # relative to the current epoch
wire_dtypes = st.sampled_from(
    [pb.DTYPE_FLOAT32] * 6
    + [pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_INT8, pb.DTYPE_INT8, pb.DTYPE_INT64]
    + [0, 99, 2**31 - 1]
)
reply_dtypes = st.sampled_from([0] * 6 + [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_INT8, 77])
sizes = st.sampled_from([0, 1, 7, 31, 32, 40, 63, 64, 65, 128, 4096, 2**31, 2**40, U64])
texts = st.one_of(
    st.text(max_size=20), st.sampled_from(["", "x" * 100_000, "line\nforged: rank 0 ok\x1b[2J"])
)


class JobMachine(RuleBasedStateMachine):
    """One job, driven as the servicer drives it; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = ByteBudget(BUDGET_LIMIT)
        self.clock = FakeClock()
        self.world_size = 3
        self.job: Job | None = None
        #: Ranks whose stream is open on this job (the servicer's connections).
        self.connected: set[int] = set()
        #: (step, bucket, offset) of every averaged chunk sent.
        self.averaged: set[tuple[int, int, int]] = set()
        self.rejections = 0

    @initialize(
        world_size=st.integers(1, 3),
        on_failure=st.sampled_from(["abort", "elastic"]),
        min_workers=st.integers(1, 2),
    )
    def start(self, world_size: int, on_failure: str, min_workers: int) -> None:
        self.world_size = world_size
        self.job = Job(
            "job",
            JobSettings(
                world_size,
                CHUNK,
                4 * CHUNK,
                heartbeat_interval_s=1.0,
                on_failure=on_failure,
                min_workers=min_workers,
                max_collective_bytes=512,
            ),
            self.budget,
            clock=self.clock,
        )

    # ------------------------------------------------------------ the servicer's part
    @property
    def the_job(self) -> Job:
        assert self.job is not None
        return self.job

    def deliver(self, rank: int, call: Callable[[], list[Action]]) -> None:
        """Hand one message to the job as the servicer does; carry out what it asks."""
        try:
            actions = call()
        except RejectedMessage as rejection:
            self.rejections += 1
            assert rejection.code is not Code.OK and rejection.message, rejection
            self.end_stream(rank)
            return
        self.carry_out(actions)

    def end_stream(self, rank: int) -> None:
        """The stream of `rank` ended (the servicer then detaches it from the job)."""
        if rank in self.connected:
            self.connected.discard(rank)
            self.carry_out(self.the_job.detach(rank, orderly=False))

    def carry_out(self, actions: list[Action]) -> None:
        ended: list[int] = []
        for action in actions:
            if isinstance(action, Send):
                message = action.message
                if isinstance(message, bytes):
                    self.check_average(action.ranks, message)
                    continue
                if isinstance(message, ResumeBlob):
                    for raw in message.messages():  # every chunk encodes
                        pb.CoordinatorMessage.FromString(raw)
                    continue
                message.SerializeToString()  # every field within its range
                if message.WhichOneof("kind") == "step_aborted":
                    aborted = message.step_aborted
                    assert aborted.code != Code.OK and aborted.message, aborted
            elif isinstance(action, Terminate):
                assert action.code is not Code.OK and action.details, action
                ended += [rank for rank in action.ranks if rank in self.connected]
            else:
                assert isinstance(action, Persist) and action.blob
        for rank in ended:
            self.end_stream(rank)

    def check_average(self, ranks: tuple[int, ...], raw: bytes) -> None:
        decoded = decode_gradient(raw)
        assert decoded is not None, raw[:32]
        header, averaged = decoded
        key = (header.step, header.bucket_index, header.offset)
        assert key not in self.averaged, f"chunk {key} averaged twice"
        self.averaged.add(key)
        exhausted = self.the_job.in_flight.out_of_inputs
        contributors = [rank for rank in ranks if rank not in exhausted]
        divisor = len(self.the_job.members) if exhausted else len(ranks)
        expected = sum(contribution(rank, header.step) for rank in contributors) / divisor
        numpy_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_FLOAT16: np.float16}.get(
            header.dtype, np.float32 if header.dtype == pb.DTYPE_FLOAT32 else None
        )
        if numpy_dtype is None:
            return  # bfloat16 replies: numpy cannot read them; counted above
        values = np.frombuffer(bytes(averaged), dtype=numpy_dtype)
        assert values.size and np.allclose(values, expected, rtol=1e-2), (key, values, expected)

    def pick(self, data: st.DataObject, connected: bool = True) -> int:
        pool = sorted(self.connected) if connected else list(range(self.world_size))
        return data.draw(st.sampled_from(pool))

    def chunk_header(self, data: st.DataObject, **fields: int) -> ChunkHeader:
        job = self.the_job
        header = ChunkHeader(
            step=(job.open_step + data.draw(steps)) % 2**64,
            membership_epoch=(job.membership_epoch + data.draw(epochs)) % 2**64,
            bucket_index=data.draw(st.sampled_from([0, 0, 1, 1, 2, 2**31, 2**32 - 1])),
            dtype=data.draw(wire_dtypes),
            encoding=data.draw(st.sampled_from([0] * 8 + [1, 2**31 - 1])),
            contributors=data.draw(st.sampled_from([0, 0, 1, 2**32 - 1])),
            reply_dtype=data.draw(reply_dtypes),
        )
        for name, value in fields.items():
            setattr(header, name, value)
        return header

    # ------------------------------------------------------------------------ rules
    @rule(data=st.data(), mutation=st.sampled_from(["none"] * 6 + ["world", "signature", "empty"]))
    def join(self, data: st.DataObject, mutation: str) -> None:
        rank = self.pick(data, connected=False)
        join = pb.Join(
            job_id="job",
            rank=rank,
            world_size=self.world_size + (mutation == "world"),
            signature=signature((40, 11) if mutation == "signature" else BUCKET_ELEMENTS),
            incarnation=data.draw(st.sampled_from(["a", "b", "", "x" * 1000])),
        )
        if mutation == "empty":
            join.ClearField("signature")
        if rank in self.connected:
            # A second stream claims a connected rank: only that new stream may end.
            try:
                self.carry_out(self.the_job.join(rank, join))
            except RejectedMessage as rejection:
                assert rejection.code is not Code.OK and rejection.message
            return
        try:
            actions = self.the_job.join(rank, join)
        except RejectedMessage as rejection:
            assert rejection.code is not Code.OK and rejection.message
            self.carry_out(self.the_job.refused_join(rank, rejection.message))
            return
        self.connected.add(rank)
        self.carry_out(actions)

    @rule()
    def assemble(self) -> None:
        """Every missing rank joins well-formed, then rank 0 broadcasts its state in full:
        random sequences rarely get that far on their own."""
        job = self.the_job
        for rank in range(self.world_size):
            if rank in self.connected or job.state is not JobState.ASSEMBLING:
                continue
            join = pb.Join(
                job_id="job", rank=rank, world_size=self.world_size, signature=signature()
            )
            try:
                actions = job.join(rank, join)
            except RejectedMessage as rejection:
                assert rejection.code is not Code.OK and rejection.message
                continue
            self.connected.add(rank)
            self.carry_out(actions)
        if job.state is JobState.RUNNING and 0 in self.connected and not job.broadcast.complete:
            total = sum(BUCKET_ELEMENTS) * 4
            for offset in range(0, total, CHUNK):
                chunk = pb.StateChunk(offset=offset, payload=bytes(min(CHUNK, total - offset)))
                self.deliver(0, lambda chunk=chunk: job.on_state_chunk(0, chunk))  # type: ignore[misc]

    @precondition(lambda self: self.connected)
    @rule(data=st.data(), whole=st.booleans())
    def state(self, data: st.DataObject, whole: bool) -> None:
        rank = self.pick(data)
        total = sum(BUCKET_ELEMENTS) * 4
        spans = (
            [(offset, min(CHUNK, total - offset)) for offset in range(0, total, CHUNK)]
            if whole
            else [(data.draw(sizes) % 2**64, data.draw(st.integers(0, 2 * CHUNK)))]
        )
        for offset, length in spans:
            chunk = pb.StateChunk(offset=offset, payload=bytes(length))
            self.deliver(rank, lambda chunk=chunk: self.the_job.on_state_chunk(rank, chunk))  # type: ignore[misc]
            if rank not in self.connected:
                return

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def gradient(self, data: st.DataObject) -> None:
        """One chunk with any header; usually on the grid, sometimes cut or misplaced."""
        rank = self.pick(data)
        header = self.chunk_header(data)
        itemsize = dtypes.itemsize(header.dtype) if dtypes.is_supported_dtype(header.dtype) else 4
        bucket_bytes = BUCKET_ELEMENTS[header.bucket_index % 2] * itemsize
        grid = list(range(0, bucket_bytes, CHUNK))
        header.offset = data.draw(st.one_of(st.sampled_from(grid), sizes)) % 2**64
        length = min(CHUNK, max(bucket_bytes - header.offset, 0))
        length = data.draw(st.sampled_from([length] * 4 + [length + 1, max(length - 1, 0), 0]))
        body = memoryview(payload(rank, header.step, header.dtype, length))
        # An int8 chunk's scale is its value (q = 1), or a negative one, and it mostly asks
        # for the float32 answer it needs; any other chunk has no scale, or one it may not carry.
        value = contribution(rank, header.step) if header.dtype == pb.DTYPE_INT8 else 0.0
        header.scale = data.draw(st.sampled_from([value] * 8 + [-1.0 if value else 1.0]))
        if value:
            header.reply_dtype = data.draw(st.sampled_from([pb.DTYPE_FLOAT32] * 6 + [0, 8]))
        self.deliver(rank, lambda: self.the_job.on_gradient(rank, header, body))

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def whole_step(self, data: st.DataObject) -> None:
        """Every connected rank uploads the open step in full, in a random order: in
        float32, or on the int8 wire (q = 1, the value as each chunk's scale)."""
        job = self.the_job
        step, epoch = job.open_step, job.membership_epoch
        wire = data.draw(st.sampled_from([pb.DTYPE_FLOAT32] * 3 + [pb.DTYPE_INT8]))
        itemsize = dtypes.itemsize(wire)
        uploads = [
            (rank, bucket, offset)
            for rank in sorted(self.connected)
            for bucket, elements in enumerate(BUCKET_ELEMENTS)
            for offset in range(0, elements * itemsize, CHUNK)
        ]
        for rank, bucket, offset in data.draw(st.permutations(uploads)):
            if rank not in self.connected:
                continue
            int8 = wire == pb.DTYPE_INT8
            header = ChunkHeader(
                step=step,
                membership_epoch=epoch,
                bucket_index=bucket,
                offset=offset,
                dtype=wire,
                reply_dtype=pb.DTYPE_FLOAT32 if int8 else 0,
                scale=contribution(rank, step) if int8 else 0.0,
            )
            length = min(CHUNK, BUCKET_ELEMENTS[bucket] * itemsize - offset)
            body = memoryview(payload(rank, step, wire, length))
            self.deliver(
                rank,
                lambda rank=rank, header=header, body=body: job.on_gradient(rank, header, body),  # type: ignore[misc]
            )

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """Every connected rank sends one well-formed chunk of the open step, twice over:
        the second round must be refused, never averaged again."""
        job = self.the_job
        bucket = data.draw(st.sampled_from([0, 1]))
        offset = data.draw(st.sampled_from(range(0, BUCKET_ELEMENTS[bucket] * 4, CHUNK)))
        length = min(CHUNK, BUCKET_ELEMENTS[bucket] * 4 - offset)
        for _ in range(2):
            step, epoch = job.open_step, job.membership_epoch
            for rank in sorted(self.connected):
                header = ChunkHeader(
                    step=step,
                    membership_epoch=epoch,
                    bucket_index=bucket,
                    offset=offset,
                    dtype=pb.DTYPE_FLOAT32,
                )
                body = memoryview(payload(rank, step, pb.DTYPE_FLOAT32, length))
                self.deliver(
                    rank,
                    lambda rank=rank, header=header, body=body: job.on_gradient(rank, header, body),  # type: ignore[misc]
                )

    @precondition(lambda self: self.connected)
    @rule(data=st.data(), heal=st.booleans())
    def checkpoint(self, data: st.DataObject, heal: bool) -> None:
        rank = self.pick(data)
        total = data.draw(sizes)
        chunk = pb.CheckpointChunk(
            step=(self.the_job.open_step + data.draw(steps)) % 2**64,
            offset=data.draw(st.one_of(st.sampled_from([0, CHUNK, 2 * CHUNK]), sizes)) % 2**64,
            total_bytes=total % 2**64,
            payload=bytes(data.draw(st.sampled_from([0, 1, CHUNK, min(total, CHUNK), CHUNK + 1]))),
            heal=heal,
        )
        self.deliver(rank, lambda: self.the_job.on_checkpoint_chunk(rank, chunk))

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def collective(self, data: st.DataObject) -> None:
        rank = self.pick(data)
        chunk = pb.CollectiveChunk(
            sequence=data.draw(st.sampled_from([0, 0, 1, 5, U64])),
            op=data.draw(st.sampled_from([*pb.CollectiveOp.values(), 99])),
            dtype=data.draw(wire_dtypes),
            total_bytes=data.draw(sizes) % 2**64,
            offset=data.draw(st.sampled_from([0, 0, CHUNK, 3])),
            payload=bytes(data.draw(st.sampled_from([0, 4, 8, CHUNK]))),
            root=data.draw(st.sampled_from([0, 0, 1, 2, 2**32 - 1])),
            contributors=data.draw(st.sampled_from([0, 1, 2**32 - 1])),
        )
        self.deliver(rank, lambda: self.the_job.on_collective(rank, chunk))

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def out_of_inputs(self, data: st.DataObject) -> None:
        rank = self.pick(data)
        step = (self.the_job.open_step + data.draw(steps)) % 2**64
        message = pb.OutOfInputs(step=step)
        self.deliver(rank, lambda: self.the_job.on_out_of_inputs(rank, message))

    @precondition(lambda self: self.connected)
    @rule(data=st.data(), reason=texts)
    def abandon(self, data: st.DataObject, reason: str) -> None:
        rank = self.pick(data)
        step = (self.the_job.open_step + data.draw(steps)) % 2**64
        abandon = pb.AbandonStep(step=step, reason=reason)
        self.deliver(rank, lambda: self.the_job.on_abandon(rank, abandon))

    @precondition(lambda self: self.connected)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        rank = self.pick(data)
        self.the_job.liveness.touch(rank, data.draw(st.sampled_from([0, 1, U64])))

    @precondition(lambda self: self.connected)
    @rule(data=st.data(), orderly=st.booleans())
    def leave(self, data: st.DataObject, orderly: bool) -> None:
        rank = self.pick(data)
        self.connected.discard(rank)
        self.carry_out(self.the_job.detach(rank, orderly=orderly))

    @rule(seconds=st.sampled_from([0.5, 3.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        """The watchdog's pass: silent ranks are declared dead and dropped."""
        self.clock.now += seconds
        for rank in self.the_job.silent_ranks(HEARTBEAT_TIMEOUT_S):
            self.connected.discard(rank)
            self.carry_out(
                self.the_job.detach(rank, orderly=False, reason="was silent for too long in")
            )

    # ------------------------------------------------------------------- invariants
    @invariant()
    def budget_is_bounded_and_returned(self) -> None:
        if self.job is None:
            return
        assert 0 <= self.budget.used <= self.budget.limit
        idle = self.job.state in (JobState.BROKEN, JobState.REFUSED, JobState.FINISHING)
        if idle or not self.job.members:
            assert self.budget.used == 0, (self.job.state, self.budget.used)

    def teardown(self) -> None:
        if self.job is None:
            return
        for rank in sorted(self.connected):
            self.connected.discard(rank)
            self.carry_out(self.job.detach(rank, orderly=False))
        assert self.budget.used == 0, f"{self.budget.used} bytes still held after every rank left"


JobMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestJobUnderRandomMessages = JobMachine.TestCase
