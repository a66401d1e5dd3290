"""Bytes up and down per DiLoCo round: the float32 answer against the int8 answer, on the socket.

    python -m gradsync_bench.answer_bytes [--mb 16] [--extra-rounds 2]

A real `gradsync serve` (world size 2) and two real rank processes, each
training a bias-free linear layer of `--mb` MiB of float32 parameters with
`gradsync.DiLoCo(wire_dtype=torch.int8)`, once with the default answer (the
new global parameters in float32) and once with `answer_dtype=torch.int8`.
Every rank connects through a TCP relay that counts the bytes of each
direction as they cross the socket (gRPC and HTTP/2 framing, headers and
heartbeats included). Joining, rank 0's broadcast and the seed round (in
float32 either way) cost the same for both settings, so each setting runs
twice, with 1 and with 1 + `--extra-rounds` rounds, and the difference divided
by the extra rounds is what one round costs. Prints one row per setting, per
rank: bytes up and down per round.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading

import torch
from gradsync_proto.net.launch import start_coordinator

from gradsync_bench.procs import stop_process, wait_ranks

#: Bound on one job (join, broadcast, seed and the rounds of a 16 MiB model on a loaded CPU).
JOB_TIMEOUT_S = 300.0
#: Inner steps per round (the model's size, not H, decides the bytes).
SYNC_EVERY = 2
WORKER = (sys.executable, "-m", "gradsync_bench.answer_bytes", "--worker")


class CountingRelay:
    """A TCP relay on 127.0.0.1 that counts the bytes each direction carries.

    Args:
        target_port: the coordinator's port on 127.0.0.1.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        #: Bytes from the ranks to the coordinator, and back.
        self.up = 0
        self.down = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", self.target_port), timeout=30
        )
        await asyncio.gather(
            self._pipe(reader, upstream_writer, up=True),
            self._pipe(upstream_reader, writer, up=False),
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                if up:
                    self.up += len(data)
                else:
                    self.down += len(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def run_job(answer: str, rounds: int, megabytes: int) -> tuple[int, int]:
    """Bytes (up, down) of one whole job, both ranks together, as the relay counted them."""
    coordinator, port = start_coordinator(2)
    relay = CountingRelay(port)
    ranks = [
        subprocess.Popen(
            [
                *WORKER,
                *("--rank", str(rank), "--coordinator", f"127.0.0.1:{relay.port}"),
                *("--answer", answer, "--rounds", str(rounds), "--mb", str(megabytes)),
            ]
        )
        for rank in range(2)
    ]
    try:
        wait_ranks(ranks, JOB_TIMEOUT_S, lambda _, code, __: f"a rank exited with {code}")
    finally:
        stop_process(coordinator)
        relay.close()
    return relay.up, relay.down


def worker(rank: int, coordinator: str, answer: str, rounds: int, megabytes: int) -> None:
    """One rank: DiLoCo with an int8 wire over a `megabytes` MiB linear layer."""
    import gradsync  # the worker's own import: the parent only counts bytes

    side = int((megabytes * 2**20 / 4) ** 0.5)
    torch.manual_seed(rank)
    model = torch.nn.Linear(side, side, bias=False)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(100 + rank)
    with gradsync.DiLoCo(
        model,
        inner,
        sync_every=SYNC_EVERY,
        wire_dtype=torch.int8,
        answer_dtype=torch.int8 if answer == "int8" else None,
        coordinator=coordinator,
        rank=rank,
        world_size=2,
        job_id=f"answer-{answer}-{rounds}",
        timeout_s=120,
    ) as diloco:
        for _ in range(rounds * SYNC_EVERY):
            x = torch.randn(8, side, generator=generator)
            inner.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            inner.step()
            diloco.step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=16, help="model size in MiB of float32")
    parser.add_argument("--extra-rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    parser.add_argument("--answer", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rank, args.coordinator, args.answer, args.rounds, args.mb)
        return 0
    side = int((args.mb * 2**20 / 4) ** 0.5)
    print(f"model: {side} x {side} float32 = {side * side * 4:,} bytes; W = 2; int8 wire")
    print(f"{'answer':<8}{'up B/round/rank':>18}{'down B/round/rank':>20}{'down/up':>9}")
    for answer in ("fp32", "int8"):
        up_1, down_1 = run_job(answer, 1, args.mb)
        up_n, down_n = run_job(answer, 1 + args.extra_rounds, args.mb)
        up = (up_n - up_1) / args.extra_rounds / 2
        down = (down_n - down_1) / args.extra_rounds / 2
        print(f"{answer:<8}{up:>18,.0f}{down:>20,.0f}{down / up:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
