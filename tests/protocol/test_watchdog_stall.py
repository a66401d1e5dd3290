"""A coordinator whose own event loop stood still does not declare its ranks dead for it.

Why: under load, a 1 GB heal blob copied on the coordinator's loop held it
for longer than a 2 s heartbeat timeout; the heartbeats the donor sent
meanwhile waited unread, and the watchdog's next pass declared the donor
dead. Here the loop (the in-process coordinator's and the raw workers')
stands still for longer than the heartbeat timeout: the pass that wakes
late judges nobody, and once the workers' messages are read both ranks
are still members.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from gradsync_proto.v1 import gradsync_pb2 as pb
from support.rawclient import assembled_job, coordinator, run

_BEAT = pb.WorkerMessage(heartbeat=pb.Heartbeat(step=0))


@pytest.mark.timeout(60)
def test_a_stalled_coordinator_loop_declares_no_rank_dead_for_it() -> None:
    async def scenario() -> None:
        async with coordinator(heartbeat_timeout_s=1.0) as (running, channel):
            workers = await assembled_job(channel)
            for worker in workers:
                await worker.send(_BEAT)
            await asyncio.sleep(0.3)
            time.sleep(1.6)  # blocks the loop itself: longer than the heartbeat timeout
            await asyncio.sleep(0.05)  # the watchdog's late pass runs first
            for _ in range(3):  # then the ranks are heard again, and passes judge them
                for worker in workers:
                    await worker.send(_BEAT)
                await asyncio.sleep(0.2)
            assert running.servicer.jobs["job"].members.keys() == {0, 1}
            # Silence the coordinator could hear is still judged: rank 1 stops.
            deadline = time.monotonic() + 10.0
            while 1 in running.servicer.jobs["job"].members:
                assert time.monotonic() < deadline, "a silent rank 1 was never declared dead"
                await workers[0].send(_BEAT)
                await asyncio.sleep(0.2)

    run(scenario)
