"""A live fuzzer for the raw-state reader: a hostile donor against a real joiner's load.

A joiner reads a live rank's state (`gradsync.control.raw_state`) either as a
blob the coordinator relayed or straight from the donor's heal socket
(`gradsync.control.heal_channel`). Both are bytes from another process, so
every field is a claim. `run_raw_state_fuzz` mutates a genuine state (a
model with Adam) the way a malicious or broken donor might: shapes with huge,
zero, negative, many or non-integer dimensions, dtypes, offsets, sizes,
totals, tensor counts, trees (deep, cyclic references, wrong node kinds),
truncated and bit-flipped bytes, and every header field at an edge. Each
case is loaded with `load_module_state` into a fresh model, through the
relayed path and (for a share of the cases) through a real `HostileDonor`
socket. The only outcomes allowed are a loaded state or a
`CheckpointMismatchError`; anything else (an unexpected exception, a load
that took longer than its bound) is a violation.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import socket
import struct
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from gradsync.control import heal_channel, raw_state
from gradsync.control.state_load import live_state, load_module_state
from gradsync.errors import CheckpointMismatchError
from torch import nn

__all__ = ["HostileDonor", "RawFuzzReport", "hostile_header", "run_raw_state_fuzz"]

#: The edges a size field is pushed to.
_EDGES = [0, 1, -1, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**64, 2**70, 10**30]
#: How long one direct case may take (the joiner's bound is the timeout given).
_CASE_TIMEOUT_S = 5.0


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    module = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    return module, optimizer


def hostile_header(header: dict[str, Any], body: bytes = b"") -> bytes:
    """A raw state with `header` as its (JSON) header, then `body`."""
    raw = json.dumps(header).encode()
    return raw_state.MAGIC + struct.pack("<Q", len(raw)) + raw + body


class HostileDonor:
    """A donor's heal socket that sends `payload` to whoever presents the offer's token.

    The offer names this process and a fresh abstract socket, as a genuine
    donor's does, so a joiner gets past its own checks and reads what the
    donor sends: the bytes a malicious donor chooses.
    """

    def __init__(self) -> None:
        self.name = f"gradsync-heal-{secrets.token_hex(16)}"
        self._token = secrets.token_bytes(32)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.payload = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def offer(self) -> bytes:
        fields = {"socket": self.name, "pid": os.getpid(), "token": self._token.hex()}
        return heal_channel.OFFER_MAGIC + json.dumps({**fields, "total_bytes": 0}).encode()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(2.0)
                received = b""
                while len(received) < 32:
                    chunk = conn.recv(32 - len(received))
                    if not chunk:
                        break
                    received += chunk
                if received == self._token:
                    conn.sendall(self.payload)


@dataclass
class RawFuzzReport:
    """What a raw-state fuzz run found."""

    cases: int = 0
    direct: int = 0
    loaded: int = 0
    refused: int = 0
    #: (case description, what escaped) for every outcome other than a load or a refusal.
    violations: list[tuple[str, str]] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        return (
            f"raw states: {self.cases} cases ({self.direct} over a socket), {self.loaded} "
            f"loaded, {self.refused} refused, {len(self.violations)} violations"
            + "".join(f"\n  VIOLATION {what}: {why}" for what, why in self.violations[:20])
        )


def _mutations(genuine: dict[str, Any], body: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One hostile raw state (and what it is), mutated from the genuine `header` and `body`."""
    header = json.loads(json.dumps(genuine))
    tensors: list[dict[str, Any]] = header["tensors"]
    index = rng.randrange(len(tensors))
    kind = rng.randrange(12)
    if kind == 0:  # a shape with a huge dimension beside a zero one (0 bytes claimed)
        dims = [rng.choice(_EDGES[3:]), 0]
        rng.shuffle(dims)
        tensors[index].update(shape=dims, nbytes=0)
        return _retile(header, body, f"shape {dims}")
    if kind == 1:  # many dimensions
        dims = [1] * rng.choice([33, 64, 65, 1000])
        tensors[index]["shape"] = dims
        return f"{len(dims)} dimensions", hostile_header(header, body)
    if kind == 2:  # a field at an edge (or of the wrong type)
        key = rng.choice(["shape", "offset", "nbytes", "dtype"])
        value: Any = rng.choice([*_EDGES, None, "x", 1.5, [], {}, [1.5], [-1], [True]])
        tensors[index][key] = value
        return f"tensor {key} = {value!r:.60}", hostile_header(header, body)
    if kind == 3:  # a total at an edge
        header["total"] = rng.choice([*_EDGES, None, "1", 1.0])
        return f"total {header['total']!r}", hostile_header(header, body)
    if kind == 4:  # too many tensors (each empty)
        count = raw_state.MAX_TENSORS + 1 if rng.random() < 0.05 else rng.choice([9, 5000])
        empty = {"dtype": "uint8", "shape": [0], "offset": 0, "nbytes": 0}
        header["tensors"] = [*tensors, *([empty] * count)]
        for entry in header["tensors"][len(tensors) :]:
            entry["offset"] = header["total"]
        return f"{count} extra tensors", hostile_header(header, body)
    if kind == 5:  # a deep or odd tree
        depth = rng.choice([10, 63, 65, 200])
        node: Any = {"t": 0}
        for _ in range(depth):
            node = {rng.choice(["l", "u"]): [node]}
        header["tree"] = rng.choice([node, {"d": [[node, node]]}, {"o": [[], node]}, None, 3])
        return f"a tree {depth} deep", hostile_header(header, body)
    if kind == 6:  # a tree with references past the tensors, or keys that are not scalars
        header["tree"] = {"d": [[{"l": []}, {"t": len(tensors)}]]}
        return "a non-scalar key", hostile_header(header, body)
    if kind == 7:  # the module state swapped for something else
        header["tree"] = {"d": [[{"v": "module"}, rng.choice([{"v": 1}, {"t": 0}, {"l": []}])]]}
        return "a module state that is not a dict", hostile_header(header, body)
    if kind == 8:  # shapes exchanged between tensors (sizes still add up)
        other = rng.randrange(len(tensors))
        tensors[index]["shape"], tensors[other]["shape"] = (
            tensors[other]["shape"],
            tensors[index]["shape"],
        )
        return _retile(header, body, "shapes swapped")
    if kind == 9:  # a dtype swapped for another of the same size or another
        tensors[index]["dtype"] = rng.choice(["int32", "float16", "complex128", "bool"])
        return _retile(header, body, f"dtype {tensors[index]['dtype']}")
    blob = bytearray(hostile_header(header, body))
    if kind == 10:  # truncated
        return "truncated", bytes(blob[: rng.randrange(len(blob))])
    for _ in range(rng.randint(1, 8)):  # bit flips
        position = rng.randrange(len(blob))
        blob[position] ^= 1 << rng.randrange(8)
    return "bit flips", bytes(blob)


