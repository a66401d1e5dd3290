"""Every rank starts equal: rank 0's parameters and buffers, broadcast at a job's start.

Apart from `gradsync.control.session` because it is pure tensor plumbing: the
session decides *whether* a job starts from rank 0's state (a new job), from a
checkpoint or a donor's state (`_restore`), or from each rank's own (a
restarted coordinator that continued); this module only moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.link import SessionLink


def broadcast_start_state(
    link: SessionLink,
    rank: int,
    tensors: Sequence[torch.Tensor],
    welcome: pb.Welcome,
    timeout_s: float,
) -> None:
    """Rank 0 sends `tensors` as one blob; every other rank overwrites its own with it."""
    with torch.no_grad():
        if rank == 0:
            flat = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel()]
            blob = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
            link.send_state(blob.numpy())
        elif welcome.state_bytes:
            raw = link.receive_state(welcome.state_bytes, timeout_s)
            offset = 0
            for tensor in tensors:
                if tensor.numel() == 0:
                    continue
                source = torch.frombuffer(
                    raw, dtype=tensor.dtype, count=tensor.numel(), offset=offset
                )
                tensor.copy_(source.view_as(tensor))
                offset += tensor.numel() * tensor.element_size()
