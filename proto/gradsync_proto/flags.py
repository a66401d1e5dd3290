"""Argument types both commands' flags use: every value's range is checked by argparse.

A value argparse accepts must never fail later with a traceback (a metrics
port of 99999 used to reach the socket layer and print one, exit status 1),
so each flag's type checks the whole range the code behind it accepts, and
argparse turns the `ArgumentTypeError` into "argument --flag: ..." and exit
status 2. Numbers are finite: "inf" or "nan" would make a wait unbounded or
a size overflow.

Here rather than in `gradsync.flags` because the coordinator's own flags
(`gradsync_server.arguments`) take the same types as the worker's, and the
server imports nothing of the client; the types only the client's
subcommands take (output files and folders, lists) stay in `gradsync.flags`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from gradsync_proto.defaults import MIB
from gradsync_proto.net.address import parse_address

#: The longest wait any flag accepts (30 days): beyond it a "timeout" is a typo,
#: and gRPC deadlines and thread waits overflow long before infinity.
MAX_SECONDS = 30 * 24 * 3600.0
#: Chunk sizes the coordinator accepts (`ServerConfig`): 4 KiB..64 MiB.
MIN_CHUNK_MB = 4096 / MIB
MAX_CHUNK_MB = 64.0


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (either bound may be open)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        _check_range(value, low, high, text)
        return value

    return parse


def number(
    low: float | None = None, high: float | None = None, *, low_inclusive: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number above `low` (or at it) and at most `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value < low or (value == low and not low_inclusive)):
            relation = ">=" if low_inclusive else ">"
            raise argparse.ArgumentTypeError(f"must be {relation} {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return value

    return parse


def _check_range(value: int, low: int | None, high: int | None, text: str) -> None:
    too_low = low is not None and value < low
    too_high = high is not None and value > high
    if not (too_low or too_high):
        return
    if low is not None and high is not None:
        raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {text}")
    bound = f">= {low}" if too_low else f"<= {high}"
    raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")


#: Positive counts (world size, epochs, batch size, repetitions, ...).
positive_int = integer(1)
#: TCP ports to bind; 0 picks a free one.
port = integer(0, 65535)
#: Durations in seconds: positive, finite, at most MAX_SECONDS.
seconds = number(0.0, MAX_SECONDS)
#: Durations that may be zero (a shutdown grace).
seconds_or_zero = number(0.0, MAX_SECONDS, low_inclusive=True)
#: Positive finite numbers (learning rate, sizes in MiB, rates).
positive_number = number(0.0)


def coordinator(text: str) -> str:
    """An argparse type: a coordinator address, or a comma list of them (an active
    coordinator and standbys), returned in canonical "host:port[,host:port]" form."""
    try:
        return ",".join(str(parse_address(entry)) for entry in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chunk_mb(text: str) -> float:
    """An argparse type: a wire chunk size in MiB the coordinator accepts."""
    value = number(0.0)(text)
    if not MIN_CHUNK_MB <= value <= MAX_CHUNK_MB:
        raise argparse.ArgumentTypeError(
            f"chunk size must be 4 KiB..64 MiB ({MIN_CHUNK_MB:g}..{MAX_CHUNK_MB:g}), got {text}"
        )
    return value


def non_empty(text: str) -> str:
    """An argparse type: a name that is neither empty nor only spaces (a job id, a host)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
