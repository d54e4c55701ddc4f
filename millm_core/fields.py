"""The field policy: which request fields are honoured, on which endpoint, with which
engine capability — as data that plugins contribute, not branches in code.

A field sent with a non-neutral value is served only if some enabled plugin (or the core)
registered a rule honouring it for the endpoint and the engine has the capability the rule
needs; otherwise the request is refused with ``400 field_not_honoured`` naming the field.
Neutral values (``n: 1``, ``logprobs: false``, ``logit_bias: {}``, explicit ``null``, …)
mean "no change" and are accepted everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from .context import Endpoint
from .contracts.known import KNOWN_FIELDS
from .contracts.known import is_neutral as known_neutral
from .requestfields import RequestField

GENERATION_ENDPOINTS: tuple[Endpoint, ...] = ("chat.completions", "completions")  # the generation endpoints


@dataclass(frozen=True)
class FieldRule:
    """``field`` is honoured on ``endpoints`` when the engine has ``requires`` (if set).
    ``by`` names who honours it (a plugin name, or "core")."""

    field: str
    endpoints: tuple[Endpoint, ...]
    by: str
    requires: str | None = None
    condition: str = ""


# OpenAI fields the core declares, and the values of them that ask for nothing.
CORE_NEUTRAL: Mapping[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "stream": lambda v: v is False,
    # OpenAI's defaults for its sampling fields (clients such as LangChain send them always).
    "top_p": lambda v: v == 1,
    "frequency_penalty": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "stop": lambda v: v == [],
}


class FieldPolicy:
    """The assembled rules and plugin-owned fields, built once at start-up from every
    enabled plugin. Owning a field (:class:`~millm_core.requestfields.RequestField`)
    is a rule honouring it; plugins may add rules for other fields (``FieldRule``)."""

    def __init__(self) -> None:
        self._rules: dict[str, list[FieldRule]] = {}
        self._owned: dict[tuple[str, Endpoint], RequestField[Any]] = {}

    def register(self, rule: FieldRule) -> None:
        self._rules.setdefault(rule.field, []).append(rule)

    def own(self, field: RequestField[Any]) -> None:
        """Record a plugin-owned field and the rule its ownership implies."""
        for endpoint in field.endpoints:
            self._owned[(field.name, endpoint)] = field
        self.register(FieldRule(field.name, field.endpoints, by=field.owner, requires=field.requires, condition=field.condition))

    def rules(self) -> Mapping[str, list[FieldRule]]:
        return self._rules

    def is_neutral(self, name: str, endpoint: Endpoint, value: Any) -> bool:
        """Whether ``value`` of field ``name`` asks for nothing on ``endpoint``."""
        if value is None or value is msgspec.UNSET:
            return True
        owned = self._owned.get((name, endpoint))
        if owned is not None:
            return owned.is_neutral(value)
        check = CORE_NEUTRAL.get(name)
        return bool(check and check(value))

    def honours(self, name: str, endpoint: Endpoint, capabilities: frozenset[str]) -> bool:
        return any(
            endpoint in rule.endpoints and (rule.requires is None or rule.requires in capabilities)
            for rule in self._rules.get(name, ())
        )

    def why_refused(self, name: str, endpoint: Endpoint, engine: str) -> str:
        """Why ``name`` is not honoured on ``endpoint``: the capability the engine lacks,
        or that no enabled plugin honours (or declares) it."""
        needed = sorted({str(r.requires) for r in self._rules.get(name, ()) if endpoint in r.endpoints and r.requires})
        if needed:
            return f"the {engine} engine lacks the capability {' or '.join(needed)}"
        return "no enabled plugin honours it on this endpoint"

    def refusals(
        self,
        request: msgspec.Struct,
        endpoint: Endpoint,
        capabilities: frozenset[str],
        always_honoured: Iterable[str],
    ) -> list[str]:
        """Names of fields sent with a non-neutral value that nothing honours."""
        skip = set(always_honoured)
        refused: list[str] = []
        for name in request.__struct_fields__:
            if name in skip:
                continue
            if self.is_neutral(name, endpoint, getattr(request, name)):
                continue
            if not self.honours(name, endpoint, capabilities):
                refused.append(name)
        return refused


def known_refusals(raw: Mapping[str, Any], declared: Iterable[str]) -> list[str]:
    """Top-level keys of a body that the endpoint does not declare but that are known to
    change the output, sent with a non-neutral value: nothing enabled can honour them."""
    have = set(declared)
    return [name for name, value in raw.items() if name not in have and name in KNOWN_FIELDS and not known_neutral(name, value)]


class PolicyCell(msgspec.Struct, frozen=True, kw_only=True):
    """One cell of the field × endpoint × engine table."""

    field: str
    endpoint: str
    engine: str
    status: str  # "honoured", "honoured-with-condition", "refused"
    by: str | None = None
    condition: str | None = None
    reason: str | None = None


def policy_table(
    policy: FieldPolicy,
    contracts: Mapping[Endpoint, type[msgspec.Struct]],
    engines: Iterable[tuple[str, frozenset[str]]],
    structural: Iterable[str],
) -> list[PolicyCell]:
    """Every declared request field of every endpoint, and every known output-changing
    field it does not declare, on every engine: honoured (by whom, under which condition)
    or refused (and why). Other fields are never in the table: they cannot change the
    output and are always reported."""
    structural = set(structural)
    cells: list[PolicyCell] = []
    engine_list = list(engines)
    for endpoint, contract in contracts.items():
        declared = list(contract.__struct_fields__)
        for name in declared + sorted(set(KNOWN_FIELDS) - set(declared)):
            for engine, caps in engine_list:
                if name not in declared:
                    cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="refused", reason="no enabled plugin declares it on this endpoint"))
                    continue
                if name in structural:
                    cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="honoured", by="core"))
                    continue
                rules = [r for r in policy.rules().get(name, ()) if endpoint in r.endpoints]
                usable = [r for r in rules if r.requires is None or r.requires in caps]
                if usable:
                    # An unconditional rule wins; otherwise every condition under which
                    # some plugin honours the field is listed.
                    plain = [r for r in usable if not r.condition]
                    if plain:
                        cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="honoured", by=plain[0].by))
                    else:
                        by = ", ".join(sorted({r.by for r in usable}))
                        condition = "; ".join(f"{r.condition} ({r.by})" for r in sorted(usable, key=lambda r: r.by))
                        cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="honoured-with-condition", by=by, condition=condition))
                elif rules:
                    needed = ", ".join(sorted({str(r.requires) for r in rules if r.requires}))
                    cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="refused", reason=f"the engine lacks the capability {needed}"))
                else:
                    cells.append(PolicyCell(field=name, endpoint=endpoint, engine=engine, status="refused", reason="no enabled plugin honours it on this endpoint"))
    return cells
