"""JSON API for the logged-in user's notifications (session authentication with CSRF).

Every response is JSON and never cached. Errors are ``{"error": "..."}`` with
401 when not logged in, 403 for a failed CSRF check, 404 for a notification
that does not exist or belongs to someone else, 400 for a malformed id,
parameter or body, 405 (with ``Allow``) for a wrong method, and 413 for a
request body larger than ``DATA_UPLOAD_MAX_MEMORY_SIZE``. HEAD answers like GET
without the body; OPTIONS answers 200 with ``Allow`` (no login needed). The
OpenAPI document (:mod:`notifications.openapi`) describes all of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from functools import wraps
from inspect import iscoroutinefunction
from typing import Any, TypeVar, cast
from urllib.parse import urlencode

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.middleware.csrf import CsrfViewMiddleware
from django.urls import Resolver404, resolve, reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from . import inbox
from .inbox import BadInput
from .models import Notification
from .openapi import document

View = Callable[..., HttpResponse]
AsyncView = Callable[..., Coroutine[Any, Any, HttpResponse]]
#: A view, sync or async: :func:`endpoint` gives back the kind it was given.
AnyView = TypeVar("AnyView", bound=Callable[..., Any])
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
FORM_TYPES = frozenset({"multipart/form-data", "application/x-www-form-urlencoded"})


def error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


class _CsrfCheck(CsrfViewMiddleware):
    """Django's CSRF check, answering a failure with a JSON 403 instead of an HTML page."""

    def _reject(self, request: HttpRequest, reason: str) -> JsonResponse:
        return error(403, f"CSRF check failed: {reason}")


def _no_view(request: HttpRequest) -> HttpResponse:
    raise AssertionError("only the CSRF check runs")


def csrf_failure(request: HttpRequest) -> HttpResponse | None:
    """The 403 response if the request fails Django's CSRF check, else None."""
    check = _CsrfCheck(lambda req: HttpResponse())
    check.process_request(request)
    return check.process_view(request, _no_view, (), {})


def allowed_methods(methods: tuple[str, ...]) -> list[str]:
    """``methods`` with HEAD where GET is, and OPTIONS: what ``Allow`` lists."""
    allowed = list(dict.fromkeys(methods))
    if "GET" in allowed and "HEAD" not in allowed:
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    if "OPTIONS" not in allowed:
        allowed.append("OPTIONS")
    return allowed


def body_too_large(request: HttpRequest) -> HttpResponse | None:
    """The 413 (or 400) response if the declared body size is over the limit or malformed."""
    raw = request.META.get("CONTENT_LENGTH") or "0"
    try:
        length = int(raw)
    except ValueError:
        return error(400, "Content-Length must be an integer")
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is not None and length > limit:
        return error(413, f"request body is larger than {limit} bytes")
    return None


#: What a view may raise, answered as a JSON error.
VIEW_ERRORS = (RequestDataTooBig, BadInput, Notification.DoesNotExist)


def refused(exc: Exception) -> JsonResponse:
    """The JSON error answering one of :data:`VIEW_ERRORS`."""
    if isinstance(exc, RequestDataTooBig):
        return error(413, "request body is too large")
    if isinstance(exc, BadInput):
        return error(400, exc.message if exc.param == "body" else str(exc))
    return error(404, "no such notification")


def endpoint(*methods: str, public: bool = False) -> Callable[[AnyView], AnyView]:
    """Method check (405), body size (413), session authentication (401), CSRF check (403),
    HEAD and OPTIONS, no caching. The view may be a coroutine function (an async view):
    the user is then loaded with ``request.auser()``."""
    allowed = allowed_methods(methods)
    allow = ", ".join(allowed)
    # OPTIONS is answered here unless the view lists it (the catch-all 404 does).
    answer_options = "OPTIONS" not in methods

    def before(request: HttpRequest) -> HttpResponse | None:
        """The answer given without the user: a wrong method, OPTIONS, a body too large."""
        if request.method not in allowed:
            response = error(405, f"method {request.method} is not allowed here")
            response["Allow"] = allow
            return response
        if request.method == "OPTIONS" and answer_options:
            response = JsonResponse({"allow": allowed})
            response["Allow"] = allow
            return response
        return body_too_large(request)

    def admitted(request: HttpRequest, user: Any) -> HttpResponse | None:
        """The 401 or 403 refusing ``user``, else None."""
        if public:
            return None
        if not user.is_authenticated:
            return error(401, "authentication required")
        if request.method not in SAFE_METHODS:
            return csrf_failure(request)
        return None

    def decorate(view: AnyView) -> AnyView:
        wrap = _async_wrapper if iscoroutinefunction(view) else _sync_wrapper
        return cast(AnyView, csrf_exempt(never_cache(wrap(view, before, admitted, public))))

    return decorate


#: The answer given without the user (a wrong method, OPTIONS, a body too large), if any.
Before = Callable[[HttpRequest], HttpResponse | None]
#: The 401 or 403 refusing a user, if any.
Admitted = Callable[[HttpRequest, Any], HttpResponse | None]


def _sync_wrapper(view: View, before: Before, admitted: Admitted, public: bool) -> View:
    """:func:`endpoint`'s checks around a view."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        answer = before(request)
        if answer is None:
            try:
                answer = admitted(request, None if public else request.user)
                if answer is None:
                    answer = view(request, *args, **kwargs)
            except VIEW_ERRORS as exc:
                answer = refused(exc)
        return without_body_for_head(request, answer)

    return wrapper


def _async_wrapper(view: AsyncView, before: Before, admitted: Admitted, public: bool) -> AsyncView:
    """:func:`endpoint`'s checks around an async view, in the event loop (``request.auser()``)."""

    @wraps(view)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        answer = before(request)
        if answer is None:
            try:
                answer = admitted(request, None if public else await request.auser())
                if answer is None:
                    answer = await view(request, *args, **kwargs)
            except VIEW_ERRORS as exc:
                answer = refused(exc)
        return without_body_for_head(request, answer)

    return wrapper


