"""requirements.lock pins every direct dependency of requirements.txt, at a version its line allows."""

from __future__ import annotations

import re

from packaging.requirements import Requirement

from tests.support.servers import ROOT


def _lines(name: str) -> list[str]:
    text = (ROOT / name).read_text(encoding="utf-8")
    return [ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_pins_every_requirement_at_an_allowed_version():
    pins = {}
    for line in _lines("requirements.lock"):
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", line
        pins[_norm(req.name)] = spec.version
    for line in _lines("requirements.txt"):
        req = Requirement(line)
        assert _norm(req.name) in pins, f"{req.name} is not in requirements.lock (run bash scripts/lock)"
        assert req.specifier.contains(pins[_norm(req.name)], prereleases=True), (line, pins[_norm(req.name)])
        for extra in req.extras:  # psycopg[binary] → psycopg-binary
            assert _norm(f"{req.name}-{extra}") in pins, line
