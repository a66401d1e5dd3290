"""Checkpoint stores (an embedded file store, Redis) and the sealed checkpoint format."""
