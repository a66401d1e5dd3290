"""DiLoCo runs for tests: the model, each rank's batches, and a one-process simulation.

The simulation is the definition the coordinator's outer optimizer is checked
against: W replicas start from the same global parameters, each takes H
inner steps with its own inner optimizer (whose state carries over from round
to round, as on a real rank), their pseudo-gradients (global - local, rounded
to the wire dtype with the residual fed back when the wire is 16-bit) are
averaged, and `torch.optim.SGD(lr, momentum, nesterov)` applies the average to
the global parameters, which every replica continues from.

The int8 wire is simulated on the rank's bucket layout and the coordinator's
chunk grid (chunk size and shard count passed in): each chunk of each
shard's range of a bucket is quantized with its own scale (max|x| / 127,
round half to even, clipped to +-127), written here from the rule, not taken
from gradsync, and the residual is fed back per element. Its outer step is
written out as the coordinator computes it (buf = mu buf + g; g + mu buf;
p - lr step, each op rounded in float32), not as `torch.optim.SGD`, whose
fused `add(alpha=)` differs from it by an ulp here and there: harmless for a
float or 16-bit wire, but one ulp in the global parameters can move an int8
pseudo-gradient across a rounding boundary, an error of a whole quantum
(max|x| / 127), far above the tolerance. The float wires keep torch's SGD as
the definition of the outer step.

A compact answer (`Run.answer` "int8" or "bf16") is simulated by the public-copy
rule, written out here from its definition: the replicas hold the public
copy, take their pseudo-gradients against it, and after the outer step on the
exact global parameters the public copy moves by the change exact - public
rounded as the coordinator rounds it (int8: quantized per chunk of the
coordinator's grid, as the int8 wire is, then q * scale; bf16: rounded to
bfloat16 and widened), with one float32 add. The simulation's history is the
public copy (what the ranks hold); `exact_history` keeps the exact parameters.

The sparse 2-bit wire (`Run.wire` and `Run.answer` "topk2", `Run.density`)
is simulated on the same grid by `support.sparse_reference`, written from its
rule: the ranks' pseudo-gradients plus their residuals, each chunk's top-k in
2 bits, the residual fed back per element, and the answer the public-copy
rule with that same sparse rounding of the change.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gradsync import defaults
from gradsync.path.reducer import plan_buckets
from gradsync_proto import chunking
from gradsync_proto.defaults import MIB
from torch import nn

from support.sparse_reference import sparse_wire

IN, HIDDEN, OUT, BATCH = 6, 12, 3, 5
WIRES = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "topk2": torch.int8,  # the sparse 2-bit wire: int8 chunks (the worker passes a SparseWire)
}


@dataclass(frozen=True)
class Run:
    """One DiLoCo run's settings (the worker's flags)."""

    rounds: int = 3
    sync_every: int = 4
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner: str = "adamw"
    inner_lr: float = 0.05
    wire: str = "fp32"
    fragments: int = 1
    overlap_steps: int = 0
    mixing: float | None = None
    hidden: int = HIDDEN
    #: The outer answer's dtype ("fp32": the exact parameters; "int8"/"bf16": changes).
    answer: str = "fp32"
    #: The targets: "noise" (random) or "teacher" (a fixed linear map of the inputs plus
    #: a little noise: a task every rank learns alike, so their pseudo-gradients agree).
    task: str = "noise"
    #: The sparse 2-bit wire's density (wire "topk2"), up and down.
    density: float = 0.1

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=Run.rounds)
        parser.add_argument("--sync-every", type=int, default=Run.sync_every)
        parser.add_argument("--outer-lr", type=float, default=Run.outer_lr)
        parser.add_argument("--outer-momentum", type=float, default=Run.outer_momentum)
        parser.add_argument("--inner", choices=["sgd", "adamw"], default=Run.inner)
        parser.add_argument("--inner-lr", type=float, default=Run.inner_lr)
        parser.add_argument("--wire", choices=sorted(WIRES), default=Run.wire)
        parser.add_argument("--hidden", type=int, default=Run.hidden)
        parser.add_argument("--fragments", type=int, default=Run.fragments)
        parser.add_argument("--overlap-steps", type=int, default=Run.overlap_steps)
        parser.add_argument("--mixing", type=float, default=Run.mixing)
        parser.add_argument("--answer", choices=sorted(WIRES), default=Run.answer)
        parser.add_argument("--task", choices=["noise", "teacher"], default=Run.task)
        parser.add_argument("--density", type=float, default=Run.density)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> Run:
        return cls(
            args.rounds,
            args.sync_every,
            args.outer_lr,
            args.outer_momentum,
            args.inner,
            args.inner_lr,
            args.wire,
            args.fragments,
            args.overlap_steps,
            args.mixing,
            args.hidden,
            args.answer,
            args.task,
            args.density,
        )

    def argv(self) -> list[str]:
        return [
            "--rounds", str(self.rounds), "--sync-every", str(self.sync_every),
            "--outer-lr", repr(self.outer_lr), "--outer-momentum", repr(self.outer_momentum),
            "--inner", self.inner, "--inner-lr", repr(self.inner_lr), "--wire", self.wire,
            "--hidden", str(self.hidden), "--answer", self.answer, "--density", repr(self.density),
            "--fragments", str(self.fragments), "--overlap-steps", str(self.overlap_steps),
            *([] if self.task == "noise" else ["--task", self.task]),
            *([] if self.mixing is None else ["--mixing", repr(self.mixing)]),
        ]  # fmt: skip


def make_model(seed: int, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT))


def inner_optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    if run.inner == "sgd":
        return torch.optim.SGD(model.parameters(), lr=run.inner_lr)
    return torch.optim.AdamW(model.parameters(), lr=run.inner_lr, weight_decay=0.01)


def batch(run: Run, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of inner step `step` (the same on the worker and in the simulation)."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, IN, generator=generator)
    y = torch.randn(BATCH, OUT, generator=generator)
    if run.task == "teacher":
        teacher = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(4242))
        y = x @ teacher.T + 0.1 * y
    return x, y


def int8_round_trip(flat: torch.Tensor, chunk_bytes: int, shard_count: int) -> torch.Tensor:
    """What the coordinator sums for one float32 bucket sent as int8 (`flat`: its elements).

    The bucket's int8 bytes (one per element) are cut into one range per shard,
    each chunked on its own grid; every chunk gets its own scale.
    """
    out = torch.zeros_like(flat)
    for shard in range(shard_count):
        lo, hi = chunking.shard_byte_range(flat.numel(), 1, shard_count, shard)
        for offset, length in chunking.range_chunk_spans(lo, hi, chunk_bytes):
            x = flat[offset : offset + length]
            scale = x.abs().max() / 127
            if scale > 0:  # an all-zero chunk stays zero
                q = torch.round(x / scale).clamp(-127, 127)  # torch.round: half to even
                out[offset : offset + length] = q * scale
    return out


def answer_round_trip(
    changes: list[torch.Tensor],
    model: nn.Module,
    answer: str,
    chunk_bytes: int,
    shard_count: int,
    density: float = Run.density,
) -> list[torch.Tensor]:
    """What the ranks add for each parameter's change of the public copy (`answer` != fp32)."""
    if answer == "topk2":
        return sparse_wire(changes, model, chunk_bytes, shard_count, density)
    if answer == "int8":
        return int8_wire(changes, model, chunk_bytes, shard_count)
    return [change.to(WIRES[answer]).float() for change in changes]


