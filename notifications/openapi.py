"""OpenAPI 3.0 document of the notifications JSON API, served at ``/api/openapi.json``."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from .inbox import DEFAULT_PAGE_SIZE, MAX_ID, MAX_PAGE, MAX_PAGE_SIZE

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}, **extra}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _obj(required: dict[str, Any], description: str = "") -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": required,
        "required": list(required),
        "additionalProperties": False,
    }
    if description:
        schema["description"] = description
    return schema


ID = {"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_ID}
COUNT = {"type": "integer", "minimum": 0, "description": "Exact unread count (stored + buffered)."}
NULLABLE_TIME = {"type": "string", "format": "date-time", "nullable": True}

SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": {"type": "string"}}),
    "Notification": _obj(
        {
            "id": ID,
            "verb": {"type": "string"},
            "description": {"type": "string"},
            "actor": {"type": "string", "nullable": True, "description": "Actor's username."},
            "created_at": {"type": "string", "format": "date-time"},
            "is_read": {"type": "boolean"},
            "read_at": NULLABLE_TIME,
            "url": {"type": "string"},
        }
    ),
    "NotificationPage": _obj(
        {
            "results": {"type": "array", "items": _ref("Notification")},
            "page": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
            "page_size": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE},
            "next": {"type": "string", "nullable": True},
            "previous": {"type": "string", "nullable": True},
            "unread": COUNT,
        },
        "Newest first. `next` and `previous` are relative URLs of the neighbouring pages.",
    ),
    "UnreadCount": _obj({"unread": COUNT}),
    "ReadResult": _obj(
        {
            "notification": _ref("Notification"),
            "changed": {
                "type": "boolean",
                "description": "Whether this request changed the notification.",
            },
            "unread": COUNT,
        }
    ),
    "ReadAllRequest": {
        "type": "object",
        "properties": {
            "until_id": {
                **ID,
                "nullable": True,
                "description": "Only mark notifications with an id up to this one "
                "(the newest one the user has seen).",
            }
        },
        "additionalProperties": False,
    },
    "ReadAllResult": _obj(
        {
            "changed": {"type": "integer", "minimum": 0, "description": "Rows changed."},
            "unread": COUNT,
        }
    ),
    "DeleteResult": _obj({"id": ID, "deleted": {"type": "boolean"}, "unread": COUNT}),
}

NO_STORE = {
    "Cache-Control": {
        "description": "Always `no-store` (with `no-cache, must-revalidate, private`).",
        "schema": {"type": "string", "pattern": "no-store"},
    }
}

PARAM_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "Notification id. Another user's notification is a 404.",
    "schema": ID,
}


def _links(expression: str) -> dict[str, Any]:
    """Links from a response holding a notification id to the operations on it."""
    return {
        name: {"operationId": op, "parameters": {"id": expression}}
        for name, op in (
            ("GetNotification", "getNotification"),
            ("MarkRead", "markNotificationRead"),
            ("MarkUnread", "markNotificationUnread"),
            ("DeleteNotification", "deleteNotification"),
        )
    }


def _operation(
    op_id: str,
    summary: str,
    ok: dict[str, Any],
    *,
    writes: bool = False,
    by_id: bool = False,
    bad_input: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": ok}
    if bad_input:
        responses["400"] = _error("Malformed id, parameter or body.")
    responses["401"] = _error("Not logged in.")
    responses["413"] = _error("Request body larger than `DATA_UPLOAD_MAX_MEMORY_SIZE`.")
    security: list[dict[str, list]] = [{"sessionCookie": []}]
    if writes:
        responses["403"] = _error("CSRF check failed.")
        security = [{"sessionCookie": [], "csrfToken": []}]
    if by_id:
        responses["404"] = _error("No such notification, or it belongs to another user.")
    return {
        "operationId": op_id,
        "summary": summary,
        "security": security,
        "responses": responses,
        **extra,
    }


def _head(get: dict[str, Any]) -> dict[str, Any]:
    """The HEAD twin of a GET operation: the same answers, headers only."""
    responses = {
        status: {key: value for key, value in answer.items() if key in ("description", "headers")}
        for status, answer in get["responses"].items()
    }
    return {
        **get,
        "operationId": f"{get['operationId']}Head",
        "summary": f"{get['summary']} (headers only)",
        "responses": responses,
    }


def _with_heads(paths: dict[str, Any]) -> dict[str, Any]:
    """Every path item with a GET operation also gets its HEAD twin."""
    return {
        path: {**item, "head": _head(item["get"])} if "get" in item else item
        for path, item in paths.items()
    }


def _read_ok() -> dict[str, Any]:
    return _json(
        _ref("ReadResult"),
        "The notification after the change, whether it changed, and the new count.",
        links=_links("$response.body#/notification/id"),
    )


def document() -> dict[str, Any]:
    """The OpenAPI document (cookie and header names follow the project's settings)."""
    csrf_header = settings.CSRF_HEADER_NAME.removeprefix("HTTP_").replace("_", "-")
    page_params = [
        {
            "name": "page",
            "in": "query",
            "description": f"Page number, at most {MAX_PAGE}.",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 1},
        },
        {
            "name": "page_size",
            "in": "query",
            "description": f"Notifications per page, at most {MAX_PAGE_SIZE}.",
            "schema": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_PAGE_SIZE,
                "default": DEFAULT_PAGE_SIZE,
            },
        },
        {
            "name": "unread",
            "in": "query",
            "description": "`true`: unread only; `false`: read only; absent: all.",
            "schema": {"type": "boolean"},
        },
    ]
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "Tally notifications API",
            "version": "1.0.0",
            "description": (
                "The logged-in user's notifications. Authentication is Django's session "
                "cookie; unsafe methods also need the CSRF token (from the `csrftoken` "
                f'cookie) in the `{csrf_header}` header. Errors are JSON `{{"error": ...}}`; '
                "a wrong method is a 405 with `Allow`, a request body larger than "
                "`DATA_UPLOAD_MAX_MEMORY_SIZE` (2.5 MB by default) a 413. HEAD answers "
                "like GET without the body; OPTIONS on every endpoint answers 200 with "
                '`Allow` (and `{"allow": [...]}`), without a login. Responses are never cached.'
            ),
        },
        "paths": {
            "/api/notifications/": {
                "get": _operation(
                    "listNotifications",
                    "List notifications, newest first",
                    _json(
                        _ref("NotificationPage"),
                        "One page.",
                        links=_links("$response.body#/results/0/id"),
                    ),
                    parameters=page_params,
                )
            },
            "/api/notifications/unread-count/": {
                "get": _operation(
                    "getUnreadCount",
                    "Exact unread count (for the badge)",
                    _json(_ref("UnreadCount"), "The count.", headers=NO_STORE),
                    bad_input=False,
                )
            },
            "/api/notifications/read-all/": {
                "post": _operation(
                    "markAllNotificationsRead",
                    "Mark all (or all up to `until_id`) read",
                    _json(_ref("ReadAllResult"), "Rows changed and the new count."),
                    writes=True,
                    requestBody={
                        "required": False,
                        "content": {JSON: {"schema": _ref("ReadAllRequest")}},
                    },
                )
            },
            "/api/notifications/{id}/": {
                "parameters": [PARAM_ID],
                "get": _operation(
                    "getNotification",
                    "One notification",
                    _json(
                        _ref("Notification"),
                        "The notification.",
                        links=_links("$response.body#/id"),
                    ),
                    by_id=True,
                ),
                "delete": _operation(
                    "deleteNotification",
                    "Delete a notification",
                    _json(_ref("DeleteResult"), "Deleted; the new count."),
                    writes=True,
                    by_id=True,
                ),
            },
            "/api/notifications/{id}/read/": {
                "parameters": [PARAM_ID],
                "post": _operation(
                    "markNotificationRead", "Mark read", _read_ok(), writes=True, by_id=True
                ),
            },
            "/api/notifications/{id}/unread/": {
                "parameters": [PARAM_ID],
                "post": _operation(
                    "markNotificationUnread", "Mark unread", _read_ok(), writes=True, by_id=True
                ),
            },
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "sessionCookie": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": settings.SESSION_COOKIE_NAME,
                },
                "csrfToken": {"type": "apiKey", "in": "header", "name": csrf_header},
            },
        },
    }
    doc["paths"] = _with_heads(doc["paths"])
    return doc
