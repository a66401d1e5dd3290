"""A donor waits, after sending its state, until the coordinator admitted the ranks it heals.

Under the elastic policy the lowest live rank donates its state at a step
boundary, and the coordinator adds the rejoining ranks to the open step the
moment the state is complete. That is only right while no chunk of that step
has summed anyone yet: every chunk is summed in ascending rank order, and
nothing can be summed before the donor (the lowest rank) contributes.

On a single coordinator the stream keeps that order by itself: the donor's
gradient chunks travel behind its state. A sharded coordinator's other shards
get the donor's chunks on their own streams, and hear of the new membership
from the leader, on another connection; a shard that had summed the donor
before could not add the newcomer in rank order, and the step was aborted for
every rank (or, worse, completed at the shard without the newcomer while the
leader counted it in). So the donor uploads nothing of the step until the
leader's MembershipChanged has reached it: its chunks then carry the new
epoch, and a shard holds a chunk of an epoch it has not heard of until the
leader's view of that epoch arrives (`JobPlane.awaits_leader`), which adds
the newcomers first. The newcomer cannot take part in the step before that
anyway: it waits for the same state.

What the donor cannot tell apart: a membership change for another reason (a
rank lost while the state is in transit) ends the wait early too; a shard may
then sum the donor before the newcomer's view, and aborts the step (safe,
every rank skips it; rare).
"""

from __future__ import annotations

import logging

from gradsync.config import ClientConfig
from gradsync.control.link import SessionLink
from gradsync.errors import GradSyncError

log = logging.getLogger("gradsync.client")


def await_heal_answer(link: SessionLink, config: ClientConfig, step: int) -> None:
    """Block (bounded) until the coordinator used the state this rank just sent.

    An abort of `step` ends the wait too: the coordinator uses no state taken
    for an aborted step (it asks again at a later boundary if newcomers still
    wait). Bounded by half the step timeout, so that the ranks waiting for this
    rank's gradients of `step` still get them in time when no answer comes. A
    failed stream is not raised here: it stays recorded and surfaces at the
    step's next wait, where the model wrapper handles it.
    """
    timeout_s = config.timeout_s / 2
    try:
        answered = link.wait_heal_answer(step, timeout_s)
    except GradSyncError as exc:
        log.warning("rank %d: stopped waiting for its state to be used: %s", config.rank, exc)
        return
    if not answered:
        log.warning(
            "rank %d: the coordinator admitted nobody with its state of step %d within %gs; "
            "training on (a sharded coordinator may abort this step)",
            config.rank,
            step,
            timeout_s,
        )
