"""One-process simulation of DiLoCo on the sparse 2-bit wire, for sweeping its settings.

    python -m gradsync_bench.sparse_sim --steps 300 --world 2 \
        --runs int8x2 topk2:d=0.02 topk2:d=0.03,m=0.9,lr=0.7,decay=0.9

W replicas of a character transformer (the wan task's architecture,
`wan_task.CharTransformer`, by default shrunk so a sweep takes minutes on a
shared core; `--full` for the scorecard's own size), each with its own AdamW
and its own slice of the corpus, trained in one process with the rules a
real run follows:

- every `--sync-every` inner steps each replica uploads its pseudo-gradient
  (the public global parameters minus its own) plus its error-feedback
  residual: int8 with one scale per chunk ("int8x2") or each chunk's top
  `d` share in 2 bits ("topk2", `gradsync_proto.sparse_wire`'s rule); the
  residual becomes `decay * (upload wanted - what was sent)`;
- the hub averages what was sent, takes an outer SGD step (learning rate
  `lr`, default 1.0; Nesterov momentum `m`, default `gradsync.DiLoCo`'s for
  the wire: 0.5 dense, 0 sparse) on its exact parameters, and answers each
  chunk's change of the public copy (exact - public) as int8 or as its top
  `a` share in 2 bits; every replica adds the answer to the public copy and
  starts the next round from it.

Other knobs of a run: `fit` (the 2-bit step rule), `keep` (a replica keeps
what it has not sent instead of restarting from the public copy), `--chunk`
(elements per chunk, so per top-k). Reported: the held-out loss of the public
copy after the last round (what every rank holds), and its ratio to the first
run's.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from gradsync_proto import int8_wire, sparse_wire
from torch import nn

from gradsync_bench import wan_task

#: Elements per chunk (the coordinator's default grid: 1 MiB of int8 bytes).
CHUNK = 1 << 20


@dataclass(frozen=True)
class Run:
    """One simulated run's wire and outer settings."""

    wire: str = "topk2"
    d: float = 0.02
    #: The answer's density (0: int8 answer).
    a: float = -1.0
    lr: float = 1.0
    #: Nesterov outer momentum (< 0: the library's default for the wire).
    m: float = -1.0
    decay: float = 1.0
    #: The 2-bit step: 0 = max|selected| / 3 (the wire's rule), 1 = a least-squares fit;
    #: 2 = no rounding (the selection's float32 values).
    fit: float = 0.0
    #: 1: a replica keeps what it has not sent (it restarts from public - residual and
    #: its residual is not added again); 0: it restarts from public (gradsync's rule).
    keep: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Run:
        wire, _, rest = text.partition(":")
        fields: dict[str, float] = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            fields[key] = float(value)
        return cls(wire, **fields)

    @property
    def momentum(self) -> float:
        if self.m >= 0:
            return self.m
        return 0.0 if self.wire == "topk2" else 0.5  # `gradsync.DiLoCo`'s defaults

    @property
    def answer_density(self) -> float:
        if self.wire == "int8x2":
            return 0.0
        return self.d if self.a < 0 else self.a


def _chunks(flat: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(chunk, flat.size - lo)) for lo in range(0, flat.size, chunk)]


def fitted(piece: np.ndarray, density: float, fit: float) -> np.ndarray:
    """Top-k 2-bit with the step fitted by least squares to the selection's magnitudes."""
    magnitude = np.abs(piece)
    indices = sparse_wire._top_indices(magnitude, sparse_wire.select_count(piece.size, density))
    chosen = magnitude[indices]
    out = np.zeros_like(piece)
    if fit == 2:  # the selection's exact values (no 2-bit rounding), for comparison
        out[indices] = piece[indices]
        return out
    step = np.float32(chosen.mean())
    for _ in range(2):  # assign each magnitude to level 1 or 3, then fit the step
        levels = np.where(chosen >= 2 * step, np.float32(3), np.float32(1))
        step = np.float32((levels * chosen).sum() / (levels * levels).sum())
    if step > 0:
        codes = np.clip(np.rint((piece[indices] / step + 3) / 2), 0, 3)
        out[indices] = (codes * 2 - 3).astype(np.float32) * step
    return out


def send(flat: np.ndarray, density: float, chunk: int, fit: float = 0.0) -> np.ndarray:
    """What the wire carries for `flat` (float32): int8 at density 0, else top-k 2-bit."""
    out = np.zeros_like(flat)
    for lo, length in _chunks(flat, chunk):
        piece = flat[lo : lo + length]
        if density and fit:
            out[lo : lo + length] = fitted(piece, density, fit)
        elif density:
            out[lo : lo + length] = sparse_wire.encode(piece, density)[1].values()
        else:
            q, scale = int8_wire.quantize_chunk(piece)
            out[lo : lo + length] = int8_wire.dequantize(q, scale)
    return out


def simulate(run: Run, args: argparse.Namespace) -> float:
    """Train `run`; the held-out loss of the public copy after the last round."""
    torch.set_num_threads(1)
    corpus = wan_task.read_corpus()
    world = args.world
    slices = [wan_task.split(corpus, r, world) for r in range(world)]
    held_out = slices[0][1]
    batches = [
        wan_task.Batches(text, args.batch, args.context, r) for r, (text, _) in enumerate(slices)
    ]
    models: list[nn.Module] = []
    for _ in range(world):
        torch.manual_seed(0)
        if args.full:
            models.append(wan_task.CharTransformer(context=args.context))
        else:
            models.append(wan_task.CharTransformer(args.width, args.layers, 2, args.context))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in models]
    params = [list(m.parameters()) for m in models]

    def flat_of(r: int) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in params[r]]).numpy().copy()

    def load(r: int, flat: np.ndarray) -> None:
        values = torch.from_numpy(flat)
        with torch.no_grad():
            offset = 0
            for p in params[r]:
                p.copy_(values[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    public = flat_of(0)
    exact = public.copy()
    buf = np.zeros_like(exact)
    residuals = [np.zeros_like(exact) for _ in range(world)]
    up = 0.0 if run.wire == "int8x2" else run.d
    down = run.answer_density
    for step in range(1, args.steps + 1):
        for r in range(world):
            optimizers[r].zero_grad()
            inputs, targets = batches[r].next()
            torch.autograd.backward(wan_task.loss_of(models[r], inputs, targets))
            optimizers[r].step()
        if step % args.sync_every:
            continue
        total = np.zeros_like(exact)
        for r in range(world):
            wanted = public - flat_of(r) + (0 if run.keep else residuals[r])
            sent = send(wanted, up, args.chunk, run.fit)
            residuals[r] = (wanted - sent) * np.float32(run.decay)
            total += sent
        g = total / np.float32(world)
        if run.momentum:
            buf = buf * np.float32(run.momentum) + g
            g = g + np.float32(run.momentum) * buf
        exact = exact - np.float32(run.lr) * g
        public = public + send(exact - public, down, args.chunk, run.fit)
        for r in range(world):
            load(r, public - residuals[r] if run.keep else public)
    load(0, public)
    return wan_task.held_out_loss(models[0], held_out, args.context)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["int8x2", "topk2"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="elements per chunk")
    parser.add_argument("--full", action="store_true", help="the scorecard's model size")
    args = parser.parse_args()
    base: float | None = None
    for text in args.runs:
        started = time.perf_counter()
        loss = simulate(Run.parse(text), args)
        base = loss if base is None else base
        ratio = loss / base if math.isfinite(base) else math.nan
        print(
            f"{text:<44}{loss:>9.4f}{ratio:>8.4f}{time.perf_counter() - started:>7.0f}s", flush=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
