"""How the admin prints things: times, ages, badges, JSON, texts cut to a bound."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db import connection
from django.http import HttpResponse
from django.template.loader import render_to_string
from django.utils import dateformat, timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext, gettext_noop, pgettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal import encryption
from durable_agents._internal.deepjson import dumps_deep, loads_deep
from durable_agents._internal.text import (
    count_invisible,
    invisible_warning,
    reveal_invisible,
    revealed,
    storable_text,
)
from durable_agents.models import (
    AgentQuestion,
    AgentRun,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
)

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


# Fixed colours per status: the only values interpolated into a style attribute.
RUN_COLORS: dict[str, str] = {
    RunStatus.PENDING: "#6c757d",
    RunStatus.RUNNING: "#0b6bcb",
    RunStatus.WAITING: "#b35c00",
    RunStatus.SUCCEEDED: "#1a7f37",
    RunStatus.FAILED: "#c62828",
    RunStatus.CANCELLED: "#57606a",
    RunStatus.DEAD: "#6f2da8",
}
QUESTION_COLORS: dict[str, str] = {
    QuestionStatus.OPEN: "#b35c00",
    QuestionStatus.ANSWERED: "#1a7f37",
    QuestionStatus.CANCELLED: "#57606a",
}
INTENT_COLORS: dict[str, str] = {
    IntentStatus.PENDING: "#b35c00",
    IntentStatus.APPROVED: "#0b6bcb",
    IntentStatus.REJECTED: "#c62828",
    IntentStatus.EXECUTING: "#0b6bcb",
    IntentStatus.DONE: "#1a7f37",
    IntentStatus.UNKNOWN: "#6f2da8",
}

HOUR_CHART_HEIGHT = 100


# Short labels for the runs list, where "Waiting for a person" would widen the column.
RUN_SHORT_LABELS: dict[str, StrOrPromise] = {
    RunStatus.PENDING: _("Pending"),
    RunStatus.RUNNING: _("Running"),
    RunStatus.WAITING: _("Waiting"),
    RunStatus.SUCCEEDED: _("Succeeded"),
    RunStatus.FAILED: _("Failed"),
    RunStatus.CANCELLED: _("Cancelled"),
    RunStatus.DEAD: _("Dead"),
}
# The statuses as the operations page names them (lowercase, as the status values read).
RUN_STATUS_NAMES: dict[str, StrOrPromise] = {
    RunStatus.PENDING: _("pending"),
    RunStatus.RUNNING: _("running"),
    RunStatus.WAITING: _("waiting"),
    RunStatus.SUCCEEDED: _("succeeded"),
    RunStatus.FAILED: _("failed"),
    RunStatus.CANCELLED: _("cancelled"),
    RunStatus.DEAD: _("dead"),
}

# One format for every time the admin prints: fields, columns and the transcript.
TIME_FORMAT = "Y-m-d H:i:s"


def badge(
    status: str, label: StrOrPromise, colors: dict[str, str], title: StrOrPromise = ""
) -> SafeString:
    if title:
        return format_html(
            '<span class="da-badge" style="background-color:{}" title="{}">{}</span>',
            colors.get(status, "#57606a"),
            title,
            label,
        )
    return format_html(
        '<span class="da-badge" style="background-color:{}">{}</span>',
        colors.get(status, "#57606a"),
        label,
    )


def format_time(value: datetime.datetime | None, fmt: str = TIME_FORMAT) -> str:
    """A datetime in the current time zone as ``fmt`` (a ``date`` filter format)."""
    if value is None:
        return ""
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return dateformat.format(value, fmt)


def compact_age(since: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """``45s``, ``12m``, ``3h``, ``2d``: the list's age column in a few characters."""
    seconds = max(int(((now or timezone.now()) - since).total_seconds()), 0)
    if seconds >= 86_400:
        return pgettext("compact age", "%(count)sd") % {"count": seconds // 86_400}
    if seconds >= 3_600:
        return pgettext("compact age", "%(count)sh") % {"count": seconds // 3_600}
    if seconds >= 60:
        return pgettext("compact age", "%(count)sm") % {"count": seconds // 60}
    return pgettext("compact age", "%(count)ss") % {"count": seconds}


def lease_summary(
    owner: str | None, until: datetime.datetime | None, now: datetime.datetime | None = None
) -> SafeString | None:
    """The list's lease column: the owner, then "until HH:MM:SS" or "expired"; None if free."""
    if not owner and until is None:
        return None
    if until is None:
        state = ""
    elif until > (now or timezone.now()):
        state = gettext("until %(time)s") % {"time": format_time(until, "H:i:s")}
    else:
        state = gettext("expired")
    # Worker ids read host:pid:suffix; a narrow column may break them after a colon only.
    shown = Truncator(owner or "—").chars(24).split(":")
    return format_html(
        '<span class="da-lease" title="{}">{}</span>{}',
        owner or "",
        format_html_join(mark_safe(":<wbr>"), "{}", ((part,) for part in shown)),
        format_html('<br><span class="da-meta">{}</span>', state) if state else "",
    )


def pretty_json(value: Any) -> str:
    """``value`` as indented JSON; a value nested too deep for the indenting encoder (it
    recurses per level) is printed compact at any depth, and one that cannot be printed
    says so."""
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        pass
    try:
        return dumps_deep(value)
    except (TypeError, ValueError) as exc:
        return gettext("[a JSON value that cannot be shown: %(error)s]") % {
            "error": type(exc).__name__
        }


def audits_values() -> bool:
    """Whether an admin LogEntry may quote the value a person typed (an answer, an event
    payload, a recorded result). Not once ENCRYPTION_KEYS holds a key: those values are
    encrypted at rest, and ``django_admin_log.change_message`` is plain text that every dump,
    backup and replica carries. The entry then says what was done and by whom, never what."""
    return not encryption.enabled()


def load_json(text: str) -> Any:
    """``json.loads`` at any depth (``deepjson``); text that is not JSON raises ValueError
    (a page then shows the text as it is)."""
    return loads_deep(text)


def shown_json(value: Any) -> str:
    """``pretty_json`` that a page can always encode (lone surrogates and NUL marked)."""
    return storable_text(pretty_json(value))


def intent_fingerprint(intent: ToolIntent) -> str:
    """What a person saw when asked to approve ``intent``: its id, run, tool and input.

    The approving POST carries this back; the view approves only when it still matches, so
    what is approved is exactly what was shown. ASCII JSON, so that any value (lone
    surrogates included) has one text and one hash.
    """
    canonical = json.dumps(
        [intent.pk, str(intent.run_id), intent.tool, intent.input],
        ensure_ascii=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def sql_literal_id(run_id: Any) -> str:
    """The run id as the database stores it: a uuid on PostgreSQL, 32 hex digits on SQLite."""
    return run_id.hex if connection.vendor == "sqlite" else str(run_id)


def sql_hint(run: AgentRun) -> str:
    rid = sql_literal_id(run.pk)
    return (
        f"SELECT status, attempt, lease_owner, lease_until, last_seq, error\n"
        f"  FROM agent_run WHERE id = '{rid}';\n"
        f"SELECT seq, kind, request_id, attempt, worker, created_at, payload\n"
        f"  FROM agent_step WHERE run_id = '{rid}' ORDER BY seq;\n"
        f"SELECT seq, call_index, tool, is_error, key, result\n"
        f"  FROM tool_effect WHERE run_id = '{rid}' ORDER BY seq, call_index;\n"
        f"SELECT id, seq, call_index, tool, status, decided_by_id, decided_at, reason\n"
        f"  FROM tool_intent WHERE run_id = '{rid}' ORDER BY seq, call_index;"
        + (FORK_HINT.format(rid=rid) if run.fork_seq is not None else "")
    ) + (ENCRYPTED_HINT.format(run_id=run.pk) if encryption.enabled() else "")


# A fork's steps before its fork point are rows of other runs (agent_step_share names the
# stretches): the query above shows only its own rows, this one the whole log.
FORK_HINT = (
    "\n-- A fork: its whole log, the stretches it shares (agent_step_share) included.\n"
    "SELECT seq, kind, run_id, payload FROM agent_step WHERE run_id = '{rid}'\n"
    "UNION ALL\n"
    "SELECT s.seq, s.kind, s.run_id, s.payload\n"
    "  FROM agent_step_share h\n"
    "  JOIN agent_step s ON s.run_id = h.source_id AND s.seq >= h.lo AND s.seq < h.hi\n"
    " WHERE h.fork_id = '{rid}'\n"
    " ORDER BY 1;"
)


# With ENCRYPTION_KEYS, payload and result read as ciphertext in SQL: how to read them.
ENCRYPTED_HINT = (
    "\n-- payload and result are encrypted (da:enc:v1:...); in plain text:\n"
    "--   python manage.py durable_agents_decrypt --run {run_id}\n"
    "--   ... | python manage.py durable_agents_decrypt --column tool_effect.result"
)


# ---------------------------------------------------------------------------------------------
# Text shown on a page: never crashes the encoder, never unbounded

# A text longer than this is cut on the run page, with a link to the whole (a model turn or
# a tool result can be megabytes; the page must stay small whatever the run did).
TEXT_SHOWN_CHARS = 4_000


@dataclass
class Text:
    """A string for a template: storable (encodable), cut to a bound, with where the whole is."""

    text: str
    length: int  # of the whole text
    url: str = ""  # the whole text, when there is a view for it
    cut: bool = False


def shown_text(value: Any, url: str = "", limit: int = TEXT_SHOWN_CHARS) -> Text:
    """``value`` as a ``Text``: NUL and lone surrogates marked (``storable_text``), cut to
    ``limit`` characters. The cut happens before the markers, so a huge text is never copied
    whole."""
    text = value if isinstance(value, str) else storable_text(value)
    if len(text) > limit:
        return Text(storable_text(text[:limit]), len(text), url, cut=True)
    return Text(storable_text(text), len(text), url)


def revealed_excerpt(text: str, limit: int) -> SafeString:
    """A list column's excerpt of ``text``: at most ``limit`` characters, its invisible and
    direction-changing characters drawn as markers, after a warning that counts those of the
    whole ``text`` (an excerpt must not hide one past its cut)."""
    excerpt, _shown = reveal_invisible(Truncator(text).chars(limit))
    return format_html("{}{}", invisible_warning(count_invisible(text)), excerpt)


def cut_at_word(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis;
    and whether it was cut. A single word longer than the limit is cut where it must be."""
    if len(text) <= limit:
        return text, False
    head = text[: limit + 1]
    space = max(head.rfind(" "), head.rfind("\t"))
    # A space in the second half: cut there; otherwise one long word, cut where we must.
    head = head[:space] if space > limit // 2 else head[:limit]
    return head.rstrip() + "…", True


@dataclass
class IntentLine:
    """What a person decided about an irreversible call, and then what became of the call.

    Kept apart so that "approved by operator" never reads as "operator ran it".
    """

    decision: str  # "approved", "rejected" or "awaiting a decision"
    by: str = ""
    at: str = ""
    reason: str = ""
    outcome: str = ""  # "done", "done: the tool raised", "running", "not run yet", ...
    action: str = ""  # what a person should do on the intent page, if anything
    state: str = ""  # the intent status, for the CSS class
    raised: bool = False  # done, but the tool raised: the outcome is an error


INTENT_OUTCOMES: dict[str, StrOrPromise] = {
    IntentStatus.APPROVED: _("not run yet"),
    IntentStatus.EXECUTING: _("running"),
    IntentStatus.DONE: _("done"),
    IntentStatus.UNKNOWN: _("outcome unknown"),
    IntentStatus.REJECTED: _("not run"),
}
# A done intent whose tool raised: not a success, whatever the status says. The English
# text (marked for the catalogue); pages show gettext(RAISED_LABEL).
RAISED_LABEL = gettext_noop("done: the tool raised")
RAISED_TITLE = _("the call ran and the tool raised: the model received an error result")
RAISED_COLOR = "#c2410c"


# Short labels for the intents list, where "Pending approval" would widen the column.
INTENT_SHORT_LABELS: dict[str, StrOrPromise] = {
    IntentStatus.PENDING: _("Pending"),
    IntentStatus.UNKNOWN: _("Unknown"),
}


def intent_badge(intent: ToolIntent, raised: bool | None = None, short: bool = False) -> SafeString:
    """The status badge of an intent; a done intent whose effect is an error reads so.

    ``raised`` defaults to the ``_raised`` annotation of the admin's queryset.
    """
    if raised is None:
        raised = bool(getattr(intent, "_raised", False))
    if intent.status == IntentStatus.DONE and raised:
        return format_html(
            '<span class="da-badge da-raised" style="background-color:{}" title="{}">{}</span>',
            RAISED_COLOR,
            RAISED_TITLE,
            gettext(RAISED_LABEL),
        )
    label = intent.get_status_display()
    if short:
        return badge(
            intent.status, INTENT_SHORT_LABELS.get(intent.status, label), INTENT_COLORS, label
        )
    return badge(intent.status, label, INTENT_COLORS)


def describe_intent(intent: ToolIntent, effect: ToolEffect | None = None) -> IntentLine:
    """The transcript's intent line (uses ``decided_by``: select it with the intent)."""
    if intent.status == IntentStatus.PENDING:
        return IntentLine(
            gettext("awaiting a decision"), action=gettext("decide it"), state=intent.status
        )
    decided_by = intent.decided_by
    raised = intent.status == IntentStatus.DONE and effect is not None and effect.is_error
    return IntentLine(
        decision=gettext("rejected")
        if intent.status == IntentStatus.REJECTED
        else gettext("approved"),
        by=storable_text(decided_by.get_username()) if decided_by is not None else "",
        at=format_time(intent.decided_at),
        reason=storable_text(intent.reason),
        outcome=gettext(RAISED_LABEL)
        if raised
        else str(INTENT_OUTCOMES.get(intent.status, intent.get_status_display().lower())),
        action=gettext("resolve it") if intent.status == IntentStatus.UNKNOWN else "",
        state=intent.status,
        raised=raised,
    )


def question_badge(question: AgentQuestion) -> SafeString:
    return badge(question.status, question.get_status_display(), QUESTION_COLORS)


def plain_text_response(text: str) -> HttpResponse:
    """The whole of a text that a page showed cut: plain text that a browser never sniffs
    into HTML, nor runs anything from."""
    response = HttpResponse(storable_text(text), content_type="text/plain; charset=utf-8")
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "default-src 'none'; sandbox"
    response["Content-Disposition"] = "inline"
    return response


def time_field(field_name: str, description: StrOrPromise) -> Callable[[Any, Any], str]:
    """A read-only field or column printing ``field_name`` as ``TIME_FORMAT``.

    Django prints datetimes in the locale's format ("Dec. 2, 2026, 4:51 p.m."); the transcript
    prints them as ISO-like times, and so does every page of the admin through these.
    """

    @admin.display(description=description, ordering=field_name)
    def show(self: admin.ModelAdmin[Any], obj: Any) -> str:
        return format_time(getattr(obj, field_name)) or self.get_empty_value_display()

    show.__name__ = f"{field_name}_display"
    return show


def revealed_field(field_name: str, description: StrOrPromise) -> Callable[[Any, Any], str]:
    """A read-only field printing the text ``field_name`` with its invisible and
    direction-changing characters drawn as markers (Django would print them as they are)."""

    @admin.display(description=description, ordering=field_name)
    def show(self: admin.ModelAdmin[Any], obj: Any) -> str:
        value = getattr(obj, field_name)
        return revealed(value) if value else self.get_empty_value_display()

    show.__name__ = f"{field_name}_shown"
    return show


def text_html(text: Text) -> SafeString:
    """A possibly cut text as a read-only field: the transcript's markup (its template, with
    autoescape on, and its translated words)."""
    html = render_to_string("admin/durable_agents/includes/text.html", {"t": text})
    return mark_safe(html.strip())  # the template escaped every value in it


def created_title(obj: Any) -> str:
    """The title of a list's age line: when the object was created."""
    return gettext("created %(time)s") % {"time": format_time(obj.created_at)}


def ago(when: Any) -> str:
    """``3h ago``: the age under an id or a name in a list."""
    return gettext("%(age)s ago") % {"age": compact_age(when)}


def number_and_age(pk: Any, created_at: Any, title: str) -> SafeString:
    """A list's id column: ``#12``, and under it its age (``title`` on hover: when)."""
    if not created_at:
        return format_html("#{}", pk)
    return format_html(
        '#{}<br><span class="da-meta" title="{}">{}</span>', pk, title, ago(created_at)
    )
