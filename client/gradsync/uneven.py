"""Uneven inputs: the `model.join()` context manager, as torch DDP's.

With torch DDP, a rank that runs out of data while others still train would
hang the others' all-reduces; `with model.join():` lets it "shadow" their
steps instead. Here the coordinator does the shadowing: when the training
loop inside the block ends on a rank, that rank

1. sends OutOfInputs(step = the first step it will not run). From then on
   the coordinator completes steps and collectives without it (gradient
   averages keep dividing by the world size, as DDP's default
   `divide_by_initial_world_size=True`);
2. waits for JoinProgress, which the coordinator sends after every step the
   others complete; each one renews the wait's deadline (the sync timeout),
   so a rank can wait through any number of the others' steps but never
   hangs on a job that stopped moving;
3. when the last rank has run out too, every rank gets JoinProgress with
   all_joined: each sets its step and collective counters to the job's
   (`next_step`, `next_collective`) and all adopt the parameters and buffers
   of the last rank to join (one BROADCAST), as DDP's join does, so that
   every rank ends equal.

An exception inside the block propagates without joining (as torch's Join).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from gradsync.collectives import Collectives
from gradsync.errors import GradSyncError, SyncTimeoutError

__all__ = ["JoinTarget", "join_context", "run_join"]

log = logging.getLogger("gradsync.client")

#: Progress is logged at INFO at most this often while a rank waits in join().
_LOG_EVERY_S = 10.0


class JoinTarget(Protocol):
    """What join() needs of the model wrapper."""

    #: The wrapped model, whose parameters and buffers every rank ends with.
    module: nn.Module
    #: The wrapper's collectives (its link, rank, world size and sync timeout).
    collectives: Collectives

    @property
    def step(self) -> int:
        """The next synchronized step of this rank."""
        ...

    @step.setter
    def step(self, value: int) -> None:
        """Continue at step `value` (also what heartbeats report)."""


@contextlib.contextmanager
def join_context(
    target: JoinTarget,
    *,
    enable: bool = True,
    divide_by_initial_world_size: bool = True,
    throw_on_early_termination: bool = False,
) -> Iterator[None]:
    """A context manager for training loops with uneven inputs (see the module docstring).

    Args:
        target: the model wrapper.
        enable: False makes it a no-op (as DDP's).
        divide_by_initial_world_size: only True (DDP's default) is supported:
            averages always divide by the world size.
        throw_on_early_termination: not supported (the coordinator does not tell
            still-training ranks that one ran out).

    Raises:
        ValueError: an unsupported option.
        SyncTimeoutError: no progress from the coordinator within the sync timeout.
        GradSyncError: the coordinator or the final broadcast failed.
    """
    if not divide_by_initial_world_size:
        raise ValueError(
            "join(divide_by_initial_world_size=False) is not supported: gradient averages "
            "always divide by the world size"
        )
    if throw_on_early_termination:
        raise ValueError("join(throw_on_early_termination=True) is not supported")
    yield
    # Reached only when the block ended without an exception.
    if enable:
        run_join(target)


def run_join(target: JoinTarget) -> None:
    """This rank is out of inputs: wait for every rank to be, then end equal.

    Raises:
        SyncTimeoutError: no progress from the coordinator within the sync timeout.
        GradSyncError: the coordinator or the final broadcast failed.
    """
    collectives = target.collectives
    link, rank = collectives.link, collectives.rank
    out_at = target.step
    link.send_out_of_inputs(out_at)
    log.info("rank %d: out of inputs at step %d; waiting for the other ranks", rank, out_at)
    last_log = time.monotonic()
    while True:
        try:
            progress = link.wait_join_progress(collectives.timeout_s)
        except SyncTimeoutError as exc:
            raise SyncTimeoutError(
                f"join(): no progress from the coordinator for {collectives.timeout_s:g}s "
                f"after running out of inputs at step {out_at}",
                rank=rank,
                step=out_at,
            ) from exc
        if progress.all_joined:
            break
        link.current_step = int(progress.next_step)  # heartbeats show the job's step
        if time.monotonic() - last_log >= _LOG_EVERY_S:
            last_log = time.monotonic()
            log.info(
                "rank %d: in join(): ranks %s are out of inputs; the others are at step %d",
                rank,
                list(progress.joined_ranks),
                progress.next_step,
            )
    target.step = int(progress.next_step)
    link.set_collective_sequence(int(progress.next_collective))
    source = int(progress.last_joiner)
    if not 0 <= source < collectives.world_size:
        raise GradSyncError(
            f"join(): the coordinator named rank {source} as the last to join, "
            f"outside the world size {collectives.world_size}",
            rank=rank,
        )
    module = target.module
    tensors = [p for p in module.parameters()] + [b for b in module.buffers()]
    with torch.no_grad():
        collectives.broadcast_tensors(tensors, src=source)
    log.info(
        "rank %d: join() done: every rank is out of inputs; continuing at step %d with "
        "rank %d's parameters",
        rank,
        progress.next_step,
        source,
    )
