"""The churn soak's end checks, from the workers' logs and final parameters alone.

- every live replica is bitwise identical (the SHA-256 of its parameters);
- no step is applied twice: within a rank, across its incarnations, the steps
  it applied only go up, one at a time, except where the library moved it
  (a coordinator restart that continued at another step: the `restart` event);
- the final parameters equal a replay of the recorded contributions: step s
  averaged the gradients of the ranks that applied it, plus those that died
  with s in flight when the coordinator's count says their gradient was in
  (the model is one bucket; under sharded coordinators a rank killed while
  uploading may be in some shards' ranges of it and not in others', which the
  replay tries when the step's logged digest asks for it);
- per failure: the time to detect it (the first reaction the system shows: a
  membership change, another coordinator serving, a rank told of a restart or
  an error), the time to recover (the first step applied after that), the
  steps computed again (a rank submitting a step it had submitted before in
  the same process), and how long a restarted rank took to train again.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations, pairwise, product
from pathlib import Path
from typing import Any

from gradsync_proto import chunking

from gradsync_bench import churn_worker
from gradsync_bench.churn_schedule import Failure, Sample


@dataclass
class Incarnation:
    """One worker process: its events in order."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["e"] == kind]


def read_logs(folder: Path, world_size: int) -> list[Incarnation]:
    """Every incarnation of every rank, from rank*.jsonl (a torn last line is dropped)."""
    incarnations: list[Incarnation] = []
    for rank in range(world_size):
        path = folder / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        current: Incarnation | None = None
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by SIGKILL
            if event["e"] == "start" or current is None:
                current = Incarnation(rank)
                incarnations.append(current)
            current.events.append(event)
    return incarnations


def replicas_identical(incarnations: list[Incarnation], world_size: int) -> dict[str, Any]:
    """The final digests of the live ranks: all present, all equal, at one step."""
    finals = {inc.rank: inc.of("final")[-1] for inc in incarnations if inc.of("final")}
    digests = {rank: final["digest"] for rank, final in finals.items()}
    steps = {rank: final["s"] for rank, final in finals.items()}
    return {
        "ok": len(finals) == world_size and len(set(digests.values())) == 1,
        "live_ranks": sorted(finals),
        "distinct_digests": len(set(digests.values())),
        "final_steps": sorted(set(steps.values())),
        "digest": next(iter(digests.values()), None),
    }


def applied_once(incarnations: list[Incarnation]) -> dict[str, Any]:
    """No step applied twice or skipped by a rank, and the job's steps have no hole."""
    problems: list[str] = []
    last_of_rank: dict[int, int] = {}
    applied_events = 0
    jumps = 0
    for inc in incarnations:
        expected: int | None = None
        for event in inc.events:
            if event["e"] in ("joined", "restart") or (event["e"] == "aborted" and "next" in event):
                event = {**event, "s": event.get("next", event["s"])}
                if expected is not None and event["s"] != expected:
                    jumps += 1
                expected = event["s"]
            elif event["e"] == "applied":
                applied_events += 1
                step = event["s"]
                if expected is not None and step != expected:
                    problems.append(f"rank {inc.rank} applied step {step}, expected {expected}")
                if step <= last_of_rank.get(inc.rank, -1):
                    problems.append(f"rank {inc.rank} applied step {step} again")
                last_of_rank[inc.rank] = step
                expected = step + 1
    steps = {e["s"] for inc in incarnations for e in inc.of("applied")}
    aborted = aborted_steps(incarnations)
    final = max(steps, default=-1) + 1
    holes = sorted(set(range(final)) - steps - aborted)
    if holes:
        problems.append(f"no rank applied steps {holes[:10]} ({len(holes)} in all)")
    return {
        "ok": not problems,
        "problems": problems[:20],
        "steps_advanced": final,
        "steps_applied": len(steps),
        "applied_events": applied_events,
        "moved_by_restart": jumps,
        "aborted_steps": sorted(aborted)[:50],
    }


def aborted_steps(incarnations: list[Incarnation]) -> set[int]:
    """Steps some rank saw aborted and no rank applied (every rank skipped the update)."""
    applied = {e["s"] for inc in incarnations for e in inc.of("applied")}
    return {e["s"] for inc in incarnations for e in inc.of("aborted")} - applied


