"""What the lanes plugin offers other plugins (the Batch API reads a line's ``model@lane``
suffix): the lane names. Its public surface.
"""

from __future__ import annotations

from .plugin import LANES

__all__ = ["LANES"]
