"""Fuzz message generation: random and mutated `WorkerMessage` bytes for the live fuzzer.

`Messages` draws, from one seeded `random.Random`, what a hostile or broken
worker might send a coordinator: Joins with mutated fields and signatures,
gradient chunks with every header field sometimes at an edge (through the
coordinator's fast parser and, with an unknown field appended, through
protobuf), sparse 2-bit chunks (well formed or mutated), checkpoint,
state, collective, abandon, heartbeat and leave messages with absurd sizes,
offsets, steps and strings, and random, truncated, bit-flipped or extended
bytes. It only makes bytes; the streams
that carry them are `support.fuzzing.Fuzzer`'s.
"""

from __future__ import annotations

import random

import numpy as np
from gradsync_proto import sparse_wire
from gradsync_proto.codec import ChunkHeader, encode_gradient
from gradsync_proto.v1 import gradsync_pb2 as pb

from support.rawclient import BUCKET_BYTES, CHUNK, signature

U64 = 2**64 - 1
#: A log line a worker tries to forge through a text field (`scan_log` looks for it).
FORGED = "forged by h5: rank 0 says all is well"
EDGES = [0, 1, 2, 3, 127, 128, 4095, 4096, 4097, 8320, 2**31 - 1, 2**31, 2**32 - 1, 2**32, U64]
#: Sizes a hostile worker declares (checkpoint totals, collective totals, offsets).
#: 2**31 and above are the "allocate by declared size" holes of issue 11.
DECLARED = [0, 1, 8, 4095, 4096, 4097, 8320, 1 << 20, 1 << 26, 2**31, 2**40, U64]


