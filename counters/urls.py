"""URLs of the counters app: ``path("", include("counters.urls"))`` serves ``/metrics``."""

from django.urls import path

from counters.ops.exposition import metrics_view

app_name = "counters"

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
]
