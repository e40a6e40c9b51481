// Keeps the unread badge live: polls the count endpoint and updates the badge,
// the page title and a polite status message, without reloading the page.
(function () {
  "use strict";

  const body = document.body;
  const url = body.dataset.countUrl;
  const badge = document.getElementById("unread-badge");
  const count = document.getElementById("unread-count");
  const status = document.getElementById("live-status");
  if (!url || !badge || !count) {
    return;
  }

  const interval = Math.max(1, Number(body.dataset.pollSeconds) || 5) * 1000;
  const maxDelay = 60000;
  const baseTitle = document.title.replace(/^\(\d+\) /, "");
  const shownOnLoad = Number(badge.dataset.unread) || 0;
  let delay = interval;
  let timer = null;

  function render(unread) {
    if (String(unread) === badge.dataset.unread) {
      return;
    }
    badge.dataset.unread = String(unread);
    count.textContent = String(unread);
    document.title = (unread > 0 ? "(" + unread + ") " : "") + baseTitle;
    if (status) {
      status.replaceChildren();
      if (unread > shownOnLoad) {
        const link = document.createElement("a");
        link.href = window.location.pathname;
        link.textContent = "Show them";
        status.append("New notifications have arrived. ", link);
      }
    }
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  async function poll() {
    if (document.hidden) {
      schedule(interval);
      return;
    }
    try {
      const response = await fetch(url, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "application/json" },
      });
      if (response.status === 401) {
        return; // logged out elsewhere: stop polling
      }
      if (!response.ok) {
        throw new Error("HTTP " + response.status);
      }
      const data = await response.json();
      if (Number.isInteger(data.unread)) {
        render(data.unread);
      }
      delay = interval;
    } catch (err) {
      delay = Math.min(delay * 2, maxDelay); // back off while the server is unreachable
    }
    schedule(delay);
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) {
      schedule(0);
    }
  });
  schedule(interval);
})();
