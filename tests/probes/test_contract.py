"""The published contracts: the committed JSON Schemas are what the code generates, real
results and exports validate against them, and the verdicts header parses as RFC 8941
with an independent parser (http-sfv) for any score."""

from __future__ import annotations

import json
import math
import pathlib
from decimal import Decimal
from typing import Any

import http_sfv
import httpx
import jsonschema
from hypothesis import example, given
from hypothesis import strategies as st

from millm_plugins.probes import published
from millm_plugins.probes.header import sf_decimal, sf_string

from .helpers import HELD_SEA, JSON, Fitted, arm, chat, import_probe, ok, user

SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "schemas"


def test_the_committed_schemas_are_generated() -> None:
    for name in published.FILES:
        assert (SCHEMAS / name).read_text() == published.render(name), f"run `make schemas` and commit docs/schemas/{name}"


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_results_and_documents_follow_their_schemas(probe_server: Any, fitted: Fitted) -> None:
    doc = fitted.document(probe_id="schema")
    validator("mi-probe-v1.json").validate(doc)
    import_probe(probe_server, doc)
    validator("mi-probe-v1.json").validate(ok(httpx.get(probe_server.base_url + "/api/probes/schema/export")))
    ok(arm(probe_server, "schema", windows=["all", "prompt", "response", "last_user"]))
    results = chat(probe_server, user(HELD_SEA[0]), max_tokens=1).json()["millm_probe_verdicts"]
    check = validator("mi-probe-result-v1.json")
    for result in results:
        check.validate(result)
    assert {r["outcome"] for r in results} == {"scored", "skipped"}  # a null score and verdict validate too
    broken = {**results[0], "outcome": "maybe"}
    assert not check.is_valid(broken)
    ok(httpx.delete(probe_server.base_url + "/api/probes/schema", headers=JSON))


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e13, max_value=1e13))
@example(0.0005)
@example(-0.0004)
@example(999999999999.9996)
@example(1.0)
def test_decimals_parse_as_rfc8941(value: float) -> None:
    text = sf_decimal(value)
    if text is None:
        assert abs(round(value, 3)) >= 1e12
        return
    item = http_sfv.Item()
    item.parse(text.encode())
    assert isinstance(item.value, Decimal | int)
    assert math.isclose(float(item.value), value, abs_tol=5.0001e-4, rel_tol=1e-12)


@given(st.text(max_size=40))
def test_names_parse_as_rfc8941_strings(name: str) -> None:
    item = http_sfv.Item()
    item.parse(sf_string(name).encode())
    # Printable ASCII comes back as it was; every other byte (and "%") percent-encoded.
    want = "".join(c if " " <= c <= "~" and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    assert item.value == want
