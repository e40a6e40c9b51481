"""Create demo users with notifications, and print how to log in as them."""

from __future__ import annotations

import random
import secrets
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from notifications.models import Notification, UnreadCounter

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
EVENTS = (
    ("commented on your post", "Looks good to me, one question about the flush interval."),
    ("mentioned you", "@{user} can you review the rollout plan?"),
    ("assigned you an issue", "Badge shows a stale count after logout"),
    ("approved your pull request", "Nice work on the counters."),
    ("replied to your comment", "Agreed, let's keep the batch size at 1000."),
    ("invited you to a project", "Project: Billing"),
    ("starred your repository", ""),
    ("requested your review", "Refactor the inbox templates"),
)


class Command(BaseCommand):
    help = (
        "Create demo users with notifications (about a third of them read) and print their logins."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--users", type=int, default=3, help="demo users (1-8, default 3)")
        parser.add_argument(
            "--notifications", type=int, default=30, help="notifications per user (default 30)"
        )
        parser.add_argument(
            "--password", help="password for every demo user (default: a new random one each)"
        )
        parser.add_argument(
            "--admin", action="store_true", help="also create the superuser 'admin' for /admin/"
        )
        parser.add_argument("--seed", type=int, help="random seed, for repeatable data")

    def handle(self, *args: Any, **options: Any) -> None:
        users_wanted = options["users"]
        per_user = options["notifications"]
        if not 1 <= users_wanted <= len(NAMES):
            raise CommandError(f"--users must be from 1 to {len(NAMES)}")
        if not 0 <= per_user <= 100_000:
            raise CommandError("--notifications must be from 0 to 100000")
        rng = random.Random(options["seed"])
        User = get_user_model()
        logins: list[tuple[str, str]] = []
        with transaction.atomic():
            users = []
            for name in NAMES[:users_wanted]:
                user, _ = User._default_manager.get_or_create(username=name)
                password = options["password"] or secrets.token_urlsafe(9)
                user.set_password(password)
                user.save()
                users.append(user)
                logins.append((name, password))
            if options["admin"]:
                admin, _ = User._default_manager.get_or_create(username="admin")
                password = options["password"] or secrets.token_urlsafe(9)
                admin.is_staff = admin.is_superuser = True
                admin.set_password(password)
                admin.save()
                logins.append(("admin", password))
            now = timezone.now()
            rows = []
            for user in users:
                others: list[Any] = [u for u in users if u.pk != user.pk] or [None]
                for _ in range(per_user):
                    verb, description = rng.choice(EVENTS)
                    created = now - timedelta(minutes=rng.randint(1, 60 * 24 * 14))
                    is_read = rng.random() < 1 / 3
                    rows.append(
                        Notification(
                            recipient=user,
                            actor=rng.choice(others),
                            verb=verb,
                            description=description.format(user=user.username),
                            created_at=created,
                            is_read=is_read,
                            read_at=created + timedelta(minutes=5) if is_read else None,
                        )
                    )
            Notification.objects.bulk_create(rows, batch_size=1000)
        counts = UnreadCounter.objects.get_counts(users)
        for user in users:
            self.stdout.write(f"{user.username}: {counts[user.pk]} unread")
        self.stdout.write("Log in at /accounts/login/ as:")
        for name, password in logins:
            self.stdout.write(f"  {name} / {password}")
