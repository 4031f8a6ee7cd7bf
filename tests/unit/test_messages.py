"""Sentences a person reads: pydantic's "Value error," never leaks into them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from songserve.api.settings import DispatcherSettings
from songserve.errors import ConfigError
from songserve.http.errors import validation_message
from songserve.process.settings import load_settings
from songserve.schemas import WorkerAnnouncement


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


def test_a_fresh_store_says_it_was_created_in_one_line_and_a_migration_in_one_line(tmp_path, caplog):
    import asyncio
    import logging

    from songserve.api.store.migrations import migrate as run_steps
    from songserve.api.store.sqlite.connector import SqliteConnector
    from songserve.api.store.sqlite.migrations import MIGRATIONS

    caplog.set_level(logging.INFO, logger="songserve.api.store.migrations")
    db = SqliteConnector(tmp_path / "jobs.sqlite3")

    def migrate(conn, steps=MIGRATIONS):
        return asyncio.run(run_steps(conn, steps))

    assert migrate(db, MIGRATIONS[:2]) == [MIGRATIONS[0].version, MIGRATIONS[1].version]
    assert [r.getMessage() for r in caplog.records] == [f"job store: created (schema version {MIGRATIONS[1].version})"]
    caplog.clear()
    applied = migrate(db)
    assert len(applied) == len(MIGRATIONS) - 2 >= 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"job store: schema migrated from version {MIGRATIONS[1].version} to {applied[-1]} (")
    caplog.clear()
    assert migrate(db) == []
    assert not caplog.records  # the usual start: nothing applied, nothing said
    db.shutdown()
