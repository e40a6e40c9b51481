from django.urls import path

from . import views

app_name = "notifications"

urlpatterns = [
    path("", views.home, name="home"),
    path("api/notifications/unread-count/", views.unread_count, name="unread-count"),
]
