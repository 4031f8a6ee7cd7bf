"""Sentences a person reads: pydantic's "Value error," never leaks into them (issue 37, Why 10)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from songserve.errors import ConfigError
from songserve.http_errors import validation_message
from songserve.schemas import WorkerAnnouncement
from songserve.settings import DispatcherSettings, load_settings

pytestmark = pytest.mark.quick


def test_a_validators_sentence_reaches_a_client_without_pydantics_prefix():
    with pytest.raises(ValidationError) as err:
        WorkerAnnouncement(url="ftp://gpu1:8001")
    assert "Value error" in str(err.value)  # what pydantic itself says
    said = validation_message(err.value.errors())
    assert said == "Field 'url': 'ftp://gpu1:8001' is not an http(s) URL with a host."


def test_a_settings_refusal_has_no_pydantic_prefix():
    with pytest.raises(ConfigError) as err:
        load_settings(DispatcherSettings, ["--port", "8889", "--acestep-port", "8889"])
    assert str(err.value) == (
        "Setting acestep_port: must differ from API_PORT (each dialect has its own port) (got '8889')."
    )
