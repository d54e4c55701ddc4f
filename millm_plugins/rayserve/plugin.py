"""Adds ``--ray`` (with ``--replicas``, ``--ray-address``, …) to ``millm serve``. Importing
this module imports nothing of Ray: only ``millm serve --ray`` does."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from millm_core.api import Command, Settings, hookimpl


def _configure(parser: argparse.ArgumentParser, add_settings: Callable[[argparse.ArgumentParser], None]) -> None:
    from .command import configure

    configure(parser)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    from .command import run

    return run(args, settings)


COMMAND = Command(
    name="ray",
    help="serve as Ray Serve replicas behind one HTTP route (--replicas, --ray-address; needs millm[ray])",
    configure=_configure,
    run=_run,
    serve_option=True,
)


@hookimpl
def millm_register_commands(register: Callable[[Command], None]) -> None:
    register(COMMAND)
