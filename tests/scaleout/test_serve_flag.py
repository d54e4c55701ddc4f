"""``millm serve --ray`` is a flag of ``millm serve`` that the rayserve plugin adds, and a
server without it never imports Ray: not when the CLI is built, not when the app is built
with every installed plugin."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_ray_flag_parses_and_nothing_else_imports_ray() -> None:
    code = textwrap.dedent(
        """
        import sys
        from millm_core.cli import build_parser
        from millm_core.config import load_settings
        from millm_core.plugins import PluginHost
        from millm_core.server.app import build_host, create_app

        declared = PluginHost.declared_settings()
        parser = build_parser(declared, PluginHost.declared_commands())
        args = parser.parse_args(["serve", "--ray", "--replicas", "3", "--ray-address", "auto", "--ray-gpus-per-replica", "1"])
        assert (args.command, args.ray, args.replicas, args.ray_address, args.ray_gpus_per_replica) == ("serve", True, 3, "auto", 1.0)
        plain = parser.parse_args(["serve", "--port", "8001"])
        assert (plain.ray, plain.replicas) == (False, 1)
        settings = load_settings({"db": ":memory:"}, environ={}, plugin_settings=declared)
        host = build_host(settings)
        assert "rayserve" in host.names()
        create_app(settings, host=host)
        assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")], "ray was imported"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
