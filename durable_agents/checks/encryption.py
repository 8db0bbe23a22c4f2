"""``ENCRYPTION_KEYS`` (E060 to E062): a list, each key well formed, no key twice."""

from __future__ import annotations

from django.core.checks import CheckMessage, Error

from durable_agents.conf import app_settings

# ENCRYPTION_KEYS: not a list of strings; a key that is not urlsafe base64 of 32 bytes; one key
# twice (its second place would be dead weight, and likely a copy-paste slip).
ENCRYPTION_CHECK_IDS = {
    "list": "durable_agents.E060",
    "key": "durable_agents.E061",
    "twice": "durable_agents.E062",
}
KEY_HINT = (
    "Each key is 32 random bytes in urlsafe base64 (44 characters); "
    "`manage.py durable_agents_rotate_keys --new-key` prints one."
)


def bad_encryption_keys() -> list[CheckMessage]:
    """Malformed keys, named by their position, never shown."""
    from durable_agents._internal.encryption import InvalidKey, key_id, parse_key

    keys = app_settings.ENCRYPTION_KEYS
    if not isinstance(keys, list | tuple):
        return [
            Error(
                "DURABLE_AGENTS['ENCRYPTION_KEYS'] must be a list of keys, not "
                f"{type(keys).__name__}.",
                hint=KEY_HINT,
                id=ENCRYPTION_CHECK_IDS["list"],
            )
        ]
    messages: list[CheckMessage] = []
    seen: dict[str, int] = {}
    for position, text in enumerate(keys):
        if position == 0 and text is None:
            continue  # write plain text; the keys after it decrypt
        try:
            kid = key_id(parse_key(text, position))
        except InvalidKey as exc:
            messages.append(
                Error(f"DURABLE_AGENTS: {exc}.", hint=KEY_HINT, id=ENCRYPTION_CHECK_IDS["key"])
            )
            continue
        if kid in seen:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['ENCRYPTION_KEYS'][{position}] is the same key as "
                    f"[{seen[kid]}] (key id {kid}).",
                    id=ENCRYPTION_CHECK_IDS["twice"],
                )
            )
        seen.setdefault(kid, position)
    return messages
