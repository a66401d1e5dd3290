"""The coordinator's side of a host group: an input that covers several ranks, as pure logic.

A host group's leader sends its host's sum naming the ranks it covers; those
ranks send nothing. The collective completes once every participant is
covered, with the flat path's bits where the covered ranks come first in rank
order, answers only the senders, and counts every covered rank as a
contributor. Malformed or overlapping covers are refused naming the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from gradsync_server.control.collectives import Collectives
from gradsync_server.dataplane.actions import Send
from gradsync_server.dataplane.budget import ByteBudget
from gradsync_server.errors import RejectedMessage


def sent(message: pb.CoordinatorMessage | bytes) -> pb.CoordinatorMessage:
    """A Send's message (a result chunk travels encoded once for all its ranks)."""
    return pb.CoordinatorMessage.FromString(message) if isinstance(message, bytes) else message


WORLD = 4


def chunk(
    values: np.ndarray, op: int = pb.COLLECTIVE_OP_SUM, **fields: object
) -> pb.CollectiveChunk:
    raw = values.astype(np.float32).tobytes()
    return pb.CollectiveChunk(
        sequence=0,
        op=op,  # type: ignore[arg-type]
        dtype=pb.DTYPE_FLOAT32,
        total_bytes=len(raw),
        payload=raw,
        **fields,  # type: ignore[arg-type]
    )


def engine() -> Collectives:
    return Collectives(WORLD, 1 << 16, 1 << 20, ByteBudget(1 << 24).for_owner("job"))


def test_a_covering_input_stands_for_its_ranks_with_the_flat_bits() -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(33).astype(np.float32) for _ in range(WORLD)]
    host = inputs[0] + inputs[1]  # ranks 0 and 1 on one host, summed there in rank order
    collectives = engine()
    everyone = list(range(WORLD))
    covered = chunk(host, covered_ranks=[0, 1], covered_waited_s=[0.0, 0.25])
    assert collectives.accept(3, chunk(inputs[3]), everyone) == []
    assert collectives.accept(0, covered, everyone) == []
    assert collectives.waiting_ranks() == (0, 1, 3)
    actions = collectives.accept(2, chunk(inputs[2]), everyone)
    assert len(actions) == 1 and isinstance(actions[0], Send)
    assert actions[0].ranks == (0, 2, 3)  # rank 1 hears it from its leader
    result = sent(actions[0].message).collective
    assert result.contributors == WORLD
    flat = ((inputs[0] + inputs[1]) + inputs[2]) + inputs[3]
    np.testing.assert_array_equal(np.frombuffer(result.payload, np.float32), flat)


def test_a_covered_rank_lost_after_its_leader_sent_still_counts() -> None:
    collectives = engine()
    everyone = list(range(WORLD))
    ones = np.ones(4, np.float32)
    assert collectives.accept(0, chunk(3 * ones, covered_ranks=[0, 1, 2]), everyone) == []
    assert collectives.drop_participant(1) == []  # its input is in rank 0's, whole
    (send,) = collectives.accept(3, chunk(ones), [0, 2, 3])
    assert isinstance(send, Send) and send.ranks == (0, 3)
    np.testing.assert_array_equal(
        np.frombuffer(sent(send.message).collective.payload, np.float32), 4
    )


@pytest.mark.parametrize(
    ("rank", "fields", "op", "says"),
    [
        (1, {"covered_ranks": [0, 1]}, pb.COLLECTIVE_OP_SUM, "covering ranks [0, 1]: they must"),
        (0, {"covered_ranks": [0, 1]}, pb.COLLECTIVE_OP_AVG, "only a sum, min or max may"),
        (0, {"covered_ranks": [0, 2], "covered_waited_s": [0.1]}, pb.COLLECTIVE_OP_SUM, "1 waits"),
    ],
)
def test_a_malformed_cover_is_refused(rank: int, fields: dict, op: int, says: str) -> None:
    with pytest.raises(RejectedMessage, match=says.replace("[", r"\[").replace("]", r"\]")):
        engine().accept(rank, chunk(np.ones(2), op, **fields), list(range(WORLD)))


def test_a_rank_that_sends_its_own_input_beside_its_cover_is_refused_naming_both() -> None:
    collectives = engine()
    everyone = list(range(WORLD))
    collectives.accept(0, chunk(np.ones(2), covered_ranks=[0, 1]), everyone)
    with pytest.raises(RejectedMessage, match=r"rank 1 sent .* but rank 0's input already covers"):
        collectives.accept(1, chunk(np.ones(2)), everyone)
    collectives.accept(3, chunk(np.ones(2)), everyone)
    with pytest.raises(RejectedMessage, match="covering rank 3, whose input rank 3 already sent"):
        collectives.accept(2, chunk(np.ones(2), covered_ranks=[2, 3]), everyone)
