"""The forms of the admin's POST views and confirmation pages."""

from __future__ import annotations

import json
from typing import Any, cast

from django import forms
from django.core.exceptions import ValidationError
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.text import Unstorable, check_depth, has_unstorable, storable_text
from durable_agents.declare.agents import registry

# What the model is told when a person rejects its call.
REASON_MAX_CHARS = 5_000
# An answer to a question (the model reads it as the ask_person result).
ANSWER_MAX_CHARS = 20_000
# The JSON text of an event's payload typed into a form.
PAYLOAD_MAX_CHARS = 100_000


def no_unstorable(value: str) -> None:
    # Django's CharField already refuses NUL; a lone surrogate cannot be encoded either.
    if has_unstorable(value):
        raise ValidationError(
            gettext("Remove the NUL character or unpaired surrogate from this text.")
        )


class StartRunForm(forms.Form):
    agent = forms.ChoiceField(
        label=_("Agent"), help_text=_("Registered agents, as name @ version.")
    )
    task = forms.CharField(
        label=_("Task"),
        widget=forms.Textarea(attrs={"rows": 10, "cols": 80}),
        validators=[no_unstorable],
    )
    # A choice, not free text: a run may only pin a model that a registered version of its
    # agent declares (one that its prompts and tools were written for).
    model = forms.ChoiceField(
        label=_("Model"),
        required=False,
        help_text=_(
            "Leave empty for the model of the chosen version; otherwise one of the models "
            "that the agent's registered versions use."
        ),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agents = sorted(registry.all(), key=lambda a: (a.name, a.version))
        # The value is JSON so that any character in a name or version survives the round trip.
        cast(forms.ChoiceField, self.fields["agent"]).choices = [
            (json.dumps([a.name, a.version]), f"{a.name} @ {a.version} ({a.model})") for a in agents
        ]
        self.models_by_agent: dict[str, set[str]] = {}
        for agent in agents:
            self.models_by_agent.setdefault(agent.name, set()).add(agent.model)
        users: dict[str, list[str]] = {}
        for name, models in self.models_by_agent.items():
            for model in models:
                users.setdefault(model, []).append(name)
        cast(forms.ChoiceField, self.fields["model"]).choices = [
            ("", gettext("The chosen version's own model")),
            *(
                (
                    model,
                    gettext("%(model)s (for %(agents)s)")
                    % {"model": model, "agents": ", ".join(users[model])},
                )
                for model in sorted(users)
            ),
        ]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        agent, model = data.get("agent"), data.get("model")
        if agent and model:
            name = json.loads(agent)[0]
            allowed = self.models_by_agent.get(name, set())
            if model not in allowed:
                self.add_error(
                    "model",
                    gettext(
                        "%(model)s is not a model of agent %(agent)s; its versions use %(models)s."
                    )
                    % {
                        "model": model,
                        "agent": name,
                        "models": ", ".join(sorted(allowed)) or gettext("none"),
                    },
                )
        return data


class AnswerForm(forms.Form):
    """The answer to a run's question: the ask_person tool's result, with who and when."""

    # The question the page showed: the answer goes to that one or nowhere.
    question = forms.IntegerField(widget=forms.HiddenInput, min_value=1, max_value=2**63 - 1)
    answer = forms.CharField(
        label=_("Your answer (the model reads it, with your name)"),
        max_length=ANSWER_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        validators=[no_unstorable],
        error_messages={"required": _("Write an answer: the model reads it, and you are named.")},
    )


def parse_payload(text: str) -> Any:
    """An event payload typed into a form: JSON (any value), empty for null. Raises
    ValidationError with a reason a person can act on; never a RecursionError."""
    text = text.strip()
    if not text:
        return None
    try:
        value = loads_deep(text)  # any depth without recursion; then bounded
    except ValueError as exc:
        raise ValidationError(
            gettext("The payload is not JSON: %(error)s") % {"error": storable_text(exc, 200)}
        ) from None
    try:
        check_depth(value)
    except Unstorable as exc:
        # exc reads "is nested deeper than ...": the sentence's predicate.
        raise ValidationError(gettext("The payload %(problem)s.") % {"problem": exc}) from None
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValidationError(
            gettext("The payload is not JSON: NaN and Infinity are not.")
        ) from None
    return value


class EventPayloadForm(forms.Form):
    payload = forms.CharField(
        label=_("Payload (JSON; empty for null)"),
        required=False,
        strip=False,
        max_length=PAYLOAD_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60, "spellcheck": "false"}),
        help_text=_('What each woken run receives as woken_by["payload"], e.g. {"status": "ok"}.'),
    )

    def clean_payload(self) -> Any:
        return parse_payload(self.cleaned_data.get("payload") or "")


class MarkedTextInput(forms.TextInput):
    """A text input whose value holds no invisible or direction-changing character as it is:
    each is written as a character reference, so the browser still posts the value exactly.
    An input cannot draw markers, so when there is any such character the value is shown
    above it with its markers, after the warning."""

    template_name = "durable_agents/widgets/marked_text_input.html"


class MarkedTextarea(forms.Textarea):
    """MarkedTextInput's textarea: the value with its markers above it, the exact value in it."""

    template_name = "durable_agents/widgets/marked_textarea.html"


class SendEventForm(EventPayloadForm):
    name = forms.CharField(
        label=_("Name"),
        max_length=200,
        validators=[no_unstorable],
        widget=MarkedTextInput,
        help_text=_(
            "The name the runs wait on (Wait(event=name)). An event is sent once: "
            "sending a name again changes nothing."
        ),
    )
    # Django's Form declares it per instance (a ClassVar would not type-check).
    field_order = ["name", "payload"]  # noqa: RUF012


class RejectForm(forms.Form):
    reason = forms.CharField(
        label=_("Reason (the model sees it)"),
        max_length=REASON_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        validators=[no_unstorable],
        error_messages={"required": _("Say why: the model reads the reason and you are named.")},
    )


class ResolveForm(forms.Form):
    happened = forms.ChoiceField(
        choices=[("yes", "yes"), ("no", "no")],
        error_messages={"required": _("Say whether the call happened.")},
    )
    result = forms.CharField(required=False, strip=False, validators=[no_unstorable])
    reason = forms.CharField(
        required=False, max_length=REASON_MAX_CHARS, validators=[no_unstorable]
    )
