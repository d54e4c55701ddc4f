"""millm core: request/response contracts, the plugin spine and the serving pipeline.

The core knows no model family, no feature and no engine library: engines and features
arrive as pluggy plugins (see :mod:`millm_core.hookspecs`).
"""

__version__ = "0.1.0"
