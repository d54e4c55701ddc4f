"""Memory the host has free, for engines' load plans and admission estimates (no torch:
a device's own free memory is the engine's to read)."""

from __future__ import annotations

import os


def host_available_bytes() -> int:
    """Memory the system could give this process now without swapping: ``MemAvailable``
    on Linux, else the free physical pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
