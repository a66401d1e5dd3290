"""A host's local group (hierarchical aggregation) over real sockets, processes and tmpfs.

No coordinator: the leader's upload is played by the test (the sum stays in
the result region as its own "average"), so what is checked is the group
alone: the sum's bits, the unnamed segment and its memory, the secret, and
what members see when a peer dies.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from gradsync.errors import GradSyncError, SharedMemoryError
from gradsync.local.local_group import LocalGroup
from gradsync.path.buffers import BucketBuffer
from gradsync_proto.v1 import gradsync_pb2 as pb

RANKS = [2, 4, 5]
#: Odd sizes, an empty bucket, a float64 bucket (index 3), the presence bucket last.
SIZES = [4097 * 4, 13 * 4, 0, 301 * 8, 7 * 4]
DTYPES = [pb.DTYPE_FLOAT32] * 3 + [pb.DTYPE_FLOAT64, pb.DTYPE_FLOAT32]
NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_FLOAT64: np.float64}

MEMBER = r"""
import sys, time
import numpy as np
from gradsync.path.buffers import BucketBuffer
from gradsync.local.local_group import LocalGroup
from gradsync.errors import GradSyncError

rank, ranks, secret, directory, mode, out = (
    int(sys.argv[1]), [int(r) for r in sys.argv[2].split(",")], bytes.fromhex(sys.argv[3]),
    sys.argv[4], sys.argv[5], sys.argv[6])
sizes = [int(s) for s in sys.argv[7].split(",")]
dtypes = [int(d) for d in sys.argv[8].split(",")]
numpy = {1: np.float32, 2: np.float64}
group = LocalGroup.form(job_id="t", rank=rank, ranks=ranks, secret=secret, bucket_bytes=sizes,
                        timeout_s=20, heartbeat_interval_s=0.1, directory=directory)
group.verdict_s = 0.5
print("formed", flush=True)
if mode == "hold":
    if group.is_leader:
        time.sleep(60)
    try:
        group.wait_averaged(0, 20, lambda s: time.sleep(s), lambda r: False)
    except GradSyncError as exc:
        print("error:", exc, flush=True)
    group.close()
    sys.exit(3)
