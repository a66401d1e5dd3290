"""How every gradsync client connects: TLS or plaintext channels, and the token.

One `ChannelSecurity` value describes a client's side of transport security:
the CA that issued the server's certificate (TLS), this client's own
certificate and key (mTLS), and the shared token sent as call metadata on
every RPC. Every client builds its channels and call metadata here: the
worker's Sync stream (`gradsync.control.transport`), its shard data streams
(`gradsync.path.shard_streams`), `gradsync status`, the health probe and a
shard's control link to its leader (`gradsync_server.rpc.shard_link`), so none
of them can forget the token or fall back to plaintext on its own.

Settings come from arguments first, then the environment, read when the
value is resolved (at construction of the model wrapper or when a command
starts), never at import: `GRADSYNC_TLS_CA`, `GRADSYNC_TLS_CERT`,
`GRADSYNC_TLS_KEY`, and `GRADSYNC_TOKEN` or `GRADSYNC_TOKEN_FILE`. Every file
is read once, at resolution, so a wrong path is an error naming the setting
before anything connects.

gRPC retries a failed TLS handshake as quietly as a refused connection.
`handshake_failure` tries the same handshake with Python's `ssl` (same
files), so that a wrong CA, an expired certificate or a missing client
certificate becomes an error that says so instead of an endless wait.
"""

from __future__ import annotations

import os
import ssl
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gradsync_proto import auth
from gradsync_proto.net.address import parse_address
from gradsync_proto.net.reachability import CLOSED_AFTER_HANDSHAKE, diagnose

#: The environment variables read by `ChannelSecurity.resolve`.
ENV_TLS_CA = "GRADSYNC_TLS_CA"
ENV_TLS_CERT = "GRADSYNC_TLS_CERT"
ENV_TLS_KEY = "GRADSYNC_TLS_KEY"

#: Words in gRPC's error details that point at TLS rather than at the network.
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "x509")

__all__ = [
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ChannelSecurity",
    "handshake_failure",
    "security_from_args",
]


