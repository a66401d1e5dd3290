"""Argument types both commands' flags use: every value's range is checked by argparse.

A value argparse accepts must never fail later with a traceback (a metrics
port of 99999 used to reach the socket layer and print one, exit status 1),
so each flag's type checks the whole range the code behind it accepts, and
argparse turns the `ArgumentTypeError` into "argument --flag: ..." and exit
status 2. Numbers are finite: "inf" or "nan" would make a wait unbounded or
a size overflow.

Here rather than in `gradsync.flags` because the coordinator's own flags
(declared on `gradsync_server.config.CoordinatorConfig`) take the same types
as the worker's, and the server imports nothing of the client; the types only
the client's subcommands take (output files and folders, lists) stay in
`gradsync.flags`.

A config dataclass declares its flags here too: each field made by `option`
holds a `Flag` in its metadata (name, type, unit, help, roles), `add_flags`
builds a subcommand's flags from the dataclass, and `config_from_flags`
builds the dataclass from the parsed flags, so a new knob is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from gradsync_proto.defaults import MIB
from gradsync_proto.net.address import parse_address

#: The longest wait any flag accepts (30 days): beyond it a "timeout" is a typo,
#: and gRPC deadlines and thread waits overflow long before infinity.
MAX_SECONDS = 30 * 24 * 3600.0
#: Chunk sizes the coordinator accepts (`CoordinatorConfig`): 4 KiB..64 MiB.
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


#: A flag's value read from the parsed flags and the environment instead of taken as given.
Reader = Callable[[argparse.Namespace, Mapping[str, str]], Any]
Config = TypeVar("Config")
#: `Flag.flag_default` when the flag's default is the field's (in the flag's unit).
_FIELD_DEFAULT: Any = object()


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field of a config dataclass is set from the command line.

    Attributes:
        help: the help text, or one per role where the roles' texts differ.
        name: the flag ("--chunk-mb"); "" = the field's name with dashes (`_bytes` read
            `_mb` in a MiB flag); None = no flag of its own (the value comes from `read` alone).
        type: the argparse type, which checks the value's whole range.
        unit: the field holds `int(flag value * unit)` (a MiB flag of a byte field).
        roles: the roles (subcommands) that have this flag; None = every role.
        flag_default: the flag's default in its own unit, when not the field's default.
        read: the field's value from the parsed flags and the environment (other flags,
            files); None = the flag's value, where None leaves the field's default.
        choices, action, required, metavar: as argparse's `add_argument`.
    """

    help: str | Mapping[str, str] = ""
    name: str | None = ""
    type: Callable[[str], Any] | None = None
    unit: float = 1
    roles: Collection[str] | None = None
    flag_default: Any = _FIELD_DEFAULT
    read: Reader | None = None
    choices: Collection[str] | None = None
    action: str | None = None
    required: bool = False
    metavar: str | None = None

    def serves(self, role: str) -> bool:
        """Whether the subcommand of `role` sets this field."""
        return self.roles is None or role in self.roles


def option(
    default: Any, help: str | Mapping[str, str] = "", *, repr: bool = True, **flag: Any
) -> Any:
    """A config field that has a flag: `dataclasses.field` with the `Flag` in its metadata.

    Args:
        default: the field's default.
        help, flag: the `Flag` (its attributes as keywords).
        repr: show the value in the config's repr (False for secrets).
    """
    return dataclasses.field(default=default, repr=repr, metadata={"flag": Flag(help, **flag)})


def _flags(config_type: type[Any], role: str) -> list[tuple[dataclasses.Field[Any], Flag]]:
    found = []
    for field in dataclasses.fields(config_type):
        spec = field.metadata.get("flag")
        if isinstance(spec, Flag) and spec.serves(role):
            found.append((field, spec))
    return found


def _option(field: dataclasses.Field[Any], spec: Flag) -> str:
    name = field.name.removesuffix("_bytes") + "_mb" if spec.unit == MIB else field.name
    return spec.name or "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, config_type: type[Any], role: str) -> None:
    """Add the flags of `role`'s subcommand, in field order, from `config_type`'s metadata."""
    for field, spec in _flags(config_type, role):
        if spec.name is None:
            continue
        text = spec.help if isinstance(spec.help, str) else spec.help[role]
        options: dict[str, Any] = {"help": text}
        if spec.action is not None:
            options["action"] = spec.action
            if spec.action == "store_false":
                options["dest"] = field.name
        else:
            default: Any = spec.flag_default
            if default is _FIELD_DEFAULT:
                default = field.default
                if default is not None and spec.unit != 1:
                    default /= spec.unit
            options.update(type=spec.type, default=default, required=spec.required)
            if spec.choices is not None:
                options["choices"] = spec.choices
            if spec.metavar is not None:
                options["metavar"] = spec.metavar
        parser.add_argument(_option(field, spec), **options)


def config_from_flags(
    config_type: type[Config], args: argparse.Namespace, environ: Mapping[str, str]
) -> Config:
    """The config of the subcommand that parsed `args` (whose `role` names its role).

    Raises:
        ValueError: a flag's value is refused, or the config refuses the values together
            (its messages name the flags).
    """
    values: dict[str, Any] = {}
    for field, spec in _flags(config_type, args.role):
        if spec.read is not None:
            values[field.name] = spec.read(args, environ)
            continue
        value = getattr(args, field.name if spec.action == "store_false" else _dest(field, spec))
        if value is not None:
            values[field.name] = int(value * spec.unit) if spec.unit != 1 else value
    build: Callable[..., Config] = config_type
    return build(role=args.role, **values)


def _dest(field: dataclasses.Field[Any], spec: Flag) -> str:
    return _option(field, spec).lstrip("-").replace("-", "_")
