from django.apps import AppConfig
from django.db.models.signals import post_migrate


class CountersConfig(AppConfig):
    name = "counters"
    verbose_name = "Counters"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, schedule  # noqa: F401  (registers system checks)

        post_migrate.connect(
            schedule.ensure_periodic_task_after_migrate,
            sender=self,
            dispatch_uid="counters.ensure_periodic_task",
        )
