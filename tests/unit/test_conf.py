"""The typed settings object: read on every access, defaults declared once, unknown names
refused."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from durable_agents.conf import DEFAULTS, DurableAgentsSettings, Setting, app_settings


def test_a_setting_is_read_on_every_access() -> None:
    with override_settings(DURABLE_AGENTS={"LEASE_SECONDS": 7}):
        assert app_settings.LEASE_SECONDS == 7
    with override_settings(DURABLE_AGENTS={}):
        assert app_settings.LEASE_SECONDS == DEFAULTS["LEASE_SECONDS"] == 60


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no setting 'LEASE_SECONDZ'"):
        getattr(app_settings, "LEASE_SECONDZ")  # noqa: B009 - the name is not declared


def test_every_setting_is_declared_with_a_default_and_a_description() -> None:
    declared: dict[str, Any] = {
        name: value
        for name, value in vars(DurableAgentsSettings).items()
        if isinstance(value, Setting)
    }
    assert set(declared) == set(DEFAULTS)
    assert {"LEASE_SECONDS", "OFFLINE", "BETAS", "CLIENT_FACTORY"} <= set(declared)
    for name, setting in declared.items():
        assert setting.default is DEFAULTS[name]
        assert setting.__doc__, name
