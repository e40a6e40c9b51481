"""The live inbox in a real browser, on the project served as `make run` serves it (uvicorn).

Chromium keeps one Server-Sent Events stream open and sends nothing else while
it is up: the badge shows another process's new notification within a second
of its COMMIT and the list shows it without a click; 20 idle seconds pass
without a single request. With the stream refused, the page polls and says so.
"""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.helpers import truth
from tests.procs import run_manage
from tests.web.conftest import notify
from tests.web.test_asgi import uvicorn  # noqa: F401  (the fixture)
from tests.web.test_browser import CHROMIUM_ARGS, chromium, open_inbox  # noqa: F401

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.redis,
    pytest.mark.serial,
    pytest.mark.live,
]

#: The latest a change may show in the browser after its COMMIT, in seconds.
WITHIN = 1.0


class Server:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture
def page(chromium, uvicorn, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 960, "height": 720})
        finally:
            browser.close()


def create_elsewhere(user, verb: str) -> float:
    """Create a notification of ``user`` in another process; the time of its COMMIT."""
    code, out, err = run_manage(
        "shell",
        "-c",
        "import time; from notifications.models import Notification; "
        f"Notification.objects.create(recipient_id={user.pk}, verb={verb!r}); "
        "print(time.time())",
    )
    assert code == 0, err
    return float(out.strip().splitlines()[-1])


def test_badge_and_list_follow_another_process_within_a_second(page, uvicorn, alice):  # noqa: F811
    notify(alice, 2)
    open_inbox(page, Server(uvicorn))
    expect(page.locator("body")).to_have_attribute("data-live", "stream")
    count = page.locator("#unread-count")
    expect(count).to_have_text("2")
    # The time the badge changes, taken by the page itself.
    page.evaluate(
        """() => new MutationObserver(() => { window.changedAt ??= Date.now() / 1000; })
            .observe(document.getElementById("unread-count"), {childList: true})"""
    )
    committed = create_elsewhere(alice, "replied to your comment")
    expect(count).to_have_text("3", timeout=5_000)
    late = page.evaluate("window.changedAt") - committed
    assert late < WITHIN, f"the badge changed {late:.3f} s after the COMMIT"
    first = page.locator(".notification").first
    expect(first).to_contain_text("replied to your comment")
    expect(first).to_have_class(re.compile(r"\bis-unread\b"))
    expect(page.locator("#live-status")).to_have_text("New notification: replied to your comment")
    assert page.evaluate("window.sameDocument") is True
    assert truth(alice) == 3


def test_no_request_while_idle(page, uvicorn, alice):  # noqa: F811
    notify(alice, 1)
    open_inbox(page, Server(uvicorn))
    expect(page.locator("body")).to_have_attribute("data-live", "stream")
    sent: list[str] = []
    page.on("request", lambda request: sent.append(request.url))
    start = time.monotonic()
    page.wait_for_timeout(20_000)
    assert time.monotonic() - start >= 20
    assert sent == []
    expect(page.locator("#unread-count")).to_have_text("1")


def test_without_the_stream_the_page_polls_and_says_so(page, uvicorn, alice):  # noqa: F811
    page.route("**/api/notifications/stream/", lambda route: route.abort())
    notify(alice, 1)
    open_inbox(page, Server(uvicorn))
    expect(page.locator("#live-connection")).to_contain_text("Live updates paused")
    expect(page.locator("body")).to_have_attribute("data-live", "polling")
    notify(alice, 1, verb="while polling")
    expect(page.locator("#unread-count")).to_have_text("2", timeout=15_000)
    expect(page.locator(".notification").first).to_contain_text("while polling")
