"""What the tools plugin offers other plugins (the responses plugin): the type of a function
name. Its public surface: import these names from here.
"""

from __future__ import annotations

from .fields import FunctionName

__all__ = ["FunctionName"]
