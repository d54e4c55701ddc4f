"""``millm`` subcommands that plugins add (``millm_register_commands``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from .config import Settings


@dataclass(frozen=True)
class Command:
    """A ``millm <name>`` subcommand. ``configure(parser, add_settings)`` adds its own
    arguments, and calls ``add_settings(p)`` on each parser that takes the server's
    settings flags (``--model``, ``--dtype``, …); ``run(args, settings)`` does the work and
    returns the exit status. A ``serve_option`` is no subcommand of its own but another way
    to serve: ``millm serve --<name>`` runs ``run`` instead of the in-process server, and
    ``configure`` adds its arguments to ``millm serve`` (whose parser takes the settings)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser, Callable[[argparse.ArgumentParser], None]], None]
    run: Callable[[argparse.Namespace, Settings], int]
    serve_option: bool = False
