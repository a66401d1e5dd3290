"""One-process simulation of a W-rank training run: DDP, one rank alone, and gradsync's DiLoCo.

The quality harness (`gradsync_bench.quality`) tunes DiLoCo's outer settings over
thousands of inner steps; real processes on a shared machine would take hours for a
grid, so the runs are simulated here, rule for rule as the coordinator runs them:

- DDP: one model; every step averages the W ranks' gradients (each rank's batch is
  the same size, so that is the gradient of the mean loss over the W batches).
- one rank: rank 0's model and batches alone (a quarter of the samples at W = 4).
- DiLoCo: W replicas start from the same parameters, each with its own inner
  optimizer (state kept across rounds, as on a rank). Fragment i of F (the
  parameters cut in order into F runs of about equal bytes, as `gradsync.DiLoCo`
  cuts them) has its round at the inner steps t with t mod H = i*H/F. A round
  averages the W pseudo-gradients (global - local) of its fragment; an int8
  wire quantizes each with one float32 scale per chunk (max|x| / 127, ties to
  even, clipped to +-127; the whole model fits one chunk of the coordinator's
  grid at the sizes used here) and feeds each rank's rounding error into its
  next pseudo-gradient. The outer step is SGD with (Nesterov) momentum on the
  global parameters, which every replica then copies. The model scored is rank
  0's, what a rank holds (at a step that is a multiple of H, with one fragment,
  the global parameters).

The warm-up (`Setting.warmup_rounds`) scales the outer learning rate of the
first rounds linearly up to its value, the rule `gradsync.DiLoCo` would follow
if the harness chose it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from gradsync_bench import wan_task

#: The quality task's model (42,880 parameters): small enough that 2,000 steps of 4
#: replicas take minutes on a shared core.
WIDTH, LAYERS, HEADS, CONTEXT = 32, 2, 2, 32
#: Each rank's batch (sequences of CONTEXT bytes).
BATCH = 16


@dataclass(frozen=True)
class Setting:
    """One simulated run."""

    #: "ddp", "one" (rank 0 alone) or "diloco".
    method: str
    sync_every: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    #: "fp32" or "int8" pseudo-gradients on the wire.
    wire: str = "fp32"
    fragments: int = 1
    #: Rounds over which the outer learning rate ramps linearly up (0: none).
    warmup_rounds: int = 0

    @property
    def name(self) -> str:
        if self.method != "diloco":
            return self.method
        name = f"h{self.sync_every}-{self.wire}"
        if self.fragments > 1:
            name += f"-f{self.fragments}"
        name += f"-lr{self.outer_lr:g}-m{self.outer_momentum:g}"
        if not self.nesterov:
            name += "-plain"
        if self.warmup_rounds:
            name += f"-wu{self.warmup_rounds}"
        return name


@dataclass(frozen=True)
class Task:
    """The training task every setting of a harness run shares."""

    steps: int = 2000
    world_size: int = 4
    inner_lr: float = 3e-3
    #: Inner learning rate: linear warm-up over these steps, then cosine decay to 10 %.
    lr_warmup: int = 100
    eval_every: int = 100
    seed: int = 0


@dataclass
class Result:
    setting: Setting
    held_out_loss: float
    #: [inner step, held-out loss] of rank 0's model.
    curve: list[list[float]] = field(default_factory=list)
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        return {
            "name": self.setting.name,
            "setting": asdict(self.setting),
            "held_out_loss": self.held_out_loss,
            "curve": self.curve,
            "seconds": self.seconds,
        }


class ReplicaTransformer(nn.Module):
    """R copies of a small causal pre-norm transformer over bytes, computed as one batch.

    Every parameter has a leading replica dimension; replica r only ever reads its own
    slice, so its gradient is its own loss's, and AdamW (elementwise) on the stacked
    parameters is R independent AdamWs. Every copy starts from the same parameters
    (seeded). `forward` takes tokens [R, B, T] and returns logits [R, B, T, 256]. A
    rank of a real run holds `ReplicaTransformer(1)`.
    """

    def __init__(
        self,
        replicas: int,
        width: int = WIDTH,
        layers: int = LAYERS,
        heads: int = HEADS,
        context: int = CONTEXT,
        seed: int = 0,
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.replicas, self.heads = replicas, heads

        def weight(*shape: int, std: float) -> nn.Parameter:
            one = torch.randn(*shape, generator=generator) * std
            return nn.Parameter(one.unsqueeze(0).repeat(replicas, *[1] * len(shape)).contiguous())

        def const(value: float, *shape: int) -> nn.Parameter:
            return nn.Parameter(torch.full((replicas, *shape), value))

        d = width
        self.embed = weight(wan_task.VOCAB, d, std=0.02)
        self.position = weight(context, d, std=0.02)
        self.blocks = nn.ParameterList()
        for _ in range(layers):
            self.blocks.extend(
                [
                    const(1.0, d), const(0.0, d),  # norm 1
                    weight(d, 3 * d, std=d**-0.5), const(0.0, 3 * d),  # q, k, v
                    weight(d, d, std=(d * 2 * layers) ** -0.5), const(0.0, d),  # out
                    const(1.0, d), const(0.0, d),  # norm 2
                    weight(d, 4 * d, std=d**-0.5), const(0.0, 4 * d),  # up
                    weight(4 * d, d, std=(4 * d * 2 * layers) ** -0.5), const(0.0, d),  # down
                ]
            )  # fmt: skip
        self.norm_weight, self.norm_bias = const(1.0, d), const(0.0, d)
        self.head = weight(d, wan_task.VOCAB, std=d**-0.5)

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        normed = nn.functional.layer_norm(x, (x.shape[-1],))
        return normed * w[:, None, None, :] + b[:, None, None, :]

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        r, batch, length, _ = x.shape
        y = torch.bmm(x.reshape(r, batch * length, -1), w).view(r, batch, length, -1)
        return y if b is None else y + b[:, None, None, :]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        r, batch, length = tokens.shape
        index = torch.arange(r)[:, None, None]
        h = self.embed[index, tokens] + self.position[:, None, :length, :]
        p = list(self.blocks)
        for i in range(0, len(p), 12):
            n1w, n1b, qkv_w, qkv_b, out_w, out_b, n2w, n2b, up_w, up_b, down_w, down_b = p[
                i : i + 12
            ]
            qkv = self._linear(self._norm(h, n1w, n1b), qkv_w, qkv_b)
            heads = qkv.view(r * batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            attended = nn.functional.scaled_dot_product_attention(
                heads[0], heads[1], heads[2], is_causal=True
            )
            attended = attended.permute(0, 2, 1, 3).reshape(r, batch, length, -1)
            h = h + self._linear(attended, out_w, out_b)
            up = nn.functional.gelu(self._linear(self._norm(h, n2w, n2b), up_w, up_b))
            h = h + self._linear(up, down_w, down_b)
        return self._linear(self._norm(h, self.norm_weight, self.norm_bias), self.head, None)


def replica_losses(
    model: ReplicaTransformer, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Each replica's mean next-byte cross-entropy, [R], in nats."""
    logits = model(inputs)
    per_token = nn.functional.cross_entropy(
        logits.reshape(-1, wan_task.VOCAB), targets.reshape(-1), reduction="none"
    )
    return per_token.view(inputs.shape[0], -1).mean(dim=1)