def int8_wire(
    deltas: list[torch.Tensor], model: nn.Module, chunk_bytes: int, shard_count: int
) -> list[torch.Tensor]:
    """Each parameter's dequantized pseudo-gradient, quantized on the rank's bucket layout."""
    named = list(model.named_parameters())
    buckets, _ = plan_buckets(
        named, int(defaults.BUCKET_CAP_MB * MIB), int(defaults.FIRST_BUCKET_MB * MIB)
    )
    out = list(deltas)
    for plan in buckets:
        indices = list(plan.parameter_indices)
        flat = torch.cat([deltas[i].reshape(-1) for i in indices])
        sent = int8_round_trip(flat, chunk_bytes, shard_count)
        for i, piece in zip(indices, sent.split([deltas[i].numel() for i in indices]), strict=True):
            out[i] = piece.reshape(deltas[i].shape)
    return out


class CoordinatorSGD:
    """The coordinator's outer step, op by op in float32 (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], run: Run) -> None:
        self.params, self.run = params, run
        self.momenta = [torch.zeros_like(p) for p in params]

    def step(self, grads: list[torch.Tensor]) -> None:
        lr, mu = self.run.outer_lr, self.run.outer_momentum
        with torch.no_grad():
            for p, buf, grad in zip(self.params, self.momenta, grads, strict=True):
                buf.copy_(buf * mu + grad if mu else grad)
                step = grad + mu * buf if mu else buf
                p.copy_(p - lr * step)


#: One replica's inner step: (replica index, its model, its inner optimizer, inner step).
InnerStep = Callable[[int, nn.Module, torch.optim.Optimizer, int], None]
#: What the coordinator takes in for a replica's tensors sent in a dtype ("int8", "bf16",
#: "topk2", ...): (tensors, the replica's model, dtype name) -> the rounded tensors.
Rounding = Callable[[list[torch.Tensor], nn.Module, str], list[torch.Tensor]]


def rank_step(
    run: Run, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """One inner step of rank `rank`: the mean-squared error on its batch, then the optimizer."""
    x, y = batch(run, rank, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _replicas(
    run: Run, count: int, initial: nn.Module
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """`count` copies of `initial`, each with its own inner optimizer."""
    replicas = [make_model(0, run.hidden) for _ in range(count)]
    for replica in replicas:
        replica.load_state_dict(initial.state_dict())
    return replicas, [inner_optimizer(run, replica) for replica in replicas]


def _outer_sgd(run: Run, params: list[torch.Tensor]) -> torch.optim.SGD:
    return torch.optim.SGD(
        params, lr=run.outer_lr, momentum=run.outer_momentum, nesterov=run.outer_momentum > 0
    )


def simulate(
    run: Run,
    world_size: int,
    initial: nn.Module,
    *,
    chunk_bytes: int = defaults.CHUNK_BYTES,
    shard_count: int = 1,
    error_feedback: bool = True,
    lost: tuple[int, int] | None = None,
    back: int | None = None,
    partial: Sequence[int] = (),
    exact_history: list[list[torch.Tensor]] | None = None,
    inner_step: InnerStep | None = None,
    rounding: Rounding | None = None,
) -> list[list[torch.Tensor]]:
    """The global parameters the ranks hold after each round (round 0 = the initial ones).

    With a compact answer (`run.answer`) that is the public copy; the exact global
    parameters after each round are appended to `exact_history` (if given).

    Args:
        lost: (rank, round): that rank is gone from that round on (1-based), so the round
            and every later one average over the others (`--on-failure elastic`).
        back: the lost rank comes back restarted (a fresh inner optimizer, no residual)
            from round `back`'s global parameters and takes part in rounds back + 1 on.
        partial: parameters (indices) whose pseudo-gradients the lost rank still delivered
            in the round it was lost in (it died mid-round): there they average over it too.
        chunk_bytes, shard_count: the coordinator's grid (the int8 wire's scales are per chunk).
        error_feedback: feed a narrow wire's rounding error back (as the ranks do by default).
        inner_step: a replica's inner step (default: `rank_step`, one rank a replica).
        rounding: how a replica's pseudo-gradients (in `run.wire`) and the compact answer's
            changes (in `run.answer`) are rounded (default: on the replica's own bucket
            layout and the coordinator's grid, `answer_round_trip`).
    """
    wire = WIRES[run.wire]
    if inner_step is None:
        inner_step = functools.partial(rank_step, run)
    if rounding is None:
        rounding = functools.partial(
            _round_trip, chunk_bytes=chunk_bytes, shard_count=shard_count, density=run.density
        )
    replicas, optimizers = _replicas(run, world_size, initial)
    # The seed round's answer: the average of the ranks' identical parameters, summed in
    # rank order and divided in float32 (the parameters themselves for W = 1, 2, 4).
    seeded = []
    for p in initial.parameters():
        total = p.detach().clone()
        for _ in range(world_size - 1):
            total = total + p.detach()
        seeded.append(total / world_size)
    global_params = [p.requires_grad_(True) for p in seeded]
    outer: torch.optim.SGD | CoordinatorSGD = _outer_sgd(run, global_params)
    if wire is torch.int8 or run.answer != "fp32":  # quantized: one ulp can move a quantum
        outer = CoordinatorSGD(global_params, run)
    residuals = [[torch.zeros_like(p) for p in global_params] for _ in replicas]
    history = [[p.detach().clone() for p in initial.parameters()]]  # before the seed
    # What the ranks hold: the exact parameters themselves, unless the answer is compact.
    public = [p.detach().clone() for p in global_params]
    if exact_history is not None:
        exact_history.append([p.detach().clone() for p in global_params])
    for number in range(1, run.rounds + 1):
        gone = lost is not None and number >= lost[1] and (back is None or number <= back)
        live = [r for r in range(world_size) if not (gone and lost is not None and r == lost[0])]
        if lost is not None and back is not None and number == back + 1 >= lost[1]:
            rank = lost[0]  # restarted: a fresh process from round `back`'s parameters
            with torch.no_grad():
                for p, g in zip(replicas[rank].parameters(), history[back], strict=True):
                    p.copy_(g)
            optimizers[rank] = inner_optimizer(run, replicas[rank])
            residuals[rank] = [torch.zeros_like(p) for p in global_params]
        dying = lost is not None and number == lost[1] and bool(partial)
        senders = [r for r in range(world_size) if r in live or (dying and r == lost[0])]
        for inner in range(run.sync_every):
            for rank in senders:
                inner_step(
                    rank, replicas[rank], optimizers[rank], (number - 1) * run.sync_every + inner
                )
        pseudo: dict[int, list[torch.Tensor]] = {}
        for rank in senders:
            replica = replicas[rank]
            deltas = [g - p.detach() for g, p in zip(public, replica.parameters(), strict=True)]
            if wire is None:
                pseudo[rank] = deltas
                continue
            deltas = [d + r for d, r in zip(deltas, residuals[rank], strict=True)]
            pseudo[rank] = rounding(deltas, replica, run.wire)
            if error_feedback:
                residuals[rank] = [d - s for d, s in zip(deltas, pseudo[rank], strict=True)]
        averages = []
        for index in range(len(global_params)):
            ranks = senders if index in partial else live  # (ascending: the rank order)
            averages.append(torch.stack([pseudo[r][index] for r in ranks]).sum(0) / len(ranks))
        if isinstance(outer, CoordinatorSGD):
            outer.step(averages)
        else:
            outer.zero_grad()
            for g, average in zip(global_params, averages, strict=True):
                g.grad = average
            outer.step()
        if run.answer == "fp32":
            public = [p.detach().clone() for p in global_params]
        else:
            changes = [g.detach() - h for g, h in zip(global_params, public, strict=True)]
            added = rounding(changes, replicas[0], run.answer)
            public = [h + a for h, a in zip(public, added, strict=True)]
        with torch.no_grad():
            for rank in live:
                for p, g in zip(replicas[rank].parameters(), public, strict=True):
                    p.copy_(g)
        history.append([p.clone() for p in public])
        if exact_history is not None:
            exact_history.append([p.detach().clone() for p in global_params])
    return history


def _round_trip(
    tensors: list[torch.Tensor],
    model: nn.Module,
    dtype: str,
    *,
    chunk_bytes: int,
    shard_count: int,
    density: float,
) -> list[torch.Tensor]:
    return answer_round_trip(tensors, model, dtype, chunk_bytes, shard_count, density)


def simulate_streaming(
    run: Run,
    world_size: int,
    initial: nn.Module,
    split: list[int],
    *,
    inner_step: InnerStep | None = None,
) -> list[list[torch.Tensor]]:
    """Every replica's parameters at the end of a Streaming DiLoCo run.

    `split` gives how many parameters each fragment holds, in order (as the
    library cuts them). Fragment i starts a round after the inner steps t with
    t mod H = i*H/F; its answer (one outer step of the fragment's own optimizer on
    the replicas' mean pseudo-gradient) is merged `overlap_steps` inner steps later:
    p = mixing * global + (1 - mixing) * p, or replaced without overlap.
    `inner_step`: a replica's inner step (default: `rank_step`, one rank a replica).
    """
    if inner_step is None:
        inner_step = functools.partial(rank_step, run)
    mixing = run.mixing if run.mixing is not None else (1.0 if run.overlap_steps == 0 else 0.5)
    replicas, optimizers = _replicas(run, world_size, initial)
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    local = [list(r.parameters()) for r in replicas]
    fragments = []
    for i in range(len(split)):
        params = [
            p.detach().clone().requires_grad_(True) for p in local[0][bounds[i] : bounds[i + 1]]
        ]
        fragments.append((params, _outer_sgd(run, params)))
    apply_at: dict[int, int] = {}

    def merge(index: int, share: float) -> None:
        params, _ = fragments[index]
        with torch.no_grad():
            for replica in local:
                for p, g in zip(replica[bounds[index] : bounds[index + 1]], params, strict=True):
                    if share == 1.0:
                        p.copy_(g)
                    else:
                        p.mul_(1.0 - share).add_(g, alpha=share)
        apply_at.pop(index, None)

    def outer_step(index: int) -> None:
        params, outer = fragments[index]
        outer.zero_grad()
        for position, g in enumerate(params):
            deltas = [g.detach() - replica[bounds[index] + position].detach() for replica in local]
            g.grad = torch.stack(deltas).sum(0) / world_size
        outer.step()

    count, every = len(split), run.sync_every
    for t in range(1, run.rounds * every + 1):
        for rank, (replica, optimizer) in enumerate(zip(replicas, optimizers, strict=True)):
            inner_step(rank, replica, optimizer, t - 1)
        for index in range(count):
            if apply_at.get(index) == t:
                merge(index, mixing)
            if t % every != index * every // count:
                continue
            outer_step(index)
            if run.overlap_steps == 0:
                merge(index, 1.0)
            else:
                apply_at[index] = t + run.overlap_steps
    return [[p.detach().clone() for p in replica] for replica in local]


@dataclass(frozen=True)
class LocalRound:
    """One of a rank's own rounds in a run with stragglers: where its contribution went.

    Attributes:
        start: the coordinator round whose global parameters the rank began it from
            (0 = the initial ones).
        on_time: the coordinator round it contributed to in time, or None (late).
        merged_into: a late contribution merged into that later round; None = dropped.
    """

    start: int
    on_time: int | None
    merged_into: int | None = None


def on_time_rounds(count: int) -> list[LocalRound]:
    """A rank that made every round in time: round j from round j - 1's parameters."""
    return [LocalRound(j - 1, j) for j in range(1, count + 1)]


def simulate_stragglers(
    run: Run,
    world_size: int,
    initial: nn.Module,
    schedule: dict[int, list[LocalRound]],
    rounds: int,
    weights: dict[int, float] | None = None,
) -> list[list[torch.Tensor]]:
    """The global parameters after each coordinator round (0 = the initial ones).

    Each rank runs its own rounds in order (H inner steps on its own batches, its
    inner optimizer's state carried over), each from the global parameters it held
    (`LocalRound.start`). Coordinator round c averages the on-time contributions
    (ascending rank) and then the late ones merged into it (ascending rank), weighted
    by `weights[rank]` if given (sum(w g) / sum(w), the sum of the weights and the
    quotient in float64, rounded to float32, as the coordinator divides), then takes
    the outer step.
    float32 wire only.
    """
    replicas, optimizers = _replicas(run, world_size, initial)
    global_params = [p.detach().clone().requires_grad_(True) for p in initial.parameters()]
    outer = _outer_sgd(run, global_params)
    history = [[p.detach().clone() for p in global_params]]
    done = dict.fromkeys(range(world_size), 0)  # local rounds each rank has run
    pseudo: dict[tuple[int, int], list[torch.Tensor]] = {}  # (rank, local round) -> deltas

    def run_local(rank: int, index: int) -> list[torch.Tensor]:
        while done[rank] <= index:
            number = done[rank]
            start = history[schedule[rank][number].start]
            replica, optimizer = replicas[rank], optimizers[rank]
            with torch.no_grad():
                for p, g in zip(replica.parameters(), start, strict=True):
                    p.copy_(g)
            for inner in range(run.sync_every):
                rank_step(run, rank, replica, optimizer, number * run.sync_every + inner)
            deltas = [g - p.detach() for g, p in zip(start, replica.parameters(), strict=True)]
            pseudo[(rank, number)] = deltas
            done[rank] += 1
        return pseudo[(rank, index)]

    for number in range(1, rounds + 1):
        contributions: list[tuple[int, list[torch.Tensor]]] = []
        for late in (False, True):
            for rank in range(world_size):
                for index, local in enumerate(schedule[rank]):
                    target = local.merged_into if late else local.on_time
                    if target == number:
                        contributions.append((rank, run_local(rank, index)))
        averages = []
        for position in range(len(global_params)):
            if weights is None:
                total = torch.stack([deltas[position] for _, deltas in contributions]).sum(0)
                averages.append(total / len(contributions))
                continue
            total = torch.zeros_like(global_params[position])
            for rank, deltas in contributions:  # one product and one add at a time, in order
                total = total + torch.tensor(weights[rank], dtype=torch.float32) * deltas[position]
            weight_sum = float(sum(weights[rank] for rank, _ in contributions))
            averages.append((total.double() / weight_sum).float())  # divided in float64
        outer.zero_grad()
        for g, average in zip(global_params, averages, strict=True):
            g.grad = average
        outer.step()
        history.append([p.detach().clone() for p in global_params])
    return history
