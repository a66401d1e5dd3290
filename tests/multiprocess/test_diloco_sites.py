"""DiLoCo across sites: each replica a site of ranks with FSDP2 or DDP inside, over gloo.

Real `gradsync serve`, real worker processes, one torch.distributed (gloo) world per
site, as torchrun starts a site. Every site's model after every round must be
bitwise the same on every rank of every site and equal a one-process simulation
(`support.diloco_sites_reference`) in which each site is one replica whose
gradient is the mean of its ranks' gradients: with FSDP2 inside (each shard
index across the sites its own job), unsharded and over two coordinator shards;
with DDP inside, sites of different sizes (only a site's rank 0 uploads); an int8
wire with compact answers and streaming fragments at the replica level. A site
that loses a rank drops out as a whole under elastic and rejoins whole; a site
that comes with another shard layout is refused, both layouts named.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradsync.status import query_status
from gradsync_proto.net.launch import free_port
from support.diloco_reference import Run, make_model
from support.diloco_sites_reference import simulate_sites, simulate_sites_streaming
from support.processes import WORKERS, reap

SITE_WORKER = WORKERS / "diloco_site_worker.py"
NAMES = [name for name, _ in make_model(0).named_parameters()]
#: The seed of site 0's model, which the seed round makes everyone's.
INITIAL = 100
SITES = 2
H = 5


@pytest.fixture(autouse=True)
def _flat(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sites stand for different hosts: no local group across them.
    monkeypatch.setenv("GRADSYNC_HIERARCHICAL", "0")


def launch_site(
    address: str,
    site: int,
    size: int,
    inside: str,
    folder: Path,
    *extra: str,
    per_rank: dict[int, list[str]] | None = None,
    tag: str = "",
) -> list[subprocess.Popen[Any]]:
    """Start every rank of one site (its own gloo world); each logs to folder."""
    port = free_port()
    processes = []
    for k in range(size):
        name = f"site{site}{tag}-rank{k}"
        argv = [
            sys.executable, str(SITE_WORKER), "--coordinator", address,
            "--site", str(site), "--sites", str(SITES), "--site-rank", str(k),
            "--site-size", str(size), "--site-port", str(port), "--inside", inside,
            "--out", str(folder / f"{name}.npz"), *extra, *(per_rank or {}).get(k, []),
        ]  # fmt: skip
        with open(folder / f"{name}.log", "w") as log:
            processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    return processes


def finish(processes: list[subprocess.Popen[Any]], folder: Path, timeout: float = 120) -> None:
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        reap(processes)
    failed = [p for p, code in zip(processes, codes, strict=True) if code != 0]
    logs = "\n".join(
        (folder / (Path(str(p.args[p.args.index("--out") + 1])).stem + ".log")).read_text()[-3000:]
        for p in failed
    )
    assert not failed, logs


def run_sites(
    address: str, sizes: list[int], inside: str, folder: Path, run: Run
) -> dict[str, dict[str, np.ndarray]]:
    """Run every site to the end; return each rank's saved arrays by 'site<s>-rank<k>'."""
    processes = []
    for site, size in enumerate(sizes):
        processes += launch_site(address, site, size, inside, folder, *run.argv())
    finish(processes, folder)
    return {
        f"site{s}-rank{k}": dict(np.load(folder / f"site{s}-rank{k}.npz"))
        for s, size in enumerate(sizes)
        for k in range(size)
    }


def rounds_of(saved: dict[str, np.ndarray], first: int, last: int) -> dict[int, list[np.ndarray]]:
    return {r: [saved[f"round{r}/{name}"] for name in NAMES] for r in range(first, last + 1)}


