"""Installing an example plugin package the way a user would (pip), into a private
directory on ``sys.path`` that is removed again afterwards."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@contextlib.contextmanager
def installed(package: str, module_prefix: str, workdir: pathlib.Path) -> Iterator[str]:
    """pip-install ``examples/<package>`` (from a copy, so no build output lands in the
    working tree) and make it importable until the block ends."""
    target, source = workdir / "site", workdir / "src"
    shutil.copytree(EXAMPLES / package, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield str(target)
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.startswith(module_prefix)]:
            del sys.modules[name]
        importlib.invalidate_caches()
