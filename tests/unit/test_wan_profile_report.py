"""The wan profiles' reader (`gradsync_bench.wan_profile_report`): py-spy's raw stacks sorted
into kinds per thread, and a round's timeline set against the link's bound."""

from __future__ import annotations

from pathlib import Path

from gradsync_bench.wan_profile_report import kind_of, read_raw, round_lines, thread_table, trim

RAW = """\
thread (0x1): MainThread;main (w.py:1);backward (t.py:2);_engine_run_backward (a.py:3) 60
thread (0x1): MainThread;main (w.py:1);Fragment.wait (d.py:4);Thread.join (t.py:5) 30
thread (0x1): MainThread;main (w.py:1);adam (o.py:6) 10
thread (0x2): gradsync-diloco-round;Thread.run (t.py:1);Int8Quantization.before_upload (q.py:2) 5
thread (0x3): gradsync-diloco-round;Thread.run (t.py:1);Inbox.wait (i.py:2) 20
thread (0x4): Thread-1 (_poll_wrapper);Thread.run (t.py:1) 100
"""


def test_stacks_are_sorted_into_kinds_per_thread_and_scaled_to_the_window(tmp_path: Path) -> None:
    raw = tmp_path / "m-rank0.raw"
    raw.write_text(RAW)
    threads = read_raw(raw)
    # Two threads of one name stay apart (their ids differ).
    assert sorted(threads) == [
        "MainThread (0x1)",
        "Thread-1 (_poll_wrapper) (0x4)",
        "gradsync-diloco-round (0x2)",
        "gradsync-diloco-round (0x3)",
    ]
    assert kind_of(["main", "backward", "_engine_run_backward"]) == "backward"
    assert kind_of(["main", "Fragment.wait", "Thread.join"]) == "waiting for the round"
    assert kind_of(["Thread.run", "Int8Quantization.before_upload"]) == "int8 quantize / dequantize"
    assert kind_of(["Thread._bootstrap", "Thread.run"]) == "idle (blocked thread)"
    table = thread_table(raw, window_s=10.0)
    # 100 samples span the 10 s window: 60 of backward are 6 s, the round thread's 20 are 2 s.
    assert "| MainThread (0x1) | 100 | backward | 60.0% | 6.0 |" in table
    assert "| MainThread (0x1) | 100 | waiting for the round | 30.0% | 3.0 |" in table
    assert "| gradsync-diloco-round (0x3) | 20 | waiting for the round | 100.0% | 2.0 |" in table
    assert not any("_poll_wrapper" in line for line in table)
    top = trim(raw, 2).read_text().splitlines()
    assert top[0].startswith("# py-spy raw stacks of m-rank0.raw: the 2 largest of 6")
    assert top[1].endswith(" 100") and top[2].endswith(" 60")


def test_a_round_is_set_against_its_links_bound() -> None:
    records = [
        {
            "round_timeline": [
                {
                    "fragment": 0,
                    "start_s": 10.0 + rank,
                    "answer_s": 20.0,
                    "sent_bytes": 5_000_000,
                    "received_bytes": 20_000_000,
                }
            ]
        }
        for rank in range(4)
    ]
    link = {"rate_mbit": 100.0, "delay_ms": 25.0, "hub_mbit": None}
    (line,) = round_lines(records, link, 4)
    # 4 x 5 MB at 12.5 MB/s = 1.6 s up; 4 x 20 MB through the coordinator's link = 6.4 s down.
    assert "uploads start 10.0-13.0 s (spread 3.0 s)" in line
    assert "first upload's start to the last answer 10.0 s" in line
    assert "the last upload's start to the answers (mean) 7.0 s" in line
    assert "4 x 5.0 MB up = 1.60 s, 4 x 20.0 MB down = 6.40 s, round trip 0.10 s" in line
    assert (
        "one after the other 8.10 s, answers streaming back while the uploads go on 6.50 s" in line
    )
    hub = round_lines(records, dict(link, hub_mbit=1000.0), 4)[0]
    # With the coordinator host at 1 Gbit/s each worker's own link sets it: 0.4 s and 1.6 s.
    assert "up = 0.40 s" in hub and "down = 1.60 s" in hub
