"""The steering-set hash: the spec's test vectors TV-1..TV-4 and canonical-form invariants."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from millm_core.steering import STRENGTH_LIMIT, AppliedSet

LFM = "LiquidAI--LFM2.5-1.2B-Instruct-sae--layer_11"
GEMMA = "jbloom--gemma-2-2b-res-jb--layer_20--width_16k--average_l0_71"


@pytest.mark.parametrize(
    ("sae", "features", "canonical", "digest"),
    [
        (LFM, [(1234, 8.0)], f"millm.steering-set/v1\nsae={LFM}\n1234:4020000000000000\n",
         "sha256:a4eae730e5105f422b93abeece7e03bda3c29b096c07aa9cee6f247e12844105"),
        (LFM, [(1234, -8.0)], f"millm.steering-set/v1\nsae={LFM}\n1234:c020000000000000\n",
         "sha256:cc6c48faa720096e5c65fc1b2afab1b9b87659fb4465f20db421a2ed7fed78a7"),
        (GEMMA, [(77, -2.5), (5, 0.1), (900, 0.0), (12, -0.0)], f"millm.steering-set/v1\nsae={GEMMA}\n5:3fb999999999999a\n77:c004000000000000\n",
         "sha256:b843912201c5c18f872976e35af288e5f484d81e31a03a1dc16c3b9dbd82e710"),
        (GEMMA, [(3, 500.0)], f"millm.steering-set/v1\nsae={GEMMA}\n3:4069000000000000\n",
         "sha256:3f51779e6e33ee248acf6f520cb9475b4ef62f68275060bb69d2e228033b78df"),
    ],
    ids=["TV-1", "TV-2", "TV-3", "TV-4"],
)
def test_vectors(sae: str, features: list[tuple[int, float]], canonical: str, digest: str) -> None:
    applied = AppliedSet.build(sae, features)
    assert applied.canonical_form() == canonical
    assert applied.hash == digest


def test_clamp_is_counted() -> None:
    assert AppliedSet.build(GEMMA, [(3, 500.0), (4, -250.0), (5, 200.0)]).clamped == 2


def _independent_hash(sae: str, features: dict[int, float]) -> str:
    """The spec's reference implementation, written out separately."""
    applied = {i: max(-200.0, min(200.0, float(s))) for i, s in features.items()}
    applied = {i: s for i, s in applied.items() if s != 0.0}
    lines = ["millm.steering-set/v1", f"sae={sae}"] + [f"{i}:{struct.pack('>d', applied[i]).hex()}" for i in sorted(applied)]
    return "sha256:" + hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


strengths = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6) | st.sampled_from([0.0, -0.0, 200.0, -200.0])
feature_sets = st.dictionaries(st.integers(0, 65535), strengths, max_size=12)


@given(st.text(min_size=1, max_size=40).filter(lambda s: "\n" not in s), feature_sets)
def test_hash_matches_the_reference_and_is_order_independent(sae: str, features: dict[int, float]) -> None:
    forward = AppliedSet.build(sae, list(features.items()))
    backward = AppliedSet.build(sae, list(reversed(list(features.items()))))
    assert forward.hash == backward.hash == _independent_hash(sae, features)
    assert all(value != 0.0 and abs(value) <= STRENGTH_LIMIT for _, value in forward.features)


@given(feature_sets)
def test_zeros_change_nothing(features: dict[int, float]) -> None:
    base = AppliedSet.build("s", features)
    padded = AppliedSet.build("s", {**{i + 70000: 0.0 for i in range(3)}, **features, 70010: -0.0})
    assert base.hash == padded.hash


def test_nan_is_refused_and_an_overflowed_product_clamps_and_counts() -> None:
    with pytest.raises(ValueError):
        AppliedSet.build("s", [(1, float("nan"))])
    overflowed = AppliedSet.build("s", [(1, 1e308 * 2.0), (2, -1e308 * 2.0)])  # stored × λ past binary64's range
    assert overflowed.features == ((1, 200.0), (2, -200.0)) and overflowed.clamped == 2