def _retile(header: dict[str, Any], body: bytes, what: str) -> tuple[str, bytes]:
    """`header` with every nbytes recomputed from its shape and the offsets tiled again."""
    offset = 0
    for entry in header["tensors"]:
        dtype = getattr(torch, str(entry["dtype"]), torch.uint8)
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        entry.update(offset=offset, nbytes=numel * dtype.itemsize)
        offset += entry["nbytes"]
    header["total"] = offset
    return what, hostile_header(header, body[:offset].ljust(offset, b"\0")[: 1 << 20])


def _load(blob: bytes, timeout_s: float) -> None:
    module = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))  # the joiner's own model
    with warnings.catch_warnings():  # a complex state cast into real parameters loads
        warnings.simplefilter("ignore", UserWarning)
        load_module_state(blob, module, "fuzz-raw", 1, 7, timeout_s=timeout_s)


def run_raw_state_fuzz(cases: int, seed: int = 0, direct_share: float = 0.2) -> RawFuzzReport:
    """`cases` hostile raw states, each loaded into a fresh model; the outcomes."""
    rng = random.Random(seed)
    module, optimizer = _model()
    prefix, tensors = raw_state.encode(live_state(module, optimizer, 7, 2))
    genuine = json.loads(prefix[raw_state.PREFIX_BYTES :])
    body = b"".join(bytes(raw_state.tensor_bytes(t)) for t in tensors if t.numel())
    report = RawFuzzReport()
    donor = HostileDonor()
    try:
        for _ in range(cases):
            what, blob = _mutations(genuine, body, rng)
            direct = rng.random() < direct_share
            report.cases += 1
            started = time.monotonic()
            try:
                if direct:
                    report.direct += 1
                    donor.payload = blob
                    _load(donor.offer(), timeout_s=_CASE_TIMEOUT_S)
                else:
                    _load(blob, timeout_s=_CASE_TIMEOUT_S)
                report.loaded += 1
            except CheckpointMismatchError as exc:
                report.refused += 1
                report.reasons[_shape_of(str(exc))] += 1
            except Exception as exc:  # what the fuzzer looks for
                report.violations.append((what, f"{type(exc).__name__}: {exc}"[:300]))
            took = time.monotonic() - started
            if took > 2 * _CASE_TIMEOUT_S:
                report.violations.append((what, f"took {took:.1f} s"))
    finally:
        donor.close()
    return report


def _shape_of(message: str) -> str:
    """A refusal's text with its numbers as N (to count reasons)."""
    return "".join("N" if c.isdigit() else c for c in message)[:160]
