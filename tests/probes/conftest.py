"""Fixtures of the probe tests: the probe fitted on the tiny model (once per session) and
a server of the module's own (the session's shared server never has a probe armed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .helpers import Fitted


@pytest.fixture(scope="session")
def fitted(tiny_engine: Any) -> Fitted:
    return Fitted(tiny_engine)


@pytest.fixture(scope="module")
def probe_server(make_server: Any) -> Iterator[Any]:
    with make_server() as srv:
        yield srv
