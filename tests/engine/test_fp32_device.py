"""Where the float32 scoring copy of a GPU model goes, decided from each device's free
memory. No GPU is on the CI machine, so the free-memory probe is replaced by a table (the
decision is what is tested here; the copy itself runs in tests/scoring on the CPU)."""

from __future__ import annotations

import pytest
import torch

from millm_core.api import ScoringPrecisionUnavailable
from millm_engines.transformers import fp32

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")
MIB = 2**20


@pytest.fixture
def free(monkeypatch: pytest.MonkeyPatch) -> dict[torch.device, int]:
    table: dict[torch.device, int] = {}
    monkeypatch.setattr(fp32, "available_bytes", lambda device: table[device])
    return table


def test_auto_puts_the_copy_beside_a_gpu_model_when_it_fits(free: dict[torch.device, int]) -> None:
    free.update({GPU: 800 * MIB, CPU: 100 * MIB})
    assert fp32.choose_device("auto", GPU, 500 * MIB) == GPU


def test_auto_falls_back_to_cpu_memory_when_the_gpu_is_full(free: dict[torch.device, int]) -> None:
    free.update({GPU: 100 * MIB, CPU: 4000 * MIB})
    assert fp32.choose_device("auto", GPU, 500 * MIB) == CPU


def test_no_room_anywhere_is_refused_with_the_memory_reason(free: dict[torch.device, int]) -> None:
    free.update({GPU: 100 * MIB, CPU: 200 * MIB})
    with pytest.raises(ScoringPrecisionUnavailable) as caught:
        fp32.choose_device("auto", GPU, 500 * MIB)
    assert caught.value.reason == "memory"  # type: ignore[attr-defined]
    assert "cuda:0" in caught.value.message and "cpu" in caught.value.message


def test_cpu_is_accepted_for_a_gpu_model(free: dict[torch.device, int]) -> None:
    free.update({CPU: 4000 * MIB})
    assert fp32.choose_device("cpu", GPU, 500 * MIB) == CPU
