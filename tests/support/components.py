"""The real components the system tests use, and why a test skips without one.

A test that needs a real redis-server, Prometheus or the `ip`/`tc` tools skips
when the binary is missing, with a reason that contains `MISSING_COMPONENT`;
tests/conftest.py counts those skips and says at the end of the run how many
there were and the one command that installs what is missing
(`INSTALL_COMMAND`, the script `scripts/test.sh` runs itself when it is root).
"""

from __future__ import annotations

import shutil

from gradsync_bench import netns_probe

#: The words every missing-component skip reason contains (counted by tests/conftest.py).
MISSING_COMPONENT = "missing real component"
#: Installs every component below (Debian/Ubuntu); scripts/test.sh runs it when root.
INSTALL_COMMAND = "sudo bash scripts/install-system-deps.sh"


def missing(binary: str, package: str) -> str:
    """The skip reason for a test that needs `binary` from the Debian package `package`."""
    return f"{MISSING_COMPONENT}: {binary} not installed (Debian package {package})"


REDIS_SERVER = shutil.which("redis-server")
NO_REDIS_SERVER = missing("redis-server", "redis-server")

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = missing("prometheus", "prometheus")

NO_IPROUTE2 = missing("ip and tc", "iproute2")


def netns_available() -> tuple[bool, str]:
    """Whether emulated clusters can be built here: `(True, "")` or `(False, skip reason)`."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, NO_IPROUTE2
    return netns_probe.available()
