"""A live state as raw tensors: a small JSON header, then every tensor's bytes, back to back.

Why not `torch.save`: healing a rank moves hundreds of MB to GB, and a pickle
in a zip archive costs a serialization pass, a copy into a buffer and a
parse on the other side (0.5 s for 400 MB here). This format is written
straight from the tensors and read straight into freshly allocated ones
(`recv_into`), and reading it executes nothing: the header is JSON, its
tree holds only None, bools, numbers, strings, lists, tuples, dicts and
tensor references.

Layout::

    MAGIC (8 bytes) | header length (u64, little-endian) | header (UTF-8 JSON) | tensor bytes

    header = {"tree": node, "tensors": [{"dtype", "shape", "offset", "nbytes"}], "total": int}
    node   = {"t": index} | {"d": [[key node, value node], ...]} | {"l": [node, ...]}
           | {"u": [node, ...]} (a tuple) | {"v": None | bool | int | float | str}
           | {"o": [[[key node, value node], ...], metadata node]} (a state dict's
             OrderedDict and its `_metadata`, which `load_state_dict` reads versions from)

Encoding the donor's tree copies no tensor (the caller keeps them unchanged
until their bytes are sent). Every size in a header is a claim from the
network: the header's own length is capped (`MAX_HEADER_BYTES`), the
tensors must tile [0, total) in order with each `nbytes` equal to its
dtype's size times its shape's product, and `total` must be within the
reader's limit before a single tensor is allocated. A shape is bounded on
its own too, because its product may be 0 while a dimension is not: at most
`MAX_DIMS` dimensions, each (and the product of those that are not 0)
within the reader's limit, and at most `MAX_TENSORS` tensors; an
allocation that still fails is a `BadRawState` naming the tensor. Pure
logic and blocking reads; no gRPC.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MAGIC",
    "MAX_HEADER_BYTES",
    "BadRawState",
    "Layout",
    "decode",
    "encode",
    "parse_header",
    "to_bytes",
]

MAGIC = b"GSRAW01\n"
#: The largest header accepted: names and shapes of a few hundred thousand tensors.
MAX_HEADER_BYTES = 16 << 20
#: The most dimensions a tensor may have, and the most tensors a state may hold.
MAX_DIMS = 32
MAX_TENSORS = 1 << 18
_LENGTH = struct.Struct("<Q")
PREFIX_BYTES = len(MAGIC) + _LENGTH.size
#: The most bytes one in-memory copy moves while it holds the GIL (a few ms): a copy of
#: a whole 300 MB tensor under load held it for seconds, and the transport's heartbeats
#: with it (a joiner declared dead at a 2 s heartbeat timeout).
SLICE_BYTES = 16 << 20
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


class BadRawState(ValueError):
    """A raw state that cannot be read: truncated, corrupted, or larger than allowed."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in the body, and what they are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """A checked header: the tree to rebuild and the tensors to read, in body order."""

    tree: Any
    tensors: tuple[TensorEntry, ...]
    total: int

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The state with each tensor reference replaced by `tensors[index]`."""
        return _decode_node(self.tree, tensors, 0)


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The prefix and header of `state`, and its tensors (contiguous CPU) in body order.

    The body is `b"".join(t.view(uint8) for t in tensors)`; the caller writes
    each tensor's bytes itself, so nothing is copied here.

    Raises:
        TypeError: `state` holds something other than the node kinds above.
    """
    tensors: list[torch.Tensor] = []
    tree = _encode_node(state, tensors)
    entries, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        entry = {"dtype": dtype, "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes}
        entries.append(entry)
        offset += nbytes
    header = json.dumps({"tree": tree, "tensors": entries, "total": offset}).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header, tensors


def to_bytes(state: Any) -> bytearray:
    """`state` as one raw blob (to travel through the coordinator as a heal blob).

    Copied slice by slice (`copy_in_slices`), so that no single copy holds the
    GIL for long: the transport's event loop thread must still get it to
    send heartbeats while a GB is written.
    """
    prefix, tensors = encode(state)
    # Grown slice by slice: `bytearray(n)` would zero a GB in one call first (0.4 s
    # holding the GIL here), while growing a large one remaps it without a copy.
    blob = bytearray(prefix)
    for tensor in tensors:
        if tensor.numel():
            source = tensor_bytes(tensor)
            for start in range(0, len(source), SLICE_BYTES):
                blob += source[start : start + SLICE_BYTES]
    return blob


def copy_in_slices(target: memoryview, source: memoryview) -> None:
    """`target[:] = source`, `SLICE_BYTES` at a time (the GIL changes hands in between)."""
    for start in range(0, len(source), SLICE_BYTES):
        target[start : start + SLICE_BYTES] = source[start : start + SLICE_BYTES]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()  # numpy's stubs: no Buffer
    return memoryview(array).cast("B")


def header_length(prefix: bytes) -> int:
    """The header length a prefix declares (checked against the cap).

    Raises:
        BadRawState: not this format, or a header above `MAX_HEADER_BYTES`.
    """
    if len(prefix) != PREFIX_BYTES or not prefix.startswith(MAGIC):
        raise BadRawState(f"not a gradsync raw state (it starts with {prefix[:8]!r})")
    length = int(_LENGTH.unpack(prefix[len(MAGIC) :])[0])
    if length > MAX_HEADER_BYTES:
        raise BadRawState(
            f"its header claims {length} bytes; at most {MAX_HEADER_BYTES} are accepted"
        )
    return length


def parse_header(header: bytes, limit_bytes: int) -> Layout:
    """Check a header against the rules above and `limit_bytes` (the most tensor bytes).

    Raises:
        BadRawState: malformed JSON, unknown dtypes, sizes that do not add up, tensors that
            do not tile the body, references to missing tensors, or a body over the limit.
    """
    try:
        fields = json.loads(header.decode())
        tree, raw_entries, total = fields["tree"], fields["tensors"], fields["total"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise BadRawState(f"its header is not valid: {type(exc).__name__}: {exc}") from None
    if not _is_count(total) or not isinstance(raw_entries, list):
        raise BadRawState(f"its header's total {total!r} or tensor list is malformed")
    if len(raw_entries) > MAX_TENSORS:
        raise BadRawState(
            f"it claims {len(raw_entries)} tensors; at most {MAX_TENSORS} are accepted"
        )
    if total > limit_bytes:
        raise BadRawState(
            f"it claims {total} bytes of tensors; at most {limit_bytes} are accepted here"
        )
    entries, offset = [], 0
    for index, raw in enumerate(raw_entries):
        entry = _entry(index, raw, limit_bytes)
        if entry.offset != offset:
            raise BadRawState(
                f"tensor {index} starts at byte {entry.offset}, expected {offset} "
                "(tensors must follow each other)"
            )
        offset += entry.nbytes
        entries.append(entry)
    if offset != total:
        raise BadRawState(f"its tensors hold {offset} bytes, but the header claims {total}")
    layout = Layout(tree, tuple(entries), total)
    try:  # every reference resolves (a dry run with placeholders, before any allocation)
        layout.build([torch.empty(0)] * len(entries))
    except (TypeError, ValueError, IndexError, KeyError, RecursionError) as exc:
        raise BadRawState(f"its header's tree is malformed: {exc}") from None
    return layout


def read_tensors(
    layout: Layout,
    read_into: Callable[[memoryview], None],
    into: Mapping[int, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Fill each tensor of `layout` with `read_into` (which fills its target whole).

    `into` gives, by tensor index, an existing tensor to read into instead of a
    new one (the reader's own parameters): it is used only when its dtype and
    shape are the entry's and it is contiguous on the CPU, else a tensor is
    allocated. Why: memory that is already mapped is read into about twice as
    fast as fresh pages (each fresh page faults inside the socket copy), and
    the state then needs no second copy into the model.
    """
    tensors = []
    for index, entry in enumerate(layout.tensors):
        tensor = (into or {}).get(index)
        if tensor is None or not fits(tensor, entry):
            tensor = _allocate(index, entry)
        if entry.nbytes:
            read_into(tensor_bytes(tensor))
        tensors.append(tensor)
    return tensors


