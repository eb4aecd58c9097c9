"""RunnerConfig: defaults, validation, and BCG_* environment variables (bad values keep defaults)."""
import dataclasses
import logging

import pytest

from bcg.runtime.config import RunnerConfig


def test_defaults_are_valid_and_frozen():
    config = RunnerConfig()
    assert config.enabled and config.copy_outputs and not config.debug
    assert config.pool_budget_bytes is None and config.max_entries >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_entries = 3


def test_from_env_reads_every_kind_of_field():
    env = {"BCG_ENABLED": "0", "BCG_MAX_ENTRIES": "4", "BCG_POOL_BUDGET_BYTES": "2GiB",
           "BCG_MAX_SEGMENTS": "64", "BCG_COPY_OUTPUTS": "false", "BCG_DEBUG": "yes",
           "BCG_DEBUG_SINGLE_BREAK": "on", "BCG_CAPTURE_WARMUP_RUNS": "2", "BCG_MAX_BREAK_MISMATCHES": "1",
           "UNRELATED": "x"}
    config = RunnerConfig.from_env(env)
    assert config == RunnerConfig(enabled=False, max_entries=4, pool_budget_bytes=2 * 2**30, max_segments=64,
                                  copy_outputs=False, debug=True, debug_single_break=True,
                                  capture_warmup_runs=2, max_break_mismatches=1)


@pytest.mark.parametrize("raw, expected", [("1_000_000", 10**6), ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29),
                                           ("none", None), ("0", None)])
def test_byte_budget_accepts_units_and_none(raw, expected):
    assert RunnerConfig.from_env({"BCG_POOL_BUDGET_BYTES": raw}).pool_budget_bytes == expected


@pytest.mark.parametrize("raw, expected", [("0", False), ("false", False), ("1", True), ("on", True),
                                           ("auto", None), ("none", None), ("", None)])
def test_compile_dynamic_reads_1_0_as_bool_and_auto_as_none(raw, expected):
    assert RunnerConfig.from_env({"BCG_COMPILE_DYNAMIC": raw}).compile_dynamic is expected


@pytest.mark.parametrize("name, raw", [("BCG_MAX_ENTRIES", "many"), ("BCG_MAX_ENTRIES", "0"),
                                       ("BCG_ENABLED", "maybe"), ("BCG_POOL_BUDGET_BYTES", "-5"),
                                       ("BCG_POOL_BUDGET_BYTES", "2 parsecs"), ("BCG_MAX_SEGMENTS", "1.5"),
                                       ("BCG_MAX_BREAK_MISMATCHES", "0")])
def test_bad_values_warn_and_keep_the_default(name, raw, caplog):
    good = {"BCG_COPY_OUTPUTS": "0"}
    with caplog.at_level(logging.WARNING, logger="bcg.runtime.config"):
        config = RunnerConfig.from_env({name: raw, **good})
    assert config == RunnerConfig(copy_outputs=False)    # the bad one keeps its default, the good one applies
    assert len(caplog.records) == 1 and name in caplog.records[0].getMessage()


def test_overrides_win_over_environment_and_are_validated():
    assert RunnerConfig.from_env({"BCG_MAX_ENTRIES": "4"}, max_entries=2).max_entries == 2
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        RunnerConfig.from_env({}, max_entries=0)


def test_from_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("BCG_MAX_ENTRIES", "7")
    assert RunnerConfig.from_env().max_entries == 7
    assert RunnerConfig.env_var("max_entries") == "BCG_MAX_ENTRIES"


def test_invalid_constructor_arguments_name_the_fix():
    with pytest.raises(ValueError, match="positive byte count or None"):
        RunnerConfig(pool_budget_bytes=0)
    with pytest.raises(ValueError, match="max_segments"):
        RunnerConfig(max_segments=0)
    with pytest.raises(ValueError, match="1 blocks a signature at its first"):
        RunnerConfig(max_break_mismatches=0)
