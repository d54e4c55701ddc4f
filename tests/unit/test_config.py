"""Settings: flags beat environment beats defaults; bad values fail at start-up."""

from __future__ import annotations

import pytest

from millm_core.cli import build_parser
from millm_core.config import PARSERS, Settings, env_name, load_settings
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
    assert set(PARSERS) == set(Settings.__struct_fields__)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for field in PARSERS:
        assert "--" + field.replace("_", "-") in help_text
        assert env_name(field) in help_text
