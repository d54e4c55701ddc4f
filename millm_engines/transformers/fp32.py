"""A temporary float32 copy of a loaded model, for float32 scoring.

The served weights are never cast or changed: the copy is built for one request and
released after it. A model already in float32 is used as it is. Refusals carry the reason
the API documents: ``model_not_float32_castable``, ``memory``, ``device``, ``busy``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator

import torch
from torch import nn

from millm_core.api import ScoringPrecisionUnavailable

from .memory import available_bytes


def castability_problem(model: nn.Module) -> str | None:
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        return "the model is quantized"
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point:
            return f"parameter {name} is {param.dtype}, not floating point"
    return None


class Float32Copies:
    """Builds one float32 copy at a time (a second concurrent request is ``busy``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the copy slot (used by a request, and by tests to observe ``busy``)."""
        if not self._lock.acquire(blocking=False):
            raise ScoringPrecisionUnavailable("another request's float32 copy is in use; retry when it finishes", reason="busy")
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def copy_of(self, model: nn.Module, device: str, headroom_mb: int) -> Iterator[nn.Module]:
        params = list(model.parameters())
        if all(p.dtype == torch.float32 for p in params):
            yield model
            return
        problem = castability_problem(model)
        if problem:
            raise ScoringPrecisionUnavailable(f"cannot build a float32 copy: {problem}", reason="model_not_float32_castable")
        here = params[0].device
        if device not in ("auto", str(here)) and not (device == "cpu" and here.type == "cpu"):
            raise ScoringPrecisionUnavailable(
                f"SCORING_FLOAT32_DEVICE={device!r} is not usable: the model is on {here}", reason="device"
            )
        need = sum(p.numel() for p in params) * 4
        free = available_bytes(here)
        if need + headroom_mb * 2**20 > free:
            raise ScoringPrecisionUnavailable(
                f"a float32 copy needs {need / 2**20:.0f} MiB plus {headroom_mb} MiB headroom; "
                f"{free / 2**20:.0f} MiB are available on {here}",
                reason="memory",
            )
        with self.hold():
            try:
                clone = copy.deepcopy(model).to(torch.float32)
            except (MemoryError, RuntimeError) as exc:
                raise ScoringPrecisionUnavailable(f"building the float32 copy ran out of memory: {exc}", reason="memory") from exc
            try:
                yield clone
            finally:
                del clone
