"""`compat.untraced`: torch.compile never traces the wrapper's I/O, and nothing compiled costs
no torch._dynamo import."""

from __future__ import annotations

import subprocess
import sys

import torch
from gradsync import compat


def test_importing_the_wrapper_does_not_import_dynamo() -> None:
    # A fresh interpreter: this test process may have imported dynamo already.
    code = "import sys, gradsync.ddp; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_an_untraced_call_runs_eagerly_on_every_compiled_call() -> None:
    calls: list[bool] = []

    @compat.untraced
    def side_effect() -> None:
        # Traced, this would record True (dynamo's constant), or replay a recorded append.
        calls.append(torch.compiler.is_compiling())

    def step(x: torch.Tensor) -> torch.Tensor:
        side_effect()
        return x * 2

    compiled = torch.compile(step, backend="eager")
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [False, False, False]


def test_an_untraced_call_outside_compile_is_the_function_itself() -> None:
    @compat.untraced
    def double(value: int) -> int:
        return 2 * value

    assert double(21) == 42
    assert double.__name__ == "double"
