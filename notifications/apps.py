from django.apps import AppConfig
from django.db.models import Q

#: Name of the counter that holds unread notifications per user.
UNREAD_COUNTER = "unread"


class NotificationsConfig(AppConfig):
    name = "notifications"
    verbose_name = "Notifications"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .models import Notification

        # Unread notifications per recipient, in UnreadCounter.count. A count of
        # rows, so it never reads below zero. Live: the inbox's stream watches it.
        counters.track(
            UNREAD_COUNTER,
            Notification,
            key="recipient",
            into="notifications.UnreadCounter.count",
            where=Q(is_read=False),
            live=True,
        )