def assert_sites_match(
    outputs: dict[str, dict[str, np.ndarray]], run: Run, expected: list[list[Any]]
) -> None:
    """Every rank of every site holds bitwise the same model after every round, equal to
    the simulation within 1e-5; and the model moved."""
    reference = rounds_of(outputs["site0-rank0"], 0, run.rounds)
    for who, saved in outputs.items():
        for number, params in rounds_of(saved, 0, run.rounds).items():
            for a, b in zip(params, reference[number], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{who}, round {number}")
        assert int(saved["inner_steps"]) == run.rounds * run.sync_every, who
    for number, params in reference.items():
        worst = max(
            float(np.abs(a - b.numpy()).max())
            for a, b in zip(params, expected[number], strict=True)
        )
        assert worst <= 1e-5, f"round {number}: {worst:.3g} from the simulation"
    moved = max(
        float(np.abs(a - b).max()) for a, b in zip(reference[run.rounds], reference[0], strict=True)
    )
    assert moved > 1e-3, "the global parameters did not move: nothing was trained"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shards", [1, 2], ids=["unsharded", "two-shards"])
def test_fsdp2_inside_two_sites_match_a_one_process_simulation(
    shards: int, tmp_path: Path, coordinator_factory
) -> None:
    extra = ("--shards", str(shards)) if shards > 1 else ()
    coordinator = coordinator_factory(SITES, *extra)
    run = Run(sync_every=H, rounds=3)
    outputs = run_sites(coordinator.address, [2, 2], "fsdp", tmp_path, run)
    # One job per shard index, each site a rank of it: rank k of each site is in job k.
    for s in range(SITES):
        for k in range(2):
            assert list(outputs[f"site{s}-rank{k}"]["jobs"]) == [f"sites.site-rank-{k}"]
    expected = simulate_sites(run, [2, 2], make_model(INITIAL), shards=2)
    assert_sites_match(outputs, run, expected)
    # What `gradsync status` shows: a job per shard index, the sites its ranks.
    jobs = {job.job_id: job for job in query_status(coordinator.address).jobs}
    for k in range(2):
        job = jobs[f"sites.site-rank-{k}"]
        assert job.world_size == SITES and job.outer and job.outer_rounds == run.rounds, job


@pytest.mark.timeout(300)
def test_ddp_inside_sites_of_different_sizes_match_and_only_rank_0_uploads(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(SITES)
    run = Run(sync_every=H, rounds=3)
    outputs = run_sites(coordinator.address, [2, 1], "ddp", tmp_path, run)
    expected = simulate_sites(run, [2, 1], make_model(INITIAL))
    assert_sites_match(outputs, run, expected)
    assert list(outputs["site0-rank0"]["jobs"]) == ["sites"]
    assert list(outputs["site0-rank1"]["jobs"]) == []  # it received the answer in the site
    assert int(outputs["site0-rank0"]["last_round_bytes"]) > 0
    assert int(outputs["site0-rank1"]["last_round_bytes"]) == 0


@pytest.mark.timeout(300)
def test_int8_wire_with_compact_answers_across_fsdp2_sites_matches_its_reference(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(SITES)
    run = Run(sync_every=H, rounds=3, wire="int8", answer="int8")
    outputs = run_sites(coordinator.address, [2, 2], "fsdp", tmp_path, run)
    expected = simulate_sites(run, [2, 2], make_model(INITIAL), shards=2)
    assert_sites_match(outputs, run, expected)
    # The quantization is really there: a float32 run ends elsewhere.
    exact = simulate_sites(dataclasses.replace(run, wire="fp32", answer="fp32"), [2, 2],
                           make_model(INITIAL), shards=2)[-1]  # fmt: skip
    got = [outputs["site0-rank0"][f"round{run.rounds}/{name}"] for name in NAMES]
    assert max(float(np.abs(a - b.numpy()).max()) for a, b in zip(got, exact, strict=True)) > 1e-6
    # A quarter of float32's bytes down, plus a scale per chunk.
    for k in range(2):
        received = int(outputs[f"site0-rank{k}"]["last_round_received"])
        elements = sum(int(np.prod(p.shape)) for p in _shards(k))
        assert elements < received < 2 * elements, (k, received, elements)


def _shards(k: int) -> list[np.ndarray]:
    """Rank k's FSDP2 pieces (of 2) of the test model's parameters."""
    return [np.array_split(p.detach().numpy(), 2)[k] for p in make_model(0).parameters()]


@pytest.mark.timeout(300)
def test_streaming_fragments_across_fsdp2_sites_match_a_one_process_simulation(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(SITES)
    run = Run(sync_every=6, rounds=3, fragments=2)
    outputs = run_sites(coordinator.address, [2, 2], "fsdp", tmp_path, run)
    for k in range(2):
        assert list(outputs[f"site0-rank{k}"]["jobs"]) == [
            f"sites.site-rank-{k}.fragment0",
            f"sites.site-rank-{k}.fragment1",
        ]
    split = [int(n) for n in outputs["site0-rank0"]["fragment_sizes"]]
    assert len(split) == 2 and sum(split) == len(NAMES)
    for saved in outputs.values():  # every rank cuts where the whole parameters are cut
        assert [int(n) for n in saved["fragment_sizes"]] == split
    expected = simulate_sites_streaming(run, [2, 2], make_model(INITIAL), split)
    for who, saved in outputs.items():
        site = int(who[len("site")])
        first = outputs[f"site{site}-rank0"]
        for name in NAMES:  # the ranks of a site hold the same model
            np.testing.assert_array_equal(saved[f"final/{name}"], first[f"final/{name}"])
        got = [saved[f"final/{name}"] for name in NAMES]
        worst = max(
            float(np.abs(a - b.numpy()).max()) for a, b in zip(got, expected[site], strict=True)
        )
        assert worst <= 1e-5, f"{who}: {worst:.3g} from the simulation"
        assert int(saved["inner_steps"]) == run.rounds * run.sync_every


def _wait_for(path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:g} s"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_site_that_loses_a_rank_drops_out_and_rejoins_whole_under_elastic(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(
        SITES, "--on-failure", "elastic", "--min-workers", "1",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2",
    )  # fmt: skip
    run = Run(sync_every=H, rounds=4)
    gate = tmp_path / "gate"
    dies_at = H + 2  # inside round 2's inner steps
    site0 = launch_site(
        coordinator.address, 0, 2, "fsdp", tmp_path, *run.argv(), "--before-round", f"3:{gate}"
    )
    site1 = launch_site(
        coordinator.address, 1, 2, "fsdp", tmp_path, *run.argv(),
        per_rank={1: ["--die-at-step", str(dies_at)]},
    )  # fmt: skip
    again: list[subprocess.Popen[Any]] = []
    try:
        first = [p.wait(timeout=120) for p in site1]
        assert first[1] == -9 and first[0] not in (0, None), first  # the site failed whole
        # torchrun's part: the whole site started again, while site 0 waits before round 3.
        again = launch_site(
            coordinator.address, 1, 2, "fsdp", tmp_path, *run.argv(), "--resume",
            per_rank={k: ["--joining", str(tmp_path / f"joining{k}")] for k in range(2)},
            tag="-again",
        )  # fmt: skip
        for k in range(2):
            _wait_for(tmp_path / f"joining{k}")
        time.sleep(10.0)  # both ranks' joins reach the coordinator before site 0 goes on
        gate.touch()
        finish([*site0, *again], tmp_path, timeout=150)
    finally:
        reap([*site0, *site1, *again])
    outputs = {
        who: dict(np.load(tmp_path / f"{who}.npz"))
        for who in ["site0-rank0", "site0-rank1", "site1-again-rank0", "site1-again-rank1"]
    }
    back = int(outputs["site1-again-rank0"]["first_round"])
    assert back == 2, back  # let in at site 0's round 3 boundary: it holds round 2's model
    expected = simulate_sites(run, [2, 2], make_model(INITIAL), shards=2, lost=(1, 2), back=back)
    survivor = rounds_of(outputs["site0-rank0"], 0, run.rounds)
    for who, saved in outputs.items():
        start = 0 if who.startswith("site0") else back
        for number, params in rounds_of(saved, start, run.rounds).items():
            for a, b in zip(params, survivor[number], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{who}, round {number}")
        # Every rank ran exactly its inner steps: none recomputed.
        assert int(saved["inner_steps"]) == (run.rounds - start) * run.sync_every, who
    for number, params in survivor.items():
        worst = max(
            float(np.abs(a - b.numpy()).max())
            for a, b in zip(params, expected[number], strict=True)
        )
        assert worst <= 1e-5, f"round {number}: {worst:.3g} from the simulation"
    # Had site 1 stayed out, rounds 3 and 4 would differ: the test can tell.
    alone = simulate_sites(run, [2, 2], make_model(INITIAL), shards=2, lost=(1, 2))
    assert float((alone[-1][0] - expected[-1][0]).abs().max()) > 1e-4


@pytest.mark.timeout(300)
def test_a_site_with_another_shard_layout_is_refused_naming_both_layouts(
    tmp_path: Path, coordinator_factory
) -> None:
    coordinator = coordinator_factory(SITES)
    run = Run(sync_every=H, rounds=1)
    site0 = launch_site(
        coordinator.address, 0, 2, "fsdp", tmp_path, *run.argv(), "--timeout-s", "20",
        per_rank={0: ["--joining", str(tmp_path / "joining")]},
    )  # fmt: skip
    site1: list[subprocess.Popen[Any]] = []
    try:
        _wait_for(tmp_path / "joining")
        time.sleep(3.0)  # site 0's layout is the job's reference
        site1 = launch_site(
            coordinator.address, 1, 1, "fsdp", tmp_path, *run.argv(), "--timeout-s", "20"
        )
        assert site1[0].wait(timeout=120) != 0
        assert site0[0].wait(timeout=60) != 0
    finally:
        reap([*site0, *site1])
    for who in ["site1-rank0", "site0-rank0"]:
        text = (tmp_path / f"{who}.log").read_text()
        assert "[site rank 0 of 1]" in text and "[site rank 0 of 2]" in text, text[-3000:]
