"""Capability probe: can emulated clusters (and link delay) be built on this machine?

Tests and benchmarks skip, with a reason, where network namespaces cannot be used: not Linux, not
root, no iproute2, or a container or minimal kernel lacking a bridge, veth, tbf or (for link
delay, :mod:`gradsync_bench.netns_delay`) a TUN device. Root
alone does not tell, so :func:`available` really creates (and removes) one of each, once per
process. It is separate from :mod:`gradsync_bench.netns` because callers that only decide
whether to skip need none of the cluster's lifecycle, and the probe's throwaway objects use
their own name prefix (``gp``) so they never collide with a cluster's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from functools import cache

from gradsync_bench.netns_commands import HOST_IFNAME, NetnsError, run_command, run_ip
from gradsync_bench.netns_shaping import tbf_args

__all__ = ["available", "delay_available"]


@dataclass(frozen=True)
class _Probe:
    ok: bool
    reason: str
    tun: bool


@cache
def _probe() -> _Probe:
    """Try every kernel feature a Cluster needs once, on throwaway objects, and clean up."""
    if not sys.platform.startswith("linux"):
        return _Probe(False, f"network namespaces need Linux, this is {sys.platform}", False)
    if os.geteuid() != 0:
        return _Probe(False, "network namespaces need root (CAP_NET_ADMIN)", False)
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return _Probe(False, "iproute2 is not installed (no `ip` or `tc` command)", False)
    tag = "gp" + secrets.token_hex(3)
    ns, bridge, port = f"{tag}-probe", f"{tag}br", f"{tag}v0"
    created: list[list[str]] = []
    try:
        run_ip("netns", "add", ns)
        created.append(["ip", "netns", "del", ns])
        run_ip("link", "add", bridge, "type", "bridge")
        created.append(["ip", "link", "del", "dev", bridge])
        run_ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
        created.append(["ip", "link", "del", "dev", port])
        run_ip("link", "set", "dev", port, "master", bridge)
        run_command(["tc", "qdisc", "replace", "dev", port, "root", *tbf_args(100)])
        try:
            run_ip("-n", ns, "tuntap", "add", "dev", "gptun", "mode", "tun")
            tun = True
        except NetnsError:
            tun = False
        return _Probe(True, "", tun)
    except NetnsError as exc:
        return _Probe(False, f"cannot build an emulated cluster: {exc}", False)
    finally:
        for argv in reversed(created):
            with contextlib.suppress(NetnsError):
                run_command(argv)


def available() -> tuple[bool, str]:
    """Whether clusters can be built here: ``(True, "")`` or ``(False, reason)``.

    Besides root it really creates (and removes) a namespace, a bridge, a veth and a tbf
    qdisc, because containers and minimal kernels often lack one of them even for root;
    tests use the reason in their skip message. The answer is cached per process.
    """
    probe = _probe()
    return probe.ok, probe.reason


def delay_available() -> tuple[bool, str]:
    """Like :func:`available`, and also that TUN devices work, for ``LinkShape.delay_ms``."""
    probe = _probe()
    if not probe.ok:
        return False, probe.reason
    if not probe.tun:
        return False, "cannot create a TUN device (/dev/net/tun, CONFIG_TUN), so no link delay"
    return True, ""