def in_flight(incarnations: list[Incarnation]) -> dict[int, set[int]]:
    """Per step, the ranks whose process submitted it and never applied it.

    It died (or was dropped) with the step open, or the coordinator died under
    it and the job then went on past it. Its gradient may still be in the
    average: the count says, or (`unclaimed`) the step's digest.
    """
    open_at_death: dict[int, set[int]] = {}
    for inc in incarnations:
        work = [
            e for e in inc.events if e["e"] in ("submit", "applied", "restart", "aborted", "final")
        ]
        for index, event in enumerate(work):
            following = work[index + 1] if index + 1 < len(work) else None
            if event["e"] == "submit" and (
                following is None or following["e"] != "applied" or following["s"] != event["s"]
            ):
                open_at_death.setdefault(event["s"], set()).add(inc.rank)
    return open_at_death


def contributions(incarnations: list[Incarnation]) -> tuple[dict[int, list[int]], list[str]]:
    """The ranks whose gradients step s averaged, for every step; and what is unresolved."""
    applied: dict[int, set[int]] = {}
    counts: dict[int, Counter[int]] = {}
    for inc in incarnations:
        for event in inc.of("applied"):
            applied.setdefault(event["s"], set()).add(inc.rank)
            counts.setdefault(event["s"], Counter())[event["c"]] += 1
    in_flight_at_death = in_flight(incarnations)
    members: dict[int, list[int]] = {}
    unresolved: list[str] = []
    for step in sorted(applied):
        count_of, _ = counts[step].most_common(1)[0]
        if len(counts[step]) > 1:
            unresolved.append(f"step {step}: ranks saw different counts {dict(counts[step])}")
        known = applied[step]
        candidates = sorted(in_flight_at_death.get(step, set()) - known)
        missing = count_of - len(known)
        if missing < 0 or missing > len(candidates):
            unresolved.append(
                f"step {step}: {count_of} contributors, applied by {sorted(known)}, "
                f"in flight at death {candidates}"
            )
            members[step] = sorted(known)
            continue
        choices = list(combinations(candidates, missing))
        if len(choices) > 1:
            unresolved.append(f"step {step}: {missing} of {candidates} contributed, unknown which")
        members[step] = sorted(known | set(choices[0]))
    return members, unresolved


def unclaimed(
    incarnations: list[Incarnation], members: dict[int, list[int]]
) -> dict[int, list[int]]:
    """Per step, the ranks lost with it in flight that its count leaves out.

    A step's count (`last_contributors`) is the smallest over the step's chunks,
    and every step ends with a small bucket of its own (which parameters were
    used, sent after the gradients): a rank lost between the two is in the
    gradients' average and not in the count (an elastic step keeps what a lost
    rank contributed). `replay` tells the two apart by the step's logged digest.
    """
    lost = {
        step: sorted(ranks - set(members.get(step, [])))
        for step, ranks in in_flight(incarnations).items()
    }
    return {step: ranks for step, ranks in lost.items() if ranks}


def logged_digests(incarnations: list[Incarnation]) -> dict[int, str]:
    """Each applied step's parameter digest, as the first rank that applied it logged it."""
    logged: dict[int, str] = {}
    for inc in incarnations:
        for event in inc.of("applied"):
            if "d" in event:
                logged.setdefault(event["s"], event["d"])
    return logged