class Messages:
    """Random and mutated WorkerMessage bytes (see the module docstring)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def edge(self) -> int:
        return self.rng.choice(EDGES)

    def text(self) -> str:
        return self.rng.choice(
            ["", "ok", "x" * 3000, f"bye\n{FORGED}", "\x00\x1b[2J\u202e", "é" * 50]
        )

    def signature(self) -> pb.ModelSignature:
        sig = signature()
        mutation = self.rng.randrange(8)
        if mutation == 0:
            sig.parameters[0].shape[:] = [self.rng.choice([0, 1, 2**31, 2**40])]
        elif mutation == 1:
            sig.buckets[0].num_elements = self.rng.choice([0, 1, 2**31, 2**32 - 1])
        elif mutation == 2:
            sig.buckets[0].parameter_indices[:] = [self.rng.choice([7, 2**32 - 1])]
        elif mutation == 3:
            sig.parameters[0].dtype = self.rng.choice([0, 99, pb.DTYPE_INT64])
        elif mutation == 4:
            sig.parameters[0].name = "n" * self.rng.choice([0, 5000])
        return sig

    def join(self, job_id: str, rank: int) -> pb.WorkerMessage:
        rng = self.rng
        return pb.WorkerMessage(
            join=pb.Join(
                job_id=job_id if rng.random() < 0.95 else rng.choice(["", "j" * 500, "a\nb"]),
                rank=rank if rng.random() < 0.95 else rng.choice([2, 2**32 - 1]),
                world_size=2 if rng.random() < 0.95 else self.edge() % 2**32,
                signature=signature() if rng.random() < 0.9 else self.signature(),
                incarnation=rng.choice(["fuzz"] * 18 + ["", "i" * 2000]),
            )
        )

    def gradient(self, step: int) -> bytes:
        """A gradient chunk near the job's grid, every header field sometimes at an edge."""
        rng = self.rng
        offset = rng.choice([0, CHUNK, 2 * CHUNK])
        header = ChunkHeader(
            step=step if rng.random() < 0.7 else self.edge() % 2**64,
            membership_epoch=0 if rng.random() < 0.8 else self.edge() % 2**64,
            bucket_index=0 if rng.random() < 0.8 else self.edge() % 2**32,
            offset=offset if rng.random() < 0.8 else self.edge() % 2**64,
            dtype=pb.DTYPE_FLOAT32 if rng.random() < 0.8 else rng.choice([0, 2, 3, 4, 99]),
            encoding=0 if rng.random() < 0.9 else rng.choice([1, 2**31 - 1]),
            contributors=0 if rng.random() < 0.9 else self.edge() % 2**32,
            reply_dtype=0 if rng.random() < 0.9 else rng.choice([1, 3, 99]),
        )
        length = min(CHUNK, BUCKET_BYTES - offset)
        length = length if rng.random() < 0.8 else rng.choice([0, 1, length - 1, length + 1])
        raw = encode_gradient(header, rng.randbytes(max(length, 0)))
        if rng.random() < 0.2:
            raw += b"\xa8\x06\x01"  # an unknown top-level field: the protobuf (slow) path
        return raw

    def sparse(self, step: int) -> bytes:
        """A sparse 2-bit chunk (`ENCODING_TOPK2`, the int8 grid of the float32 bucket):
        well formed, or with some of its bytes (or its claimed element count) mutated."""
        rng = self.rng
        elements = BUCKET_BYTES // 4  # one int8 byte per float32 element
        offset = rng.choice([0, CHUNK])  # CHUNK: past this bucket's int8 bytes
        length = max(1, min(CHUNK, elements - offset))
        values = np.random.default_rng(rng.randrange(2**32)).standard_normal(length)
        count = length if rng.random() < 0.8 else rng.choice([0, 1, length + 1, 2**30])
        payload = bytearray(sparse_wire.encode(values[:count].astype(np.float32), 0.05)[0])
        for _ in range(rng.choice([0, 0, 1, 3])):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        header = ChunkHeader(
            step=step,
            offset=offset,
            dtype=pb.DTYPE_INT8,
            encoding=pb.ENCODING_TOPK2,
            reply_dtype=pb.DTYPE_FLOAT32,
            scale=0.0 if rng.random() < 0.9 else rng.choice([0.5, -1.0, float("nan")]),
        )
        return encode_gradient(header, bytes(payload))

    def other(self, step: int) -> pb.WorkerMessage:
        rng = self.rng
        kind = rng.randrange(10)
        if kind == 0:
            return pb.WorkerMessage(heartbeat=pb.Heartbeat(step=rng.choice([step, U64])))
        if kind == 1:
            return pb.WorkerMessage(
                abandon=pb.AbandonStep(step=rng.choice([step, step + 1, U64]), reason=self.text())
            )
        if kind == 2:
            return pb.WorkerMessage(
                checkpoint=pb.CheckpointChunk(
                    step=rng.choice([step, 0, U64]),
                    offset=rng.choice([0, CHUNK, self.edge()]),
                    total_bytes=rng.choice(DECLARED),
                    payload=rng.randbytes(rng.choice([0, 1, 100, CHUNK])),
                    heal=rng.random() < 0.3,
                )
            )
        if kind == 3:
            return pb.WorkerMessage(
                collective=pb.CollectiveChunk(
                    sequence=rng.choice([0, 1, U64]),
                    op=rng.choice([0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 99]),
                    dtype=rng.choice([0, 1, 5, 99]),
                    total_bytes=rng.choice(DECLARED),
                    offset=rng.choice([0, CHUNK, 3]),
                    payload=rng.randbytes(rng.choice([0, 4, 64])),
                    root=rng.choice([0, 1, 2**32 - 1]),
                    reduce_op=rng.choice([0, 1, 5, 8, 99]),
                    send_splits=rng.choice([[], [4, 60], [U64, 0], [8] * 9]),
                    receive_splits=rng.choice([[], [32, 32], [0, U64]]),
                )
            )
        if kind == 4:
            return pb.WorkerMessage(out_of_inputs=pb.OutOfInputs(step=rng.choice([step, U64])))
        if kind == 5:
            return pb.WorkerMessage(
                state=pb.StateChunk(
                    offset=rng.choice([0, CHUNK, 2 * CHUNK, self.edge()]),
                    payload=bytes(rng.choice([0, 8, 128, CHUNK, CHUNK + 1])),
                )
            )
        if kind == 6:
            return pb.WorkerMessage(join=pb.Join(job_id="again", rank=0, world_size=2))
        if kind == 7:
            return pb.WorkerMessage(shard_hello=pb.ShardHello(job_id="x"))
        if kind == 8:
            return pb.WorkerMessage()
        return pb.WorkerMessage(leave=pb.Leave(reason=self.text()))

    def garbage(self, raw: bytes) -> bytes:
        """Random bytes, or `raw` truncated, bit-flipped or extended."""
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0 or not raw:
            return rng.randbytes(rng.choice([0, 1, 2, 7, 60, 600]))
        if kind == 1:
            return raw[: rng.randrange(len(raw))]
        if kind == 2:
            index = rng.randrange(len(raw))
            return raw[:index] + bytes([raw[index] ^ rng.randrange(1, 256)]) + raw[index + 1 :]
        return raw + rng.randbytes(rng.choice([1, 5, 40]))

    def next(self, step: int, joined: bool) -> bytes:
        """One message for a stream that has (or has not yet) joined."""
        rng = self.rng
        roll = rng.random()
        if joined and roll < 0.7:
            return self.sparse(step) if rng.random() < 0.1 else self.gradient(step)
        base = self.other(step).SerializeToString() if roll < 0.93 else self.gradient(step)
        return self.garbage(base) if rng.random() < 0.2 else base
