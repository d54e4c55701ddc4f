"""The structured-output plugin's own error."""

from __future__ import annotations

from millm_core.api import MillmError


class ConstrainedOutputInvalid(MillmError):
    """A closed document that does not validate against the request's schema."""

    status = 500
    code = "constrained_output_invalid"
    type = "server_error"
