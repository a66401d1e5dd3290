"""Waiting for a job to assemble, and saying what it waits for.

Ranks of one job start on different hosts at different moments, possibly
before their coordinator. Between sending Join and receiving Welcome a worker
can wait minutes, and a silent wait looks like a hang. `wait_for_welcome`
keeps the wait bounded by the join timeout and reports every ~10 s at INFO
which ranks are still missing (from the coordinator's AssemblyProgress:
"rank 1: waiting for ranks [2] of 3, 20 s of 300 s"), or at WARNING why the
coordinator cannot be reached (`gradsync_proto.net.reachability`) and how long the
worker keeps trying. At the deadline the error says the same: the address and
the reason, or the ranks that never came.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gradsync_proto.net.address import parse_address
from gradsync_proto.net.channels import ChannelSecurity, handshake_failure
from gradsync_proto.net.reachability import diagnose
from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync.control.inbox import Inbox
from gradsync.errors import CoordinatorUnavailableError, SyncTimeoutError, TransportSecurityError

log = logging.getLogger("gradsync.client")

#: The first report after this long (a normal start is quiet), then one every REPORT_EVERY_S.
FIRST_REPORT_S = 3.0
REPORT_EVERY_S = 10.0
#: Bound on one reachability probe (name lookup, then each TCP connect).
PROBE_TIMEOUT_S = 2.0


def wait_for_welcome(
    inbox: Inbox,
    target: str,
    rank: int,
    timeout_s: float,
    is_connected: Callable[[], bool],
    *,
    first_report_s: float = FIRST_REPORT_S,
    report_every_s: float = REPORT_EVERY_S,
    security: ChannelSecurity | None = None,
    unreachable_s: float | None = None,
) -> pb.Welcome:
    """Block until the job is assembled, reporting progress every ~10 s.

    Args:
        inbox: where the coordinator's AssemblyProgress and Welcome arrive.
        target: the coordinator's "host:port" (named in logs and errors).
        rank: this worker's rank.
        timeout_s: the join timeout.
        is_connected: whether the gRPC connection is up now.
        first_report_s, report_every_s: when to report while nothing changes.
        security: the link's TLS settings: while not connected, a TLS handshake
            that fails (wrong CA, expired or missing certificate) is raised at the
            first report instead of being retried until the timeout.
        unreachable_s: give up after this long if no connection came up at all (a
            dead host among several addresses: the next one may serve); a connected
            coordinator is waited for until `timeout_s`, however late the others are.

    Raises:
        CoordinatorUnavailableError: the coordinator was not reachable in time
            (names the address and the reason).
        SyncTimeoutError: reachable, but the job did not assemble in time
            (names the missing ranks).
        JoinRefusedError: the coordinator refused this worker.
        TransportSecurityError: the TLS handshake with the coordinator fails.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    next_report = started + first_report_s
    seen = 0
    shown: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    progress: pb.AssemblyProgress | None = None
    reason: str | None = None
    give_up = started + unreachable_s if unreachable_s is not None else None
    while (now := time.monotonic()) < deadline:
        wake = min(deadline, next_report)
        if give_up is not None and now < give_up:
            wake = min(wake, give_up)
        welcome, progress, count = inbox.wait_assembly(wake - now, seen)
        if welcome is not None:
            return welcome
        now = time.monotonic()
        if give_up is not None and now >= give_up and progress is None and not is_connected():
            _raise_on_handshake_failure(target, rank, security)
            reason = unreachable_reason(target, PROBE_TIMEOUT_S)
            raise CoordinatorUnavailableError(
                f"could not reach the coordinator at {target} within {unreachable_s:g}s: {reason}",
                rank=rank,
            )
        if progress is not None and count > seen:
            seen = count
            sets = (tuple(progress.joined_ranks), tuple(progress.missing_ranks))
            if sets != shown:  # who is missing changed: say so at once
                shown = sets
                next_report = now
        if now >= next_report:
            if progress is not None:
                log.info(
                    "rank %d: waiting for ranks %s of %d, %.0f s of %g s",
                    rank,
                    list(progress.missing_ranks),
                    len(progress.joined_ranks) + len(progress.missing_ranks),
                    now - started,
                    timeout_s,
                )
            elif is_connected():
                log.info(
                    "rank %d: connected to %s, waiting for the job to assemble, %.0f s of %g s",
                    rank,
                    target,
                    now - started,
                    timeout_s,
                )
            else:
                _raise_on_handshake_failure(target, rank, security)
                reason = unreachable_reason(target, min(PROBE_TIMEOUT_S, deadline - now))
                log.warning(
                    "rank %d: cannot reach the coordinator at %s (%s); still trying for "
                    "%.0f s of %g s",
                    rank,
                    target,
                    reason,
                    max(0.0, deadline - time.monotonic()),
                    timeout_s,
                )
            next_report = time.monotonic() + report_every_s
    if progress is None and not is_connected():
        reason = reason or unreachable_reason(target, PROBE_TIMEOUT_S)
        raise CoordinatorUnavailableError(
            f"could not reach the coordinator at {target} within {timeout_s:g}s: {reason}",
            rank=rank,
        )
    missing = (
        f"; still missing ranks {list(progress.missing_ranks)} of "
        f"{len(progress.joined_ranks) + len(progress.missing_ranks)}"
        if progress is not None
        else ""
    )
    raise SyncTimeoutError(
        f"connected to {target}, but the job did not assemble within {timeout_s:g}s{missing} "
        "(are all ranks started with the same world size and job id?)",
        rank=rank,
    )


def _raise_on_handshake_failure(target: str, rank: int, security: ChannelSecurity | None) -> None:
    """Raise TransportSecurityError when TLS, not the network, keeps the link down."""
    failure = handshake_failure(target, security or ChannelSecurity(), PROBE_TIMEOUT_S)
    if failure is not None:
        raise TransportSecurityError(
            f"cannot connect to the coordinator at {target}: {failure}", rank=rank
        )


def unreachable_reason(target: str, timeout_s: float) -> str:
    """Why the coordinator at `target` is not connected, in words."""
    try:
        address = parse_address(target)
    except ValueError as exc:
        return f"invalid address: {exc}"
    reason = diagnose(address.host, address.port, max(0.1, timeout_s))
    if reason is None:
        return (
            "it accepts TCP connections, but no gRPC connection came up yet "
            "(is it a gradsync coordinator, with the same TLS settings?)"
        )
    return reason


def load_lazy_modules(rank: int) -> None:
    """Import now what torch imports on a training loop's first steps, before the Join.

    torch's optimizers import `torch._dynamo` when the first one is built (`add_param_group`
    runs under `torch._disable_dynamo`): a second or more of CPU, longer on a busy host. A
    rank that rejoins a running elastic job is added to the open step as soon as its state
    is healed, inside this constructor, and the live ranks wait for its gradients of that
    step from then on. Paid here, before the Join, the import delays only this rank's own
    start; a job's first ranks would pay it at their optimizer anyway. A torch without
    `torch._dynamo` (or one that fails to import it) is left alone: the optimizer will say.
    """
    started = time.monotonic()
    try:
        import torch._dynamo  # noqa: F401  (imported for its side effect: loaded once)
    except Exception as exc:  # any failure here is the optimizer's to report
        log.debug("rank %d: torch._dynamo not loaded ahead (%s)", rank, exc)
        return
    log.debug("rank %d: loaded torch._dynamo in %.2fs", rank, time.monotonic() - started)
