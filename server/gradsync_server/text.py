"""Free text from the network, made safe to log and relay (pure logic).

Reasons (Leave.reason, AbandonStep.reason), incarnations and versions come
from peers. Logged raw, a newline in one forges a log line; relayed raw, a
1 MB reason goes to every rank. So every such field is cut to a bounded
length and shown with `repr`, which escapes newlines and control characters
and makes the field's boundaries visible.
"""

from __future__ import annotations

#: Longest free-text reason kept (longer ones are cut, saying how much was dropped).
MAX_REASON_CHARS = 200


def capped(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` cut to at most `limit` characters, noting how many were dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def quoted(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` capped and quoted with repr ("" stays "", so callers can supply a default)."""
    if not text:
        return ""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text) - limit} more characters)"
