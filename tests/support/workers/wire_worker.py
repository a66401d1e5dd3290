"""One rank of the 16-bit wire fidelity test: one backward pass per wire configuration.

The model's parameters p_i enter the loss as sum(p_i * g_i), so the local
gradient of p_i is exactly g_i, this rank's `wire_reference.spread_gradients`.
For each wire configuration (a 16-bit dtype, answered in it or, "-fp32", in
float32: `wire_answer_dtype`) the rank writes the gradients the wrapper left in
`.grad` ("<configuration>/<i>") and the local ones it started from ("local/<i>"), so the test
recomputes the references from what the ranks really had.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import wire_reference

#: name: (wire_dtype, wire_answer_dtype), one job each.
CONFIGURATIONS = {
    "bfloat16": (torch.bfloat16, None),
    "float16": (torch.float16, None),
    "bfloat16-fp32": (torch.bfloat16, torch.float32),
    "float16-fp32": (torch.float16, torch.float32),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    torch.set_num_threads(1)
    import gradsync

    local = wire_reference.spread_gradients(args.rank)
    saved = {f"local/{i}": gradient.numpy() for i, gradient in enumerate(local)}
    for name, (wire_dtype, answer_dtype) in CONFIGURATIONS.items():
        parameters = nn.ParameterList(nn.Parameter(torch.zeros_like(g)) for g in local)
        model = gradsync.DistributedDataParallel(
            parameters,
            coordinator=args.coordinator,
            rank=args.rank,
            world_size=args.world_size,
            job_id=f"wire-{name}",
            bucket_cap_mb=0.01,  # one parameter per bucket: several buckets, several chunks
            first_bucket_mb=0.01,
            timeout_s=60,
            join_timeout_s=60,
            wire_dtype=wire_dtype,
            wire_answer_dtype=answer_dtype,
        )
        loss = sum((p * g).sum() for p, g in zip(parameters, local, strict=True))
        loss.backward()
        for i, param in enumerate(parameters):
            assert param.grad is not None
            saved[f"{name}/{i}"] = param.grad.numpy().copy()
        saved[f"meta/{name}/bytes_sent"] = np.array(model.bytes_sent)
        model.close()
    np.savez(args.out, **saved)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
