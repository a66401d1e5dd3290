"""The netns suite's 16-bit wire option: flag to plan to methods, and its table (no network)."""

from __future__ import annotations

import pytest
from gradsync.arguments import build_parser
from gradsync_bench.plan_args import plan_from_args
from gradsync_bench.sync_worker import GRADSYNC_METHODS, JOB_SUFFIX
from gradsync_bench.wire_report import DDP_BF16, WIRES, markdown_lines

pytestmark = pytest.mark.unit


def row(**methods: float) -> dict[str, object]:
    """A netns row with the given methods' median times (ms)."""
    return {
        "layout": "dedicated",
        "world_size": 4,
        "shards": 4,
        "megabytes": 16.0,
        "gradsync_of_bound": 0.8,
        **{name: {"median_ms": ms} for name, ms in methods.items()},
    }


def test_the_wire_flag_reaches_the_plan() -> None:
    args = build_parser().parse_args(["bench", "--suites", "netns", "--netns-wires", "bf16,fp16"])
    assert plan_from_args(args).netns_wires == ("bf16", "fp16")
    default = build_parser().parse_args(["bench", "--suites", "netns"])
    assert plan_from_args(default).netns_wires == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--netns-wires", "int4"])


def test_every_wire_is_a_flat_gradsync_job_of_its_own() -> None:
    for wire in WIRES:
        hierarchical, dtype = GRADSYNC_METHODS[wire]
        assert not hierarchical and dtype is not None
        assert str(dtype) == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[wire]
        assert JOB_SUFFIX[wire]  # never the fp32 job's id
    assert len(set(JOB_SUFFIX.values())) == len(JOB_SUFFIX)


def test_the_table_shows_ratios_to_fp32_and_to_ddp() -> None:
    lines = markdown_lines([row(gradsync=1000, gloo=1100, bf16=520, **{DDP_BF16: 650})])
    table = "\n".join(lines)
    assert "| dedicated | 4 | 4 | 16 | 1000 (80%) | 520 (0.52) | 1100 | 650 | 0.80 |" in table
    assert "fp16" not in table.split("\n")[2]  # only the wires that were timed


def test_rows_without_a_16_bit_wire_make_no_table() -> None:
    assert markdown_lines([row(gradsync=1000, gloo=1100)]) == []
