"""Bad input is reported as bad input, before any I/O: enqueue options out of range,
text PostgreSQL cannot store (refused alike wherever it is), bad values given to the
constructors; and a public dashboard needs a strong token."""

from __future__ import annotations

import datetime as dt
import secrets

import pytest

import cyclone_mp as cy
from cyclone_mp.errors import ConfigurationError, PayloadError, UnstorableText

import handlers as h


# -- 6. bad input is reported as bad input (the API) ---------------------------------------------


@pytest.mark.parametrize("options,words", [
    ({"timeout": 1e300}, "timeout must be at most 100 years"),
    ({"timeout": dt.timedelta.max}, "timeout must be at most 100 years"),
    ({"delay": 1e300}, "delay must be at most 100 years"),
    ({"scheduled_at": "tomorrow"}, "scheduled_at must be a timezone-aware datetime, not str"),
    ({"priority": 2**40}, "priority must be an int from -2147483648 to 2147483647"),
    ({"max_attempts": 2**40}, "max_attempts must be an int from 1 to 2147483647"),
    ({"max_reclaims": 2**40}, "max_reclaims must be an int from 0 to 2147483647"),
    ({"queue": "q" * 10_000}, "queue must be at most 200 characters"),
    ({"queue": "bad\x00queue"}, "queue cannot be stored in PostgreSQL: it contains a NUL character"),
    ({"queue": "bad\x07queue"}, "queue must not contain control characters"),
])
def test_enqueue_options_out_of_range_are_configuration_errors(options, words):
    """Issue 18 fault 6: these reached the database (bigint out of range, NOTIFY payload
    too long) or raised AttributeError; each is now a ConfigurationError before any I/O."""
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected", cy.Mux().register(h.ok))
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(")):
        client.enqueue(h.ok, {}, **options)


NOT_STORABLE = [("a\ud800b", "a lone surrogate (text that is not valid Unicode)"),
                ("a\x00b", "a NUL character (\\u0000)")]


@pytest.mark.parametrize("text,problem", NOT_STORABLE)
def test_text_postgresql_cannot_store_is_refused_alike_wherever_it_is(text, problem):
    """A lone surrogate (or a NUL) is refused before any I/O with one type,
    UnstorableText (a ConfigurationError and a PayloadError both), and one message
    naming where it was: a concurrency key used to reach the database (QueryRejected)
    where a queue gave a ConfigurationError about "control characters"."""
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected", cy.Mux().register(h.ok))
    by_key = cy.step("h18_keyed", concurrency_key=lambda inp: text)(h.ok.fn)
    places = {
        "step name": lambda: cy.step(text)(h.ok.fn),
        "workflow name": lambda: cy.Workflow(text),
        "workflow 'w': node name": lambda: cy.Workflow("w").add(h.ok, name=text),
        "queue": lambda: client.enqueue(h.ok, {}, queue=text),
        "concurrency_key": lambda: client.enqueue(h.ok, {}, concurrency_key=text),
        "idempotency_key": lambda: client.enqueue(h.ok, {}, idempotency_key=text),
        "input": lambda: client.enqueue(h.ok, {text: 1}),
        "signal name": lambda: client.signal("00000000-0000-0000-0000-000000000000", text),
        "key": lambda: client.runs(key=text),  # a filter of runs
    }
    for what, call in places.items():
        with pytest.raises(UnstorableText) as info:
            call()
        assert str(info.value) == f"{what} cannot be stored in PostgreSQL: it contains {problem}"
        assert isinstance(info.value, ConfigurationError) and isinstance(info.value, PayloadError)
    for call in (lambda: client.enqueue(by_key, {}), lambda: client.enqueue_many(h.ok, [{}], concurrency_key=text),
                 lambda: client.enqueue_many(h.ok, [{}], queue=text),
                 lambda: cy.Client("postgresql://x@127.0.0.1:1/x", queues=[text])):
        with pytest.raises(UnstorableText, match="cannot be stored in PostgreSQL"):
            call()


def test_constructors_refuse_bad_values_at_once():
    with pytest.raises(ConfigurationError, match="dsn must be a connection string or None"):
        cy.Client(5)
    with pytest.raises(ConfigurationError, match="step name must not contain control characters"):
        cy.step("bad\x1bname")(h.ok.fn)
    with pytest.raises(ConfigurationError, match="workflow name must be at most 200"):
        cy.Workflow("w" * 201)
    with pytest.raises(ConfigurationError, match="lease_ttl must be at most 100 years"):
        cy.Client("postgresql://x@127.0.0.1:1/x", lease_ttl=dt.timedelta.max)
    with pytest.raises(ConfigurationError, match="max_payload must be an int from 1024 to 268435455"):
        cy.Client("postgresql://x@127.0.0.1:1/x", max_payload=2**40)
    wf = cy.Workflow("w")
    with pytest.raises(ConfigurationError, match="until= must be timezone-aware"):
        wf.timer("t", until="tomorrow")
    client = cy.Client("postgresql://nobody@127.0.0.1:1/never-connected")
    with pytest.raises(ConfigurationError, match="signal name must be at most 200"):
        client.signal("00000000-0000-0000-0000-000000000000", "s" * 10_000)


# -- 8. dashboard tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("token,words", [
    (" ", "empty or only white space"), ("", None), ("x", "needs at least 16"),
    ("a" * 40, "too easy to guess"), ("passwordpassword", "too easy to guess"),
    (" " + secrets.token_urlsafe(32), "white space"),
])
def test_a_public_dashboard_needs_a_strong_token(token, words):
    """Issue 18 fault 8: `--token " "` on a public bind, then `?token=%20`, authenticated."""
    from cyclone_mp.dashboard import check_bind

    with pytest.raises(ConfigurationError, match=words or "without a token") as info:
        check_bind("0.0.0.0", token or None)
    assert token.strip() == "" or token.strip() not in str(info.value)  # the token is never echoed
    check_bind("0.0.0.0", secrets.token_urlsafe(32))
    check_bind("127.0.0.1", "short-but-local")
    with pytest.raises(ConfigurationError, match="white space"):
        check_bind("127.0.0.1", " ")
