from django.apps import AppConfig


class CountersConfig(AppConfig):
    name = "counters"
    verbose_name = "Counters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from counters import checks  # noqa: F401  (registers system checks)
        from counters.signals import connect_signals  # (needs the app registry: models)

        connect_signals(self)
        from django.db.models.signals import post_migrate

        from counters.read.backfill import seen_after_migrate

        # After migrate (and flush) every counter is seen: a new one over existing rows backfills.
        post_migrate.connect(seen_after_migrate, sender=self, dispatch_uid="counters.backfill")
