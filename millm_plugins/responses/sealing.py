"""Encrypted reasoning: ``include: ["reasoning.encrypted_content"]`` seals a reasoning
item's text with AES-256-GCM under a key only the server holds, so a client can send the
reasoning back on a later turn without being able to read or alter it.

The key comes from ``--responses-key-file`` (32 bytes, raw or as hex or base64 text), or
is generated once and kept in the database, so that a sealed item still opens after a
restart. A blob is ``base64url(version | nonce | ciphertext+tag)``; the version and a fixed
context string are authenticated with it, so a blob altered in any byte, or sealed by
another key, does not open.
"""

from __future__ import annotations

import base64
import binascii
import os
import sqlite3

from millm_core.api import ConfigError, Store

KEY_BYTES = 32
NONCE_BYTES = 12
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


class Sealer:
    """Seals and opens reasoning text under one key."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # imported when the server starts, not with the plugin

        if len(key) != KEY_BYTES:
            raise ValueError(f"the key must be {KEY_BYTES} bytes")
        self._aead = AESGCM(key)

    def seal(self, text: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, text.encode("utf-8"), VERSION + CONTEXT)
        return base64.urlsafe_b64encode(VERSION + nonce + sealed).decode("ascii")

    def open(self, blob: str) -> str | None:
        """The text, or None when ``blob`` was not sealed by this key or was altered."""
        from cryptography.exceptions import InvalidTag

        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (ValueError, UnicodeEncodeError, binascii.Error):
            return None
        if len(raw) < 1 + NONCE_BYTES + 16 or raw[:1] != VERSION:
            return None
        try:
            text = self._aead.decrypt(raw[1 : 1 + NONCE_BYTES], raw[1 + NONCE_BYTES :], VERSION + CONTEXT)
        except InvalidTag:
            return None
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError:
            return None
