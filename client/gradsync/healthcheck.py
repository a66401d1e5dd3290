"""A container health probe: is the coordinator at HOST:PORT serving?

`python -m gradsync.healthcheck 127.0.0.1:50051` asks the coordinator's
standard gRPC health service (grpc.health.v1) about the gradsync service and
exits 0 when the answer is SERVING, 1 otherwise, printing why. Docker's
HEALTHCHECK and compose's `condition: service_healthy` run it; it needs no
extra binary in the image (grpc_health_probe) and checks what matters: a
draining coordinator reports NOT_SERVING before it closes its port, so the
probe fails as soon as the coordinator stops accepting joins.

Every call has a deadline, so a hung coordinator fails the probe instead of
stalling it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.v1 import gradsync_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradsync import flags
from gradsync.arguments import add_client_security_flags, client_security

#: The service the coordinator registers, as named by the contract itself.
COORDINATOR_SERVICE: str = gradsync_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class HealthResult:
    """The probe's verdict: `healthy` when the status is SERVING; `message` says why."""

    healthy: bool
    message: str


def check(
    address: str,
    service: str = COORDINATOR_SERVICE,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    security: ChannelSecurity | None = None,
) -> HealthResult:
    """Ask the health service at `address` about `service`, waiting at most `timeout_s`.

    Args:
        address: "host:port" of the coordinator.
        service: the service to ask about; "" asks about the server as a whole.
        timeout_s: deadline of the whole check, connection included.
        security: TLS and token (the health service needs the token like every call).

    Returns:
        healthy=True only for SERVING; otherwise the status or the gRPC error.
    """
    security = security or ChannelSecurity()
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout_s,
                metadata=security.metadata,
            )
        except grpc.RpcError as exc:
            return HealthResult(False, _describe_error(address, service, timeout_s, exc))
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
    return HealthResult(healthy, f"{_shown(service)} at {address} is {status}")


def _shown(service: str) -> str:
    return f"service {service!r}" if service else "the server"


def _describe_error(address: str, service: str, timeout_s: float, exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {address} within {timeout_s:g}s (DEADLINE_EXCEEDED)"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach {address} (UNAVAILABLE: {details})"
    if code == grpc.StatusCode.NOT_FOUND:
        return (
            f"{address} does not know {_shown(service)} (NOT_FOUND): is it a gradsync coordinator?"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{address} refused the probe (UNAUTHENTICATED): {details}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"{address} has no gRPC health service (UNIMPLEMENTED)"
    name = code.name if code is not None else "error"
    return f"health check of {address} failed ({name}: {details})"


def build_parser() -> argparse.ArgumentParser:
    """The probe's argument parser (exposed for tests of the Dockerfile and compose file)."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.healthcheck",
        description="Exit 0 when the gradsync coordinator at ADDRESS reports SERVING, else 1.",
    )
    parser.add_argument(
        "address",
        type=flags.coordinator,
        help="coordinator host:port, e.g. 127.0.0.1:50051 or [::1]:50051",
    )
    parser.add_argument(
        "--service",
        default=COORDINATOR_SERVICE,
        help=f"service to ask about; '' for the whole server (default {COORDINATOR_SERVICE})",
    )
    parser.add_argument(
        "--timeout-s",
        type=flags.seconds,
        default=DEFAULT_TIMEOUT_S,
        help=f"deadline of the check in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    add_client_security_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the probe; returns the exit code (0 healthy, 1 not, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    result = check(args.address, args.service, args.timeout_s, client_security(parser, args))
    if result.healthy:
        print(f"healthy: {result.message}")
        return 0
    print(f"unhealthy: {result.message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
