from django.contrib import admin
from django.urls import include, path, re_path

from notifications.api import not_found

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("notifications.urls")),
    # /metrics: the Prometheus exposition, 404 unless COUNTERS_METRICS is on.
    path("", include("counters.urls")),
    # Any other path under /api/ answers with a JSON 404, not an HTML page.
    re_path(r"^api/(?P<rest>.*)\Z", not_found, name="api-not-found"),
]
