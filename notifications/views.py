"""The inbox page and its form actions (the JSON API is in :mod:`notifications.api`)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from . import inbox
from .inbox import BadInput
from .models import Notification

PAGE_SIZE = 20
SHOW = ("all", "unread")


def poll_seconds() -> float:
    """Seconds between two badge refreshes in the browser (``NOTIFICATIONS_POLL_INTERVAL``)."""
    return float(getattr(settings, "NOTIFICATIONS_POLL_INTERVAL", 5))


def undo_seconds() -> float:
    """Seconds a deleted item can be restored before the deletion is sent
    (``NOTIFICATIONS_UNDO_SECONDS``)."""
    return float(getattr(settings, "NOTIFICATIONS_UNDO_SECONDS", 5))


def bad_request(request: HttpRequest, message: str) -> HttpResponse:
    return render(request, "notifications/bad_request.html", {"message": message}, status=400)


@require_GET
def home(request: HttpRequest) -> HttpResponse:
    return redirect("notifications:inbox")


@login_required
@require_GET
def inbox_page(request: HttpRequest) -> HttpResponse:
    try:
        number = inbox.parse_int(request.GET.get("page"), "page", default=1, maximum=inbox.MAX_PAGE)
        show = request.GET.get("show", "all")
        if show not in SHOW:
            raise BadInput("show", "must be all or unread")
    except BadInput as exc:
        return bad_request(request, str(exc))
    qs = inbox.own(request.user)
    if show == "unread":
        qs = qs.unread()
    return render(
        request,
        "notifications/inbox.html",
        {
            "page": inbox.page_of(qs, number, PAGE_SIZE),
            "show": show,
            "unread": inbox.unread_count(request.user),
            "until_id": inbox.newest_id(request.user),
            "poll_seconds": poll_seconds(),
            "undo_seconds": undo_seconds(),
        },
    )


def _back(request: HttpRequest) -> HttpResponse:
    """Redirect to the page the form was on (if it is on this site), else the inbox."""
    target = request.POST.get("next", "")
    if url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return redirect(target)
    return redirect(reverse("notifications:inbox"))


def _own(request: HttpRequest, raw_id: str) -> Notification:
    try:
        return inbox.get_own(request.user, inbox.parse_id(raw_id))
    except (BadInput, Notification.DoesNotExist) as exc:
        raise Http404("No such notification.") from exc


@login_required
@require_POST
def mark_read(request: HttpRequest, raw_id: str) -> HttpResponse:
    n = _own(request, raw_id)
    if n.mark_read():
        messages.success(request, f"Marked read: {n.verb}")
    return _back(request)


@login_required
@require_POST
def mark_unread(request: HttpRequest, raw_id: str) -> HttpResponse:
    n = _own(request, raw_id)
    if n.mark_unread():
        messages.success(request, f"Marked unread: {n.verb}")
    return _back(request)


@login_required
@require_POST
def delete(request: HttpRequest, raw_id: str) -> HttpResponse:
    n = _own(request, raw_id)
    verb = n.verb
    n.delete()
    messages.success(request, f"Deleted: {verb}")
    return _back(request)


@login_required
@require_POST
def read_all(request: HttpRequest) -> HttpResponse:
    raw = request.POST.get("until_id") or None
    try:
        until_id = None if raw is None else inbox.parse_id(raw, "until_id")
    except BadInput as exc:
        return bad_request(request, str(exc))
    changed = inbox.mark_all_read(request.user, until_id)
    messages.success(request, f"Marked {changed} notification{'s' if changed != 1 else ''} read.")
    return _back(request)