def replay(
    members: dict[int, list[int]],
    final_step: int,
    skipped: set[int] | frozenset[int] = frozenset(),
    digests: dict[int, str] | None = None,
    lost: dict[int, list[int]] | None = None,
    logged: dict[int, str] | None = None,
    counted: dict[int, list[int]] | None = None,
    shards: int = 1,
) -> dict[str, Any]:
    """Single-process training where step s averages the gradients of members[s]; the
    steps in `skipped` (aborted for every rank) change nothing.

    The sum is formed in ascending rank order in float32 and divided by the count,
    as the coordinator does, so the replay can match the replicas bitwise.

    Args:
        digests: filled with the replay's parameter digest after every step it applied
            (as the workers log it: `first_divergence` compares the two).
        lost: per step, ranks lost with it in flight that may be in its gradients'
            average although its count leaves them out (`unclaimed`).
        logged: per step, the digest the ranks logged (`logged_digests`). At a step
            of `lost` whose replay differs from it, the lost ranks are tried in as
            well; the first set that gives the logged digest is kept (else the count's).
        counted: filled with the steps of `lost` that had to count a lost rank, and
            the ranks they were replayed over (the union over shards).
        shards: coordinator shards. Each averages its own element range of the
            bucket over the ranks whose range reached it, so a rank killed while
            uploading may be in one shard's average and not another's: at a step
            of `lost`, every choice per shard is tried too.
    """
    import copy

    import torch

    torch.set_num_threads(1)
    model = churn_worker.ChurnModel(0)
    optimizer = churn_worker.make_optimizer(model)
    parameters = list(model.parameters())

    def gradients(step: int, rank: int) -> list[torch.Tensor]:
        model.zero_grad()
        x, y = churn_worker.rank_batch(step, rank)
        loss = churn_worker.loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        return [p.grad.detach().clone() for p in parameters if p.grad is not None]

    def train(step: int, per_shard: list[list[int]]) -> None:
        """One step whose shard i averaged the ranks per_shard[i] over its range."""
        ranks = sorted({rank for shard_ranks in per_shard for rank in shard_ranks})
        flat = {rank: churn_worker.bucket_layout(gradients(step, rank)) for rank in ranks}
        average = torch.empty_like(next(iter(flat.values())))
        bounds = chunking.shard_ranges(churn_worker.bucket_elements(model), len(per_shard))
        for (start, stop), shard_ranks in zip(bounds, per_shard, strict=True):
            stop = min(stop, average.numel())  # (the presence tail is not a gradient)
            if start >= stop:
                continue
            total = flat[shard_ranks[0]][start:stop].clone()
            for rank in shard_ranks[1:]:
                total = total + flat[rank][start:stop]
            average[start:stop] = total / len(shard_ranks)
        for parameter, grad in zip(
            parameters, churn_worker.unflatten(average, parameters), strict=True
        ):
            parameter.grad = grad
        optimizer.step()

    for step in range(final_step):
        ranks = members.get(step, [])
        if not ranks:
            if step in skipped:
                continue  # aborted for every rank: no update anywhere
            raise ValueError(f"no contribution recorded for step {step}")
        extra = (lost or {}).get(step, [])
        wanted = (logged or {}).get(step)
        if extra and wanted is not None:
            before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
            sets = [ranks] + [
                sorted({*ranks, *subset})
                for size in range(1, len(extra) + 1)
                for subset in combinations(extra, size)
            ]
            # Every shard the same set first (the usual case), then mixtures.
            uniform = [[option] * shards for option in sets]
            mixed = [list(c) for c in product(sets, repeat=shards) if len(set(map(tuple, c))) > 1]
            for option in uniform + mixed:
                train(step, option)
                if churn_worker.digest(model)[:16] == wanted:
                    union = sorted({rank for shard_ranks in option for rank in shard_ranks})
                    if union != ranks and counted is not None:
                        counted[step] = union
                    break
                # A copy each time: loading keeps the given tensors, which the next try's
                # optimizer step would change in place.
                model.load_state_dict(before[0])
                optimizer.load_state_dict(copy.deepcopy(before[1]))
            else:
                train(step, [ranks])  # none matches: the count's, and the difference shows
        else:
            train(step, [ranks])
        if digests is not None:
            digests[step] = churn_worker.digest(model)[:16]
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def first_divergence(
    incarnations: list[Incarnation], replayed: dict[int, str]
) -> dict[str, Any] | None:
    """The first step after which some rank's parameters differ from the replay's.

    Every `applied` event carries the rank's digest after that step; the replay's
    after the same step is in `replayed`. Where a rank left the replay first says
    which step (and which ranks) to look at in the logs. None: no rank ever did
    (or the logs predate the per-step digest).
    """
    first: dict[str, Any] | None = None
    for inc in incarnations:
        for event in inc.of("applied"):
            expected = replayed.get(event["s"])
            if "d" not in event or expected is None or event["d"] == expected:
                continue
            if first is None or event["s"] < first["step"]:
                first = {"step": event["s"], "ranks": [], "count": event["c"]}
            if event["s"] == first["step"]:
                first["ranks"].append(inc.rank)
            break  # the rest of this process follows from its first difference
    return first


