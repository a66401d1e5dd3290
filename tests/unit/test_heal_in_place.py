"""A joiner reads a donor's offered state straight into its own parameters, bitwise.

Real loopback sockets in one process (`gradsync.control.heal_channel`): the
donor offers its live state without waiting (as at a step boundary), the
joiner fetches it through `state_load.load_module_state`, and its module must
then hold the donor's bytes in its own memory (the same storage as before:
no second copy, no fresh pages), its optimizer the donor's moments, and the
buffers the value they had at the boundary even if a forward pass changed
the donor's since. A model that loads its state some other way, or does not
fit, takes the generic path.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from gradsync.control import heal_channel, state_load
from gradsync.errors import CheckpointMismatchError
from torch import nn


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    module(torch.randn(16, 64)).square().mean().backward()
    optimizer.step()
    return module, optimizer


def _offered(module: nn.Module, optimizer: torch.optim.Optimizer) -> heal_channel.StateOffer:
    """The donor's offer as `send_heal_state` makes it at a step boundary (nothing waited)."""
    state = state_load.live_state(module, optimizer, 7, 2)
    state["module"] = state_load._buffers_copied(module, state["module"])
    return heal_channel.StateOffer(state, serve_s=30.0)


def _flat(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> list[bytes]:
    state = optimizer.state_dict()["state"]
    return [
        value.reshape(-1).view(torch.uint8).numpy().tobytes()
        for index in sorted(state)
        for value in state[index].values()
    ]


def test_a_joiner_reads_the_state_into_its_own_parameters_bitwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    donor, donor_optimizer = _model(seed=1)
    expected = _flat(donor.state_dict())
    offer = _offered(donor, donor_optimizer)
    try:
        with torch.no_grad():  # a forward pass changes the donor's buffers after its boundary
            donor[1].running_mean.add_(1.0)  # type: ignore[operator]
        joiner = _model(seed=2)[0]
        storage = {name: t.data_ptr() for name, t in joiner.state_dict().items()}
        assert _flat(joiner.state_dict()) != expected
        with caplog.at_level(logging.INFO, logger="gradsync.client"):
            optimizer_state = state_load.load_module_state(offer.offer(), joiner, "j", 1, 7)
        assert "into its own parameters" in caplog.text
        assert _flat(joiner.state_dict()) == expected  # the buffers as at the boundary
        assert {n: t.data_ptr() for n, t in joiner.state_dict().items()} == storage
        joiner_optimizer = torch.optim.Adam(joiner.parameters(), lr=1e-2)
        joiner_optimizer.load_state_dict(optimizer_state)
        assert _optimizer_bytes(joiner_optimizer) == _optimizer_bytes(donor_optimizer)
        # Released at the end of the step the joiner entered: the offer ends, and
        # nobody reads the donor's tensors once they change.
        offer.release(wait_s=10.0)
        with pytest.raises(CheckpointMismatchError, match="could not read a live rank"):
            state_load.load_module_state(offer.offer(), joiner, "j", 1, 7, timeout_s=5.0)
    finally:
        offer.close()


def test_an_offer_nobody_came_for_is_served_from_a_snapshot_once_released() -> None:
    donor, donor_optimizer = _model(seed=1)
    expected = _flat(donor.state_dict())
    offer = _offered(donor, donor_optimizer)
    try:
        offer.release(wait_s=10.0)  # the step ended before any joiner came
        with torch.no_grad():
            for parameter in donor.parameters():
                parameter.add_(1.0)  # optimizer.step(): the live tensors change
        joiner = _model(seed=3)[0]
        state_load.load_module_state(offer.offer(), joiner, "j", 1, 7)
        assert _flat(joiner.state_dict()) == expected
    finally:
        offer.close()


class _Renamed(nn.Linear):
    """A module that loads its state its own way (so reading in place is not a copy)."""

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)


def test_a_model_with_its_own_loading_or_another_shape_takes_the_generic_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(4)
    donor = nn.Sequential(_Renamed(8, 4))
    offer = heal_channel.StateOffer(state_load.live_state(donor, None, 3, 2), serve_s=30.0)
    try:
        joiner = nn.Sequential(_Renamed(8, 4))
        with caplog.at_level(logging.INFO, logger="gradsync.client"):
            state_load.load_module_state(offer.offer(), joiner, "j", 1, 3)
        assert "into its own parameters" not in caplog.text
        assert _flat(joiner.state_dict()) == _flat(donor.state_dict())
        wider = nn.Sequential(_Renamed(8, 5))
        with pytest.raises(CheckpointMismatchError, match="does not fit this model"):
            state_load.load_module_state(offer.offer(), wider, "j", 1, 3)
        plain = nn.Sequential(nn.Linear(8, 5))  # plain loading, other shapes: refused too
        with pytest.raises(CheckpointMismatchError, match="does not fit this model"):
            state_load.load_module_state(offer.offer(), plain, "j", 1, 3)
    finally:
        offer.close()
