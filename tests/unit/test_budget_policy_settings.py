"""Where the scheduler's settings come from, and the errors a wrong one gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.schedulers.policy import (
    SETTINGS_FILE_ENV,
    BudgetPolicySettings,
    SchedulerSettingsError,
    load_budget_settings,
)


def test_defaults_when_nothing_is_given() -> None:
    assert load_budget_settings(None, {}) == BudgetPolicySettings()


def test_inline_settings() -> None:
    settings = load_budget_settings({"target_itl_ms": 25, "min_chunk": 256}, {})
    assert (settings.target_itl_ms, settings.min_chunk) == (25.0, 256)


def test_yaml_file_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "sched.yaml"
    path.write_text("target_itl_ms: 80\nstep_model:\n  prior:\n    intercept_ms: 3\n")
    settings = load_budget_settings(None, {SETTINGS_FILE_ENV: str(path)})
    assert settings.target_itl_ms == 80.0
    assert settings.step_model.prior.intercept_ms == 3.0


def test_json_file_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "sched.json"
    path.write_text(json.dumps({"max_chunk": 1024}))
    assert load_budget_settings(None, {SETTINGS_FILE_ENV: str(path)}).max_chunk == 1024


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_budget_settings(None, {SETTINGS_FILE_ENV: str(path)}) == BudgetPolicySettings()


@pytest.mark.parametrize(
    ("inline", "message"),
    [
        ({"target_itl": 30}, r"target_itl\n.*Extra inputs are not permitted"),
        ({"target_itl_ms": "fast"}, r"target_itl_ms\n.*valid number"),
        ({"step_model": {"outlier_sigmas": 0.5}}, r"step_model.outlier_sigmas"),
        ([1, 2], r"must be a mapping, got list"),
    ],
)
def test_invalid_inline_settings_name_the_field_and_the_source(inline, message: str) -> None:
    with pytest.raises(SchedulerSettingsError, match=message) as info:
        load_budget_settings(inline, {})
    assert "additional_config['splitserve_scheduler']" in str(info.value)


def test_invalid_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("min_chunk: -5\n")
    with pytest.raises(SchedulerSettingsError, match=r"bad\.yaml.*\n.*min_chunk"):
        load_budget_settings(None, {SETTINGS_FILE_ENV: str(path)})


def test_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(SchedulerSettingsError, match="cannot read scheduler settings"):
        load_budget_settings(None, {SETTINGS_FILE_ENV: str(tmp_path / "absent.yaml")})
    broken = tmp_path / "broken.yaml"
    broken.write_text("target_itl_ms: [1,\n")
    with pytest.raises(SchedulerSettingsError, match="cannot read scheduler settings"):
        load_budget_settings(None, {SETTINGS_FILE_ENV: str(broken)})


def test_both_sources_at_once_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "sched.yaml"
    path.write_text("target_itl_ms: 80\n")
    with pytest.raises(SchedulerSettingsError, match="given twice"):
        load_budget_settings({"target_itl_ms": 20}, {SETTINGS_FILE_ENV: str(path)})
