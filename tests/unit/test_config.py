"""Settings: flags beat environment beats defaults; bad values fail at start-up."""

from __future__ import annotations

import pytest

from millm_core.cli import build_parser
from millm_core.config import PARSERS, PluginSetting, Settings, env_name, load_settings
from millm_core.errors import ConfigError


def test_defaults() -> None:
    s = load_settings(environ={})
    assert (s.host, s.port, s.dtype, s.plugins, s.log_format) == ("127.0.0.1", 8000, "auto", None, "console")


def test_environment_then_flags() -> None:
    env = {"MILLM_PORT": "9001", "MILLM_PLUGINS": "sampling, other", "MILLM_DTYPE": "bfloat16"}
    s = load_settings(environ=env)
    assert (s.port, s.plugins, s.dtype) == (9001, ("sampling", "other"), "bfloat16")
    assert load_settings({"port": 9002}, environ=env).port == 9002


@pytest.mark.parametrize("env", [{"MILLM_PORT": "eighty"}, {"MILLM_DTYPE": "int3"}, {"MILLM_MAX_MODEL_LEN": "0"}])
def test_bad_values_are_config_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_settings(environ=env)


def test_every_setting_has_a_flag_and_an_env_var() -> None:
    assert set(PARSERS) == set(Settings.__struct_fields__) - {"plugin_values"}
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for field in PARSERS:
        assert "--" + field.replace("_", "-") in help_text
        assert env_name(field) in help_text


def test_plugin_settings_come_from_environment_and_flags() -> None:
    window, name = PluginSetting("probe_window", 8, "window size", int), PluginSetting("probe_name", "none")
    declared = [window, name]
    s = load_settings(environ={"MILLM_PROBE_WINDOW": "16"}, plugin_settings=declared)
    assert (window.get(s), name.get(s)) == (16, "none")
    assert window.get(load_settings({"probe_window": 32}, environ={"MILLM_PROBE_WINDOW": "16"}, plugin_settings=declared)) == 32
    assert window.get(load_settings(environ={}, plugin_settings=declared)) == 8
    with pytest.raises(ConfigError):
        load_settings(environ={"MILLM_PROBE_WINDOW": "wide"}, plugin_settings=declared)
    with pytest.raises(ConfigError, match="shadows"):
        load_settings(environ={}, plugin_settings=[PluginSetting("port", 1)])


@pytest.mark.parametrize(("env", "message"), [({"MILLM_LOG_LEVEL": "verbose"}, "log_level"), ({"MILLM_DEFAULT_MAX_TOKENS": "-1"}, "default-max-tokens")])
def test_log_level_and_default_budget_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=env)
    assert load_settings(environ={"MILLM_DEFAULT_MAX_TOKENS": "0", "MILLM_LOG_LEVEL": "warning"}).default_max_tokens == 0
    for spelled, level in (("INFO", "info"), ("Warning", "warning"), ("warn", "warning"), ("CRITICAL", "critical")):
        assert load_settings(environ={"MILLM_LOG_LEVEL": spelled}).log_level == level
    assert load_settings({"log_level": "DEBUG"}, environ={}).log_level == "debug"


def test_an_api_key_list_with_no_key_is_refused() -> None:
    """A key meant to guard the server that came out blank must not leave it open."""
    from millm_core.cli import build_parser, _overrides

    for raw in (" ", ",", " , "):
        with pytest.raises(ConfigError, match="holds no key"):
            load_settings(environ={"MILLM_API_KEY": raw})
        with pytest.raises(ConfigError, match="holds no key"):
            _overrides(build_parser().parse_args(["serve", "--api-key", raw]), ())
    assert load_settings(environ={"MILLM_API_KEY": ""}).api_key == ()  # empty: no keys, said so
    assert load_settings(environ={"MILLM_API_KEY": " k1 ,k2"}).api_key == ("k1", "k2")
