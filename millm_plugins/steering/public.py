"""What the steering plugin offers plugins built on it (circuits, activations, probes):
its live state and snapshot, SAEs as loaded, features and profiles and their checks, the
intensity dial, and how entries are applied and reported. With
:mod:`millm_plugins.steering.contrib` (adding steering to a request) this is the steering
plugin's public surface: import these names from here, never from its other modules.
"""

from __future__ import annotations

from .api import STATE, dials_of, plain_plan
from .apply import Dials, Entry, profile_entry, report
from .inline import Feature, InvalidFeatureIndex, SAENotAttached
from .intensity import Intensity, clamped_bounds, is_off, resolve_clamped
from .live import CLAIMS_UNREADABLE, Live
from .profiles import Dial, Profile, check_dial, check_layer
from .registry import SteeringState
from .sae import SAE

__all__ = ["CLAIMS_UNREADABLE", "Dial", "Dials", "Entry", "Feature", "Intensity", "InvalidFeatureIndex", "Live", "Profile", "SAE", "SAENotAttached", "STATE", "SteeringState", "check_dial", "check_layer", "clamped_bounds", "dials_of", "is_off", "plain_plan", "profile_entry", "report", "resolve_clamped"]
