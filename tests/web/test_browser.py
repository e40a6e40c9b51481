"""The inbox in a real browser: Debian's Chromium, headless, driven by Playwright.

Logs in, reads the badge, marks one notification read and sees the badge drop
by one, then sees it rise and the new notification at the top of the list, without
a reload or a click, when another process creates it. Saves a screenshot of the
inbox; with TALLY_SCREENSHOT=docs/inbox.png it refreshes the one the README shows.
The actions happen in place (same document, same URL and scroll position), keep
the focus on the pressed control, "Mark read" and "Mark unread" are equally wide,
a deletion changes the badge at once and can be undone until its delay has passed,
and the badge stays in view on a small screen.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from django.db import connections
from playwright.sync_api import expect, sync_playwright

from notifications.models import Notification
from tests.helpers import assert_exact, truth
from tests.procs import run_manage
from tests.web.conftest import PASSWORD

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis, pytest.mark.serial]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
SCREENSHOT_ENV = "TALLY_SCREENSHOT"


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium, installed with apt-get if it is missing."""
    if not Path(CHROMIUM).exists():
        if shutil.which("apt-get") is None:
            pytest.fail(f"{CHROMIUM} is missing and apt-get is not available to install it")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                pytest.fail(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    return CHROMIUM


@pytest.fixture
def inbox_data(alice, make_member):
    bob, carol = make_member("bob"), make_member("carol")
    rows = [
        (bob, "assigned you an issue", "Badge shows a stale count after logout", True),
        (carol, "approved your pull request", "Exact counters for the inbox", False),
        (bob, "commented on your post", "Looks good to me, one question about the flush.", False),
        (carol, "mentioned you", "@alice can you review the rollout plan?", False),
    ]
    for actor, verb, description, is_read in rows:
        Notification.objects.create(
            recipient=alice, actor=actor, verb=verb, description=description, is_read=is_read
        )
    Notification.objects.create(recipient=bob, actor=carol, verb="not for alice")
    return carol


def test_badge_drops_on_read_and_rises_on_a_notification_from_another_process(
    chromium, live_server, settings, monkeypatch, alice, inbox_data, tmp_path
):
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "inbox.png")
    settings.NOTIFICATIONS_POLL_INTERVAL = 1
    # Playwright's sync API keeps an event loop running in this thread; the ORM
    # calls made here between browser steps are plain synchronous ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    carol = inbox_data
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 960, "height": 720})
            page.goto(f"{live_server.url}/notifications/")
            expect(page).to_have_url(re.compile(r"/accounts/login/\?next="))
            page.get_by_label("Username").fill("alice")
            page.get_by_label("Password").fill(PASSWORD)
            page.get_by_role("button", name="Log in").click()
            expect(page).to_have_url(f"{live_server.url}/notifications/")

            count = page.locator("#unread-count")
            before = int(count.inner_text())
            assert before == truth(alice) == 3

            page.keyboard.press("Tab")  # the skip link gets a visible focus ring
            outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
            assert outline == "solid"

            page.get_by_role("button", name="Mark read: mentioned you").click()
            expect(count).to_have_text(str(before - 1))
            assert truth(alice) == before - 1
            expect(page.locator("#toast")).to_have_text("Marked read: mentioned you")

            page.evaluate("window.sameDocument = true")
            code, _, err = run_manage(
                "shell",
                "-c",
                "from notifications.models import Notification; "
                f"Notification.objects.create(recipient_id={alice.pk}, actor_id={carol.pk}, "
                "verb='replied to your comment', description='Agreed, keep the batch at 1000.')",
            )
            assert code == 0, err
            assert truth(alice) == before

            expect(count).to_have_text(str(before), timeout=20_000)
            assert page.evaluate("window.sameDocument") is True  # updated without a reload
            expect(page).to_have_title(f"({before}) Notifications · Tally")
            # The new notification is in the list, at the top, announced politely.
            first = page.locator(".notification").first
            expect(first).to_contain_text("carol replied to your comment")
            expect(first).to_have_class(re.compile(r"\bis-unread\b"))
            status = page.locator("#live-status")
            expect(status).to_have_attribute("aria-live", "polite")
            expect(status).to_have_text("New notification: carol replied to your comment")
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot))
            assert screenshot.stat().st_size > 10_000
        finally:
            browser.close()
            # Inside Playwright's loop the ORM used a connection of its own: close it,
            # or it would keep the test database open after the run.
            connections.close_all()
    assert_exact(alice)


@pytest.fixture
def browser_page(chromium, live_server, monkeypatch):
    """A Chromium page (960 by 600, so the inbox scrolls); closed with its browser afterwards."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 960, "height": 600})
        finally:
            browser.close()
            connections.close_all()


def open_inbox(page, live_server, username: str = "alice") -> None:
    page.goto(f"{live_server.url}/accounts/login/?next=/notifications/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(f"{live_server.url}/notifications/")
    page.evaluate("window.sameDocument = true")  # gone if anything reloads the page


def width(locator) -> float:
    box = locator.bounding_box()
    assert box is not None
    return box["width"]


@pytest.fixture
def many(alice, bob):
    """25 notifications of alice (a page of 20 and more), every third one read; bob's one."""
    for i in range(25):
        Notification.objects.create(recipient=alice, verb=f"event {i:02d}", is_read=i % 3 == 0)
    Notification.objects.create(recipient=bob, verb="not for alice")


