"""What the sampling plugin offers other plugins: how ``X-miLLM-Seed`` states a seed and
the scope of its promise (scoring states a scored request's seed the same way). Import
these names from here, never from the plugin's other modules.
"""

from __future__ import annotations

from .plugin import SEED_HEADER, seed_header

__all__ = ["SEED_HEADER", "seed_header"]
