"""The plugin boundary: built-in plugins and engines use only what a third party's could,
the public API in :mod:`millm_core.api`."""

from __future__ import annotations

import ast
import pathlib

import millm_core.api as api

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _core_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``millm_core`` module in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "millm_core":
                found += [(node.lineno, f"millm_core.{alias.name}") for alias in node.names]
            elif node.module.startswith("millm_core."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("millm_core")]
    return found


def test_plugins_and_engines_import_only_the_public_api() -> None:
    files = sorted([*ROOT.glob("millm_plugins/**/*.py"), *ROOT.glob("millm_engines/**/*.py"), *ROOT.glob("examples/**/*.py")])
    assert len(files) > 20
    # A plugin's own tests may also use the kit (fixtures, the engine conformance suite).
    kit = {"millm_core.testing", "millm_core.conformance"}

    def allowed(path: pathlib.Path, module: str) -> bool:
        is_test = path.name.startswith("test_") or path.name == "conftest.py"
        return module == "millm_core.api" or (is_test and module in kit)

    offending = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in files for line, module in _core_imports(p) if not allowed(p, module)]
    assert offending == []


def test_the_check_would_catch_a_private_import(tmp_path: pathlib.Path) -> None:
    sample = tmp_path / "plugin.py"
    sample.write_text("from millm_core.server import app\nimport millm_core.fields\nfrom millm_core import codec\nfrom millm_core.api import hookimpl\n")
    assert [m for _, m in _core_imports(sample)] == ["millm_core.server", "millm_core.fields", "millm_core.codec", "millm_core.api"]


def test_public_api_exports_exist_and_are_documented() -> None:
    assert len(api.__all__) == len(set(api.__all__))
    for name in api.__all__:
        obj = getattr(api, name)  # every listed name is importable
        if isinstance(obj, type) and obj.__module__.startswith("millm_core") and not name.isupper():
            assert obj.__doc__, f"{name} has no docstring"


def test_plugins_and_engines_read_no_server_state() -> None:
    """The core's app state (``app.state.millm``) and the request scope's state are the
    server's internals: a plugin reaches them through ``app_context``, ``request_id`` and
    the other public helpers."""
    files = sorted([*ROOT.glob("millm_plugins/**/*.py"), *ROOT.glob("millm_engines/**/*.py"), *ROOT.glob("examples/**/*.py")])
    offending = [
        f"{p.relative_to(ROOT)}:{number}"
        for p in files
        if not p.name.startswith("test_")
        for number, line in enumerate(p.read_text().splitlines(), 1)
        if ".state.millm" in line or "request.state" in line or 'scope["state"]' in line
    ]
    assert offending == []


def _plugin_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a ``millm_plugins`` module in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("millm_plugins"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("millm_plugins")]
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:
            found.append((node.lineno, "." * node.level + (node.module or "")))  # reaching out of its own package
    return found


def test_plugins_build_on_each_other_only_through_their_public_modules() -> None:
    """A plugin that builds on another (circuits on steering, tools on structured, …) imports
    only that plugin's ``public`` or ``contrib`` module: what docs/plugins.md lists, and what a
    third party building on it would use."""
    offending = []
    for path in sorted(ROOT.glob("millm_plugins/**/*.py")):
        own = path.relative_to(ROOT).parts[1]
        for line, module in _plugin_imports(path):
            parts = module.split(".")
            if module.startswith(".") or parts[1:2] != [own] and (len(parts) != 3 or parts[2] not in ("public", "contrib")):
                offending.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offending == []
    for public in ROOT.glob("millm_plugins/*/public.py"):  # each lists what it offers, all importable
        module = __import__(f"millm_plugins.{public.parent.name}.public", fromlist=["__all__"])
        assert module.__all__ and all(hasattr(module, name) for name in module.__all__)
