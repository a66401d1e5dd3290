"""The contribution screen on the wan task, in one process: false positives and held-out loss.

W replicas of the wan scorecard's character transformer (`wan_task`, a smaller
width and depth so that a CPU runs it) train DiLoCo rounds in this process:
each takes H inner AdamW steps on its own slice, its pseudo-gradient is cut
into the coordinator's chunks (1 MiB of float32), and every chunk is measured,
judged and merged by the coordinator's own rules (`gradsync_server.dataplane.screening`),
then one outer Nesterov SGD step applies the average. No sockets: this measures
the rules, not the transport (the multi-process tests check that the
coordinator applies the same rules). It imports the coordinator's internals, so
it is a script beside the other tools, not part of `gradsync_bench` (whose
modules use only the library's public API).

Runs: an honest run per policy (every flag is a false positive: their rate per
rank-round is reported), then one rank attacking from round 3 on (x100, sign
flip, Gaussian noise of its own RMS, 5 rounds stale) under each policy; the
final held-out loss is compared with the honest run's.

    PYTHONPATH=client:server:proto:bench python scripts/screen_quality.py --rounds 30 \
        --out /tmp/screen-quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from gradsync_bench import wan_task
from gradsync_server.dataplane.screening import (
    ScreenPolicy,
    ScreenThresholds,
    judge,
    measure_chunk,
    merge,
)

CHUNK_ELEMENTS = (1 << 20) // 4
ATTACKS = ("scaled", "flipped", "random", "stale")


def corrupt(
    attack: str,
    honest: np.ndarray,
    history: list[np.ndarray],
    number: int,
    generator: np.random.Generator,
) -> np.ndarray:
    """The attacker's upload of round `number` in place of its honest pseudo-gradient."""
    if attack == "scaled":
        scaled: np.ndarray = honest * np.float32(100)
        return scaled
    if attack == "flipped":
        return -honest
    if attack == "random":
        rms = float(np.sqrt(np.mean(honest**2)))
        noise: np.ndarray = generator.standard_normal(honest.size).astype(np.float32)
        return noise * np.float32(rms)
    return history[max(0, number - 1 - 5)]  # "stale": its upload of 5 rounds before


