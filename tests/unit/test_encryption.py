"""The codec of encryption at rest (encryption.py), the encrypted fields and the key checks."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from durable_agents import checks as da_checks
from durable_agents._internal import encryption
from durable_agents._internal.encryption import InvalidKey, Keyring, UndecryptableValue
from durable_agents.models import AgentQuestion, AgentRun, AgentStep, ToolEffect

KEY_A = base64.urlsafe_b64encode(b"A" * 32).decode()
KEY_B = base64.urlsafe_b64encode(b"B" * 32).decode()
COLUMN = "agent_step.payload"
# Thinking text, key order, escapes, astral characters, a lone-surrogate escape: all kept.
TEXT = '{"z":1,"a":"caf\\u00e9 \u2603 \U0001f600","thinking":"x\\ud800y",  "b" : [ ]}'


@pytest.fixture
def keys(settings: Any) -> Any:
    def use(*keys: str) -> None:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "ENCRYPTION_KEYS": list(keys)}

    return use


def test_a_value_reads_back_exactly_and_names_its_key_not_the_key(keys: Any) -> None:
    keys(KEY_A)
    sealed = encryption.seal(TEXT, COLUMN)
    kid = encryption.key_id(b"A" * 32)
    assert sealed.startswith(f"da:enc:v1:{kid}:")
    assert KEY_A not in sealed
    assert "thinking" not in sealed
    assert encryption.unseal(sealed, COLUMN) == TEXT
    assert encryption.seal(TEXT, COLUMN) != sealed  # a fresh nonce each time


def test_every_key_decrypts_the_first_encrypts(keys: Any) -> None:
    keys(KEY_A)
    old = encryption.seal(TEXT, COLUMN)
    keys(KEY_B, KEY_A)
    assert encryption.unseal(old, COLUMN) == TEXT
    assert encryption.seal(TEXT, COLUMN).startswith(f"da:enc:v1:{encryption.key_id(b'B' * 32)}:")


def test_plain_rows_read_as_they_are(keys: Any) -> None:
    keys(KEY_A)
    assert encryption.unseal(TEXT, COLUMN) == TEXT
    assert encryption.unseal("", COLUMN) == ""


def test_a_ciphertext_is_bound_to_its_column(keys: Any) -> None:
    keys(KEY_A)
    sealed = encryption.seal(TEXT, COLUMN)
    with pytest.raises(UndecryptableValue, match="copied from another column"):
        encryption.unseal(sealed, "tool_effect.result")


def test_an_altered_ciphertext_is_refused(keys: Any) -> None:
    keys(KEY_A)
    sealed = encryption.seal(TEXT, COLUMN)
    at = len(sealed) // 2  # inside the ciphertext, not in the padding bits of the tail
    flipped = sealed[:at] + ("A" if sealed[at] != "A" else "B") + sealed[at + 1 :]
    with pytest.raises(UndecryptableValue, match="altered"):
        encryption.unseal(flipped, COLUMN)


def test_a_missing_key_is_named_by_its_id(keys: Any) -> None:
    keys(KEY_A)
    sealed = encryption.seal(TEXT, COLUMN)
    kid = encryption.key_id(b"A" * 32)
    keys(KEY_B)
    with pytest.raises(
        UndecryptableValue, match=f"agent_step.payload is encrypted with key id {kid}"
    ):
        encryption.unseal(sealed, COLUMN)
    keys()
    with pytest.raises(UndecryptableValue, match="ENCRYPTION_KEYS is empty"):
        encryption.unseal(sealed, COLUMN)


def test_plain_text_that_looks_like_ciphertext_is_kept_apart(keys: Any) -> None:
    keys()
    looks = "da:enc:v1:00000000:bm90IGEgY2lwaGVydGV4dA=="
    stored = encryption.seal(looks, "agent_question.answer")
    assert stored != looks
    assert encryption.unseal(stored, "agent_question.answer") == looks
    assert encryption.seal(TEXT, COLUMN) == TEXT  # JSON text is stored as it is


def test_lenient_reads_note_the_reason_instead_of_raising(keys: Any) -> None:
    keys(KEY_A)
    sealed = encryption.seal(TEXT, COLUMN)
    keys(KEY_B)
    with encryption.lenient() as problems:
        assert encryption.unseal_field(sealed, COLUMN) is None
    assert problems
    assert "key id" in problems[0]
    with pytest.raises(UndecryptableValue):
        encryption.unseal_field(sealed, COLUMN)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("not base64!", "ENCRYPTION_KEYS\\[0\\] is not urlsafe base64"),
        (base64.urlsafe_b64encode(b"short").decode(), "decodes to 5 bytes"),
        (42, "must be a string, not int"),
    ],
)
def test_malformed_keys_are_refused_without_showing_them(key: Any, message: str) -> None:
    with pytest.raises(InvalidKey, match=message) as raised:
        Keyring([key])
    assert str(key) not in str(raised.value) or isinstance(key, int)


def test_the_fields_encrypt_what_they_write(keys: Any) -> None:
    keys(KEY_A)
    step = AgentStep._meta.get_field("payload")
    stored = step.get_prep_value(TEXT)
    assert encryption.is_sealed(stored)
    assert step.from_db_value(stored, None, None) == TEXT
    result = ToolEffect._meta.get_field("result")
    stored = result.get_prep_value({"a": [1, "x"]})
    assert encryption.is_sealed(stored)
    assert result.from_db_value(stored, None, None) == {"a": [1, "x"]}
    with pytest.raises(UndecryptableValue):  # bound to tool_effect.result, not the step
        step.from_db_value(stored, None, None)
    answer = AgentQuestion._meta.get_field("answer")
    assert encryption.is_sealed(answer.get_prep_value("eu-west"))
    assert AgentRun._meta.get_field("wait_runs").get_prep_value(["x"]) == '["x"]'


def test_encryption_is_not_part_of_the_schema() -> None:
    # No migration turns it on: the fields deconstruct as before.
    _, path, _, kwargs = AgentStep._meta.get_field("payload").deconstruct()
    assert (path, kwargs) == ("django.db.models.TextField", {})
    _, path, _, kwargs = ToolEffect._meta.get_field("result").deconstruct()
    assert (path, kwargs) == ("durable_agents.models.JSONTextField", {})


# --------------------------------------------------------------------------- checks


def check_ids(settings: Any, value: Any) -> list[str]:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "ENCRYPTION_KEYS": value}
    return sorted(str(m.id) for m in da_checks.check_settings())


def test_the_checks_of_encryption_keys(settings: Any) -> None:
    settings.DEBUG = True
    assert check_ids(settings, [KEY_A, KEY_B]) == []
    assert check_ids(settings, KEY_A) == ["durable_agents.E060"]
    assert check_ids(settings, [KEY_A, "nope"]) == ["durable_agents.E061"]
    assert check_ids(settings, [KEY_A, KEY_A]) == ["durable_agents.E062"]


def test_a_malformed_key_check_names_its_place_never_the_key(settings: Any) -> None:
    settings.DEBUG = True
    secret = base64.urlsafe_b64encode(b"x" * 31).decode()
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "ENCRYPTION_KEYS": [KEY_A, secret]}
    (message,) = da_checks.check_settings()
    assert "ENCRYPTION_KEYS[1] decodes to 31 bytes" in message.msg
    assert secret not in message.msg
    assert secret not in str(message.hint)
    assert KEY_A not in message.msg


def test_a_first_entry_of_none_writes_plain_text_and_the_keys_after_it_decrypt(
    keys: Any, settings: Any
) -> None:
    # The first phase of turning encryption on (or off) across a rolling deploy: every process
    # can read what any other writes, and none encrypts yet.
    keys(KEY_A)
    old = encryption.seal(TEXT, COLUMN)
    keys(None, KEY_A)
    assert encryption.seal(TEXT, COLUMN) == TEXT
    assert encryption.unseal(old, COLUMN) == TEXT
    assert encryption.enabled()
    settings.DEBUG = True
    assert check_ids(settings, [None, KEY_A]) == []
    assert check_ids(settings, [KEY_A, None]) == ["durable_agents.E061"]
