"""The constraint library's view of an engine's vocabulary (lm-format-enforcer's
``TokenEnforcerTokenizerData``), built from the engine's own ``encode``/``decode`` so it
works for any engine, and cached on disk: building it decodes every token twice.

Built the way the library's transformers integration builds it (that module does not
import under transformers 5, so it is never imported here): each token's text is read
after a ``"0"`` token, so a token that starts a word keeps its leading space.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from lmformatenforcer import TokenEnforcerTokenizerData
from lmformatenforcer.tokenizerprefixtree import JsonFreetextTokenCache

CACHE_VERSION = 1  # bump when the token list's meaning changes
FINGERPRINT_IDS = 512
# Text whose token ids tell tokenizers apart beyond the sampled ids (merges, normalisers).
PROBE_TEXT = 'The "quick" {brown: [1, 2.5e-3, null]} fox\n\tjumps — naïve café 東京 🙂 def f(x): return x'

log = structlog.get_logger("millm.structured")

RegularToken = tuple[int, str, bool]  # (id, text after a "0" token, starts a word)


class TokenizerData(TokenEnforcerTokenizerData):
    """The library's tokenizer data plus two things millm's constraint uses:
    ``partial_tokens``, a boolean array over token ids marking tokens whose text holds
    U+FFFD (a part of a multi-byte character; its character is only counted once a later
    token completes it, which a string's ``maxLength`` cannot allow for, so
    :class:`~.constraint.JsonConstraint` withholds them inside such a string), and
    ``freetext_arrays``, the enforcer's free-text token lists as arrays, converted once
    and shared by every row of this vocabulary."""

    partial_tokens: np.ndarray
    freetext_arrays: dict[int, tuple[list[int], np.ndarray]]  # see JsonConstraint._to_array


@dataclass(frozen=True)
class VocabData:
    """The tokenizer data for one engine's vocabulary, with how it was obtained:
    ``built_s`` the seconds spent (building, or reading the cache), ``cached`` whether the
    token list came from the disk cache."""

    data: TokenizerData
    built_s: float
    cached: bool
    regular_tokens: list[RegularToken]


def build_regular_tokens(
    decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], vocab_size: int, eos: Iterable[int]
) -> list[RegularToken]:
    """``(id, text, is_word_start)`` for every regular token in ``range(vocab_size)``.

    ``text`` is the token's text as it reads after a ``"0"`` token (so a word-start
    token's leading space survives decoders that strip it at the start of a text);
    ``is_word_start`` says whether that text is longer than the token decoded alone.
    Skipped: the eos ids, tokens whose text is empty (special tokens, since ``decode``
    skips them) and ids the tokenizer cannot decode (``vocab_size`` may be the model's
    padded embedding size, larger than the tokenizer's vocabulary)."""
    eos_ids = set(eos)
    token_0 = encode("0")[-1]
    prefix_len = len(decode([token_0]))
    regular: list[RegularToken] = []
    for token_id in range(vocab_size):
        if token_id in eos_ids:
            continue
        try:
            after_0 = decode([token_0, token_id])[prefix_len:]
            alone = decode([token_id])
        except Exception:  # an id past the tokenizer's vocabulary: not a token
            continue
        if not after_0:
            continue
        regular.append((token_id, after_0, len(after_0) > len(alone)))
    return regular


def decoder_for(decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """The decoder the enforcer uses: ``decode`` without trailing U+FFFD, the replacement
    character an incomplete UTF-8 sequence decodes to until its next byte arrives."""

    def decoder(ids: list[int]) -> str:
        return decode(ids).rstrip("\ufffd")

    return decoder


def make_tokenizer_data(
    regular: list[RegularToken], decode: Callable[[list[int]], str], eos: Iterable[int], vocab_size: int
) -> TokenizerData:
    """The enforcer's tokenizer data from a regular-token list.

    One correction to the library: its cache of tokens allowed inside a JSON string keeps
    tokens holding raw control characters other than newlines (a tab, ``\\x00``…), which
    JSON forbids unescaped; they are left out here, so a constrained string never holds one.

    (Byte-level tokenizers such as GPT-2's or SmolLM2's have no token that reads as a word
    start, so the enforcer re-decodes the whole generated text at each step to find the
    new characters. Marking whole tokens as word starts would avoid that, but then the
    U+FFFD of a multi-byte character left incomplete would never be counted.)"""
    data = TokenizerData(regular, decoder_for(decode), sorted(set(eos)), False, vocab_size)
    partial = np.zeros(vocab_size + 1, dtype=bool)
    partial[[token_id for token_id, text, _ in data.regular_tokens if "\ufffd" in text]] = True
    data.partial_tokens = partial
    data.freetext_arrays = {}
    freetext = JsonFreetextTokenCache(False, vocab_size)
    for token_id, text, _ in data.regular_tokens:
        if not any(ord(c) < 0x20 for c in text):
            freetext.add_token(text, token_id)
    freetext.freeze()
    data.tokenizer_tree.json_freetext_tokens = freetext
    return data


def fingerprint(decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], vocab_size: int, eos: Iterable[int]) -> str:
    """A sha256 that changes with the vocabulary: its size, the eos ids, the texts of ~512
    ids spread over it (first and last included) and the encoding of a probe text."""
    step = max(1, vocab_size // FINGERPRINT_IDS)
    ids = sorted({*range(0, vocab_size, step), vocab_size - 1})
    texts: list[str | None] = []
    for token_id in ids:
        try:
            texts.append(decode([token_id]))
        except Exception:
            texts.append(None)
    payload = {"version": CACHE_VERSION, "vocab_size": vocab_size, "eos": sorted(set(eos)), "texts": texts, "probe": encode(PROBE_TEXT)}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=True).encode()).hexdigest()


