"""Transport security on real processes with real certificates (made here with trustme).

One coordinator requiring TLS, client certificates (mTLS) and a token serves most
tests: a wrong CA, a missing or expired client certificate and a plaintext client
are refused with errors that say so (within seconds, not after the join timeout);
a missing or wrong token is UNAUTHENTICATED before anything happens (the job it
tried to join does not exist afterwards); `Status` and the health service need
the token too. A sharded coordinator over mTLS trains two real ranks end to end,
its local shard children getting the token through their environment, and so does
DiLoCo (whose wrong-token rank is refused). Protected
mode: `serve` and `shard` refuse a non-loopback address without credentials
(exit 2, saying how to set a token) unless `--insecure`. A shard with the wrong
shard token is refused by its leader.
"""

from __future__ import annotations

import datetime
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gradsync import AuthenticationError, DiLoCo, DistributedDataParallel, TransportSecurityError
from gradsync.healthcheck import check
from gradsync.status import query_status
from gradsync_proto import auth
from gradsync_proto.net.channels import ChannelSecurity
from gradsync_proto.net.launch import parse_banner
from gradsync_server.rpc.auth_check import exposure_refusal
from support.diloco_reference import Run, make_model, simulate
from support.processes import TRAIN_WORKER, WORKERS, CoordinatorProcess, run_ranks
from support.shards import wait_for_shard_bytes

trustme = pytest.importorskip("trustme", reason="trustme is not installed: pip install trustme")

TOKEN = "t0k3n-" + "x" * 26
OTHER_TOKEN = "wr0ng-" + "y" * 26
DILOCO_WORKER = WORKERS / "diloco_worker.py"
#: Environment variables that would leak this process's settings into a child.
SECURITY_ENV = (
    auth.ENV_TOKEN,
    auth.ENV_TOKEN_FILE,
    auth.ENV_SHARD_TOKEN,
    auth.ENV_SHARD_TOKEN_FILE,
    "GRADSYNC_TLS_CA",
    "GRADSYNC_TLS_CERT",
    "GRADSYNC_TLS_KEY",
)
#: One parallel worker runs the whole module: its certificates and its secured coordinator
#: are made once (module fixtures).
pytestmark = pytest.mark.xdist_group("tls")


@dataclass(frozen=True)
class Pki:
    """PEM files: one CA for servers and clients, and the ways to get it wrong."""

    ca: str
    server: str  # certificate + key, for 127.0.0.1 and localhost
    client: str  # certificate + key
    expired_client: str
    other_ca: str
    token_file: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_and_cert_chain_pem.write_to_path(str(folder / "server.pem"))
    client = ca.issue_cert("worker.gradsync.test")
    client.private_key_and_cert_chain_pem.write_to_path(str(folder / "client.pem"))
    yesterday = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    expired = ca.issue_cert(
        "old-worker.gradsync.test",
        not_before=yesterday - datetime.timedelta(days=30),
        not_after=yesterday,
    )
    expired.private_key_and_cert_chain_pem.write_to_path(str(folder / "expired.pem"))
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    return Pki(
        ca=str(folder / "ca.pem"),
        server=str(folder / "server.pem"),
        client=str(folder / "client.pem"),
        expired_client=str(folder / "expired.pem"),
        other_ca=str(folder / "other-ca.pem"),
        token_file=str(token_file),
    )


def mtls_flags(pki: Pki) -> list[str]:
    return [
        "--tls-cert", pki.server, "--tls-key", pki.server,
        "--tls-client-ca", pki.ca, "--token-file", pki.token_file,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def secured(pki: Pki) -> CoordinatorProcess:
    """A coordinator that requires TLS, a client certificate and the token."""
    coordinator = CoordinatorProcess(2, *mtls_flags(pki))
    yield coordinator  # type: ignore[misc]
    coordinator.stop()


def good(pki: Pki, **changes: str | None) -> ChannelSecurity:
    settings: dict[str, str | None] = {
        "tls_ca": pki.ca, "tls_cert": pki.client, "tls_key": pki.client, "token": TOKEN,
    }  # fmt: skip
    settings.update(changes)
    return ChannelSecurity.resolve(**settings, environ={})


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in SECURITY_ENV}
    env.update(extra)
    return env


