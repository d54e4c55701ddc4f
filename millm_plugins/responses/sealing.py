"""Encrypted reasoning: ``include: ["reasoning.encrypted_content"]`` seals a reasoning
item's text with AES-256-GCM under a key only the server holds, so that a client that keeps
no state (``store: false``) can carry the reasoning to its next turn and the server knows
that what it renders is what its model wrote.

What this guarantees is the blob's integrity and authenticity, nothing more: a blob that
opens was sealed by a server holding this key and was not altered. It does not keep the
reasoning from the client — the same item carries the text in plain ``content`` — and it
does not stop a client from sending reasoning of its own: a reasoning item with ``content``
and no ``encrypted_content`` renders whatever text it carries, as any input does.

The key comes from ``--responses-key-file`` (32 bytes, raw or as hex or base64 text), or
is generated once and kept in the database (whoever can read the database file can open
every blob). A blob is ``base64url(version | key id | nonce | ciphertext+tag)``: the key
id is the first 4 bytes of the key's SHA-256, so that a blob sealed under another key is
told apart from an altered one; the version, the key id and a fixed context string are
authenticated with the text.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import sqlite3
from typing import Literal

from millm_core.api import ConfigError, Store

KEY_BYTES = 32
NONCE_BYTES = 12
KEY_ID_BYTES = 4
TAG_BYTES = 16
VERSION = b"\x01"
CONTEXT = b"millm responses reasoning v1"
NAMESPACE = "responses_key"
MIGRATIONS = ("CREATE TABLE responses_key (id INTEGER PRIMARY KEY CHECK (id = 1), key BLOB NOT NULL)",)


def parse_key(data: bytes) -> bytes:
    """A 32-byte key from a key file's bytes: raw, or hex or base64 text."""
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            key = decode(text.decode("ascii"))
        except (ValueError, UnicodeDecodeError, binascii.Error):
            continue
        if len(key) == KEY_BYTES:
            return key
    raise ValueError(f"a key file holds {KEY_BYTES} bytes, raw or as hex or base64 text")


def read_key_file(path: str) -> bytes:
    """The key in ``path``; a missing or malformed file stops start-up."""
    try:
        with open(path, "rb") as handle:
            return parse_key(handle.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--responses-key-file {path!r}: {exc}") from exc


def stored_key(store: Store) -> bytes:
    """The database's key, generated the first time (one per database, shared by every
    server that opens it)."""
    store.migrate(NAMESPACE, MIGRATIONS)

    def take(conn: sqlite3.Connection) -> bytes:
        conn.execute("INSERT OR IGNORE INTO responses_key (id, key) VALUES (1, ?)", (os.urandom(KEY_BYTES),))
        row = conn.execute("SELECT key FROM responses_key WHERE id = 1").fetchone()
        return bytes(row[0])

    with store.transaction() as conn:
        return take(conn)


def key_id(key: bytes) -> bytes:
    """The 4 bytes that name a key in its blobs: the start of its SHA-256."""
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES]


Refusal = Literal["malformed", "other_key", "altered"]


class SealError(Exception):
    """A blob that does not open: ``reason`` says why — ``malformed`` (not a blob of this
    format), ``other_key`` (sealed under another key: a server with another key file or
    database), ``altered`` (this key's id, but the text or tag was changed)."""

    def __init__(self, reason: Refusal) -> None:
        super().__init__(reason)
        self.reason: Refusal = reason


class Sealer:
    """Seals and opens reasoning text under one key."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # imported when the server starts, not with the plugin

        if len(key) != KEY_BYTES:
            raise ValueError(f"the key must be {KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self._kid = key_id(key)

    def seal(self, text: str) -> str:
        """``text`` sealed under this key: a base64url blob, a fresh nonce each time."""
        nonce = os.urandom(NONCE_BYTES)
        header = VERSION + self._kid
        sealed = self._aead.encrypt(nonce, text.encode("utf-8"), header + CONTEXT)
        return base64.urlsafe_b64encode(header + nonce + sealed).decode("ascii")

    def open(self, blob: str) -> str:
        """The text ``blob`` seals; :class:`SealError` when it does not open."""
        from cryptography.exceptions import InvalidTag

        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (ValueError, UnicodeEncodeError, binascii.Error):
            raise SealError("malformed") from None
        head = len(VERSION) + KEY_ID_BYTES
        if len(raw) < head + NONCE_BYTES + TAG_BYTES or raw[: len(VERSION)] != VERSION:
            raise SealError("malformed")
        if raw[len(VERSION) : head] != self._kid:
            raise SealError("other_key")
        try:
            text = self._aead.decrypt(raw[head : head + NONCE_BYTES], raw[head + NONCE_BYTES :], raw[:head] + CONTEXT)
        except InvalidTag:
            raise SealError("altered") from None
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError:
            raise SealError("altered") from None
