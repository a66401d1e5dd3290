"""One rank of a torch.distributed job that meets through the coordinator's store.

It builds a `CoordinatorStore` on the coordinator's address and hands it to
`torch.distributed.init_process_group("gloo", store=...)`: gloo's ranks find
each other through it (nothing of gradsync's stream is used). Then it runs an
all_reduce, a `new_group` and its all_reduce, and a barrier, and saves the
results to --out (.npz). On an error it saves {"error": message} and exits 3.
"""

from __future__ import annotations

import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
import torch.distributed as dist
from gradsync.distributed.store import CoordinatorStore
from gradsync_proto.net.channels import ChannelSecurity
from support import scenarios


def main() -> int:
    parser = scenarios.worker_parser(__doc__)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    # torch's deprecation notices about its own internals are no fault of this script.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")
    time.sleep(args.delay_s)
    rank, world = args.rank, args.world_size
    try:
        store = CoordinatorStore(
            args.coordinator,
            namespace=args.namespace,
            security=ChannelSecurity.resolve(),
            timeout=timedelta(seconds=60),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        total = torch.tensor([rank + 1.0, 10.0 * rank])
        dist.all_reduce(total)
        sub = dist.new_group(list(range(world)))
        again = torch.tensor([2.0**rank])
        dist.all_reduce(again, group=sub)
        dist.barrier()
        backend = dist.get_backend()
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as exc:
        np.savez(args.out, error=np.array(str(exc)))
        return 3
    np.savez(args.out, total=total.numpy(), again=again.numpy(), backend=np.array(backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