def join(address: str, job_id: str, timeout_s: float = 20.0, **security: str | None) -> None:
    """Construct a rank-0 DDP of a 2-rank job (raises whatever joining raises)."""
    DistributedDataParallel(
        torch.nn.Linear(2, 1),
        coordinator=address,
        rank=0,
        world_size=2,
        job_id=job_id,
        join_timeout_s=timeout_s,
        reconnect_timeout_s=0,
        **security,  # type: ignore[arg-type]
    )


# --- TLS ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_ranks_train_through_local_shards_over_mtls_with_a_token(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, coordinator_factory
) -> None:
    # The leader's shard child gets the token by environment and the TLS files by flag; the
    # workers read everything from the environment, as under torchrun.
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)
    coordinator = coordinator_factory(2, "--shards", "2", "--tls-ca", pki.ca, *mtls_flags(pki))
    assert TOKEN not in "".join(coordinator.startup_lines)
    assert "security: TLS + client certificates + token" in "".join(coordinator.startup_lines)
    monkeypatch.setenv("GRADSYNC_TLS_CA", pki.ca)
    monkeypatch.setenv("GRADSYNC_TLS_CERT", pki.client)
    monkeypatch.setenv("GRADSYNC_TLS_KEY", pki.client)
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, pki.token_file)
    saved = run_ranks(TRAIN_WORKER, coordinator.address, 2, tmp_path, "--scenario", "parity")
    finals = [name for name in saved[0] if name.startswith("final/")]
    assert finals
    for name in finals:
        np.testing.assert_array_equal(saved[0][name], saved[1][name])
    trained = [n for n in finals if not np.array_equal(saved[0][n], saved[0]["initial/" + n[6:]])]
    assert trained, "no parameter changed: nothing was trained"
    # Both shards carried gradients, so the data streams to the shard child ran over mTLS too.
    assert len(wait_for_shard_bytes(coordinator.address, security=good(pki))) == 2


@pytest.mark.timeout(90)
def test_diloco_trains_through_local_shards_over_mtls_and_refuses_a_wrong_token(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, coordinator_factory
) -> None:
    # The outer rounds, their global parameters and the shards' ranges all travel over
    # mTLS with the token, the workers taking every setting from the environment.
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)
    coordinator = coordinator_factory(2, "--shards", "2", "--tls-ca", pki.ca, *mtls_flags(pki))
    with pytest.raises(AuthenticationError, match=r"UNAUTHENTICATED.*token"):
        DiLoCo(
            torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1),
            coordinator=coordinator.address, rank=0, world_size=2, job_id="diloco-intruder",
            join_timeout_s=20, reconnect_timeout_s=0, tls_ca=pki.ca, tls_cert=pki.client,
            tls_key=pki.client, token=OTHER_TOKEN,
        )  # fmt: skip
    monkeypatch.setenv("GRADSYNC_TLS_CA", pki.ca)
    monkeypatch.setenv("GRADSYNC_TLS_CERT", pki.client)
    monkeypatch.setenv("GRADSYNC_TLS_KEY", pki.client)
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, pki.token_file)
    run = Run(rounds=2)
    saved = run_ranks(DILOCO_WORKER, coordinator.address, 2, tmp_path, *run.argv())
    expected = simulate(run, 2, make_model(100, run.hidden))[-1]
    names = [name for name, _ in make_model(0, run.hidden).named_parameters()]
    for name, want in zip(names, expected, strict=True):
        np.testing.assert_array_equal(saved[0][f"final/{name}"], saved[1][f"final/{name}"])
        np.testing.assert_allclose(saved[0][f"final/{name}"], want.numpy(), rtol=0, atol=1e-5)
    assert len(wait_for_shard_bytes(coordinator.address, security=good(pki))) == 2
    reply = query_status(coordinator.address, security=good(pki))
    assert "diloco-intruder" not in [job.job_id for job in reply.jobs]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tls_ca": "other_ca"}, "CERTIFICATE_VERIFY_FAILED"),
        ({"tls_cert": None, "tls_key": None}, "requires a client certificate and got none"),
        ({"tls_cert": "expired_client", "tls_key": "expired_client"}, "expired"),
    ],
    ids=["wrong-ca", "no-client-cert", "expired-client-cert"],
)
def test_a_failed_handshake_is_a_clear_error_not_a_hang(
    pki: Pki, secured: CoordinatorProcess, changes: dict[str, str | None], words: str
) -> None:
    files = {key: None if value is None else getattr(pki, value) for key, value in changes.items()}
    security = good(pki, **files)
    with pytest.raises(ConnectionError, match=words):
        query_status(secured.address, security=security)
    # The worker: a TransportSecurityError within seconds, though the join timeout is 20 s.
    # (The wrapper imports torch._dynamo before it joins, seconds of CPU on a loaded host:
    # loaded here first, so that the time below is the connection's.)
    import torch._dynamo  # noqa: F401

    started = time.monotonic()
    with pytest.raises(TransportSecurityError, match=words):
        join(
            secured.address,
            "tls-refused",
            tls_ca=security.ca_path,
            tls_cert=security.cert_path,
            tls_key=security.key_path,
            token=TOKEN,
        )
    assert time.monotonic() - started < 10