def compare_to_replay(folder: Path, expected: dict[str, Any], ranks: list[int]) -> dict[str, Any]:
    """Bitwise equality and the largest relative error of each live rank's final state."""
    import torch

    bitwise = True
    worst = 0.0
    for rank in ranks:
        state = torch.load(folder / f"final{rank}.pt")
        for name, value in expected.items():
            got = state[name]
            bitwise = bitwise and torch.equal(got, value)
            error = float((got - value).norm() / value.norm().clamp_min(1e-30))
            worst = max(worst, error)
    return {"bitwise": bitwise, "max_relative_error": worst, "ok": worst <= 1e-5}


def step_times(incarnations: list[Incarnation]) -> list[tuple[float, int]]:
    """(wall time, step) of the first application of every step, in time order."""
    first: dict[int, float] = {}
    for inc in incarnations:
        for event in inc.of("applied"):
            first[event["s"]] = min(first.get(event["s"], event["t"]), event["t"])
    return sorted((t, step) for step, t in first.items())


def failure_timings(
    failures: list[Failure],
    samples: list[Sample],
    incarnations: list[Incarnation],
    end: float,
) -> list[dict[str, Any]]:
    """Per failure: detect, recover, steps computed again, a restarted rank's return."""
    times = step_times(incarnations)
    rows: list[dict[str, Any]] = []
    for index, failure in enumerate(failures):
        window_end = failures[index + 1].at if index + 1 < len(failures) else end
        before = [s for s in samples if s.t <= failure.at]
        epoch = before[-1].epoch if before else None
        active = before[-1].active if before else None
        reactions = [
            s.t
            for s in samples
            if failure.at < s.t < window_end and (s.epoch != epoch or s.active != active)
        ]
        reactions += [
            e["t"]
            for inc in incarnations
            for e in inc.events
            if e["e"] in ("restart", "error") and failure.at < e["t"] < window_end
        ]
        detect = min(reactions) - failure.at if reactions else None
        since = failure.at + (detect or 0.0)
        after = [t for t, _ in times if t > since]  # it may recover after the next failure
        gaps = [b - a for (a, _), (b, _) in pairwise(times)]
        window_gaps = [
            gap for gap, (t, _) in zip(gaps, times[1:], strict=False) if failure.at < t < window_end
        ]
        rows.append(
            {
                "kind": failure.kind,
                "target": failure.target,
                "at_s": failure.at,
                "detect_s": detect,
                "recover_s": (after[0] - failure.at) if after else None,
                "longest_stall_s": max(window_gaps, default=None),
                "recomputed": _recomputed(incarnations, failure.at, window_end),
                "rank_back_s": _rank_back(incarnations, failure, window_end),
                **failure.detail,
            }
        )
    return rows


def _recomputed(incarnations: list[Incarnation], start: float, end: float) -> int:
    """Steps a process submitted a second time, the second time within [start, end)."""
    count = 0
    for inc in incarnations:
        seen: set[int] = set()
        for event in inc.of("submit"):
            if event["s"] in seen and start <= event["t"] < end:
                count += 1
            seen.add(event["s"])
    return count


def _rank_back(incarnations: list[Incarnation], failure: Failure, end: float) -> float | None:
    """For a worker failure: seconds until a new process of that rank applied a step."""
    if not failure.kind.startswith("worker"):
        return None
    rank = int(failure.target.split()[-1])
    for inc in incarnations:
        starts = inc.of("start")
        if inc.rank != rank or not starts or starts[0]["t"] <= failure.at:
            continue
        applied = inc.of("applied")
        if applied:
            return float(applied[0]["t"] - failure.at)
    return None


def summarize_kinds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: count, median and max of detect / recover, total recomputed steps."""
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({row["kind"] for row in rows}):
        mine = [row for row in rows if row["kind"] == kind]
        entry: dict[str, Any] = {"count": len(mine)}
        for key in ("detect_s", "recover_s", "longest_stall_s", "rank_back_s"):
            values = sorted(row[key] for row in mine if row[key] is not None)
            entry[key] = (
                {"median": values[len(values) // 2], "max": values[-1], "n": len(values)}
                if values
                else None
            )
        entry["recomputed"] = sum(row["recomputed"] for row in mine)
        kinds[kind] = entry
    return kinds
