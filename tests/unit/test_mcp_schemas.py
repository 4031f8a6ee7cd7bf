"""Each MCP tool's input schema is the HTTP API's own: every argument that mirrors a field of a request model
(``GenerateRequest``, ``ContinueFrom``) or a query parameter (``GET /jobs``) has that field's type, limits and
description, as the dispatcher's OpenAPI document states them. A limit changed on one side only fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

from songserve.api.compose import check_settings
from songserve.api.http.app import create_app
from songserve.api.mcp.server import tool
from songserve.api.mcp.tools import tool_specs
from songserve.api.settings import DispatcherSettings
from songserve.schemas import MAX_WAIT_SEC, ContinueFrom, GenerateRequest

# tool → {argument: where the HTTP API keeps it}
MIRRORS: dict[str, dict[str, tuple[str, str]]] = {
    "make_song": {
        name: ("GenerateRequest", name)
        for name in (
            "tags",
            "prompt",
            "prompt_mode",
            "mode",
            "lyrics",
            "duration",
            "num_tracks",
            "seed",
            "adapter",
            "adapter_scale",
            "takes",
            "continue_from",
        )
    },
    "retake": {
        "job_id": ("ContinueFrom", "job_id"),
        "track_index": ("ContinueFrom", "track_index"),
        "at_sec": ("ContinueFrom", "at_sec"),
        **{
            n: ("GenerateRequest", n)
            for n in ("tags", "prompt", "prompt_mode", "lyrics", "duration", "num_tracks", "seed")
        },
    },
    **{
        tool: {
            "job_id": ("ContinueFrom", "job_id"),
            "track_index": ("ContinueFrom", "track_index"),
            **{edge: ("ContinueFrom", edge) for edge in edges},
            **{n: ("GenerateRequest", n) for n in ("tags", "prompt", "prompt_mode", "lyrics", "num_tracks", "seed")},
        }
        for tool, edges in (("repaint", ("at_sec", "end_sec", "parts")), ("extend_start", ("before_sec",)))
    },
    "list_jobs": {"limit": ("GET /jobs", "limit"), "cursor": ("GET /jobs", "cursor")},
}
# A path's job id (GET /job/{job_id}: no model on HTTP) has continue_from.job_id's limits (test below).
JOB_PATHS = {"wait_for_job", "get_job", "cancel_job"}
UNMIRRORED = {
    ("wait_for_job", "timeout_sec"),
    ("upload_audio", "audio_base64"),
    ("upload_audio", "filename"),
    *((name, "job_id") for name in JOB_PATHS),
}


def _plain(schema: dict[str, Any]) -> dict[str, Any]:
    """A property's schema as a limit: no title or default, an optional type as its type, $refs compared by name."""
    out = {k: v for k, v in schema.items() if k not in ("title", "default")}
    if "anyOf" in out:
        kept = [s for s in out.pop("anyOf") if s != {"type": "null"}]
        out = {**(kept[0] if len(kept) == 1 else {"anyOf": kept}), **out}
    if "$ref" in out:
        out["$ref"] = out["$ref"].rsplit("/", 1)[-1]
    if isinstance(out.get("items"), dict):
        out["items"] = _plain(out["items"])
    return out


@pytest.fixture(scope="module")
def http_side(tmp_path_factory) -> dict[str, dict[str, Any]]:
    s = DispatcherSettings(state_dir=tmp_path_factory.mktemp("schemas"))
    openapi = create_app(check_settings(s)).openapi()
    jobs = {p["name"]: p["schema"] for p in openapi["paths"]["/jobs"]["get"]["parameters"]}
    return {
        "GenerateRequest": GenerateRequest.model_json_schema()["properties"],
        "ContinueFrom": ContinueFrom.model_json_schema()["properties"],
        "GET /jobs": {
            name: {**schema, "description": p.get("description")}
            for name, schema, p in ((p["name"], p["schema"], p) for p in openapi["paths"]["/jobs"]["get"]["parameters"])
        },
        "openapi": openapi["components"]["schemas"],
        "jobs": jobs,
    }


def test_every_tool_argument_is_the_http_apis_field_or_named_as_its_own(http_side):
    specs = tool_specs(DispatcherSettings())
    for spec in specs:
        schema = tool(spec).input_schema
        assert schema["type"] == "object", spec.name
        assert schema["additionalProperties"] is False, spec.name
        for name, prop in schema["properties"].items():
            if (spec.name, name) in UNMIRRORED:
                continue
            model, field = MIRRORS[spec.name][name]
            theirs = http_side[model][field]
            assert _plain(prop) == _plain(theirs), (spec.name, name, prop, theirs)
        assert set(MIRRORS.get(spec.name, {})) <= set(schema["properties"]), spec.name


def test_the_request_models_are_the_ones_the_routes_take(http_side):
    """What the test above compares with is what /generate's OpenAPI body is (a route moved to another model fails)."""
    body = http_side["openapi"]["GenerateRequest"]["properties"]
    assert {k: _plain(v) for k, v in body.items()} == {
        k: _plain(v) for k, v in GenerateRequest.model_json_schema()["properties"].items()
    }


def test_a_job_id_is_bounded_as_continue_froms_and_the_wait_as_prefer_wait(http_side):
    tools = {s.name: tool(s).input_schema for s in tool_specs(DispatcherSettings())}
    take = _plain(http_side["ContinueFrom"]["job_id"])
    for name in JOB_PATHS:
        job_id = _plain(tools[name]["properties"]["job_id"])
        assert (job_id["pattern"], job_id["maxLength"]) == (take["pattern"], take["maxLength"]), name
        assert tools[name]["required"] == ["job_id"]
    assert tools["wait_for_job"]["properties"]["timeout_sec"]["maximum"] == MAX_WAIT_SEC
