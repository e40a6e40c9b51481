from django.urls import path

from . import api, stream, views

app_name = "notifications"

urlpatterns = [
    path("", views.home, name="home"),
    path("notifications/", views.inbox_page, name="inbox"),
    path("notifications/read-all/", views.read_all, name="read-all"),
    path("notifications/<str:raw_id>/read/", views.mark_read, name="read"),
    path("notifications/<str:raw_id>/unread/", views.mark_unread, name="unread"),
    path("notifications/<str:raw_id>/delete/", views.delete, name="delete"),
    path("api/openapi.json", api.openapi, name="api-openapi"),
    path("api/notifications/", api.notification_list, name="api-list"),
    path("api/notifications/unread-count/", api.unread_count, name="api-unread-count"),
    path("api/notifications/read-all/", api.read_all, name="api-read-all"),
    path("api/notifications/stream/", stream.stream, name="api-stream"),
    path("api/notifications/<str:raw_id>/", api.notification_detail, name="api-detail"),
    path("api/notifications/<str:raw_id>/read/", api.mark_read, name="api-read"),
    path("api/notifications/<str:raw_id>/unread/", api.mark_unread, name="api-unread"),
]
