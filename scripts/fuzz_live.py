"""Fuzz a real `gradsync serve` with random and mutated messages, and print what happened.

    .venv/bin/python scripts/fuzz_live.py --messages 100000 [--token] [--raw-states N]
        [--tls-hellos N]

Starts a coordinator on loopback, sends `--messages` hostile messages over
many concurrent Sync streams (plus Status calls) while a well-behaved two-rank
job checks its averages, then prints a summary: messages, streams, a histogram
of status codes, crashes, violations (UNKNOWN or INTERNAL statuses, statuses
without a message, rejected streams ended with OK, forged log lines), RSS before
/ after / peak and the duration. With `--token` the coordinator requires a
random token ($GRADSYNC_TOKEN): most calls and the legit job present it, about
one in ten presents none or a wrong one and must be refused UNAUTHENTICATED.
With `--raw-states N` it also loads N hostile raw states (a malicious
donor's, relayed or over a real heal socket) into a joiner's model
(tests/support/fuzz_raw_state.py): each must load or be refused with a
`CheckpointMismatchError`. With `--tls-hellos N` it also opens N hostile
connections to the TLS frame port of a second coordinator (TLS and a token):
broken or silent handshakes, HELLOs with wrong tokens, magic, kinds or lengths
(tests/support/fuzz_frame_hello.py); each must end within the first-message
deadline, saying why where it can. Exits 1 when anything went wrong. The fuzzer
itself is tests/support/fuzzing.py (with fuzz_messages.py and
fuzz_coordinator.py; the suite runs both in tests/protocol/test_fuzz_live.py).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.fuzz_frame_hello import run_frame_hello_fuzz
from support.fuzz_raw_state import run_raw_state_fuzz
from support.fuzzing import run_fuzz

#: The most RSS the coordinator may gain over a run, after warm-up.
RSS_GROWTH_LIMIT_MIB = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages to send")
    parser.add_argument("--seed", type=int, default=0, help="random seed (runs are repeatable)")
    parser.add_argument("--lanes", type=int, default=8, help="concurrent stream lanes")
    parser.add_argument(
        "--token",
        action="store_true",
        help="token mode: the coordinator requires a random token; ~10%% of calls lack it",
    )
    parser.add_argument(
        "--raw-states", type=int, default=0, help="hostile raw states a joiner loads (0: none)"
    )
    parser.add_argument(
        "--tls-hellos", type=int, default=0, help="hostile TLS frame-port openings (0: none)"
    )
    parser.add_argument("--log", type=Path, help="coordinator log file (default: a temp dir)")
    parser.add_argument(
        "--reasons", type=int, default=25, help="how many of the commonest status messages to list"
    )
    args = parser.parse_args()
    log = args.log or Path(tempfile.mkdtemp(prefix="gradsync-fuzz-")) / "coordinator.log"
    token = secrets.token_urlsafe(32) if args.token else None
    report = run_fuzz(log, args.messages, seed=args.seed, lanes=args.lanes, token=token)
    print(report.summary())
    if args.reasons:
        print("commonest status messages (numbers shown as N):")
        for reason, count in report.reasons.most_common(args.reasons):
            print(f"  {count:6d}  {reason}")
    growth_mib = (report.rss_after_kib - report.rss_before_kib) / 1024
    failed = (
        not report.alive
        or bool(report.violations)
        or bool(report.legit_error)
        or growth_mib > RSS_GROWTH_LIMIT_MIB
        or report.unauth_refused != report.unauth_calls
        or (report.token and not report.unauth_calls)
    )
    if args.raw_states:
        raw = run_raw_state_fuzz(args.raw_states, seed=args.seed)
        print(raw.summary())
        failed = failed or bool(raw.violations)
    if args.tls_hellos:
        hellos = run_frame_hello_fuzz(Path(tempfile.mkdtemp(prefix="gradsync-fuzz-tls-")),
                                      args.tls_hellos, seed=args.seed)  # fmt: skip
        print(hellos.summary())
        failed = failed or bool(hellos.violations) or not hellos.alive
    print("RESULT", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
