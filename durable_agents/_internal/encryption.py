"""Encryption at rest of the columns that hold customers' data (``ENCRYPTION_KEYS``).

A column opts in at the field (``JSONTextField(encrypted=True)``, ``EncryptedTextField``):
whatever writes through the ORM, or through the raw statements of ``store/postgres_*.py`` with
``seal`` on the value, stores

    da:enc:v1:<key id>:<base64 of nonce + ciphertext + tag>

AES-256-GCM (``cryptography``), a fresh 96-bit nonce per value, under the first key of
``ENCRYPTION_KEYS``; any key of the list decrypts. The key id is the first 8 hex digits of a
SHA-256 of the key (never the key itself), so that a row says which key it needs and rotation
finds the rows not under the first key with a LIKE on the prefix.

The prefix makes the text self-describing: plain rows (written before encryption was turned
on, or by a deployment without keys) and encrypted rows coexist and both read back, so
turning encryption on needs no downtime and rotation runs while workers write.

Associated data: the prefix up to the key id and the column (``agent_step.payload``...), so a
ciphertext copied into another column does not decrypt. Not the row's run id: a field's codec
sees only the value (an ORM ``update()`` has no row at hand), and swapping values between rows
of one column needs write access to the database, which is outside what this protects
against (dumps, backups, replicas, read-only SQL; docs/howto/encryption.md, "Data at rest").

Decryption gives back the very text that was encrypted, so the conversation rebuilt from the
log is byte for byte what was sent (thinking signatures would refuse anything else).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import functools
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from durable_agents.conf import app_settings
from durable_agents.exceptions import InvalidKey, UndecryptableValue  # the one error tree

__all__ = [
    "MARKED",
    "PREFIX",
    "InvalidKey",
    "Keyring",
    "UndecryptableValue",
    "Unreadable",
    "enabled",
    "key_id",
    "lenient",
    "new_key",
    "parse_key",
    "seal",
    "shown",
    "unseal",
]

PREFIX = "da:enc:v1:"
# A plain value that itself begins with "da:" (only free text can: JSON text never does) is
# stored behind this marker while no key is configured, so it is never taken for ciphertext.
RAW = "da:raw:"
MARKED = "da:"
KEY_BYTES = 32
NONCE_BYTES = 12
KEY_ID_CHARS = 8


def new_key() -> str:
    """A fresh key for ENCRYPTION_KEYS: 32 random bytes, urlsafe base64."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode("ascii")


