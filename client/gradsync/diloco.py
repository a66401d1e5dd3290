"""`gradsync.DiLoCo`: low-communication training, the outer optimizer on the coordinator.

DiLoCo (Douillard et al., arXiv 2311.08105) trains every rank on its own for
`sync_every` inner steps, then runs one *outer* step: each rank's
pseudo-gradient, the global parameters minus its local ones, is averaged,
and an outer optimizer (SGD with Nesterov momentum) applies that average to
the global parameters, which every rank then continues from. The ranks talk
once per `sync_every` steps instead of every step.

Here the coordinator holds the global parameters and runs the outer
optimizer (`gradsync_server.dataplane.outer`): a rank uploads its
pseudo-gradient as one synchronized "backward pass" of the wrapped
`DistributedDataParallel` (every bucket, overlapped, through the same
coordinator and shards, in float32 or a 16-bit wire), and the answer to
every bucket is the new global parameters, in float32, which it copies into
its model. So every rank holds bitwise the same global model after every
round, whatever the arrival order, and nothing but the coordinator keeps the
outer momentum. The first round after joining seeds the coordinator's global
parameters with the ranks' (identical, after rank 0's broadcast) parameters,
always in float32.

The inner optimizer and its state stay on the rank, untouched. Buffers
(BatchNorm statistics) are not synchronized: each rank keeps its own, as in
DiLoCo.

On a 16-bit wire the rounding error of each pseudo-gradient is kept on the
rank and added to the next one (`error_feedback`, on by default there), so
what the coordinator receives sums to the true pseudo-gradients over rounds.

The answer can be compact too (`answer_dtype`; the default with an int8 wire):
with an int8 wire and `answer_dtype=torch.int8` (a bfloat16 wire and
`answer_dtype=torch.bfloat16`)
the coordinator keeps, beside its exact float32 global parameters, the
*public copy*: the global parameters exactly as the ranks hold them. Every
round it answers with the change exact - public, quantized as the wire is
(int8 with a float32 scale per chunk), and adds the dequantized change to
the public copy, as every rank adds it to its own: the ranks and the public
copy stay bitwise identical, and the next change is taken against the public
copy, so the quantization error is carried forward, never accumulated. The
ranks then hold (and take their pseudo-gradients against) the public copy,
within one quantization step of the exact parameters (int8: scale / 2 per
element, the scale being max|change| / 127 of its chunk). Bytes down per
round: a quarter of float32's for int8 (plus 4 bytes per chunk), half for
bfloat16. The seed round's answer stays exact float32.

Streaming DiLoCo (Douillard et al., 2025): with `fragments=F` the parameters
are cut into F fragments of about equal size, fragment i synchronizes at the
inner steps t with t mod H = i*H/F (staggered, so the link carries one
fragment at a time), and with `overlap_steps=tau` its round stays in flight
for tau inner steps while training goes on; its answer is then merged with
the local progress made meanwhile (`mixing`). Each fragment is a job of its
own on the coordinator (`gradsync.diloco_fragment`).

Stragglers and mixed hardware (`gradsync.diloco_settings` checks the settings;
the coordinator's `gradsync_server.dataplane.rounds` and `late` run them): by
default every round waits for every live rank. With `min_contributors=k` (and
`round_deadline_s`) a round closes once the deadline, counted from its first
contribution, passed and at least k ranks contributed; the others stay in the
job, and their upload for it is *late*: answered with the current global
parameters (the rank continues from them, at the open round), and its
pseudo-gradient dropped (`late="drop"`, the default: every round's average
stays a function of that round's global parameters, as in plain DiLoCo, and
nothing is held for a slow rank) or merged into the next round that starts
after it arrived (`late="merge"`), if at most `max_staleness` rounds old.
With `weighted=True` the average is sum(w_i g_i) / sum(w_i), w_i being the
samples rank i processed since its last round (`step(samples=n)`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsync import defaults
from gradsync.config import ENV_JOB_ID
from gradsync.diloco_fragment import Fragment
from gradsync.diloco_metrics import DiLoCoInstruments, RoundRecord
from gradsync.diloco_settings import (
    check_outer,
    check_samples,
    check_screen,
    compact_answer_dtype,
    flatten_options,
    outer_optimizer,
    straggler_settings,
    streaming_mixing,
)
from gradsync.diloco_sites import SiteFollower, SiteFragment, SiteLayout
from gradsync.metrics import ENV_METRICS_HOST, resolve_metrics_port
from gradsync.sparse_wire import SparseWire, default_outer_momentum, sparse_settings

__all__ = ["DiLoCo"]


class DiLoCo:
    """Synchronize `model` every `sync_every` inner steps through an outer optimizer.

    Args:
        model: the module to train (not wrapped: forward it directly).
        inner_optimizer: the rank's own optimizer over `model`'s parameters (kept
            for reference and checkpoints; `DiLoCo` never steps it).
        sync_every: inner steps between two rounds of each fragment (H).
        outer_lr: the outer optimizer's learning rate.
        outer_momentum: its momentum (0 = plain outer SGD; None: 0.5, or 0 with a
            `SparseWire`, whose error feedback already carries what a round left out).
        nesterov: Nesterov momentum (as torch.optim.SGD); ignored at momentum 0.
            The defaults, outer_lr=1.0 and outer_momentum=0.5 with Nesterov for every
            H, keep an outer step within lr / (1 - momentum) = 2 averaged
            pseudo-gradients. Measured on a W = 4 char-level transformer over 2,000
            inner steps (docs/diloco.md, "Model quality"), they held the held-out
            loss within 1.8 % of DDP's at H = 10 and 4.4 % at H = 50 (0.7 and 0.9:
            5.5 % and 7.8 %; plain averaging, 1.0 and 0: 5.8 % and 8.5 %). Momentum
            0.9 remembers about 10 rounds, too long over a few hundred rounds; tune
            again for very long runs or large H.
        wire_dtype: pseudo-gradients on the wire: None (float32), torch.bfloat16,
            torch.float16 or torch.int8 (a float32 scale per chunk; float32 parameters
            only, and no `hierarchical`). The global parameters come back in float32
            unless `answer_dtype` says otherwise. Or `gradsync.SparseWire(density)`:
            each chunk's top `density` elements, 2 bits each, with error feedback,
            answered sparse too (`gradsync.sparse_wire`; same limits as int8).
        answer_dtype: "auto" (default: torch.int8 with the int8 wire, unless
            `min_contributors` is set; else None), None (the new global parameters
            in float32, exact), torch.int8 (needs wire_dtype=torch.int8) or
            torch.bfloat16 (needs wire_dtype=torch.bfloat16): every answer after the
            seed is then the change of the global parameters the ranks hold,
            quantized, a quarter (half) of the bytes down; the ranks hold the
            coordinator's public copy, within one quantization step of its exact
            parameters (see the module docstring). Part of the job's signature:
            every rank must resolve the same. No `hierarchical`, and not yet with
            `min_contributors` (a late rank is answered with the global parameters,
            not the public copy). A compact answer's outer state is not saved to the
            store: a restarted coordinator reseeds from the ranks' copy, with the
            outer momentum at zero (pass None to keep it across restarts).
        error_feedback: keep each round's rounding error and add it to the next
            pseudo-gradient (default: on with a 16-bit wire; meaningless without).
        fragments: F, the number of fragments synchronized at staggered steps (1 = the
            whole model at once, plain DiLoCo).
        overlap_steps: tau, inner steps a round stays in flight before its answer is
            merged (0 = the round blocks `step`); must be below `sync_every`.
        mixing: the share of the global parameters in that merge (p = mixing * global
            + (1 - mixing) * local); default 1 without overlap, 0.5 with.
        min_contributors: k; a round may close with k ranks' contributions instead of
            every live rank's (None = every rank, the default; with only
            `round_deadline_s` given: 1). The others' contributions are late. Needs
            `fragments=1`, an unsharded coordinator and flat ranks (`hierarchical` is
            turned off).
        round_deadline_s: seconds from a round's first contribution after which it
            closes with `min_contributors` (None: 0 when `min_contributors` is given,
            i.e. as soon as k contributed; checked every ~0.25 s at the coordinator).
            A rank whose upload is under way then is waited for. "auto": the grace
            window follows the recent spread of the ranks' arrivals (median + 3 MAD of
            each round's arrival times, the median over the last 3 rounds, at least
            0.5 s; none, i.e. every rank waited for, until a round closed with all:
            `gradsync_server.dataplane.grace`); the coordinator logs who missed it and
            exports `gradsync_round_window_seconds` and `gradsync_round_missed_total`.
        late: what becomes of a late contribution: "drop" (the default; the rank still
            gets the global parameters) or "merge" (added into the next round that
            starts after it arrived, as one more contribution).
        max_staleness: with late="merge", the oldest contribution merged, in rounds
            (default 1: only into the round right after its own); older ones are dropped.
        weighted: average sum(w_i g_i) / sum(w_i) with w_i the samples rank i processed
            since its last round (`step(samples=...)`; 1 per inner step if not given)
            instead of the plain mean.
        screen: how the coordinator screens every rank's pseudo-gradient (the same on
            every rank): "report" (the default: a contribution far from the others, by
            norm or direction, is merged and its rank named in the coordinator's log,
            metrics and status and warned on its own worker), "clip" (scaled down to 2x
            the median norm), "exclude" (left out of the round; a rank excluded 3
            rounds in a row is left out for 10), "trimmed_mean" or "median"
            (coordinate-wise robust merges). See docs/trust.md.
        coordinator: as `DistributedDataParallel` (default $GRADSYNC_COORDINATOR).
        rank: as `DistributedDataParallel` (default $RANK).
        world_size: as `DistributedDataParallel` (default $WORLD_SIZE).
        job_id: as `DistributedDataParallel` (default $GRADSYNC_JOB_ID or "default").
        metrics_port: Prometheus metrics of the rounds (`gradsync_diloco_*`: rounds,
            round seconds, bytes up and down, exposed wait, contributors), as
            `DistributedDataParallel`'s and with the same environment variables.
        metrics_host: the interface of those metrics, as `DistributedDataParallel`'s.
        trace_path: a Chrome trace of the rounds (each fragment's round on the
            transport track, the inner loop's waits for them on the other).
        replica_group: a process group of the ranks that train one replica together
            (a site: FSDP2, DDP or a plain module inside; `gradsync.diloco_sites`).
            The rounds then run between `replicas` sites instead of between ranks:
            `rank` and `world_size` are not used, and every rank of the site calls
            `step` alike. None (the default): every rank is a replica.
        replica: with `replica_group`, this site's index in [0, replicas).
        replicas: with `replica_group`, the number of sites.
        **options: any other keyword argument of `DistributedDataParallel`
            (`token`, `tls_ca`, `timeout_s`, `bucket_cap_mb`, ...).

    Raises:
        ValueError: a setting out of range (naming it and its value).
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int = 50,
        outer_lr: float = 1.0,
        outer_momentum: float | None = None,
        *,
        nesterov: bool = True,
        wire_dtype: torch.dtype | SparseWire | None = None,
        answer_dtype: torch.dtype | str | None = "auto",
        error_feedback: bool | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        mixing: float | None = None,
        min_contributors: int | None = None,
        round_deadline_s: float | str | None = None,
        late: str = "drop",
        max_staleness: int | None = None,
        weighted: bool = False,
        screen: str = "report",
        coordinator: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        job_id: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        trace_path: str | Path | None = None,
        replica_group: Any = None,
        replica: int | None = None,
        replicas: int | None = None,
        **options: Any,
    ) -> None:
        outer_momentum = default_outer_momentum(outer_momentum, wire_dtype)
        sparse, wire_dtype, answer_dtype = sparse_settings(wire_dtype, answer_dtype)
        check_outer(sync_every, outer_lr, outer_momentum, wire_dtype, error_feedback)
        answer_dtype = compact_answer_dtype(wire_dtype, answer_dtype, min_contributors)
        port = resolve_metrics_port(metrics_port, os.environ)  # a bad value fails before joining
        mixing = streaming_mixing(sync_every, fragments, overlap_steps, mixing)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.overlap_steps = overlap_steps
        self.mixing = mixing
        outer = outer_optimizer(
            outer_lr,
            outer_momentum,
            nesterov,
            answer_dtype,
            straggler_settings(
                min_contributors, round_deadline_s, late, max_staleness, weighted, world_size
            ),
        )
        outer.screen = check_screen(screen)
        if sparse is not None:  # the coordinator's answers are sparse too
            outer.answer_density = sparse.downlink_density
        feedback = wire_dtype is not None if error_feedback is None else error_feedback
        flatten_options(outer, fragments, wire_dtype, answer_dtype, options)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params: list[torch.Tensor] = [p for _, p in named]
        base = job_id or os.environ.get(ENV_JOB_ID) or defaults.JOB_ID
        site: SiteLayout | None = None
        if replica_group is not None:
            site = SiteLayout(replica_group, replica, replicas, named)
            params, base = site.params, site.job_id(base)
            rank, world_size = replica, replicas
        elif replica is not None or replicas is not None:
            raise ValueError("replica= and replicas= need replica_group= (the site's group)")
        self.site = site
        # A site's ranks cut their shards where the whole parameters are cut: fragment i
        # holds the same parameters on every rank of the site.
        groups = _split(params, fragments, site.full_bytes if site is not None else None)
        common = dict(options, coordinator=coordinator, rank=rank, world_size=world_size)
        self.fragments: list[Fragment] = []
        try:
            start = 0
            for index, group in enumerate(groups):
                name = base if len(groups) == 1 else f"{base}.fragment{index}"
                args = (group, outer, wire_dtype, feedback, name, common, answer_dtype)
                if site is None:
                    fragment = Fragment(*args, sparse=sparse)
                elif not site.uploads:
                    fragment = SiteFollower(site, group, outer.weighted)
                else:
                    names = site.shadow_names(site.names[start : start + len(group)])
                    fragment = SiteFragment(site, *args, names, sparse)
                start += len(group)
                self.fragments.append(fragment)
            if site is not None:
                site.agree_on_round(self.fragments)
        except BaseException:
            for fragment in self.fragments:
                fragment.close()
            raise
        leader = self.fragments[0]
        #: This replica's rank and the number of replicas (sites, with `replica_group`).
        self._rank, self._world_size = (
            (site.replica, site.replicas)
            if site is not None
            else (leader.ddp.rank, leader.ddp.world_size)
        )
        self._instruments = DiLoCoInstruments(
            self.rank,
            port,
            Path(trace_path) if trace_path is not None else None,
            metrics_host or os.environ.get(ENV_METRICS_HOST) or None,
        )
        #: Inner step at which each fragment's round in flight is merged.
        self._apply_at: dict[int, int] = {}
        #: Inner step at which each fragment's round in flight started.
        self._started_at: dict[int, int] = {}
        #: Inner steps taken (calls of `step`).
        self.inner_steps = 0
        #: Fragment rounds merged (the seeds not counted; F = 1: the outer rounds).
        self.rounds = 0
        #: Samples processed since each fragment's last round (`step(samples=...)`).
        self._samples = [0.0] * len(self.fragments)

    @property
    def rank(self) -> int:
        """This replica's rank among the replicas (with `replica_group`: the site's index)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of replicas (with `replica_group`: of sites)."""
        return self._world_size

    @property
    def last_round_bytes(self) -> int:
        """Bytes the latest round of every fragment uploaded, together."""
        return sum(f.last_round_bytes for f in self.fragments)

    @property
    def last_round_s(self) -> float:
        """Seconds of the longest of the fragments' latest rounds."""
        return max(f.last_round_s for f in self.fragments)

    @property
    def last_round_contributors(self) -> int:
        """Ranks whose on-time contributions the latest round averaged (fewest over the
        fragments); 0 if this rank's own was late (see `last_round_late`)."""
        return min(f.last_report.contributors for f in self.fragments)

    @property
    def last_round_merged_late(self) -> int:
        """Late contributions (of earlier rounds) merged into the latest round."""
        return max(f.last_report.merged_late for f in self.fragments)

    @property
    def last_round_staleness(self) -> int:
        """The stalest of those, in rounds (0: none merged)."""
        return max(f.last_report.staleness for f in self.fragments)

    @property
    def last_round_late(self) -> bool:
        """True if the latest round closed without this rank (it got the global parameters)."""
        return any(f.last_report.next_step for f in self.fragments)

    def step(self, samples: float | None = None) -> bool:
        """Count one inner step; start and merge the rounds it is due. True if one merged.

        Args:
            samples: the samples this inner step processed (its batch size), for
                `weighted` rounds; None counts 1. Ignored unweighted.

        Raises:
            ValueError: `samples` is negative or not finite, or a weighted round is due
                after no sample at all.
        """
        counted = check_samples(samples, self.inner_steps)
        self._samples = [total + counted for total in self._samples]
        self.inner_steps += 1
        self._instruments.inner_step()
        t, count = self.inner_steps, len(self.fragments)
        merged = False
        for index, fragment in enumerate(self.fragments):
            if self._apply_at.get(index) == t:
                merged |= self._merge(index, self.mixing)
            if t % self.sync_every != index * self.sync_every // count:
                continue
            if fragment.in_flight:  # (cannot happen while tau < H)
                merged |= self._merge(index, self.mixing)
            fragment.start(weight=self._round_weight(index))
            self._started_at[index] = t
            if self.overlap_steps == 0:
                merged |= self._merge(index, 1.0)
            else:
                self._apply_at[index] = t + self.overlap_steps
        return merged

    def _round_weight(self, index: int) -> float:
        """Fragment `index`'s weight for the round it starts now; its count starts again."""
        weight, self._samples[index] = self._samples[index], 0.0
        if self.fragments[index].weighted and not weight > 0:
            raise ValueError(
                f"rank {self.rank}: a weighted round is due at inner step {self.inner_steps} "
                f"after {weight:g} samples since the last one; pass step(samples=n) with n > 0"
            )
        return weight

    def _merge(self, index: int, mixing: float) -> bool:
        fragment = self.fragments[index]
        waited = time.perf_counter()
        fragment.apply(mixing)
        waited = time.perf_counter() - waited
        self._apply_at.pop(index, None)
        self.rounds += 1
        record = RoundRecord(
            fragment=index,
            inner_step=self._started_at.pop(index, self.inner_steps),
            started=fragment.last_round_started,
            finished=fragment.last_round_finished,
            sent_bytes=fragment.last_round_bytes,
            received_bytes=fragment.last_round_received,
            contributors=fragment.last_report.contributors,
            exposed_s=waited,
            late=bool(fragment.last_report.next_step),
            merged_late=fragment.last_report.merged_late,
            staleness=fragment.last_report.staleness,
        )
        self._instruments.round_merged(record, self.rounds)
        return True

    def sync(self) -> None:
        """Merge every round in flight, then run one more round of every fragment, now."""
        for index, fragment in enumerate(self.fragments):
            if fragment.in_flight:
                self._merge(index, self.mixing)
            fragment.start(weight=self._round_weight(index) if fragment.weighted else 1.0)
            self._started_at[index] = self.inner_steps
            self._merge(index, 1.0)

    def close(self) -> None:
        """Leave the job (as `DistributedDataParallel.close`); a round in flight is dropped."""
        try:
            for fragment in self.fragments:
                fragment.close()
        finally:
            self._instruments.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _split(
    params: list[torch.Tensor], fragments: int, sizes: list[int] | None = None
) -> list[list[torch.Tensor]]:
    """Cut `params` (in order) into `fragments` runs of about equal bytes (`sizes`, if
    given: each parameter's), none empty."""
    if sizes is None:
        sizes = [p.numel() * p.element_size() for p in params]
    total = sum(sizes)
    groups: list[list[torch.Tensor]] = [[]]
    filled = 0
    for position, (p, size) in enumerate(zip(params, sizes, strict=True)):
        left = len(params) - position  # parameters left, this one included
        open_groups = fragments - len(groups)  # groups still to start after this one
        if groups[-1] and (filled >= total * len(groups) / fragments or left <= open_groups):
            groups.append([])
        groups[-1].append(p)
        filled += size
    return groups
