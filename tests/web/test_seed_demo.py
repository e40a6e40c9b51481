"""seed_demo creates users who can log in and whose counts are exact."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.contrib.auth import authenticate
from django.core.management import CommandError, call_command

from notifications.models import Notification
from tests.helpers import assert_exact, truth

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]


def seed(*args: str) -> str:
    out = StringIO()
    call_command("seed_demo", *args, stdout=out)
    return out.getvalue()


def test_seed_demo_prints_logins_that_work(django_user_model):
    out = seed("--users", "2", "--notifications", "12", "--seed", "7", "--admin")
    logins = dict(re.findall(r"^  (\w+) / (\S+)$", out, re.M))
    assert set(logins) == {"alice", "bob", "admin"}
    for name, password in logins.items():
        assert authenticate(username=name, password=password) is not None, name
    admin = django_user_model.objects.get(username="admin")
    assert admin.is_staff and admin.is_superuser
    alice, bob = (django_user_model.objects.get(username=n) for n in ("alice", "bob"))
    assert Notification.objects.filter(recipient=alice).count() == 12
    assert 0 < truth(alice) < 12  # some are read
    assert f"alice: {truth(alice)} unread" in out
    assert_exact(alice, bob)


def test_seed_demo_runs_again_with_new_passwords():
    first = seed("--users", "1", "--notifications", "3", "--password", "pw-one")
    second = seed("--users", "1", "--notifications", "3", "--password", "pw-two")
    assert "alice / pw-one" in first and "alice / pw-two" in second
    assert authenticate(username="alice", password="pw-two") is not None
    assert Notification.objects.count() == 6


@pytest.mark.parametrize("args", [["--users", "0"], ["--users", "9"], ["--notifications", "-1"]])
def test_seed_demo_rejects_bad_sizes(args):
    with pytest.raises(CommandError):
        seed(*args)
