"""A local user holding silent connections to a donor's heal socket stalls neither side.

The donor's socket name shows in /proc/net/unix to every local user. Real
processes and sockets: the donor is this process's `StateOffer` (as
`send_heal_state` makes it at a step boundary), the attackers are forked
children holding silent connections to it, one under a second uid (made
here with `os.setuid`, so the test needs root) and one under the donor's
own, and the joiner is a fresh Python process reading the offer through
`load_module_state`. The joiner must have the donor's state bitwise within
seconds, and the donor's `release` (the end of the step the joiner enters)
must not wait for anyone.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (imported before the fork: a stranger cannot read the stdlib)
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from gradsync.control import heal_channel, state_load
from torch import nn

#: A uid no account on the machine uses (an attacker need not be a known user).
_STRANGER_UID = 54_321
#: Silent connections each attacker holds (two were enough to stall a heal for 60 s).
_CONNECTIONS = 4

_JOINER = textwrap.dedent(
    """
    import hashlib, json, sys, time
    import torch
    from torch import nn
    from gradsync.control.state_load import load_module_state

    offer = bytes.fromhex(sys.argv[1])
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    started = time.monotonic()
    load_module_state(offer, module, "job-h", 1, 7, timeout_s=60.0)
    took = time.monotonic() - started
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    print(json.dumps({"took_s": took, "digest": digest.hexdigest()}))
    """
)


def _digest(module: nn.Module) -> str:
    import hashlib

    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _connect(offer: bytes) -> socket.socket:
    """A connection to the offer's socket, as any local process can open one."""
    fields = json.loads(offer[len(heal_channel.OFFER_MAGIC) :])
    if "socket" in fields:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + fields["socket"])
    else:  # a loopback TCP offer
        conn = socket.create_connection((fields["host"], fields["port"]))
    return conn


@contextmanager
def _attacker(offer: bytes, uid: int | None) -> Iterator[int]:
    """A forked child (under `uid`, if given) holding silent connections; yields its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sockets and sleep only, then _exit
        try:
            os.close(ready_r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            held = [_connect(offer) for _ in range(_CONNECTIONS)]
            os.write(ready_w, b"1")
            time.sleep(120.0)
            del held
        except BaseException as exc:
            os.write(2, f"attacker: {exc!r}\n".encode())
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1", "the attacker could not connect"
        yield pid
    finally:
        os.close(ready_r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.timeout(120)
def test_silent_local_connections_hold_neither_the_joiner_nor_the_donors_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the attacker runs under a second uid (os.setuid in a fork)")
    caplog.set_level(logging.INFO, logger="gradsync.client")
    torch.manual_seed(0)
    donor = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    offer = heal_channel.StateOffer(state_load.live_state(donor, None, 7, 2), serve_s=60.0)
    try:
        blob = offer.offer()
        name = json.loads(blob[len(heal_channel.OFFER_MAGIC) :]).get("socket", "")
        assert name in Path("/proc/net/unix").read_text()  # every local user sees it
        with _attacker(blob, _STRANGER_UID), _attacker(blob, None):
            time.sleep(0.5)  # the donor has accepted (and the stranger's were closed)
            joiner = subprocess.run(
                [sys.executable, "-c", _JOINER, blob.hex()],
                capture_output=True,
                text=True,
                timeout=90,
                env=dict(os.environ),
            )
            assert joiner.returncode == 0, joiner.stderr[-3000:]
            result = json.loads(joiner.stdout.strip().splitlines()[-1])
            # Measured before the fix: the joiner failed after 60 s, holding nothing.
            assert result["took_s"] < 10.0, result
            assert result["digest"] == _digest(donor)
            started = time.monotonic()
            offer.release(wait_s=30.0)  # the end of the step the joiner entered
            # Measured before the fix: held 30 s by a silent connection.
            assert time.monotonic() - started < 2.0
    finally:
        offer.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"refused a peer of uid {_STRANGER_UID}" in m for m in messages), messages
