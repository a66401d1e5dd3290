"""The shared secret both ends of gradsync authenticate with.

A token is read from a file (`--token-file`) or the `GRADSYNC_TOKEN`
environment variable, never taken from the command line (where every user of
the host could read it in the process list). Workers, shards and `gradsync
status` send it as gRPC metadata on every call; the coordinator and shards
compare it in constant time before any handler runs. The same token keys the
coordinator's checkpoint MACs (`derive_key`), so a checkpoint planted in the
store by someone without the token is refused at load.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path

#: Environment variable holding the token itself.
ENV_TOKEN = "GRADSYNC_TOKEN"
#: Environment variable naming a file that holds the token.
ENV_TOKEN_FILE = "GRADSYNC_TOKEN_FILE"
#: Environment variable holding the shard token (what a shard presents to its leader).
ENV_SHARD_TOKEN = "GRADSYNC_SHARD_TOKEN"
#: Environment variable naming a file that holds the shard token.
ENV_SHARD_TOKEN_FILE = "GRADSYNC_SHARD_TOKEN_FILE"
#: gRPC metadata key the token travels in (lower case, as HTTP/2 requires).
METADATA_KEY = "authorization"
#: Scheme prefix of the metadata value.
SCHEME = "Bearer "
#: Shorter tokens are refused: a guessable secret protects nothing.
MIN_TOKEN_CHARS = 16
#: Longer tokens are refused (a token is a secret, not a document).
MAX_TOKEN_CHARS = 4096
#: Largest certificate, key or CA bundle file read (a PEM file, not a data set).
MAX_PEM_BYTES = 1 << 20


class TokenError(ValueError):
    """A token file or value is unusable; the message says which and why."""


def check_token(token: str, source: str) -> str:
    """The token with surrounding whitespace removed, or TokenError naming `source`."""
    cleaned = token.strip()
    if len(cleaned) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"the token from {source} has {len(cleaned)} characters, fewer than "
            f"{MIN_TOKEN_CHARS}: make one with `python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))'`"
        )
    if len(cleaned) > MAX_TOKEN_CHARS:
        raise TokenError(f"the token from {source} is longer than {MAX_TOKEN_CHARS} characters")
    if not cleaned.isprintable() or any(ch.isspace() for ch in cleaned):
        raise TokenError(f"the token from {source} contains whitespace or control characters")
    return cleaned


def read_token_file(path: str | Path) -> str:
    """The token stored in `path` (one line), or TokenError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"cannot read the token file {str(path)!r}: {exc}") from exc
    return check_token(text, f"the file {str(path)!r}")


def token_from_environment(
    environ: Mapping[str, str], env: str = ENV_TOKEN, env_file: str = ENV_TOKEN_FILE
) -> str | None:
    """The token named by `env` or `env_file` (by default `GRADSYNC_TOKEN` / `_FILE`), or None.

    Both set is refused rather than one silently winning: the two could hold
    different tokens, and the wrong one fails only later, on the other host.

    Raises:
        TokenError: both are set, the file cannot be read, or the token is unusable.
    """
    value, path = environ.get(env), environ.get(env_file)
    if value and path:
        raise TokenError(f"both ${env} and ${env_file} are set: set only one")
    if path:
        return read_token_file(path)
    if value:
        return check_token(value, f"${env}")
    return None


def resolve_token(
    token_file: str | None,
    environ: Mapping[str, str],
    env: str = ENV_TOKEN,
    env_file: str = ENV_TOKEN_FILE,
) -> str | None:
    """The token from its `--...-file` flag when given, else from the environment (see above).

    Raises:
        TokenError: the file or variable is unusable (the message names which).
    """
    if token_file is not None:
        return read_token_file(token_file)
    return token_from_environment(environ, env, env_file)


def resolve_shard_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The shard token from `--shard-token-file`, else `$GRADSYNC_SHARD_TOKEN(_FILE)`, or None."""
    return resolve_token(token_file, environ, ENV_SHARD_TOKEN, ENV_SHARD_TOKEN_FILE)


def shard_session(session: bytes, shard_index: int) -> bytes:
    """What shard `shard_index` knows of a rank's session secret: a keyed one-way derivative.

    The leader sends its shards this, never the session itself, and a worker
    presents the same derivative in its ShardHello. A shard (or whoever reads
    its memory) can then admit that rank's data streams to itself, but cannot
    act for the rank at the leader or at any other shard.
    """
    label = b"gradsync shard session %d" % shard_index
    return hmac.new(session, label, hashlib.sha256).digest()


def beat_proof(session: bytes, job_id: str, rank: int, sequence: int, step: int) -> bytes:
    """What a worker's side-channel heartbeat (BeatRequest) presents: a MAC over the beat.

    Keyed with the rank's session secret (Welcome.session), so only the holder
    of the session can make one, and bound to the job, rank, sequence and step,
    so a beat cannot be moved to another rank or, since the coordinator accepts
    each session's sequences only increasing, replayed.
    """
    label = b"gradsync beat\0%s\0%d\0%d\0%d" % (job_id.encode("utf-8"), rank, sequence, step)
    return hmac.new(session, label, hashlib.sha256).digest()


def beat_matches(
    session: bytes, job_id: str, rank: int, sequence: int, step: int, proof: bytes
) -> bool:
    """Whether `proof` is `beat_proof` of these values (constant time); never for no session."""
    if not session:
        return False
    return hmac.compare_digest(beat_proof(session, job_id, rank, sequence, step), proof)


def read_pem_file(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file (`what`: "--tls-cert", ...), checked to look like PEM.

    Read once at start-up, so a missing or wrong file is reported naming the
    flag before anything listens or connects, not as a handshake failure later.

    Raises:
        TokenError: the file cannot be read, is too large, or holds no PEM block.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TokenError(f"{what}: cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    if len(data) > MAX_PEM_BYTES:
        raise TokenError(f"{what}: {str(path)!r} is larger than {MAX_PEM_BYTES} bytes")
    if b"-----BEGIN " not in data:
        raise TokenError(f"{what}: {str(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def is_loopback(host: str) -> bool:
    """True when `host` reaches only this machine (127.0.0.0/8, ::1, localhost).

    `host` is a bare host ("127.0.0.1", "::1", "[::1]", "localhost") or an address
    with its port ("127.0.0.1:50051", "[::1]:5"); a bare IPv6 address has more than
    one colon, so exactly one colon means a port follows. Any other name counts as
    exposed: what a host name resolves to can change.
    """
    if host.startswith("[") and "]" in host:  # [v6] or [v6]:port
        name = host[1 : host.index("]")]
    else:  # host:port, or a bare host (a bare v6 address has several colons)
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `token` (empty without one)."""
    return () if token is None else ((METADATA_KEY, SCHEME + token),)


def presented_token(invocation_metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token a caller sent in its metadata, or None."""
    for key, value in invocation_metadata or ():
        if key == METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return text[len(SCHEME) :] if text.startswith(SCHEME) else text
    return None


def token_matches(expected: str, presented: str | None) -> bool:
    """True when `presented` equals `expected`, compared in constant time."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def derive_key(token: str, purpose: str) -> bytes:
    """A 32-byte key for `purpose` (e.g. "checkpoint"), derived from the token.

    Keys for different purposes are independent, so a MAC made for one can never
    be replayed as another, and the token itself is never used as a key.
    """
    return hmac.new(
        token.encode("utf-8"), b"gradsync/" + purpose.encode("utf-8"), hashlib.sha256
    ).digest()
