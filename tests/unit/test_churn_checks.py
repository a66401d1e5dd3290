"""The churn soak's log checks (`gradsync_bench.churn_checks`) on hand-written logs."""

from __future__ import annotations

from typing import Any

import torch
from gradsync_bench import churn_worker
from gradsync_bench.churn_checks import (
    Incarnation,
    aborted_steps,
    applied_once,
    contributions,
    first_divergence,
    logged_digests,
    replay,
    unclaimed,
)


def _inc(rank: int, *events: tuple[str, int] | tuple[str, int, int]) -> Incarnation:
    rows: list[dict[str, Any]] = [{"e": "start", "t": 0.0}]
    for index, event in enumerate(events):
        row: dict[str, Any] = {"e": event[0], "s": event[1], "t": float(index)}
        if event[0] == "applied":
            row["c"] = event[2]  # type: ignore[misc]
        if event[0] == "aborted":
            row["next"] = event[1] + 1
        rows.append(row)
    return Incarnation(rank, rows)


def test_a_rank_killed_with_its_gradient_in_counts_for_the_step() -> None:
    logs = [
        _inc(0, ("joined", 0), ("submit", 0), ("applied", 0, 3), ("submit", 1), ("applied", 1, 2)),
        _inc(1, ("joined", 0), ("submit", 0), ("applied", 0, 3), ("submit", 1), ("applied", 1, 2)),
        _inc(2, ("joined", 0), ("submit", 0)),  # SIGKILLed after its upload
    ]
    # A process that never got to train (refused while no coordinator served) is no one.
    logs.append(_inc(2, ("error", 0)))
    members, unresolved = contributions(logs)
    assert members == {0: [0, 1, 2], 1: [0, 1]} and unresolved == []
    assert applied_once(logs)["ok"]


def test_a_rank_moved_past_a_step_by_a_coordinator_restart_counts_for_it() -> None:
    # Rank 2's coordinator died after the others got step 0's average; the job went on
    # at step 1 from the ranks' state (rank 2 took theirs): its gradient was in step 0.
    logs = [
        _inc(0, ("joined", 0), ("submit", 0), ("applied", 0, 3)),
        _inc(1, ("joined", 0), ("submit", 0), ("applied", 0, 3)),
        _inc(2, ("joined", 0), ("submit", 0), ("restart", 1), ("submit", 1)),
    ]
    members, unresolved = contributions(logs)
    assert members[0] == [0, 1, 2] and unresolved == []


def test_a_step_applied_twice_and_an_unknown_count_are_reported() -> None:
    twice = [_inc(0, ("joined", 0), ("submit", 0), ("applied", 0, 1), ("applied", 0, 1))]
    assert not applied_once(twice)["ok"]
    short = [_inc(0, ("joined", 0), ("submit", 0), ("applied", 0, 2))]
    assert contributions(short)[1], "a count of 2 with one known rank must be unresolved"


def test_an_aborted_step_is_no_hole() -> None:
    steps = (("joined", 0), ("submit", 0), ("applied", 0, 2), ("submit", 1), ("aborted", 1))
    logs = [_inc(r, *steps, ("submit", 2), ("applied", 2, 2)) for r in (0, 1)]
    assert aborted_steps(logs) == {1}
    assert applied_once(logs)["ok"], applied_once(logs)


def _with_digests(inc: Incarnation, digests: dict[int, str]) -> Incarnation:
    for event in inc.of("applied"):
        event["d"] = digests[event["s"]]
    return inc


