"""What the scoring plugin offers other plugins besides :mod:`millm_plugins.scoring.contrib`
(reads of a scoring pass): whether a request is served as a scoring request. Its public
surface: import these names from here or from ``contrib``.
"""

from __future__ import annotations

from .plugin import is_scoring

__all__ = ["is_scoring"]