def test_a_plaintext_client_is_told_the_server_speaks_tls(
    pki: Pki, secured: CoordinatorProcess
) -> None:
    with pytest.raises(ConnectionError, match="speaks TLS and this client does not"):
        query_status(secured.address, security=ChannelSecurity.resolve(token=TOKEN, environ={}))


# --- the token ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, OTHER_TOKEN], ids=["missing", "wrong"])
def test_a_missing_or_wrong_token_is_refused_before_any_state_change(
    pki: Pki, secured: CoordinatorProcess, token: str | None
) -> None:
    job_id = f"intruder-{'none' if token is None else 'wrong'}"
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match=r"UNAUTHENTICATED.*token") as refused:
        join(secured.address, job_id, tls_ca=pki.ca, tls_cert=pki.client, tls_key=pki.client,
             token=token)  # fmt: skip
    assert time.monotonic() - started < 10, "an auth failure must not wait for the join timeout"
    assert OTHER_TOKEN not in str(refused.value) and TOKEN not in str(refused.value)
    # Nothing was created: with the right token, Status shows no such job.
    reply = query_status(secured.address, security=good(pki))
    assert job_id not in [job.job_id for job in reply.jobs], reply
    # Status and the health service need the token like every call.
    with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
        query_status(secured.address, security=good(pki, token=token))
    probe = check(secured.address, security=good(pki, token=token))
    assert not probe.healthy and "UNAUTHENTICATED" in probe.message
    assert check(secured.address, security=good(pki)).healthy