def test_mark_read_unread_and_all_in_place(browser_page, live_server, alice, bob, many):
    page = browser_page
    open_inbox(page, live_server)
    url, count = page.url, page.locator("#unread-count")
    unread = truth(alice)
    expect(count).to_have_text(str(unread))
    assert unread == 16

    # An unread item far down the page: scrolled to, marked read where it is.
    item = page.locator(".notification", has_text="event 07")
    item.scroll_into_view_if_needed()
    scroll = page.evaluate("window.scrollY")
    assert scroll > 0
    read_button = item.get_by_role("button", name="Mark read: event 07")
    unread_width = width(read_button)
    read_button.click()
    expect(count).to_have_text(str(unread - 1))
    expect(item).not_to_have_class(re.compile(r"\bis-unread\b"))
    toggle = item.get_by_role("button", name="Mark unread: event 07")
    expect(toggle).to_be_visible()
    expect(toggle).to_be_focused()  # the pressed button keeps the focus
    expect(page.locator("#toast")).to_have_text("Marked read: event 07")
    assert truth(alice) == unread - 1
    assert (page.url, page.evaluate("window.scrollY")) == (url, scroll)
    assert page.evaluate("window.sameDocument") is True

    # "Mark read" and "Mark unread" are as wide as each other, in every row.
    assert width(toggle) == unread_width
    widths = {width(b) for b in page.locator(".toggle-read").all()}
    assert len(widths) == 1, widths

    toggle.click()
    expect(count).to_have_text(str(unread))
    expect(item.get_by_role("button", name="Mark read: event 07")).to_be_visible()
    expect(item.get_by_role("button", name="Mark read: event 07")).to_be_focused()
    expect(page.locator("#toast")).to_have_text("Marked unread: event 07")
    assert truth(alice) == unread

    page.get_by_role("button", name="Mark all read").click()
    expect(count).to_have_text("0")
    expect(page.locator(".notification.is-unread")).to_have_count(0)
    read_all = page.get_by_role("button", name="Mark all read")
    expect(read_all).to_have_attribute("aria-disabled", "true")
    expect(read_all).to_be_focused()  # disabled for the pointer, still holding the focus
    expect(page).to_have_title("Notifications · Tally")
    # Also the oldest ones, on page 2: everything up to the newest one when the page loaded.
    expect(page.locator("#toast")).to_have_text(f"Marked {unread} notifications read.")
    assert page.evaluate("window.sameDocument") is True
    assert truth(alice) == 0
    assert truth(bob) == 1
    assert_exact(alice, bob)


def test_delete_hides_the_item_with_an_undo_then_deletes_it(
    browser_page, live_server, alice, bob, many
):
    page = browser_page
    page.clock.install()  # the undo delay runs only when the test moves the clock on
    open_inbox(page, live_server)
    count = page.locator("#unread-count")
    unread = truth(alice)
    target = Notification.objects.get(recipient=alice, verb="event 05")
    item = page.locator(f"#notification-{target.pk}")

    assert not target.is_read
    item.get_by_role("button", name="Delete: event 05").click()
    expect(item).to_be_hidden()
    undo = page.get_by_role("button", name="Undo delete: event 05")
    expect(undo).to_be_focused()
    expect(page.locator(".undo-row")).to_have_text("Deleted: event 05. Undo")
    # The badge and the toast show the deletion at once; Undo takes both back.
    expect(count).to_have_text(str(unread - 1))
    expect(page.locator("#toast")).to_have_text("Deleted: event 05")
    undo.click()
    expect(item).to_be_visible()
    expect(page.locator(".undo-row")).to_have_count(0)
    assert Notification.objects.filter(pk=target.pk).exists()
    expect(count).to_have_text(str(unread))
    expect(page.locator("#toast")).to_have_text("Kept: event 05")
    expect(item.get_by_role("button", name="Delete: event 05")).to_be_focused()

    item.get_by_role("button", name="Delete: event 05").click()
    expect(item).to_be_hidden()
    expect(count).to_have_text(str(unread - 1))
    assert Notification.objects.filter(pk=target.pk).exists()  # not sent before the undo time
    page.clock.run_for(6_000)
    expect(item).to_have_count(0)
    expect(page.locator(".undo-row")).to_have_count(0)
    expect(count).to_have_text(str(unread - 1))
    expect(page.locator("#toast")).to_have_text("Deleted: event 05")
    assert not Notification.objects.filter(pk=target.pk).exists()
    assert truth(alice) == unread - 1
    assert page.evaluate("window.sameDocument") is True
    assert_exact(alice, bob)


def test_badge_stays_in_view_on_a_small_screen(browser_page, live_server, alice, bob, many):
    page = browser_page
    page.set_viewport_size({"width": 390, "height": 844})
    open_inbox(page, live_server)
    badge = page.locator("#unread-badge")
    expect(badge).to_have_text(re.compile(rf"^{truth(alice)}\b"))
    page.locator(".notification").last.scroll_into_view_if_needed()
    assert page.evaluate("window.scrollY") > 500
    expect(badge).to_be_in_viewport()
    box = badge.bounding_box()
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 120, box
    # Nothing is wider than the screen.
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
