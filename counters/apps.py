from django.apps import AppConfig


class CountersConfig(AppConfig):
    name = "counters"
    verbose_name = "Counters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers system checks)
        from .signals import connect_signals

        connect_signals(self)