def _allocate(index: int, entry: TensorEntry) -> torch.Tensor:
    """A new tensor for `entry`; an allocation torch refuses is a `BadRawState` naming it."""
    try:
        return torch.empty(entry.shape, dtype=entry.dtype)
    except (RuntimeError, MemoryError, ValueError, OverflowError) as exc:
        raise BadRawState(
            f"tensor {index} ({entry.dtype} x {list(entry.shape)}, {entry.nbytes} bytes) could "
            f"not be allocated: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        ) from None


def fits(tensor: torch.Tensor, entry: TensorEntry) -> bool:
    """True when `entry`'s bytes can be read straight into `tensor`."""
    return (
        tensor.dtype == entry.dtype
        and tuple(tensor.shape) == entry.shape
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.requires_grad
    )


def tensor_paths(layout: Layout) -> dict[tuple[Any, ...], int]:
    """Each tensor reference of `layout`'s tree by its path of dict keys and list indices.

    For a live state, ("module", "0.weight") is the index of that parameter's
    tensor: what a reader matches against its own model before reading.
    """
    paths: dict[tuple[Any, ...], int] = {}
    _collect_paths(layout.tree, (), paths)
    return paths


def decode(
    blob: bytes | bytearray | memoryview,
    limit_bytes: int,
    into: Callable[[Layout], Mapping[int, torch.Tensor]] | None = None,
) -> Any:
    """Read a whole raw state held in memory (a heal blob relayed by the coordinator).

    `into`: given the checked header, existing tensors to read into (`read_tensors`).

    Raises:
        BadRawState: see `header_length` and `parse_header`, or a blob of the wrong length.
    """
    view = memoryview(blob).cast("B")
    length = header_length(bytes(view[:PREFIX_BYTES]))
    if len(view) < PREFIX_BYTES + length:
        raise BadRawState(f"it is truncated: {len(view)} bytes, its header alone needs more")
    layout = parse_header(bytes(view[PREFIX_BYTES : PREFIX_BYTES + length]), limit_bytes)
    body = view[PREFIX_BYTES + length :]
    if len(body) != layout.total:
        raise BadRawState(f"its body has {len(body)} bytes, the header claims {layout.total}")
    cursor = [0]

    def read_into(target: memoryview) -> None:
        copy_in_slices(target, body[cursor[0] : cursor[0] + len(target)])
        cursor[0] += len(target)

    return layout.build(read_tensors(layout, read_into, into(layout) if into else None))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(index: int, raw: object, limit_bytes: int) -> TensorEntry:
    if not isinstance(raw, dict):
        raise BadRawState(f"tensor {index} of its header is not an object")
    name = raw.get("dtype")
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    shape, offset, nbytes = raw.get("shape"), raw.get("offset"), raw.get("nbytes")
    if dtype is None:
        raise BadRawState(f"tensor {index} has an unknown dtype {name!r:.80}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise BadRawState(f"tensor {index} has a malformed shape {shape!r:.200}")
    if len(shape) > MAX_DIMS:
        raise BadRawState(
            f"tensor {index} claims {len(shape)} dimensions; at most {MAX_DIMS} are accepted"
        )
    if max(shape, default=0) > limit_bytes or math.prod(n for n in shape if n) > limit_bytes:
        raise BadRawState(
            f"tensor {index} claims the shape {shape}; no dimension (nor the product of "
            f"those above 0) may exceed {limit_bytes}, the most bytes accepted here"
        )
    if not isinstance(offset, int) or not isinstance(nbytes, int) or min(offset, nbytes) < 0:
        raise BadRawState(f"tensor {index} has a malformed offset or size")
    expected = math.prod(shape) * dtype.itemsize
    if nbytes != expected:
        raise BadRawState(
            f"tensor {index} claims {nbytes} bytes, but {dtype} x {shape} is {expected}"
        )
    return TensorEntry(dtype, tuple(shape), offset, nbytes)


def _encode_node(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return {"t": len(tensors) - 1}
    if isinstance(value, dict):
        pairs = [[_encode_node(k, tensors), _encode_node(v, tensors)] for k, v in value.items()]
        if isinstance(value, OrderedDict):  # a state dict: its `_metadata` holds versions
            return {"o": [pairs, _encode_node(getattr(value, "_metadata", None), tensors)]}
        return {"d": pairs}
    if isinstance(value, list):
        return {"l": [_encode_node(v, tensors) for v in value]}
    if isinstance(value, tuple):
        return {"u": [_encode_node(v, tensors) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return {"v": value}
    raise TypeError(f"a raw state cannot hold a {type(value).__name__}")


def _decode_node(node: Any, tensors: Sequence[torch.Tensor], depth: int) -> Any:
    if depth > 64:
        raise ValueError("nested more than 64 levels deep")
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"a node must be an object with one key, got {node!r:.80}")
    ((kind, value),) = node.items()
    if kind == "t":
        if not _is_count(value) or value >= len(tensors):
            raise IndexError(f"a reference to tensor {value!r} of {len(tensors)}")
        return tensors[value]
    if kind == "d" and isinstance(value, list):
        return dict(_pair(item, tensors, depth) for item in value)
    if kind == "o" and isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
        ordered = OrderedDict(_pair(item, tensors, depth) for item in value[0])
        metadata = _decode_node(value[1], tensors, depth + 1)
        if metadata is not None:
            ordered._metadata = metadata  # type: ignore[attr-defined]  # as torch sets it
        return ordered
    if kind in ("l", "u") and isinstance(value, list):
        items = [_decode_node(v, tensors, depth + 1) for v in value]
        return items if kind == "l" else tuple(items)
    if kind == "v" and (value is None or isinstance(value, bool | int | float | str)):
        return value
    raise ValueError(f"an unknown node kind {kind!r}")


def _pair(item: Any, tensors: Sequence[torch.Tensor], depth: int) -> tuple[Any, Any]:
    if not isinstance(item, list) or len(item) != 2:
        raise ValueError("a dict entry must be a [key, value] pair")
    key = _decode_node(item[0], tensors, depth + 1)
    if not isinstance(key, str | int | float | bool) and key is not None:
        raise TypeError(f"a dict key must be a scalar, got {type(key).__name__}")
    return key, _decode_node(item[1], tensors, depth + 1)


def _collect_paths(node: Any, path: tuple[Any, ...], paths: dict[tuple[Any, ...], int]) -> None:
    """Walk a checked tree (`parse_header` ran the decoder on it) for `tensor_paths`."""
    ((kind, value),) = node.items()
    if kind == "t":
        paths[path] = value
    elif kind in ("d", "o"):
        for key_node, value_node in value if kind == "d" else value[0]:
            key = key_node.get("v") if "v" in key_node else None
            if key is not None:
                _collect_paths(value_node, (*path, key), paths)
    elif kind in ("l", "u"):
        for position, item in enumerate(value):
            _collect_paths(item, (*path, position), paths)