@dataclass(frozen=True)
class ChannelSecurity:
    """A client's transport security: TLS roots, an optional client certificate, a token.

    Attributes:
        ca_path, cert_path, key_path: the PEM files (for messages and the handshake probe).
        root_certificates: the CA bundle the server's certificate must chain to; None =
            plaintext (no TLS).
        certificate_chain, private_key: this client's certificate and key (mTLS), or None.
        token: the shared secret sent with every call, or None.
    """

    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    root_certificates: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    @classmethod
    def resolve(
        cls,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        *,
        token_file: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ChannelSecurity:
        """Arguments first, then `GRADSYNC_TLS_*` / `GRADSYNC_TOKEN[_FILE]`; files read now.

        Raises:
            ValueError: a file cannot be read or is not PEM, a certificate without its
                key (or the reverse), a client certificate without a CA, or an
                unusable token (the message names the setting).
        """
        env = os.environ if environ is None else environ
        ca = tls_ca or env.get(ENV_TLS_CA) or None
        cert = tls_cert or env.get(ENV_TLS_CERT) or None
        key = tls_key or env.get(ENV_TLS_KEY) or None
        if (cert is None) != (key is None):
            raise ValueError(
                f"a client certificate needs its key: set both tls_cert and tls_key "
                f"(${ENV_TLS_CERT} / ${ENV_TLS_KEY}) or neither"
            )
        if cert is not None and ca is None:
            raise ValueError(
                f"a client certificate (tls_cert / ${ENV_TLS_CERT}) is only sent over TLS: "
                f"also set tls_ca (${ENV_TLS_CA}), the CA that issued the server's certificate"
            )
        try:
            if token is not None:
                secret: str | None = auth.check_token(token, "token=")
            else:
                secret = auth.resolve_token(token_file, env)
            return cls(
                ca_path=ca,
                cert_path=cert,
                key_path=key,
                root_certificates=_read(ca, f"tls_ca / ${ENV_TLS_CA}"),
                certificate_chain=_read(cert, f"tls_cert / ${ENV_TLS_CERT}"),
                private_key=_read(key, f"tls_key / ${ENV_TLS_KEY}"),
                token=secret,
            )
        except auth.TokenError as exc:
            raise ValueError(str(exc)) from None

    @property
    def tls(self) -> bool:
        """Whether channels use TLS."""
        return self.root_certificates is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token, when there is one."""
        return auth.metadata(self.token)

    def describe(self) -> str:
        """How this client connects, in words (never the token)."""
        parts = (["TLS"] if self.tls else ["plaintext"]) + (
            ["client certificate"] if self.certificate_chain else []
        )
        return " + ".join(parts + (["token"] if self.token else []))

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to `target`, secure when TLS is configured."""
        if self.tls:
            return grpc.aio.secure_channel(target, self._credentials(), options=list(options))
        return grpc.aio.insecure_channel(target, options=list(options))

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to `target` (status, health probe), secure when TLS is configured."""
        if self.tls:
            return grpc.secure_channel(target, self._credentials(), options=list(options))
        return grpc.insecure_channel(target, options=list(options))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A Python TLS context with the same trust and client certificate (None: plaintext)."""
        if self.root_certificates is None:
            return None
        context = ssl.create_default_context(cadata=self.root_certificates.decode("ascii"))
        if self.cert_path is not None and self.key_path is not None:
            context.load_cert_chain(self.cert_path, self.key_path)
        return context


def security_from_args(args: Namespace) -> ChannelSecurity:
    """The ChannelSecurity of parsed `add_client_security_flags` flags (env as fallback).

    Raises:
        ValueError: a file is unreadable or the settings do not fit together.
    """
    return ChannelSecurity.resolve(
        args.tls_ca, args.tls_cert, args.tls_key, token_file=args.token_file
    )


def handshake_failure(target: str, security: ChannelSecurity, timeout_s: float = 2.0) -> str | None:
    """Why connecting to `target` fails when TLS is the cause, in words with the remedy; else None.

    With TLS configured: the handshake (with the same files) fails, e.g. an
    untrusted or expired server certificate, or a client certificate missing
    or refused under mTLS. Without TLS: the server speaks TLS. None also when
    the server cannot be reached at all (that is retried: it may not be
    started yet).
    """
    try:
        address = parse_address(target)
        if security.tls:
            context = security.ssl_context()
            reason = diagnose(address.host, address.port, timeout_s, tls=context)
            if reason is None or not reason.startswith("TLS handshake failed"):
                return None
            return f"{reason}; {_remedy(security)}"
        probe = ssl.create_default_context()
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        reason = diagnose(address.host, address.port, timeout_s, tls=probe)
    except (ValueError, OSError):
        return None
    if reason is None or CLOSED_AFTER_HANDSHAKE in reason:
        return (
            "the server speaks TLS and this client does not: set tls_ca "
            f"(${ENV_TLS_CA} or --tls-ca) to the CA that issued its certificate"
        )
    return None


def _remedy(security: ChannelSecurity) -> str:
    if security.cert_path is None:
        return (
            f"check tls_ca / ${ENV_TLS_CA} ({security.ca_path}) against the CA that issued the "
            f"server's certificate; a server that requires client certificates (mTLS) also "
            f"needs tls_cert / tls_key (${ENV_TLS_CERT} / ${ENV_TLS_KEY})"
        )
    return (
        f"check tls_ca / ${ENV_TLS_CA} ({security.ca_path}) against the CA of the server's "
        f"certificate, and that the client certificate {security.cert_path} is unexpired and "
        "issued by the server's --tls-client-ca"
    )


def looks_like_tls(details: str) -> bool:
    """Whether gRPC's error details point at TLS (a handshake, a certificate)."""
    lowered = details.lower()
    return any(word in lowered for word in _TLS_WORDS)


def _read(path: str | None, what: str) -> bytes | None:
    return None if path is None else auth.read_pem_file(path, what)
