"""W ranks; each issues N async all_reduces of a small tensor back to back, then waits all (a DDP step's buckets)."""
import os, sys, time, json, subprocess
W = int(sys.argv[1]); N = int(sys.argv[2])
if os.environ.get("BURST_RANK") is None:
    from gradsync_proto.net.launch import free_port, local_launch, start_coordinator
    from gradsync_bench.procs import stop_process
    coord, port = start_coordinator(W, launch=local_launch)
    mport = str(free_port())
    try:
        procs = [subprocess.Popen([sys.executable, __file__, str(W), str(N)], env=dict(os.environ, BURST_RANK=str(r), RANK=str(r), WORLD_SIZE=str(W), MASTER_ADDR="127.0.0.1", MASTER_PORT=mport, GRADSYNC_COORDINATOR=f"127.0.0.1:{port}", OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, text=True) for r in range(W)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        stop_process(coord)
    print(outs[0].strip())
    sys.exit(0)
import torch, torch.distributed as dist, gradsync.distributed
torch.set_num_threads(1)
dist.init_process_group("gradsync")
ts = [torch.ones(16384) for _ in range(N)]  # 64 KiB each
for t in ts[:4]: dist.all_reduce(t)
dist.barrier()
res = {}
for rep in range(3):
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works: w.wait()
    burst = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in ts: dist.all_reduce(t)
    serial = time.perf_counter() - t0
    res.setdefault("burst_ms_per_op", []).append(round(burst / N * 1e3, 3))
    res.setdefault("serial_ms_per_op", []).append(round(serial / N * 1e3, 3))
assert torch.equal(ts[0], torch.full((16384,), float(W) ** 7))
print(json.dumps(res))
dist.destroy_process_group()
