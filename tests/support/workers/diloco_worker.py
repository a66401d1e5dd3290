"""One rank of a DiLoCo test job; writes its parameters after every round to an .npz file.

The model and each rank's batches come from `support.diloco_reference`, which also
simulates the same run in one process for the tests to compare against.

Stragglers: `--before-round R:SECONDS` sleeps (and `--before-round R:PATH` waits for
a file) before the inner step that starts the rank's round R, `--touch-before-round
R:PATH` touches a file right then (its upload follows at once), and `--after-round
R:PATH` touches one once its round R merged, so that tests order ranks across rounds
without guessing at timings. Weighted rounds claim `--samples` per inner step.

Screening: `--screen POLICY` is `DiLoCo(screen=...)`, and `--attack KIND:R` corrupts
this rank's pseudo-gradient before it is uploaded, from its round R on (`Attack`).
Every warning the client logs is saved (`warnings/roundN`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradsync
from gradsync.hooks import GradBucket
from support import scenarios
from support.diloco_reference import WIRES, Run, batch, inner_optimizer, make_model


class DieInRound:
    """A comm hook that lets round R's first bucket go, then kills its process at the next.

    Which bucket autograd hands over first is autograd's choice, so the hook writes
    down the one it let go (`report`) before it dies. The pause before the kill gives
    that bucket time to reach the coordinator and complete there with every rank's
    copy, so the round is lost for the other buckets only: the elastic policy must
    complete those over the survivors.
    """

    def __init__(self, round_number: int, report: Path) -> None:
        self.round_number = round_number
        self.report = report
        self.delivered: int | None = None

    def before_upload(self, state: object, bucket: GradBucket) -> torch.Tensor:
        if bucket.step == self.round_number:
            if self.delivered is None:
                self.delivered = bucket.index
            else:
                self.report.write_text(json.dumps({"delivered_bucket": self.delivered}))
                time.sleep(3.0)
                os.kill(os.getpid(), signal.SIGKILL)
        return bucket.buffer

    def after_average(self, state: object, bucket: GradBucket, averaged: torch.Tensor) -> None:
        bucket.buffer.copy_(averaged)


class Attack:
    """Corrupts a fragment's uploads from round `start` on (wrapped after the seed went).

    kind: "scaled" (x100), "flipped" (sign), "random" (Gaussian noise with each
    tensor's own RMS) or "stale" (the pseudo-gradient of 5 rounds before, or of the
    first round while there is none that old).
    """

    def __init__(self, spec: str, seed: int) -> None:
        kind, _, start = spec.partition(":")
        self.kind, self.start = kind, int(start)
        self.rounds = 0
        self.history: list[list[torch.Tensor]] = []
        self.generator = torch.Generator().manual_seed(seed)

    def wrap(self, fragment: object) -> None:
        original = fragment._run  # type: ignore[attr-defined]

        def run(uploads: list[torch.Tensor]) -> None:
            self.rounds += 1
            number = self.rounds
            self.history.append([u.clone() for u in uploads])
            if number >= self.start:
                with torch.no_grad():
                    for index, upload in enumerate(uploads):
                        upload.copy_(self.corrupt(number, index, upload))
            original(uploads)

        fragment._run = run  # type: ignore[attr-defined]

    def corrupt(self, number: int, index: int, upload: torch.Tensor) -> torch.Tensor:
        if self.kind == "scaled":
            return upload * 100
        if self.kind == "flipped":
            return -upload
        if self.kind == "random":
            rms = upload.pow(2).mean().sqrt()
            noise = torch.randn(upload.shape, generator=self.generator, dtype=upload.dtype)
            return noise * rms
        if self.kind == "stale":
            return self.history[max(0, number - 6)][index]
        raise ValueError(f"unknown attack {self.kind!r}")


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    Run.add_arguments(parser)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--die-at-step", type=int, default=-1, help="SIGKILL itself there")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="a slower inner step")
    parser.add_argument("--metrics", action="store_true", help="serve metrics; save a scrape")
    parser.add_argument(
        "--die-mid-round",
        type=int,
        default=0,
        help="SIGKILL itself in that round (1-based): one bucket uploaded, the others never",
    )
    parser.add_argument("--bucket-mb", type=float, default=None, help="bucket and first bucket cap")
    parser.add_argument(
        "--trace", type=Path, default=None, help="trace the rounds into this folder"
    )
    parser.add_argument("--min-contributors", type=int, default=None)
    parser.add_argument(
        "--round-deadline-s", type=lambda v: v if v == "auto" else float(v), default=None
    )
    parser.add_argument("--late", choices=["drop", "merge"], default="drop")
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--weighted", action="store_true")
    parser.add_argument("--samples", type=float, default=None, help="samples per inner step")
    parser.add_argument("--before-round", action="append", default=[], help="R:SECONDS|R:PATH")
    parser.add_argument("--after-round", action="append", default=[], help="R:PATH to touch")
    parser.add_argument("--touch-before-round", action="append", default=[], help="R:PATH")
    parser.add_argument("--screen", default="report")
    parser.add_argument("--attack", default=None, help="KIND:R (see Attack)")
    parser.add_argument("--flat", action="store_true", help="hierarchical=False")
    args = parser.parse_args()
    warned = scenarios.Warnings()
    logging.getLogger("gradsync.client").addHandler(warned)
    touch_before = dict(_round_and(value) for value in args.touch_before_round)
    before = dict(_round_and(value) for value in args.before_round)
    after = dict(_round_and(value) for value in args.after_round)
    time.sleep(args.start_delay_s)  # a rank started by hand, later than the others
    run = Run.from_arguments(args)
    rank = args.rank
    model = make_model(100 + rank, run.hidden)  # different on every rank: construction equalises
    optimizer = inner_optimizer(run, model)
    wire = gradsync.SparseWire(run.density) if run.wire == "topk2" else WIRES[run.wire]
    saved: dict[str, np.ndarray] = {}
    with gradsync.DiLoCo(
        model,
        optimizer,
        sync_every=run.sync_every,
        outer_lr=run.outer_lr,
        outer_momentum=run.outer_momentum,
        wire_dtype=wire,
        answer_dtype=None if run.answer == "topk2" else WIRES[run.answer],
        fragments=run.fragments,
        overlap_steps=run.overlap_steps,
        mixing=run.mixing,
        coordinator=args.coordinator,
        rank=rank,
        world_size=args.world_size,
        job_id=args.job_id,
        timeout_s=60,
        metrics_port=0 if args.metrics else None,
        trace_path=args.trace / f"rank{rank}.json" if args.trace else None,
        **(
            {"bucket_cap_mb": args.bucket_mb, "first_bucket_mb": args.bucket_mb}
            if args.bucket_mb
            else {}
        ),
        min_contributors=args.min_contributors,
        round_deadline_s=args.round_deadline_s,
        late=args.late,
        max_staleness=args.max_staleness,
        weighted=args.weighted,
        screen=args.screen,
        **({"hierarchical": False} if args.flat else {}),
    ) as diloco:
        if args.attack:
            attack = Attack(args.attack, rank)
            for fragment in diloco.fragments:
                attack.wrap(fragment)
        ddp = diloco.fragments[0].ddp
        for index, plan in enumerate(ddp.bucket_plans):
            saved[f"bucket{index}"] = np.array(plan.parameter_indices)
        if args.die_mid_round:
            assert ddp._reducer.comm_hook is None, "an fp32 wire only"
            report = args.out.with_suffix(".died.json")
            ddp._reducer.comm_hook = DieInRound(args.die_mid_round, report)
        for name, p in model.named_parameters():
            saved[f"round0/{name}"] = p.detach().numpy().copy()
        for step in range(run.rounds * run.sync_every):
            if step == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)  # lost while computing its inner steps
            time.sleep(args.step_delay_s)
            x, y = batch(run, rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if (step + 1) % run.sync_every == 0:  # this call starts a round
                _hold(before.get(diloco.rounds + 1))
                if diloco.rounds + 1 in touch_before:  # its upload starts right after this
                    Path(touch_before[diloco.rounds + 1]).touch()
            if diloco.step(samples=args.samples):
                number = diloco.rounds
                for name, p in model.named_parameters():
                    saved[f"round{number}/{name}"] = p.detach().numpy().copy()
                saved[f"contributors/round{number}"] = np.array(diloco.last_round_contributors)
                saved[f"late/round{number}"] = np.array(diloco.last_round_late)
                saved[f"merged/round{number}"] = np.array(diloco.last_round_merged_late)
                saved[f"staleness/round{number}"] = np.array(diloco.last_round_staleness)
                saved[f"seconds/round{number}"] = np.array(diloco.last_round_s)
                saved[f"warnings/round{number}"] = np.array("\n".join(warned.lines))
                warned.lines.clear()
                if number in after:
                    Path(after[number]).touch()
        for name, p in model.named_parameters():
            saved[f"final/{name}"] = p.detach().numpy().copy()
        saved["fragment_sizes"] = np.array([len(f.params) for f in diloco.fragments])
        saved["inner_steps"] = np.array(diloco.inner_steps)
        saved["last_round_bytes"] = np.array(diloco.last_round_bytes)
        saved["last_round_received"] = np.array(
            sum(f.last_round_received for f in diloco.fragments)
        )
        server = diloco._instruments.server
        if server is not None:  # what a scraper of this rank's endpoint reads now
            with urllib.request.urlopen(server.url, timeout=10) as reply:
                saved["metrics"] = np.frombuffer(reply.read(), dtype=np.uint8)
    np.savez(args.out, **saved)
    return 0


def _round_and(value: str) -> tuple[int, str]:
    number, _, what = value.partition(":")
    return int(number), what


def _hold(what: str | None) -> None:
    """Sleep that many seconds, or wait (bounded) until that file exists."""
    if what is None:
        return
    try:
        seconds = float(what)
    except ValueError:
        deadline = time.monotonic() + 60.0
        while not Path(what).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not appear within 60 s") from None
            time.sleep(0.02)
        return
    time.sleep(seconds)


if __name__ == "__main__":
    raise SystemExit(main())
