"""What binds a stored checkpoint to its job and model, and proves the coordinator wrote it.

A checkpoint store is keyed by job id alone, and job ids are guessable
(`default`): without more, a checkpoint written by another model under the same
id, or planted in a shared Redis, is loaded by every rank of the next start. So
the coordinator seals each checkpoint before saving it, in its metadata (which
the blob format's own checksum already covers):

- `signature_sha256`: a digest of the model signature (parameter and buffer
  names, shapes and dtypes; not the bucket layout, which a different
  `bucket_cap_mb` changes without changing the model). On load it must equal the
  digest of the joining rank's signature.
- `mac` (only when the coordinator has a token): HMAC-SHA256 under
  `derive_key(token, "checkpoint")` over the job id, step, membership epoch,
  signature digest, the other metadata and the payload's SHA-256. On load it must
  verify under the current token. Without a token a checkpoint is *not*
  authenticated (anyone who can write the store can plant one); SECURITY.md says so.

The MAC covers all the metadata, so also the job's lineage the checkpointer adds
(`gradsync_server.store.high_water`: the run, the mark acknowledged before): a MAC
proves the coordinator wrote a checkpoint, the lineage says where it stood in the
job's history, and together they let a rolled-back store be told from a sound one.

Pure logic (hashlib / hmac only): the checkpointer calls it from its worker thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping

from gradsync_proto.v1 import gradsync_pb2 as pb

from gradsync_server.store.checkpoint import Checkpoint, CheckpointHeader, header_json

#: Metadata key of the model-signature digest (hex SHA-256).
SIGNATURE_KEY = "signature_sha256"
#: Metadata key of the HMAC-SHA256 (hex); absent when no token was configured.
MAC_KEY = "mac"
#: The `derive_key` purpose of the checkpoint MAC key.
KEY_PURPOSE = "checkpoint"


def signature_digest(signature: pb.ModelSignature) -> str:
    """Hex SHA-256 of the parameters and buffers of `signature` (names, shapes, dtypes)."""
    model = pb.ModelSignature(parameters=signature.parameters, buffers=signature.buffers)
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def _mac(key: bytes, header: CheckpointHeader, metadata: Mapping[str, str]) -> str:
    """HMAC-SHA256 over every field of `header` (with `metadata`) but the MAC itself."""
    signed = {name: value for name, value in metadata.items() if name != MAC_KEY}
    return hmac.new(key, header_json(header, signed), hashlib.sha256).hexdigest()


def seal(checkpoint: Checkpoint, digest: str, key: bytes | None) -> Checkpoint:
    """`checkpoint` with the signature digest (and, given a key, the MAC) in its metadata."""
    metadata = {name: value for name, value in checkpoint.metadata.items() if name != MAC_KEY}
    metadata[SIGNATURE_KEY] = digest
    if key is not None:
        metadata[MAC_KEY] = _mac(key, checkpoint.header, metadata)
    sealed = dataclasses.replace(checkpoint, metadata=metadata)
    # Same payload: its SHA-256 (hashed for the MAC) serves the blob header too.
    sealed.__dict__["payload_sha256"] = checkpoint.payload_sha256
    return sealed


def authentic(header: CheckpointHeader, key: bytes | None) -> bool:
    """True if `header` carries a MAC that verifies under `key` (False without a key).

    For evidence read from the store (the lineage in a blob's metadata): without a key
    nothing in the store is authenticated, and nothing there can be taken on trust.
    """
    stored_mac = header.metadata.get(MAC_KEY)
    if key is None or not stored_mac:
        return False
    return hmac.compare_digest(_mac(key, header, header.metadata), stored_mac)


def mismatch(
    checkpoint: Checkpoint | CheckpointHeader, digest: str, key: bytes | None
) -> str | None:
    """Why `checkpoint` must not be resumed by a job with signature `digest`, or None.

    Args:
        checkpoint: as loaded from the store (its checksums already verified).
        digest: `signature_digest` of the joining rank's model signature.
        key: the MAC key (None: no token configured, nothing to authenticate).
    """
    header = checkpoint.header if isinstance(checkpoint, Checkpoint) else checkpoint
    stored_digest = header.metadata.get(SIGNATURE_KEY)
    if key is not None:
        if not header.metadata.get(MAC_KEY):
            return (
                "it carries no MAC, but this coordinator has a token: it was written without "
                "one (or planted by someone who cannot sign)"
            )
        if not authentic(header, key):
            return (
                "its MAC does not verify under this coordinator's token: it was written "
                "under another token, or altered or planted since"
            )
    if stored_digest is not None and stored_digest != digest:
        return (
            f"it was saved by a different model (signature digest {stored_digest[:16]}..., "
            f"the joining model's is {digest[:16]}...): same job id, another model"
        )
    return None
