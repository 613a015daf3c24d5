"""Configuration: SKRULL_* environment variables, the cached get_settings(), and the ``serve`` flags."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from scheduler_service import cli
from scheduler_service.core.planner import DEFAULT_CPSAT_TIME_LIMIT_S
from scheduler_service.runtime import settings as settings_module
from scheduler_service.runtime.settings import ENV_PREFIX, MAX_DEFAULT_WORKERS, Settings, get_settings
from scheduler_service.web import server


@pytest.fixture(autouse=True)
def clean_environment() -> Iterator[None]:
    """``serve`` exports its flags as SKRULL_* variables; put the environment and the cache back afterwards."""
    saved = {key: value for key, value in os.environ.items() if key.startswith(ENV_PREFIX)}
    for key in saved:
        del os.environ[key]
    get_settings.cache_clear()
    yield
    for key in [key for key in os.environ if key.startswith(ENV_PREFIX)]:
        del os.environ[key]
    os.environ.update(saved)
    get_settings.cache_clear()


def test_settings_read_skrull_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKRULL_MAX_SEQUENCES", "77")
    monkeypatch.setenv("SKRULL_CPSAT_WORKERS", "3")
    monkeypatch.setenv("SKRULL_ACCESS_LOG", "false")
    settings = get_settings()
    assert (settings.max_sequences, settings.cpsat_workers, settings.access_log) == (77, 3, False)
    assert settings.plan_limits.max_sequences == 77
    assert get_settings() is settings  # cached: one configuration per process


@pytest.mark.parametrize(
    ("num_cores", "cpu_max", "workers"),
    [
        pytest.param(2, None, 2, id="one-per-core"),
        pytest.param(64, None, MAX_DEFAULT_WORKERS, id="capped"),
        pytest.param(1, None, 1, id="one-core"),
        pytest.param(16, "150000 100000", 1, id="cgroup-quota-whole-cores"),
        pytest.param(16, "300000 100000", 3, id="cgroup-quota"),
        pytest.param(2, "max 100000", 2, id="no-quota"),
    ],
)
def test_default_workers_follow_the_available_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_cores: int, cpu_max: str | None, workers: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cores)))
    cgroup_file = tmp_path / "cpu.max"
    if cpu_max is not None:
        cgroup_file.write_text(cpu_max + "\n")
    monkeypatch.setattr(settings_module, "_CGROUP_CPU_MAX", cgroup_file)
    assert Settings().workers == workers
    monkeypatch.setenv("SKRULL_WORKERS", "5")  # the variable (and so the flag) overrides the default
    assert Settings().workers == 5


def test_bad_environment_fails_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKRULL_PORT", "http")
    with pytest.raises(ValidationError, match="port"):
        get_settings()


def test_default_time_limit_may_not_exceed_the_cap() -> None:
    with pytest.raises(ValidationError, match="exceeds"):
        Settings(cpsat_default_time_limit_s=20, cpsat_max_time_limit_s=10)


def test_the_service_and_the_cli_default_to_the_cores_cpsat_time_limit() -> None:
    assert Settings().cpsat_default_time_limit_s == DEFAULT_CPSAT_TIME_LIMIT_S
    assert cli.build_parser().parse_args(["plan"]).time_limit == DEFAULT_CPSAT_TIME_LIMIT_S


def test_a_lower_cap_alone_lowers_the_default_time_limit_instead_of_stopping_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings(cpsat_max_time_limit_s=3).cpsat_default_time_limit_s == 3
    monkeypatch.setenv("SKRULL_CPSAT_MAX_TIME_LIMIT_S", "5")
    assert (get_settings().cpsat_default_time_limit_s, get_settings().cpsat_max_time_limit_s) == (5, 5)
    assert Settings(cpsat_max_time_limit_s=60).cpsat_default_time_limit_s == DEFAULT_CPSAT_TIME_LIMIT_S


def test_serve_flags_override_environment_for_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKRULL_MAX_SEQUENCES", "10")
    monkeypatch.setenv("SKRULL_MAX_CP_SIZE", "16")
    served: list[Settings] = []
    monkeypatch.setattr(server, "serve", served.append)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "9001", "--workers", "2", "--max-sequences", "500",
                     "--cpsat-max-time-limit-s", "12.5", "--no-access-log"]) == 0
    [settings] = served
    assert (settings.host, settings.port, settings.workers) == ("0.0.0.0", 9001, 2)
    assert (settings.max_sequences, settings.max_cp_size, settings.cpsat_max_time_limit_s) == (500, 16, 12.5)
    assert settings.access_log is False
    # uvicorn's worker processes rebuild the settings from the environment: the flags must be there.
    assert os.environ["SKRULL_MAX_SEQUENCES"] == "500" and os.environ["SKRULL_WORKERS"] == "2"
    assert os.environ["SKRULL_ACCESS_LOG"] == "false"


def test_every_setting_has_a_serve_flag_typed_and_described_by_its_field(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parsed = vars(cli.build_parser().parse_args(["serve"]))
    assert {name: parsed.get(name, "missing") for name in Settings.model_fields} == dict.fromkeys(Settings.model_fields)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} needs a description: it is its flag's help"
        assert f"--{name.replace('_', '-')}" in help_text and f"SKRULL_{name.upper()}" in help_text
    served: list[Settings] = []
    monkeypatch.setattr(server, "serve", served.append)
    assert cli.main(["serve", "--no-feedback", "--feedback-memory-headroom", "0.5", "--state-url", "sqlite://x.db",
                     "--log-level", "debug"]) == 0
    [settings] = served
    assert (settings.feedback, settings.feedback_memory_headroom) == (False, 0.5)
    assert (settings.state_url, settings.log_level) == ("sqlite://x.db", "debug")


def test_serve_rejects_bad_flag_value(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(server, "serve", lambda settings: pytest.fail("must not start"))
    assert cli.main(["serve", "--workers", "0"]) == cli.EXIT_BAD_INPUT
    assert "invalid setting: workers" in capsys.readouterr().err


def test_plan_subcommand_still_parses() -> None:
    args = cli.build_parser().parse_args(["plan", "request.json", "--table"])
    assert args.command == "plan" and args.table
