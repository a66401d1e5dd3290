"""Configuration checks made at once: addresses, `ClientConfig`, and the CLI's flag types."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from gradsync import flags
from gradsync.config import ENV_COORDINATOR, ClientConfig
from gradsync_proto.net.address import Address, parse_address


@pytest.mark.parametrize(
    ("text", "host", "port", "canonical"),
    [
        ("127.0.0.1:50051", "127.0.0.1", 50051, "127.0.0.1:50051"),
        ("coordinator.example.org:1", "coordinator.example.org", 1, "coordinator.example.org:1"),
        ("localhost:65535", "localhost", 65535, "localhost:65535"),
        ("[::1]:50051", "::1", 50051, "[::1]:50051"),
        ("[fe80::1%eth0]:7", "fe80::1%eth0", 7, "[fe80::1%eth0]:7"),
    ],
)
def test_good_addresses_parse_and_print_back(
    text: str, host: str, port: int, canonical: str
) -> None:
    address = parse_address(text)
    assert address == Address(host, port)
    assert str(address) == canonical


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("http://host:50051", "has a scheme (http://)"),
        ("grpc://10.0.0.1:50051", "has a scheme (grpc://)"),
        ("host:0", "port 0, outside 1..65535"),
        ("host:65536", "port 65536, outside 1..65535"),
        ("host:99999", "port 99999, outside 1..65535"),
        ("host", "has no port"),
        ("host:", "has no port"),
        (":50051", "has an empty host"),
        ("", "address is empty"),
        ("   ", "address is empty"),
        ("host:port", "port 'port', which is not a number"),
        ("host:-1", "port '-1', which is not a number"),
        ("host:\uff15\uff10", "not a number"),  # fullwidth digits: isdigit(), not a port
        ("host :50051", "contains whitespace"),
        ("host:50051/", "contains a path"),
        ("::1:50051", "write an IPv6 address in brackets"),
        ("[::1]", "has no port"),
        ("[::1]50051", "after ']'"),
        ("[::1:50051", "without closing it"),
        ("[host]:50051", "not IPv6"),
        ("[]:50051", "has an empty host"),
    ],
)
def test_bad_addresses_say_what_is_wrong(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=r".") as caught:
        parse_address(text)
    message = str(caught.value)
    assert reason in message
    if text.strip():
        assert repr(text) in message  # the value is quoted


def _config(**overrides: object) -> ClientConfig:
    settings: dict[str, object] = {"coordinator": "127.0.0.1:50051", "rank": 0, "world_size": 2}
    settings.update(overrides)
    return ClientConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("http://host:50051", "has a scheme"),
        ("host:0", "outside 1..65535"),
        ("host:70000", "outside 1..65535"),
        ("host", "has no port"),
        (":50051", "empty host"),
    ],
)
def test_client_config_refuses_a_bad_coordinator_at_construction(address: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        _config(coordinator=address)
    assert str(caught.value).startswith("coordinator: ")
    assert reason in str(caught.value) and repr(address) in str(caught.value)


def test_client_config_accepts_ipv6() -> None:
    assert _config(coordinator="[::1]:50051").coordinator == "[::1]:50051"


def test_a_bad_address_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ValueError, match=rf"^\${ENV_COORDINATOR}: .*has a scheme"):
        ClientConfig.resolve(None, 0, 1, environ={ENV_COORDINATOR: "https://h:1"})
    config = ClientConfig.resolve(None, 0, 1, environ={ENV_COORDINATOR: "h:1"})
    assert config.coordinator == "h:1"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"rank": 2}, "rank 2 is out of range for world_size 2"),
        ({"world_size": 0, "rank": 0}, "world_size must be >= 1, got 0"),
        ({"bucket_cap_bytes": 0}, "bucket_cap_mb must be positive, got 0 MiB"),
        ({"first_bucket_cap_bytes": -1}, "first_bucket_mb must be positive"),
        ({"timeout_s": 0.0}, "timeout_s must be a positive number of seconds, got 0.0"),
        ({"join_timeout_s": float("nan")}, "join_timeout_s must be a positive number"),
        ({"timeout_s": float("inf")}, "timeout_s must be a positive number of seconds, got inf"),
        ({"job_id": ""}, "job_id must not be empty"),
    ],
)
def test_client_config_names_the_setting_and_the_value(
    overrides: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=r".") as caught:
        _config(**overrides)
    assert needle in str(caught.value)


# ---------------------------------------------------------------- flag types


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        (flags.port, "99999", "must be in 0..65535, got 99999"),
        (flags.port, "-1", "must be in 0..65535, got -1"),
        (flags.port, "80.5", "expected an integer, got '80.5'"),
        (flags.positive_int, "0", "must be >= 1, got 0"),
        (flags.integer(high=3), "4", "must be <= 3, got 4"),
        (flags.seconds, "0", "must be > 0, got 0"),
        (flags.seconds, "nan", "must be a finite number"),
        (flags.seconds, "inf", "must be a finite number"),
        (flags.seconds, "1e300", "must be <= 2.592e+06"),
        (flags.seconds, "soon", "expected a number, got 'soon'"),
        (flags.seconds_or_zero, "-0.5", "must be >= 0, got -0.5"),
        (flags.chunk_mb, "0.001", "chunk size must be 4 KiB..64 MiB"),
        (flags.chunk_mb, "65", "chunk size must be 4 KiB..64 MiB"),
        (flags.coordinator, "http://h:1", "has a scheme"),
        (flags.non_empty, "  ", "must not be empty"),
        (flags.number_list(flags.positive_int), "2,x", "expected an integer, got 'x'"),
        (flags.number_list(flags.positive_number), ",", "expected comma-separated values"),
        (flags.choice_list(("a", "b")), "a,c", "unknown ['c']"),
    ],
)
def test_flag_types_refuse_out_of_range_values(kind: object, text: str, needle: str) -> None:
    assert callable(kind)
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        kind(text)
    assert needle in str(caught.value)


def test_flag_types_accept_their_whole_range() -> None:
    assert flags.port("0") == 0 and flags.port("65535") == 65535
    assert flags.seconds_or_zero("0") == 0.0
    assert flags.chunk_mb("64") == 64.0
    assert flags.coordinator("[::1]:9") == "[::1]:9"
    assert flags.number_list(flags.positive_int)("2, 4") == [2, 4]
    assert flags.choice_list(("a", "b"))("b,a") == ("b", "a")


def test_output_paths_must_have_an_existing_folder(tmp_path: Path) -> None:
    assert flags.output_file(str(tmp_path / "out.npz")) == tmp_path / "out.npz"
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        flags.output_file(str(tmp_path / "missing" / "out.npz"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        flags.output_file(str(tmp_path))
    assert flags.output_folder(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        flags.output_folder(str(blocker / "results"))


def test_job_settings_default_to_the_flags_defaults_and_carry_every_flag() -> None:
    from gradsync_server import defaults as flag_defaults
    from gradsync_server.config import CoordinatorConfig
    from gradsync_server.control.settings import JobSettings, OnFailure

    plain = JobSettings(2, 4096, 8192)
    assert plain.on_failure == flag_defaults.ON_FAILURE
    assert plain.nonfinite == flag_defaults.NONFINITE
    assert plain.heartbeat_interval_s == flag_defaults.HEARTBEAT_INTERVAL_S
    config = CoordinatorConfig(
        world_size=3, on_failure="elastic", min_workers=2, nonfinite="abort", checkpoint_every=0
    )
    settings = config.job_settings()
    assert settings.on_failure is OnFailure.ELASTIC and settings.nonfinite == "abort"
    assert (settings.world_size, settings.min_workers) == (3, 2)
    assert settings.max_message_bytes == config.max_message_bytes
    with pytest.raises(ValueError):
        JobSettings(2, 4096, 8192, on_failure="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flag", "port", "local_shards", "expected"),
    [
        (None, 50051, 1, 50052),  # the default: the next port
        (None, 50051, 3, 50054),  # past the local shards' ports (--port + 1 .. + 2)
        (None, 0, 1, 0),  # --port 0: a free one
        (None, 65535, 1, 0),  # no next port: a free one
        (-1, 50051, 1, None),  # off
        (6000, 50051, 1, 6000),
        (0, 50051, 1, 0),
    ],
)
def test_the_frame_port_follows_the_grpc_port_and_never_a_local_shards(
    flag: int | None, port: int, local_shards: int, expected: int | None
) -> None:
    from gradsync_server.arguments import frame_port_of

    assert frame_port_of(flag, port, local_shards) == expected


def test_a_frame_port_out_of_range_is_refused_naming_it() -> None:
    from gradsync_server.config import CoordinatorConfig

    with pytest.raises(ValueError, match=r"frame port must be in 0\.\.65535"):
        CoordinatorConfig(world_size=2, frame_port=70000)
