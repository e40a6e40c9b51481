from django.apps import AppConfig

#: Name of the counter that holds unread notifications per user.
UNREAD_COUNTER = "unread"


class NotificationsConfig(AppConfig):
    name = "notifications"
    verbose_name = "Notifications"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import counters

        from .truth import UnreadTruth

        counters.register(
            UNREAD_COUNTER,
            "notifications.UnreadCounter",
            key_field="user",
            value_field="count",
            source=UnreadTruth(),
            non_negative=True,
        )