def parse_key(text: object, position: int = 0) -> bytes:
    """The 32 bytes of a key written as urlsafe base64; ``InvalidKey`` otherwise."""
    where = f"ENCRYPTION_KEYS[{position}]"
    if not isinstance(text, str):
        raise InvalidKey(f"{where} must be a string, not {type(text).__name__}")
    try:
        raw = base64.urlsafe_b64decode(text.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise InvalidKey(f"{where} is not urlsafe base64") from None
    if len(raw) != KEY_BYTES:
        raise InvalidKey(f"{where} decodes to {len(raw)} bytes; a key is {KEY_BYTES} bytes")
    return raw


def key_id(raw: bytes) -> str:
    """A short, stable name for a key that reveals nothing of it."""
    return hashlib.sha256(b"durable_agents key id\x00" + raw).hexdigest()[:KEY_ID_CHARS]


@dataclass(frozen=True)
class _Key:
    id: str
    aead: AESGCM


class Keyring:
    """The configured keys: the first encrypts, every one decrypts. A first entry of None
    encrypts nothing (values are written plain) while the keys after it still decrypt: the
    first phase of turning encryption on or off across a rolling deploy."""

    def __init__(self, keys: Sequence[str | None]) -> None:
        parsed = [parse_key(text, i) for i, text in enumerate(keys) if i or text is not None]
        self.keys = [_Key(key_id(raw), AESGCM(raw)) for raw in parsed]
        self.by_id = {key.id: key for key in reversed(self.keys)}
        self.first = self.keys[0] if keys[0] is not None else None
        # What every value written now begins with (None: plain values are written).
        self.first_prefix = f"{PREFIX}{self.first.id}:" if self.first is not None else None

    def seal(self, text: str, column: str) -> str:
        if self.first is None or self.first_prefix is None:
            return _plain(text)
        nonce = os.urandom(NONCE_BYTES)
        head = self.first_prefix
        sealed = self.first.aead.encrypt(nonce, text.encode("utf-8"), _aad(head, column))
        # Standard base64 through binascii: urlsafe_b64* translate the text first, which
        # costs more than the decryption itself on every row of a rebuild.
        return head + binascii.b2a_base64(nonce + sealed, newline=False).decode("ascii")

    def unseal(self, stored: str, column: str) -> str:
        kid, _, body = stored[len(PREFIX) :].partition(":")
        key = self.by_id.get(kid)
        if key is None:
            raise UndecryptableValue(column, kid, "which ENCRYPTION_KEYS does not hold")
        try:
            blob = binascii.a2b_base64(body, strict_mode=True)
            plain = key.aead.decrypt(
                blob[:NONCE_BYTES], blob[NONCE_BYTES:], _aad(f"{PREFIX}{kid}:", column)
            )
        except (InvalidTag, binascii.Error, ValueError):
            raise UndecryptableValue(
                column, kid, "but it does not decrypt: altered, or copied from another column"
            ) from None
        return plain.decode("utf-8")


def _plain(text: str) -> str:
    return RAW + text if text.startswith(MARKED) else text


def _aad(head: str, column: str) -> bytes:
    return f"{head}{column}".encode()


@functools.lru_cache(maxsize=4)
def _keyring(keys: tuple[str | None, ...]) -> Keyring:
    return Keyring(keys)


def keyring() -> Keyring | None:
    """The keyring of ENCRYPTION_KEYS now (None: encryption is off)."""
    keys = app_settings.ENCRYPTION_KEYS
    if not keys:
        return None
    if not isinstance(keys, list | tuple) or not all(
        key is None or isinstance(key, str) for key in keys
    ):
        # Refused by the system checks (E060, E061); said the same way here rather than as a
        # TypeError of the cache (an unhashable entry) or a key taken letter by letter.
        raise InvalidKey("ENCRYPTION_KEYS must be a list of key strings")
    return _keyring(tuple(keys))


def enabled() -> bool:
    """Whether values may be stored encrypted (some key is configured, to write or to read)."""
    return any(key is not None for key in app_settings.ENCRYPTION_KEYS or ())


def seal(text: str, column: str) -> str:
    """``text`` as ``column`` stores it: encrypted under the first key, or as it is (marked,
    if it could be taken for ciphertext) when no key is configured."""
    ring = keyring()
    return _plain(text) if ring is None else ring.seal(text, column)


def unseal(stored: str, column: str, ring: Keyring | bool | None = True) -> str:
    """The text a value of ``column`` stands for, plain or encrypted; ``UndecryptableValue``
    when its key is not configured. ``ring``: the keyring to use, when the caller read it
    once for many values (True: read ENCRYPTION_KEYS now)."""
    if not stored.startswith(MARKED):
        return stored
    if stored.startswith(RAW):
        return stored[len(RAW) :]
    if not stored.startswith(PREFIX):
        return stored
    if ring is True:
        ring = keyring()
    if not isinstance(ring, Keyring):
        kid = stored[len(PREFIX) :].partition(":")[0]
        raise UndecryptableValue(column, kid, "and ENCRYPTION_KEYS is empty")
    return ring.unseal(stored, column)


def is_sealed(stored: str | None) -> bool:
    return stored is not None and stored.startswith(PREFIX)


# Inside ``lenient()``: the reasons of the values that did not decrypt (fields read them as
# None instead of raising), so that a claim that takes several runs is not undone by one.
# Inside ``shown()``: the string SHOWN, so that a page names the problem instead of failing.
SHOWN = "shown"
_PROBLEMS: contextvars.ContextVar[list[str] | str | None] = contextvars.ContextVar(
    "durable_agents_undecryptable", default=None
)


class Unreadable(str):
    """What a field reads, inside ``shown()``, for a value that does not decrypt: the reason,
    as text (a JSON field gives it as is, unparsed)."""

    __slots__ = ()


@contextlib.contextmanager
def lenient() -> Iterator[list[str]]:
    """Fields read in this block give None for a value that does not decrypt, and its reason
    is appended to the list yielded."""
    problems: list[str] = []
    token = _PROBLEMS.set(problems)
    try:
        yield problems
    finally:
        _PROBLEMS.reset(token)


@contextlib.contextmanager
def shown() -> Iterator[None]:
    """Fields read in this block give ``Unreadable("[cannot decrypt: reason]")`` for a value
    that does not decrypt: for pages that only show what they read (the admin's GETs)."""
    token = _PROBLEMS.set(SHOWN)
    try:
        yield
    finally:
        _PROBLEMS.reset(token)


def unseal_field(stored: str, column: str) -> str | None:
    """``unseal`` for a field's ``from_db_value``: lenient inside ``lenient()``, an
    ``Unreadable`` inside ``shown()``."""
    try:
        return unseal(stored, column)
    except UndecryptableValue as exc:
        problems = _PROBLEMS.get()
        if problems is None:
            raise
        if isinstance(problems, str):
            return Unreadable(f"[cannot decrypt: {exc}]")
        problems.append(str(exc))
        return None
    except InvalidKey as exc:
        # A malformed ENCRYPTION_KEYS (the system checks refuse it at start-up): a page that
        # only shows what it reads names the problem instead of failing; anything that
        # would write or run goes on raising.
        if _PROBLEMS.get() != SHOWN:
            raise
        return Unreadable(f"[cannot decrypt: {exc}]")
