from django.apps import AppConfig


class BenchmarksConfig(AppConfig):
    """The benchmark behind ``manage.py counters_bench`` (a development tool, not shipped)."""

    name = "benchmarks"
    verbose_name = "Benchmarks"