def _read_cache(path: Path) -> list[RegularToken] | None:
    try:
        with path.open(encoding="utf-8") as fh:
            stored = json.load(fh)
        if stored.get("version") != CACHE_VERSION:
            return None
        return [(int(i), str(text), bool(start)) for i, text, start in stored["tokens"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: rebuild


def _write_cache(path: Path, tokens: Sequence[RegularToken]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".vocab-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"version": CACHE_VERSION, "tokens": tokens}, fh, ensure_ascii=False)
        os.replace(staging, path)  # atomic: a reader sees the old file or the new one
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def tokenizer_data(engine: Any, cache_dir: Path | None) -> VocabData:
    """The enforcer's tokenizer data for ``engine`` (anything with ``encode(text,
    add_special_tokens=...)``, ``decode(ids)`` skipping special tokens, ``info.vocab_size``
    and ``eos_token_ids``). With ``cache_dir``, the regular-token list is kept there as
    ``vocab-<sha256>.json`` keyed by :func:`fingerprint`, so a second start reuses it and a
    different vocabulary never does."""
    started = time.perf_counter()
    vocab_size = int(engine.info.vocab_size)
    eos = sorted(int(i) for i in engine.eos_token_ids)

    def decode(ids: list[int]) -> str:
        return str(engine.decode(ids))

    def encode(text: str) -> list[int]:
        return list(engine.encode(text, add_special_tokens=False))

    path = None
    regular = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"vocab-{fingerprint(decode, encode, vocab_size, eos)}.json"
        regular = _read_cache(path)
    cached = regular is not None
    if regular is None:
        regular = build_regular_tokens(decode, encode, vocab_size, eos)
        if path is not None:
            try:
                _write_cache(path, regular)
            except OSError as exc:  # the cache only saves time: serve without it
                log.warning("constraint_vocab_cache_unwritable", path=str(path), error=str(exc))
    data = make_tokenizer_data(regular, decode, eos, vocab_size)
    return VocabData(data=data, built_s=time.perf_counter() - started, cached=cached, regular_tokens=regular)