def simulate(
    args: argparse.Namespace, policy: ScreenPolicy, attack: str | None
) -> dict[str, object]:
    """One run; returns its held-out loss, flags per round and the honest cosines seen."""
    torch.manual_seed(0)
    corpus = wan_task.read_corpus(args.corpus_bytes)
    thresholds = ScreenThresholds()
    world = args.world
    start = wan_task.CharTransformer(args.width, args.layers, 4, args.context)
    replicas = []
    for rank in range(world):
        model = wan_task.CharTransformer(args.width, args.layers, 4, args.context)
        model.load_state_dict(start.state_dict())
        text, held_out = wan_task.split(corpus, rank, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.1)
        batches = wan_task.Batches(text, args.batch, args.context, rank)
        replicas.append((model, optimizer, batches))
    global_params = [p.detach().clone().requires_grad_(True) for p in start.parameters()]
    outer = torch.optim.SGD(
        global_params, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
    )
    history: list[np.ndarray] = []
    generator = np.random.default_rng(1)
    flags: list[list[int]] = []
    honest_cosines: list[float] = []
    attacker_cosines: list[float] = []
    for number in range(1, args.rounds + 1):
        uploads = []
        for model, optimizer, batches in replicas:
            for _ in range(args.sync_every):
                inputs, targets = batches.next()
                optimizer.zero_grad()
                loss = wan_task.loss_of(model, inputs, targets)
                loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                optimizer.step()
            flat = torch.cat(
                [
                    (g - p).detach().flatten()
                    for g, p in zip(global_params, model.parameters(), strict=True)
                ]
            )
            uploads.append(flat.numpy().astype(np.float32))
        history.append(uploads[-1].copy())
        culprit = args.culprit
        if attack is not None and number >= 3:
            uploads[culprit] = corrupt(attack, uploads[culprit], history, number, generator)
        average = np.empty_like(uploads[0])
        flagged: set[int] = set()
        round_measures: list[tuple[float, float]] = []
        for lo in range(0, len(average), CHUNK_ELEMENTS):
            rows = [(rank, values[lo : lo + CHUNK_ELEMENTS]) for rank, values in enumerate(uploads)]
            measures = measure_chunk(rows, thresholds.norm_ratio)
            verdict = judge(policy, thresholds, measures)
            flagged.update(f.rank for f in verdict.findings)
            median_norm = float(np.median([measured.norm for _, measured in measures]))
            for rank, measured in measures:
                ratio = measured.norm / median_norm if median_norm > 0 else math.nan
                round_measures.append((ratio, measured.cosine))
                if not math.isnan(measured.cosine):
                    is_attacker = attack is not None and number >= 3 and rank == culprit
                    (attacker_cosines if is_attacker else honest_cosines).append(measured.cosine)
            total, divisor = merge(policy, thresholds, rows, verdict)
            average[lo : lo + CHUNK_ELEMENTS] = total / np.float32(divisor)
        flags.append(sorted(flagged))
        if args.progress is not None:
            _log_round(args.progress, policy, attack, number, sorted(flagged), round_measures)
        offset = 0
        for parameter in global_params:
            size = parameter.numel()
            parameter.grad = torch.from_numpy(average[offset : offset + size].copy()).view_as(
                parameter
            )
            offset += size
        outer.step()
        for model, _, _ in replicas:
            with torch.no_grad():
                for local, shared in zip(model.parameters(), global_params, strict=True):
                    local.copy_(shared)
    model = replicas[0][0]
    _, held_out = wan_task.split(corpus, 0, world)
    return {
        "policy": policy.value,
        "attack": attack,
        "held_out_loss": wan_task.held_out_loss(model, held_out, args.context),
        "flags": flags,
        "honest_cosine_min": min(honest_cosines) if honest_cosines else None,
        "honest_cosine_median": float(np.median(honest_cosines)) if honest_cosines else None,
        "attacker_cosine_max": max(attacker_cosines) if attacker_cosines else None,
        "parameters": sum(p.numel() for p in start.parameters()),
    }


def _log_round(
    path: Path,
    policy: ScreenPolicy,
    attack: str | None,
    number: int,
    flagged: list[int],
    measures: list[tuple[float, float]],
) -> None:
    """One JSON line per round: what was flagged, and how close the honest rows came.

    A long run is stopped from outside; the per-round lines are what it leaves.
    """
    ratios = [r for r, _ in measures if not math.isnan(r)]
    cosines = [c for _, c in measures if not math.isnan(c)]
    line = {
        "policy": policy.value,
        "attack": attack,
        "round": number,
        "flagged": flagged,
        "judged": len(measures),
        "norm_ratio_max": max(ratios) if ratios else None,
        "cosine_min": min(cosines) if cosines else None,
        "cosine_median": float(np.median(cosines)) if cosines else None,
        "time": time.time(),
    }
    with path.open("a") as log:
        log.write(json.dumps(line) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--inner-lr", type=float, default=1e-3)
    parser.add_argument("--corpus-bytes", type=int, default=wan_task.CORPUS_BYTES)
    parser.add_argument("--policies", default="report,exclude,trimmed_mean")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument(
        "--culprit",
        type=int,
        default=0,
        help="the attacking rank (rank W-1 trains on the slice next to the held-out text)",
    )
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument(
        "--progress", type=Path, default=None, help="append one JSON line per round to this file"
    )
    parser.add_argument("--honest", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    policies = [ScreenPolicy(p) for p in args.policies.split(",")]
    attacks = [a for a in args.attacks.split(",") if a]
    for policy in policies:
        for attack in [None, *attacks] if args.honest else attacks:
            started = time.perf_counter()
            result = simulate(args, policy, attack)
            result["seconds"] = time.perf_counter() - started
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "flags"}), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(
                    {
                        "settings": vars(args)
                        | {"out": str(args.out), "progress": str(args.progress)},
                        "runs": results,
                    },
                    indent=1,
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
