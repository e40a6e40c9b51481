"""A tiny URLconf for tests of request-level transactions (ATOMIC_REQUESTS)."""

from django.contrib.auth import get_user_model
from django.http import HttpResponse
from django.urls import path

from notifications.models import Notification


def notify_then(request, user_id: int, outcome: str):
    user = get_user_model().objects.get(pk=user_id)
    Notification.objects.create(recipient=user, verb="in a request")
    Notification.objects.filter(recipient=user).first().mark_read()
    Notification.objects.create(recipient=user, verb="in a request")
    if outcome == "fail":
        raise RuntimeError("the view fails after writing")
    return HttpResponse("ok")


urlpatterns = [path("notify/<int:user_id>/<str:outcome>/", notify_then)]