def test_a_rank_lost_between_its_buckets_is_found_in_the_step_by_its_digest() -> None:
    # Rank 0 was SIGKILLed in step 1 after its gradients were summed, before the small
    # bucket every step ends with: the average holds it, the count (the smallest over
    # the step's chunks) says 2. The digests the others logged tell the two apart.
    truth = {0: [0, 1, 2], 1: [0, 1, 2], 2: [1, 2]}
    digests: dict[int, str] = {}
    expected = replay(truth, 3, digests=digests)
    later = (("submit", 1), ("applied", 1, 2), ("submit", 2), ("applied", 2, 2))
    logs = [
        _with_digests(
            _inc(0, ("joined", 0), ("submit", 0), ("applied", 0, 3), ("submit", 1)), digests
        ),
        *(
            _with_digests(_inc(r, ("joined", 0), ("submit", 0), ("applied", 0, 3), *later), digests)
            for r in (1, 2)
        ),
    ]
    members, unresolved = contributions(logs)
    assert members[1] == [1, 2] and unresolved == []
    lost = unclaimed(logs, members)
    assert lost == {1: [0]}
    # By the count alone the replay leaves the replicas at step 1, and says where.
    by_count: dict[int, str] = {}
    plain = replay(members, 3, digests=by_count)
    assert not all(torch.equal(plain[name], expected[name]) for name in expected)
    assert first_divergence(logs, by_count) == {"step": 1, "ranks": [1, 2], "count": 2}
    counted: dict[int, list[int]] = {}
    found = replay(members, 3, lost=lost, logged=logged_digests(logs), counted=counted)
    assert counted == {1: [0, 1, 2]}
    assert all(torch.equal(found[name], expected[name]) for name in expected)


def _mixed_step_digest(
    state: dict[str, torch.Tensor], step: int, per_shard: list[list[int]]
) -> tuple[dict[str, torch.Tensor], str]:
    """After one step from `state` in which shard i averaged ranks per_shard[i] over its
    half of the bucket, computed here by hand: per-rank gradients, reverse order, halves."""
    model = churn_worker.ChurnModel(0)
    model.load_state_dict(state)
    parameters = list(model.parameters())
    flats = {}
    for rank in sorted({r for ranks in per_shard for r in ranks}):
        model.zero_grad()
        x, y = churn_worker.rank_batch(step, rank)
        churn_worker.loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
        flats[rank] = torch.cat([p.grad.reshape(-1) for p in reversed(parameters)])  # type: ignore[union-attr]
    total = sum(p.numel() for p in parameters)
    half = -(-(total + len(parameters)) // 2)  # the presence tail rides in shard 1's range
    average = torch.empty(total)
    for (start, stop), ranks in zip(((0, half), (half, total)), per_shard, strict=True):
        summed = flats[ranks[0]][start:stop].clone()
        for rank in ranks[1:]:
            summed = summed + flats[rank][start:stop]
        average[start:stop] = summed / len(ranks)
    offset = 0
    for parameter in reversed(parameters):
        size = parameter.numel()
        parameter.grad = average[offset : offset + size].view_as(parameter).clone()
        offset += size
    churn_worker.make_optimizer(model).step()  # the first step: no momentum history
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return state, churn_worker.digest(model)[:16]


def test_a_rank_in_one_shards_average_and_not_the_others_is_found_by_its_digest() -> None:
    # Two coordinator shards each average their half of the bucket: rank 0, killed while
    # uploading step 0, reached shard 0 and not shard 1.
    initial = {n: p.detach().clone() for n, p in churn_worker.ChurnModel(0).named_parameters()}
    _, wanted = _mixed_step_digest(initial, 0, [[0, 1, 2], [1, 2]])
    logs = [
        _inc(0, ("joined", 0), ("submit", 0)),
        *(_inc(r, ("joined", 0), ("submit", 0), ("applied", 0, 2)) for r in (1, 2)),
    ]
    for inc in logs[1:]:
        _with_digests(inc, {0: wanted})
    members, unresolved = contributions(logs)
    assert members == {0: [1, 2]} and unresolved == []
    lost = unclaimed(logs, members)
    assert lost == {0: [0]}
    # Unsharded, neither [1, 2] nor [0, 1, 2] gives the logged digest: the replay says so.
    one: dict[int, str] = {}
    replay(members, 1, lost=lost, logged=logged_digests(logs), digests=one)
    assert first_divergence(logs, one) == {"step": 0, "ranks": [1, 2], "count": 2}
    two: dict[int, str] = {}
    counted: dict[int, list[int]] = {}
    replay(
        members, 1, lost=lost, logged=logged_digests(logs), digests=two, counted=counted, shards=2
    )
    assert first_divergence(logs, two) is None and two[0] == wanted
    assert counted == {0: [0, 1, 2]}