@pytest.mark.timeout(60)
def test_a_shard_with_the_wrong_shard_token_is_refused_by_its_leader(
    pki: Pki, tmp_path: Path, coordinator_factory
) -> None:
    shard_token_file = tmp_path / "shard-token"
    shard_token_file.write_text("shard-" + "z" * 26 + "\n")
    leader = coordinator_factory(
        1,
        "--wait-for-shards",
        "1",
        "--token-file",
        pki.token_file,
        "--shard-token-file",
        str(shard_token_file),
    )
    shard = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", "shard", "--leader", leader.address, "--port", "0"],
        # The workers' token is right; the shard token is not the leader's.
        env=clean_env(**{auth.ENV_TOKEN: TOKEN, auth.ENV_SHARD_TOKEN: OTHER_TOKEN}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shard.returncode == 2, shard.stderr
    assert "refused this shard" in shard.stderr and "shard token" in shard.stderr
    assert OTHER_TOKEN not in shard.stderr and TOKEN not in shard.stderr
    reply = query_status(leader.address, security=ChannelSecurity.resolve(token=TOKEN, environ={}))
    assert not any(s.alive for s in reply.shards if s.index > 0), reply.shards


# --- protected mode ----------------------------------------------------------------------------


def start_gradsync(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync.cli", *argv], env=env, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--world-size", "1", "--host", "0.0.0.0", "--port", "0"],
        ["shard", "--leader", "127.0.0.1:1", "--host", "0.0.0.0", "--port", "0"],
    ],
    ids=["serve", "shard"],
)
def test_no_credentials_beyond_loopback_exits_2_unless_insecure(argv: list[str], pki: Pki) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "gradsync.cli", *argv],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2, refused.stderr
    for words in ("refusing to listen on --host 0.0.0.0", "--token-file", "GRADSYNC_TOKEN",
                  "--insecure"):  # fmt: skip
        assert words in refused.stderr, refused.stderr
    if argv[0] == "shard":
        return  # a shard without a leader would only retry; serve shows both ways in
    for extra, env, words in (
        (["--insecure"], clean_env(), "plaintext, no authentication"),
        ([], clean_env(**{auth.ENV_TOKEN_FILE: pki.token_file}), "security: token"),
    ):
        process = start_gradsync(*argv, *extra, env=env)
        assert process.stderr is not None
        lines = []
        for line in process.stderr:
            lines.append(line)
            if parse_banner(line):
                break
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=30)[1]
        assert process.returncode == 0, "".join(lines) + rest
        assert words in "".join(lines) and TOKEN not in "".join(lines) + rest


# --- pieces ------------------------------------------------------------------------------------


def test_exposure_refusal_allows_loopback_a_token_mtls_or_insecure() -> None:
    assert exposure_refusal("serve", "0.0.0.0", token=False, client_ca=False, insecure=False)
    assert exposure_refusal("serve", "10.1.2.3", token=False, client_ca=False, insecure=False)
    for host in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"):
        assert exposure_refusal("serve", host, token=False, client_ca=False, insecure=False) is None
    for kind in ({"token": True}, {"client_ca": True}, {"insecure": True}):
        flags = {"token": False, "client_ca": False, "insecure": False, **kind}
        assert exposure_refusal("serve", "0.0.0.0", **flags) is None


def test_token_settings_are_checked_and_never_shown(tmp_path: Path) -> None:
    with pytest.raises(auth.TokenError, match="set only one"):
        auth.token_from_environment({auth.ENV_TOKEN: TOKEN, auth.ENV_TOKEN_FILE: "/x"})
    with pytest.raises(auth.TokenError, match="fewer than 16"):
        auth.token_from_environment({auth.ENV_TOKEN: "short"})
    assert auth.token_from_environment({}) is None
    security = ChannelSecurity.resolve(token=TOKEN, environ={})
    assert TOKEN not in repr(security) and TOKEN not in security.describe()
    with pytest.raises(ValueError, match="tls_ca"):
        ChannelSecurity.resolve(tls_cert="c.pem", tls_key="k.pem", environ={})
    with pytest.raises(ValueError, match="not a PEM file"):
        (tmp_path / "ca.pem").write_text("hello")
        ChannelSecurity.resolve(tls_ca=str(tmp_path / "ca.pem"), environ={})


def test_gradsync_token_writes_a_private_file_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "token"
    command = [sys.executable, "-m", "gradsync.cli", "token", str(path)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    token = auth.read_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in first.stdout + first.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and auth.read_token_file(path) == token
    kept = subprocess.run([*command, "--keep"], capture_output=True, text=True, timeout=30)
    assert kept.returncode == 0 and auth.read_token_file(path) == token


def test_worker_metrics_bind_loopback_unless_asked() -> None:
    from gradsync.instruments import Instruments

    default = Instruments(0, 0, None, [4])
    exposed = Instruments(0, 0, None, [4], metrics_host="0.0.0.0")
    try:
        assert default.server is not None and default.server.host == "127.0.0.1"
        assert exposed.server is not None and exposed.server.host == "0.0.0.0"
    finally:
        default.close()
        exposed.close()