@torch.no_grad()
def held_out_loss(model: ReplicaTransformer, held_out: torch.Tensor, replica: int = 0) -> float:
    """`wan_task.held_out_loss`'s windows, scored on one replica."""
    windows = 64
    step = max(1, (len(held_out) - CONTEXT - 1) // windows)
    starts = list(range(0, len(held_out) - CONTEXT - 1, step))[:windows]
    batch = torch.stack([held_out[s : s + CONTEXT + 1] for s in starts])
    inputs = batch[:, :-1].unsqueeze(0).expand(model.replicas, -1, -1)
    targets = batch[:, 1:].unsqueeze(0).expand(model.replicas, -1, -1)
    loss = float(replica_losses(model, inputs, targets)[replica])
    if not math.isfinite(loss):
        raise RuntimeError(f"held-out loss is {loss}")
    return loss


def inner_lr_at(task: Task, step: int) -> float:
    """The inner learning rate of inner step `step` (0-based): warm-up, then cosine to 10 %."""
    if step < task.lr_warmup:
        return task.inner_lr * (step + 1) / task.lr_warmup
    progress = (step - task.lr_warmup) / max(1, task.steps - task.lr_warmup)
    return task.inner_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(task: Task, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=task.inner_lr, weight_decay=0.01)


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def split_fragments(params: list[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indexes of `params` per fragment: runs of about equal bytes, as `gradsync.DiLoCo`."""
    total = sum(p.numel() for p in params)
    groups: list[list[int]] = [[]]
    filled = 0
    for position, p in enumerate(params):
        left, open_groups = len(params) - position, fragments - len(groups)
        if groups[-1] and (filled >= total * len(groups) / fragments or left <= open_groups):
            groups.append([])
        groups[-1].append(position)
        filled += p.numel()
    return groups


def quantize_int8(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each replica's `values` (one fragment, [R, ...] each) as the int8 wire carries them,
    dequantized: one scale per replica, max|x| / 127 over the whole fragment."""
    peak = torch.stack([v.abs().reshape(v.shape[0], -1).amax(dim=1) for v in values]).amax(dim=0)
    scale = (peak / 127.0).to(torch.float32)
    out = []
    for v in values:
        s = scale.view(-1, *[1] * (v.dim() - 1))
        q = torch.where(s > 0, torch.clamp(torch.round(v / s), -127, 127), torch.zeros_like(v))
        out.append(q * s)
    return out


class _Outer:
    """The coordinator's outer step on one fragment's global parameters (float32)."""

    def __init__(self, params: list[torch.Tensor], setting: Setting) -> None:
        self.params = params
        self.buffers = [torch.zeros_like(p) for p in params]
        self.setting = setting
        self.rounds = 0

    def step(self, average: list[torch.Tensor]) -> None:
        s = self.setting
        self.rounds += 1
        lr = s.outer_lr
        if s.warmup_rounds:
            lr *= min(1.0, self.rounds / s.warmup_rounds)
        for p, buf, g in zip(self.params, self.buffers, average, strict=True):
            if s.outer_momentum > 0:
                buf.mul_(s.outer_momentum).add_(g)
                update = g + s.outer_momentum * buf if s.nesterov else buf
            else:
                update = g
            p.sub_(lr * update)


def simulate(setting: Setting, task: Task, log: Any = None) -> Result:
    """Train `setting` on `task`; the held-out loss of rank 0's final model and its curve."""
    torch.set_num_threads(1)
    corpus = wan_task.read_corpus()
    slices = [wan_task.split(corpus, r, task.world_size) for r in range(task.world_size)]
    held_out = slices[0][1]
    batches = [
        wan_task.Batches(text, BATCH, CONTEXT, rank, task.seed)
        for rank, (text, _) in enumerate(slices)
    ]
    started = time.perf_counter()
    curve: list[list[float]] = []
    diloco = setting.method == "diloco"
    model = ReplicaTransformer(task.world_size if diloco else 1)
    optimizer = _optimizer(task, model)
    ranks = range(task.world_size) if setting.method != "one" else range(1)
    rounds = _Rounds(setting, model) if diloco else None
    for step in range(task.steps):
        _set_lr(optimizer, inner_lr_at(task, step))
        optimizer.zero_grad()
        pairs = [batches[r].next() for r in ranks]
        if diloco:
            inputs = torch.stack([i for i, _ in pairs])
            targets = torch.stack([t for _, t in pairs])
        else:  # one model: the ranks' batches are one batch (their mean gradient)
            inputs = torch.cat([i for i, _ in pairs]).unsqueeze(0)
            targets = torch.cat([t for _, t in pairs]).unsqueeze(0)
        torch.autograd.backward(replica_losses(model, inputs, targets).sum())
        optimizer.step()
        if rounds is not None:
            rounds.after_inner_step(step + 1)
        if (step + 1) % task.eval_every == 0:
            loss = held_out_loss(model, held_out)
            curve.append([step + 1, loss])
            if log is not None:
                log(f"{setting.name} step {step + 1}: held-out {loss:.4f}")
    loss = held_out_loss(model, held_out)
    return Result(setting, loss, curve, time.perf_counter() - started)


class _Rounds:
    """The DiLoCo rounds of the replicas of `model` (each replica one rank)."""

    def __init__(self, setting: Setting, model: ReplicaTransformer) -> None:
        self.setting = setting
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = split_fragments([p[0] for p in self.params], setting.fragments)
        self.outers = [
            _Outer([self.params[i][0].detach().clone() for i in g], setting) for g in self.groups
        ]
        self.residuals = [[torch.zeros_like(self.params[i]) for i in g] for g in self.groups]

    def after_inner_step(self, t: int) -> None:
        h, count = self.setting.sync_every, len(self.groups)
        for index, group in enumerate(self.groups):
            if t % h != index * h // count:
                continue
            outer = self.outers[index]
            local = [self.params[i].detach() for i in group]
            pseudo = [g.unsqueeze(0) - p for g, p in zip(outer.params, local, strict=True)]
            if self.setting.wire == "int8":
                wanted = [x + r for x, r in zip(pseudo, self.residuals[index], strict=True)]
                pseudo = quantize_int8(wanted)
                self.residuals[index] = [w - x for w, x in zip(wanted, pseudo, strict=True)]
            outer.step([x.mean(dim=0) for x in pseudo])
            with torch.no_grad():
                for p, g in zip(local, outer.params, strict=True):
                    p.copy_(g.unsqueeze(0).expand_as(p))
