"""The wan suite's training task: a character-level transformer on the standard library's source.

The slow-link scorecard needs a real learning curve on data every machine has, and a model
big enough (at least 16 MiB of float32 parameters) that its synchronization costs seconds
on a 100 Mbit/s link. The corpus is the Python standard library's own ``*.py`` files, read
in sorted order up to a byte budget, so every rank of every run sees the same bytes; the
vocabulary is the 256 byte values. Rank r trains on the r-th of W contiguous slices of the
first 95 %; the last 5 % is the held-out text every method's final model is scored on.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from torch import nn

#: Bytes of the corpus read (sorted file order): enough text for a few thousand steps.
CORPUS_BYTES = 2_000_000
#: The share of the corpus kept out of training for the final (held-out) loss.
HELD_OUT_SHARE = 0.05
VOCAB = 256


def read_corpus(limit: int = CORPUS_BYTES) -> torch.Tensor:
    """The standard library's ``*.py`` files, sorted by path, concatenated, as byte values.

    Raises:
        RuntimeError: the standard library has fewer than 10 000 bytes of Python source.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        # Only the library itself: a venv's packages would differ between machines.
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 10_000:
        raise RuntimeError(f"only {total} bytes of Python source under {root}")
    corpus = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.long)


def split(corpus: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank's training slice, the held-out tail every rank shares)."""
    held_out = int(len(corpus) * HELD_OUT_SHARE)
    train = corpus[: len(corpus) - held_out]
    per_rank = len(train) // world_size
    return train[rank * per_rank : (rank + 1) * per_rank], corpus[len(corpus) - held_out :]


class Batches:
    """Random windows of a rank's slice, from a generator seeded with the rank (and `seed`),
    so every method of a run draws the same batches on the same rank."""

    def __init__(self, text: torch.Tensor, batch: int, context: int, rank: int, seed: int = 0):
        if len(text) <= context + 1:
            raise ValueError(f"a slice of {len(text)} bytes is too short for context {context}")
        self.text, self.batch, self.context = text, batch, context
        self.generator = torch.Generator().manual_seed(1000 * seed + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            0, len(self.text) - self.context - 1, (self.batch,), generator=self.generator
        )
        windows = torch.stack([self.text[s : s + self.context + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]


class CharTransformer(nn.Module):
    """A causal pre-norm transformer over bytes (about 4.85 M parameters, 19.4 MB, with the
    defaults): embedding + learned positions, `layers` encoder blocks under a causal mask,
    a final norm and an untied output layer."""

    def __init__(
        self, width: int = 256, layers: int = 6, heads: int = 4, context: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        full_mask: torch.Tensor = self.mask  # type: ignore[assignment]  # a registered buffer
        mask = full_mask[:length, :length]
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


def build_model(context: int) -> CharTransformer:
    """The model, with the same initial parameters on every rank and in every run."""
    torch.manual_seed(0)
    return CharTransformer(context=context)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's float32 parameters (what one full synchronization moves)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy, in nats."""
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@torch.no_grad()
def held_out_loss(
    model: nn.Module, held_out: torch.Tensor, context: int, windows: int = 64
) -> float:
    """Mean loss over `windows` evenly spaced windows of the held-out text (no sampling
    noise: the same windows for every method)."""
    step = max(1, (len(held_out) - context - 1) // windows)
    starts = list(range(0, len(held_out) - context - 1, step))[:windows]
    batch = torch.stack([held_out[s : s + context + 1] for s in starts])
    loss = float(loss_of(model, batch[:, :-1], batch[:, 1:]))
    if not math.isfinite(loss):
        raise RuntimeError(f"held-out loss is {loss}")
    return loss