saved = {}
for step in range(2):
    rng = np.random.default_rng(1000 * step + rank)
    buffers = []
    for b, (size, dtype) in enumerate(zip(sizes, dtypes)):
        data = (rng.standard_normal(size // np.dtype(numpy[dtype]).itemsize) * 10.0 ** b)
        data = data.astype(numpy[dtype])
        buffers.append(BucketBuffer([data.view(np.uint8)]))
        group.post(step, b, buffers[-1], dtype)
    if group.is_leader:
        group.wait_reduced(step, len(sizes), 20, lambda s: None, lambda r: False)
        group.publish_averaged(step, len(ranks))
    else:
        assert group.wait_averaged(step, 20, lambda s: None, lambda r: False) == len(ranks)
    for b, buffer in enumerate(buffers):
        saved[f"{step}/{b}"] = buffer.segments[0].copy()
np.savez(out, **saved)
group.close()
"""


def _inputs(step: int, rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    out = []
    for index, (size, dtype) in enumerate(zip(SIZES, DTYPES, strict=True)):
        numpy = NUMPY[dtype]
        data = rng.standard_normal(size // np.dtype(numpy).itemsize) * 10.0**index
        out.append(data.astype(numpy))
    return out


def _start(
    rank: int, secret: bytes, directory: Path, mode: str, out: Path
) -> subprocess.Popen[str]:
    args = [
        str(rank),
        ",".join(map(str, RANKS)),
        secret.hex(),
        str(directory),
        mode,
        str(out),
        ",".join(map(str, SIZES)),
        ",".join(map(str, DTYPES)),
    ]
    return subprocess.Popen(
        [sys.executable, "-c", MEMBER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]], timeout_s: float = 30) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    return outputs


def test_three_processes_sum_bitwise_in_local_rank_order(tmp_path: Path) -> None:
    secret = secrets.token_bytes(32)
    procs = [_start(r, secret, Path("/dev/shm"), "sum", tmp_path / f"{r}.npz") for r in RANKS]
    outputs = _finish(procs)
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    for step in range(2):
        inputs = [_inputs(step, rank) for rank in RANKS]
        for index in range(len(SIZES)):
            reference = (inputs[0][index] + inputs[1][index]) + inputs[2][index]
            for rank in RANKS:
                got = np.load(tmp_path / f"{rank}.npz")[f"{step}/{index}"]
                assert got.tobytes() == reference.tobytes(), (rank, step, index)


def _used_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def _tmpfs(path: Path, size: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip("mounting a private tmpfs needs root (CI runs as root)")
    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    return path


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_segment_has_no_name_and_its_memory_is_freed_after_sigkill(tmp_path: Path) -> None:
    shm = _tmpfs(tmp_path / "shm", "64m")
    try:
        secret = secrets.token_bytes(32)
        procs = [_start(r, secret, shm, "hold", tmp_path / f"{r}.npz") for r in RANKS]
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "formed", line + proc.stdout.read()
        assert _used_bytes(shm) > 0, "the segment's pages are reserved up front"
        assert os.listdir(shm) == [], "the segment must never have a name"
        procs[0].send_signal(signal.SIGKILL)
        outputs = _finish(procs[1:])
        for proc, out in zip(procs[1:], outputs, strict=True):
            assert proc.returncode == 3, out
            assert f"lost local leader rank {RANKS[0]}" in out, out
        _finish(procs[:1], 10)
        deadline = time.monotonic() + 5
        while _used_bytes(shm) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _used_bytes(shm) == 0
    finally:
        _unmount(shm)


def _form_in_threads(
    secrets_by_rank: dict[int, bytes], directory: str = "/dev/shm", timeout_s: float = 5
) -> dict[int, LocalGroup | BaseException]:
    results: dict[int, LocalGroup | BaseException] = {}

    def form(rank: int) -> None:
        try:
            results[rank] = LocalGroup.form(
                job_id="threads",
                rank=rank,
                ranks=RANKS,
                secret=secrets_by_rank[rank],
                bucket_bytes=SIZES,
                timeout_s=timeout_s,
                heartbeat_interval_s=0.1,
                directory=directory,
            )
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=form, args=(rank,)) for rank in secrets_by_rank]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5)
    return results


def _close(results: dict[int, LocalGroup | BaseException]) -> None:
    for value in results.values():
        if isinstance(value, LocalGroup):
            value.close()


def test_too_small_shm_raises_shared_memory_error_on_every_member(tmp_path: Path) -> None:
    shm = _tmpfs(tmp_path / "shm", "4k")
    try:
        secret = secrets.token_bytes(32)
        results = _form_in_threads(dict.fromkeys(RANKS, secret), str(shm))
        _close(results)
        for rank in RANKS:
            error = results[rank]
            assert isinstance(error, SharedMemoryError), (rank, error)
            assert "bytes of shared memory" in str(error) and str(shm) in str(error)
            assert "--shm-size" in str(error)
        assert f"needs {_layout_bytes()} bytes" in str(results[RANKS[1]])
    finally:
        _unmount(shm)


def _layout_bytes() -> int:
    from gradsync.local.local_segment import SegmentLayout

    return SegmentLayout(tuple(SIZES), len(RANKS)).total_bytes


def test_wrong_secret_is_refused() -> None:
    good = secrets.token_bytes(32)
    # The impostor finds the socket (same name) but presents another secret.
    results = _form_in_threads({RANKS[0]: good, RANKS[1]: good}, timeout_s=0.7)
    _close(results)
    assert isinstance(results[RANKS[0]], GradSyncError)
    assert f"[{RANKS[2]}]" in str(results[RANKS[0]])  # the leader names who did not come

    import gradsync.local.local_rendezvous as rendezvous

    leader: dict[str, object] = {}

    def lead() -> None:
        try:
            leader["group"] = LocalGroup.form(
                job_id="refuse",
                rank=0,
                ranks=[0, 1],
                secret=good,
                bucket_bytes=[64],
                timeout_s=1.0,
                heartbeat_interval_s=0.1,
            )
        except GradSyncError as exc:
            leader["error"] = exc

    thread = threading.Thread(target=lead)
    thread.start()
    # Connect to the leader's socket (its name) with a wrong secret.
    original = rendezvous.socket_name
    try:
        rendezvous.socket_name = lambda job_id, secret: original(job_id, good)  # type: ignore[assignment]
        with pytest.raises(GradSyncError, match="refused this rank: wrong local secret"):
            rendezvous.follow("refuse", 1, [0, 1], b"x" * 32, time.monotonic() + 5)
    finally:
        rendezvous.socket_name = original  # type: ignore[assignment]
    thread.join(5)
    assert "error" in leader  # nobody with the right secret came


def test_follower_detects_leader_eof() -> None:
    secret = secrets.token_bytes(32)
    results = _form_in_threads(dict.fromkeys(RANKS, secret))
    groups = {rank: value for rank, value in results.items() if isinstance(value, LocalGroup)}
    assert len(groups) == 3, results
    try:
        follower = groups[RANKS[1]]
        follower.verdict_s = 0.3
        # The leader vanishes without a goodbye (as under SIGKILL).
        for conn in groups[RANKS[0]]._peers.values():
            conn.shutdown(2)
        started = time.monotonic()
        with pytest.raises(GradSyncError, match=f"lost local leader rank {RANKS[0]}"):
            follower.wait_averaged(0, 10, lambda s: time.sleep(s), lambda r: False)
        assert time.monotonic() - started < 3
    finally:
        _close(results)


def test_coordinator_verdict_wins_over_local_eof() -> None:
    secret = secrets.token_bytes(32)
    results = _form_in_threads(dict.fromkeys(RANKS, secret))
    groups = {rank: value for rank, value in results.items() if isinstance(value, LocalGroup)}
    try:
        for conn in groups[RANKS[0]]._peers.values():
            conn.shutdown(2)

        class Verdict(GradSyncError):
            pass

        def poll(wait_s: float) -> None:
            raise Verdict("the coordinator says rank 2 was lost")

        with pytest.raises(Verdict):
            groups[RANKS[2]].wait_averaged(0, 10, poll, lambda r: False)
    finally:
        _close(results)


def test_leader_goes_on_without_a_dropped_follower_elastic() -> None:
    secret = secrets.token_bytes(32)
    results = _form_in_threads(dict.fromkeys(RANKS, secret))
    groups = {rank: value for rank, value in results.items() if isinstance(value, LocalGroup)}
    leader, survivor, dead = (groups[r] for r in RANKS)
    handed: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = []
    leader.set_reduced_handler(lambda *args: handed.append(args))
    try:
        inputs = {rank: _inputs(0, rank) for rank in RANKS}
        buffers = {
            rank: [BucketBuffer([a.copy().view(np.uint8)]) for a in inputs[rank]] for rank in RANKS
        }
        # The dead follower posted bucket 0 only, then vanished.
        dead.post(0, 0, buffers[RANKS[2]][0], DTYPES[0])
        time.sleep(0.1)
        dead._peers[0].shutdown(2)
        for index, dtype in enumerate(DTYPES):
            leader.post(0, index, buffers[RANKS[0]][index], dtype)
            survivor.post(0, index, buffers[RANKS[1]][index], dtype)
        leader.wait_reduced(0, len(SIZES), 10, lambda s: time.sleep(s), lambda r: r == RANKS[2])
        covers = {bucket: covered for _, bucket, _, covered, _ in handed}
        assert all(nonfinite == () for *_, nonfinite in handed)  # clean gradients
        assert covers[0] == tuple(RANKS)  # posted before dying: counted
        assert all(covers[b] == tuple(RANKS[:2]) for b in range(1, len(SIZES)))
        for index in range(len(SIZES)):
            parts = [inputs[r][index] for r in (RANKS if index == 0 else RANKS[:2])]
            reference = parts[0] + parts[1]
            if len(parts) == 3:
                reference = reference + parts[2]
            got = leader.segment.result(index).view(reference.dtype)
            assert got.tobytes() == reference.tobytes(), index
    finally:
        _close(results)
