"""One synchronized backward pass of `gradsync.DistributedDataParallel`, hook to `.grad`.

Each parameter's post-accumulate-grad hook lands here: the parameter is
marked used, and a bucket whose last gradient arrived is handed to the
reducer (`gradsync.path.reducer`), which uploads it while autograd computes
earlier layers. The end-of-backward callback flushes the rest, waits
(bounded) for every average, moves them into `.grad` and moves on to the
next step; a lost coordinator is reconnected to through the session
(`gradsync.control.session`) and surfaces as `CoordinatorRestartedError`.

Kept apart from `gradsync.ddp` (the nn.Module face: DDP's arguments,
forward, collectives, lifecycle) because this is the per-step state machine
(the step index, whether a backward pass is in flight, the errors its hooks
recorded) and the hot path: hooks only record, and failures are raised at
the one sync point, the end of backward.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from gradsync.control.link import SessionLink
from gradsync.control.session import Session
from gradsync.errors import (
    CoordinatorUnavailableError,
    GradSyncError,
    StepAbortedError,
)
from gradsync.instruments import Instruments
from gradsync.path.gradient_path import GradientPath
from gradsync.path.reducer import Reducer

log = logging.getLogger("gradsync.client")

#: The least time between two warnings that the screen flagged this rank's gradients.
SCREEN_WARNING_INTERVAL_S = 10.0


class StepPath:
    """The step a wrapper is at and the backward pass that synchronizes it.

    Args:
        reducer: the wrapper's buckets (stages, uploads and writes back averages).
        instruments: step timing, metrics and trace.
        session: owns the link (a reconnect replaces it), reconnects, and holds the
            config (rank, for error messages; timeout_s, the bound on a step's wait).
        overlap: upload each bucket as soon as its gradients are ready.
        step: the step to start at (the session's start step).
    """

    def __init__(
        self,
        reducer: Reducer,
        instruments: Instruments,
        session: Session,
        overlap: bool,
        step: int,
    ) -> None:
        self._reducer = reducer
        self._instruments = instruments
        self._session = session
        self._rank = session.config.rank
        self._timeout_s = session.config.timeout_s
        self._overlap = overlap
        #: Index of the next synchronized step (synced backward passes so far).
        self.step = step
        #: A synchronized backward pass has started and not yet finished.
        self.backward_active = False
        #: Backward passes synchronized so far by this wrapper.
        self.synced_steps = 0
        #: The number of ranks the last step was averaged over.
        self.last_contributors = 0
        self._errors: list[Exception] = []
        #: Warn when the coordinator's screen flagged this rank's gradients (DiLoCo warns
        #: per round itself); at most once per SCREEN_WARNING_INTERVAL_S.
        self.warn_screened = True
        self._screen_warned_at = -math.inf
        self._screen_unwarned = 0
        # A rank that reconnects keeps each step's uploads, to send them again to a
        # coordinator that continued at this step (no step computed twice).
        reducer.keep_for_resend = session.reconnect_timeout_s > 0

    @property
    def _link(self) -> SessionLink:
        """The current session link (heartbeats' step, step reports); a reconnect replaces it."""
        return self._session.link

    @property
    def _path(self) -> GradientPath:
        """The current gradient path (a reconnect replaces it)."""
        return self._session.path

    def gradient_ready(self, index: int, require_sync: bool) -> None:
        """Autograd hook body: mark the parameter used, launch full buckets. Never raises."""
        self._reducer.mark_used(index)
        if not require_sync or self._reducer.bucket_of[index] < 0:
            return
        try:
            if not self.backward_active:
                self.backward_active = True
                self._instruments.backward_started(self.step)
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._reducer.gradient_ready(index, self.step, self._overlap)
        except Exception as exc:  # raised at the end of backward, with context
            self._errors.append(exc)

    def finish_backward(self) -> None:
        """End-of-backward callback: flush, wait for averages, write them to .grad."""
        step = self.step
        try:
            try:
                self._reducer.launch_rest(step)
            except Exception as exc:  # a hook's or a staging failure: raised with context below
                self._errors.append(exc)
            if self._errors:
                error = self._errors[0]
                raise GradSyncError(
                    f"preparing gradients for upload failed: {error}", rank=self._rank, step=step
                ) from error
            self.last_contributors = self._reducer.finish(step, self._wait_step)
            self.synced_steps += 1
            if self.warn_screened:
                self._warn_screened(step)
        finally:
            self._end_step(step)

    def _warn_screened(self, step: int) -> None:
        """Log what the coordinator's screen said of this rank's gradients in `step`, if
        anything (rate-limited: a rank flagged every step warns every few seconds)."""
        screened = self._path.round_report().screened
        if not screened:
            return
        now = time.monotonic()
        if now - self._screen_warned_at < SCREEN_WARNING_INTERVAL_S:
            self._screen_unwarned += 1
            return
        since = f" ({self._screen_unwarned} more flagged steps since the last warning)"
        log.warning(
            "rank %d: the coordinator's screen flagged this rank's gradients in step %d: %s%s",
            self._rank,
            step,
            screened,
            since if self._screen_unwarned else "",
        )
        self._screen_warned_at, self._screen_unwarned = now, 0

    def abandon(self, reason: str) -> None:
        """Tell the coordinator to abort the step in flight for every rank, and move on."""
        step = self.step
        log.warning("rank %d: abandoning step %d: %s", self._rank, step, reason)
        self._path.abandon_step(step, reason)
        self._end_step(step)

    def _wait_step(self, step: int) -> int:
        """Wait for the averages of `step`; reconnect to a restarted coordinator if lost.

        When the job went on at this very step with every rank's own state, the
        step's buckets are uploaded again from what was kept (`Reducer.resend`):
        the restart costs the upload, not a recomputed step. Otherwise (state
        restored from a checkpoint or from a rank ahead) the step is over for
        this rank: `CoordinatorRestartedError` says where to continue.
        """
        wait_started = self._instruments.now()
        while True:
            try:
                contributors = self._path.wait_step(step, self._timeout_s)
                break
            except StepAbortedError as exc:
                self._instruments.step_aborted(exc)
                raise
            except CoordinatorUnavailableError as exc:
                resumed_at, restarted = self._session.recover(exc, self.step, "a backward pass")
                if restarted is None:
                    # (Only when reconnecting, which is also when the uploads are kept.)
                    log.warning("rank %d: uploading step %d again", self._rank, step)
                    self._reducer.resend(step)
                    continue
                self.step = resumed_at - 1  # `_end_step` moves on to the resumed step
                raise restarted from exc
        self._instruments.step_done(step, wait_started, self._link.step_report())
        return contributors

    def _end_step(self, step: int) -> None:
        """Forget this step's staging and usage marks and move on to the next step."""
        if self.step != step:  # a reconnect moved the step
            step = self.step
        self._session.donor.release()  # a joiner read the live state meanwhile: done
        self._reducer.reset()
        self._errors.clear()
        self.backward_active = False
        self.step = step + 1
        self._link.current_step = self.step
