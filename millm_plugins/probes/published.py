"""The probes' published contracts, generated from the Structs the code uses:
``docs/schemas/mi-probe-result-v1.json`` (a result) and ``docs/schemas/mi-probe-v1.json``
(a probe document). ``python -m millm_plugins.probes.published DIR`` writes both
(``make schemas``); a test fails when a committed file drifts."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import msgspec

from .document import ProbeDocument
from .results import REASONS, ProbeResult


def _document(type_: type, schema_id: str, title: str, description: str) -> dict[str, Any]:
    (root,), defs = msgspec.json.schema_components([type_])
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": schema_id, "title": title,
            "description": description, **root, "$defs": defs}  # fmt: skip


def result_schema() -> dict[str, Any]:
    reasons = "; ".join(f"{outcome}: {', '.join(codes)}" for outcome, codes in REASONS.items())
    return _document(
        ProbeResult, "mi.probe.result/v1", "A probe's result for one window of one row (mi.probe.result/v1)",
        "One result per armed probe, window and row: in X-miLLM-Probe-Verdicts and millm_probe_verdicts of chat and text "
        "completions, in a stream's closing chunk, in GET /api/probes/events and from POST /api/probes/score. "
        f"Reason codes by outcome — {reasons}.",
    )  # fmt: skip


def probe_schema() -> dict[str, Any]:
    return _document(
        ProbeDocument, "mi.probe/v1", "A probe document (mi.probe/v1)",
        "What POST /api/probes/import takes and GET /api/probes/{id}/export returns: a linear head over the residual stream "
        "(or an attached SAE's features) at one layer, its aggregation and decision, the model it was fitted on, its evidence "
        "rung and test vectors.",
    )  # fmt: skip


FILES = {"mi-probe-result-v1.json": result_schema, "mi-probe-v1.json": probe_schema}


def render(name: str) -> str:
    return json.dumps(FILES[name](), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised by `make schemas`
    folder = sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"
    for name in FILES:
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(render(name))
