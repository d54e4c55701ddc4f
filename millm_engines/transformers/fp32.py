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


def _normalise(name: str) -> torch.device:
    """``cuda`` means the current CUDA device (``cuda:0`` unless set otherwise)."""
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ScoringPrecisionUnavailable(f"SCORING_FLOAT32_DEVICE={name!r} is not a device name", reason="device") from exc
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def choose_device(setting: str, here: torch.device, need: int) -> torch.device:
    """Where the float32 copy goes. ``auto``: beside the model when it fits there, else in
    CPU memory (a GPU model's copy falls back to the CPU); a named device must exist and
    have room. ``cpu`` is accepted whatever device the model is on."""
    if setting == "auto":
        candidates = [here] if here.type == "cpu" else [here, torch.device("cpu")]
    else:
        target = _normalise(setting)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ScoringPrecisionUnavailable(f"SCORING_FLOAT32_DEVICE={setting!r} is not usable: no CUDA device is present", reason="device")
        if target.type not in ("cpu", "cuda"):
            raise ScoringPrecisionUnavailable(f"SCORING_FLOAT32_DEVICE={setting!r} is not usable here (cpu or cuda devices only)", reason="device")
        candidates = [target]
    free = {dev: available_bytes(dev) for dev in candidates}
    for dev in candidates:
        if need <= free[dev]:
            return dev
    where = "; ".join(f"{free[dev] / 2**20:.0f} MiB are available on {dev}" for dev in candidates)
    raise ScoringPrecisionUnavailable(f"a float32 copy needs {need / 2**20:.0f} MiB (headroom included); {where}", reason="memory")


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
        need = sum(p.numel() for p in params) * 4 + headroom_mb * 2**20
        target = choose_device(device, here, need)
        with self.hold():
            try:
                clone = copy.deepcopy(model).to(device=target, dtype=torch.float32)
            except (MemoryError, RuntimeError) as exc:
                raise ScoringPrecisionUnavailable(f"building the float32 copy ran out of memory: {exc}", reason="memory") from exc
            try:
                yield clone
            finally:
                del clone
