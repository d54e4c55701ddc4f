"""What the Batch API plugin offers other plugins (the Ray Serve replica): its state (the
runner, the store, the data directory's lock), so a replica can adopt unfinished batches.
Its public surface.
"""

from __future__ import annotations

from .state import STATE

__all__ = ["STATE"]
