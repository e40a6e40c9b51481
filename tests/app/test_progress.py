"""``counters_audit`` and ``counters_flush`` draw a bar on a terminal, and nothing elsewhere
(stderr not a terminal, or ``--json``): cron mail and pipes get their summary line alone."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.core.management import call_command

import counters
from counters.verify import audit
from notifications.models import Notification
from tests.helpers import assert_exact

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drawn(text: str) -> list[str]:
    """The ``done/total`` of every redraw of the bar, in order."""
    return re.findall(r"\r\[[#.]{30}\] (\d+/\d+) ", text)


@pytest.fixture
def users(make_user):
    users = [make_user() for _ in range(5)]
    for i, user in enumerate(users):
        Notification.objects.bulk_create(
            [Notification(recipient=user, verb="v") for _ in range(i + 1)]
        )
    return users


def test_the_audit_draws_its_keys_on_a_terminal_only(users, settings, monkeypatch):
    settings.COUNTERS_SOCKET_TIMEOUT = 0.2
    counters.flush()
    monkeypatch.setattr(audit, "PAGE", 2)
    err, out = Terminal(), io.StringIO()
    call_command("counters_audit", "unread", "--slice", "4", stdout=out, stderr=err)
    assert drawn(err.getvalue()) == ["2/4", "4/4", "4/4"]  # each page, then the counter done
    assert err.getvalue().endswith(" 4/4 keys\n")
    assert out.getvalue().startswith("audited 4 keys of 1 counter")  # the summary on stdout

    for args, stderr in [((), io.StringIO()), (("--json",), Terminal())]:
        out = io.StringIO()
        call_command("counters_audit", "unread", "--slice", "4", *args, stdout=out, stderr=stderr)
        assert stderr.getvalue() == ""
    assert json.loads(out.getvalue())["counters"][0]["counter"] == "unread"


@pytest.mark.usefixtures("per_commit")  # one push after each COMMIT
def test_the_flush_draws_the_keys_it_applied_on_a_terminal_only(users):
    err, out = Terminal(), io.StringIO()
    call_command("counters_flush", stdout=out, stderr=err)
    bars = drawn(err.getvalue())
    assert bars[0] == "0/5" and bars[-1] == "5/5", bars
    assert err.getvalue().endswith(" 5/5 keys applied\n")
    assert out.getvalue().startswith("flushed ")
    assert_exact(*users)

    Notification.objects.create(recipient=users[0], verb="v")
    for args, stderr in [((), io.StringIO()), (("--json",), Terminal())]:
        out = io.StringIO()
        call_command("counters_flush", *args, stdout=out, stderr=stderr)
        assert stderr.getvalue() == ""
    assert json.loads(out.getvalue())["keys"] == 0  # the first of the two applied it
    assert_exact(*users)