def without_body_for_head(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """For HEAD: the headers of the GET answer, with its length, and no body."""
    if request.method == "HEAD" and not response.streaming:
        response["Content-Length"] = str(len(response.content))
        response.content = b""
    return response


def serialize(n: Notification) -> dict[str, Any]:
    return {
        "id": n.pk,
        "verb": n.verb,
        "description": n.description,
        "actor": n.actor.get_username() if n.actor is not None else None,
        "created_at": n.created_at.isoformat(),
        "is_read": n.is_read,
        "read_at": n.read_at.isoformat() if n.read_at else None,
        "url": reverse("notifications:api-detail", args=[n.pk]),
    }


def _page_url(request: HttpRequest, number: int, size: int, unread: bool | None) -> str:
    query: dict[str, Any] = {"page": number, "page_size": size}
    if unread is not None:
        query["unread"] = "true" if unread else "false"
    return f"{request.path}?{urlencode(query)}"


@endpoint("GET")
def notification_list(request: HttpRequest) -> JsonResponse:
    number = inbox.parse_int(request.GET.get("page"), "page", default=1, maximum=inbox.MAX_PAGE)
    size = inbox.parse_int(
        request.GET.get("page_size"),
        "page_size",
        default=inbox.DEFAULT_PAGE_SIZE,
        maximum=inbox.MAX_PAGE_SIZE,
    )
    unread = inbox.parse_bool(request.GET.get("unread"), "unread")
    qs = inbox.own(request.user)
    if unread is not None:
        qs = qs.filter(is_read=not unread)
    page = inbox.page_of(qs, number, size)
    return JsonResponse(
        {
            "results": [serialize(n) for n in page.items],
            "page": page.number,
            "page_size": page.size,
            "next": _page_url(request, number + 1, size, unread) if page.has_next else None,
            "previous": _page_url(request, number - 1, size, unread) if page.has_previous else None,
            "unread": inbox.unread_count(request.user),
        }
    )


@endpoint("GET")
async def unread_count(request: HttpRequest) -> JsonResponse:
    """The badge's poll, the busiest request: an async view, its count read by ``aget_count``."""
    user = await request.auser()
    return JsonResponse({"unread": await inbox.aunread_count(user)})


@endpoint("GET", "DELETE")
def notification_detail(request: HttpRequest, raw_id: str) -> JsonResponse:
    n = inbox.get_own(request.user, inbox.parse_id(raw_id))
    if request.method in ("GET", "HEAD"):
        return JsonResponse(serialize(n))
    pk = n.pk
    n.delete()
    return JsonResponse({"id": pk, "deleted": True, "unread": inbox.unread_count(request.user)})


def _set_read(request: HttpRequest, raw_id: str, value: bool) -> JsonResponse:
    n = inbox.get_own(request.user, inbox.parse_id(raw_id))
    changed = n.mark_read() if value else n.mark_unread()
    n.refresh_from_db(fields=["is_read", "read_at"])
    return JsonResponse(
        {
            "notification": serialize(n),
            "changed": changed,
            "unread": inbox.unread_count(request.user),
        }
    )


@endpoint("POST")
def mark_read(request: HttpRequest, raw_id: str) -> JsonResponse:
    return _set_read(request, raw_id, True)


@endpoint("POST")
def mark_unread(request: HttpRequest, raw_id: str) -> JsonResponse:
    return _set_read(request, raw_id, False)


def _json_object(request: HttpRequest) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is ``{}``."""
    not_json = "request body must be JSON (Content-Type: application/json)"
    try:
        if request.content_type in FORM_TYPES:
            # An empty form (what some clients send with a bare POST) is an empty body.
            if request.POST or request.FILES:
                raise BadInput("body", not_json)
            return {}
        body = request.body
    except RequestDataTooBig:
        raise  # a 413, not a malformed body
    except (SuspiciousOperation, MultiPartParserError) as exc:
        raise BadInput("body", "request body could not be read") from exc
    if not body.strip():
        return {}
    if request.content_type != "application/json":
        raise BadInput("body", not_json)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadInput("body", "request body is not valid JSON") from exc
    if not isinstance(data, dict):
        raise BadInput("body", "request body must be a JSON object")
    return data


@endpoint("POST")
def read_all(request: HttpRequest) -> JsonResponse:
    data = _json_object(request)
    unknown = sorted(set(data) - {"until_id"})
    if unknown:
        raise BadInput("body", f"unknown field(s): {', '.join(unknown)}")
    until_id = data.get("until_id")
    if until_id is not None and (type(until_id) is not int or not 1 <= until_id <= inbox.MAX_ID):
        raise BadInput("body", f"until_id must be an integer from 1 to {inbox.MAX_ID} or null")
    changed = inbox.mark_all_read(request.user, until_id)
    return JsonResponse({"changed": changed, "unread": inbox.unread_count(request.user)})


@endpoint("GET", public=True)
def openapi(request: HttpRequest) -> JsonResponse:
    return JsonResponse(document())


@endpoint("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", public=True)
def not_found(request: HttpRequest, rest: str) -> JsonResponse:
    """Any other path under /api/: a JSON 404, with a hint when only the final slash is missing."""
    if not request.path_info.endswith("/"):
        try:
            match = resolve(request.path_info + "/")
        except Resolver404:
            match = None
        if match is not None and match.func is not not_found:
            return error(404, f"not found; did you mean {request.path}/ ?")
    return error(404, "not found")
