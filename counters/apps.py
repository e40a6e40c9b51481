from django.apps import AppConfig


class CountersConfig(AppConfig):
    name = "counters"
    verbose_name = "Counters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from counters import checks  # noqa: F401  (registers system checks)
        from counters.signals import connect_signals  # (needs the app registry: models)

        connect_signals(self)
