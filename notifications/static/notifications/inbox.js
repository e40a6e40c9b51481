// The inbox without reloads. Keeps the unread badge and the list live: a
// Server-Sent Events stream pushes the count and the new or changed
// notifications; while it is down, the page polls the count endpoint and says
// so quietly. Does the actions in place through the JSON API: mark read /
// unread, mark all read, and delete with a few seconds to undo. Without
// JavaScript, or when a request fails, the forms do the same with a reload.
(function () {
  "use strict";

  const body = document.body;
  const url = body.dataset.countUrl;
  const badge = document.getElementById("unread-badge");
  const count = document.getElementById("unread-count");
  const status = document.getElementById("live-status");
  const connection = document.getElementById("live-connection");
  const toast = document.getElementById("toast");
  const list = document.querySelector(".notifications");
  const itemTemplate = document.getElementById("notification-template");
  const readAllForm = document.querySelector(".read-all-form");
  const readAllButton = readAllForm ? readAllForm.querySelector("button") : null;
  const untilInput = readAllForm ? readAllForm.querySelector("input[name=until_id]") : null;
  if (!url || !badge || !count) {
    return;
  }

  const interval = Math.max(1, Number(body.dataset.pollSeconds) || 5) * 1000;
  const undoDelay = Math.max(0, Number(body.dataset.undoSeconds) || 0) * 1000;
  const maxDelay = 60000;
  const baseTitle = document.title.replace(/^\(\d+\) /, "");
  // New items are shown in place only on the first page of "All" or "Unread".
  const params = new URLSearchParams(window.location.search);
  const firstPage = !params.get("page") || params.get("page") === "1";
  const onlyUnread = params.get("show") === "unread";
  // The count this page accounts for: the one it was loaded with, moved by the
  // changes made here. A count above it means new notifications arrived.
  let known = Number(badge.dataset.unread) || 0;
  // The server's last count; the badge shows it less the deletions waiting for their undo time.
  let server = known;
  // Bumped when an action starts and when it ends: a poll that overlapped an
  // action may carry a count from before it, so its answer is dropped.
  let actions = 0;
  // Deletions waiting for their undo time, by item id: {form, item, row, timer, unread}.
  const pending = new Map();

  // ---- the badge, the title, the "Mark all read" button ----

  function hiddenUnread() {
    let n = 0;
    pending.forEach(function (entry) {
      n += entry.unread ? 1 : 0;
    });
    return n;
  }

  // A count from the API (an action's answer or a poll).
  function render(unread) {
    server = unread;
    paint();
    if (unread > known) {
      fetchNew();
    } else {
      known = unread; // read elsewhere: a later rise is new again
    }
  }

  // Shows the server's count less the unread items deleted here and not yet sent.
  function paint() {
    const shown = Math.max(0, server - hiddenUnread());
    if (readAllButton) {
      // aria-disabled, not disabled: a pressed button keeps the focus.
      readAllButton.disabled = false;
      readAllButton.setAttribute("aria-disabled", String(shown === 0));
    }
    if (String(shown) === badge.dataset.unread) {
      return;
    }
    badge.dataset.unread = String(shown);
    count.textContent = String(shown);
    document.title = (shown > 0 ? "(" + shown + ") " : "") + baseTitle;
  }

  // ---- new notifications, shown in the list on their own ----

  // The newest notification this page knows of: the newest when it loaded, or one added since.
  let newest = Number(body.dataset.newestId) || 0;

  // Builds a list item like the page's own, from the API's JSON for a notification.
  function buildItem(n) {
    const fragment = itemTemplate.content.cloneNode(true);
    const item = fragment.querySelector(".notification");
    const id = String(n.id);
    item.id = "notification-" + id;
    ["id", "apiUrl", "apiRead", "apiUnread", "formRead", "formUnread"].forEach(function (key) {
      item.dataset[key] = item.dataset[key].replace("__id__", id);
    });
    item.querySelectorAll("form").forEach(function (form) {
      form.action = form.getAttribute("action").replace("__id__", id);
    });
    item.dataset.verb = n.verb;
    const title = item.querySelector(".notification-title");
    if (n.actor) {
      const strong = document.createElement("strong");
      strong.textContent = n.actor;
      title.append(strong, " ");
    }
    title.append(n.verb);
    const description = item.querySelector(".notification-description");
    if (n.description) {
      description.textContent = n.description;
    } else {
      description.remove();
    }
    const time = item.querySelector("time");
    time.dateTime = n.created_at;
    time.textContent = "just now";
    item.querySelector(".delete-form button").setAttribute("aria-label", "Delete: " + n.verb);
    showRead(item, n.is_read);
    return item;
  }

  // Adds the notifications newer than the newest one shown, at the top, and says so politely.
  function addNew(items) {
    const fresh = items
      .filter(function (n) {
        return n.id > newest && !(onlyUnread && n.is_read) && !document.getElementById("notification-" + n.id);
      })
      .sort(function (a, b) {
        return a.id - b.id;
      });
    if (fresh.length === 0) {
      return 0;
    }
    newest = fresh[fresh.length - 1].id;
    if (!list || !itemTemplate || !firstPage) {
      offerNewest();
      return 0;
    }
    const empty = document.querySelector(".empty");
    if (empty) {
      empty.remove();
    }
    fresh.forEach(function (n) {
      list.prepend(buildItem(n));
      if (!n.is_read) {
        known += 1;
      }
    });
    if (untilInput) {
      untilInput.value = String(newest); // "Mark all read" covers what is shown
    }
    const last = fresh[fresh.length - 1];
    announce(
      fresh.length === 1
        ? "New notification: " + (last.actor ? last.actor + " " : "") + last.verb
        : fresh.length + " new notifications"
    );
    return fresh.length;
  }

  function announce(text) {
    if (status) {
      status.textContent = text;
    }
  }

  // Where the list cannot take new items (another page), a link to the newest ones.
  function offerNewest() {
    if (!status || status.querySelector("a")) {
      return;
    }
    const link = document.createElement("a");
    link.href = window.location.pathname + (onlyUnread ? "?show=unread" : "");
    link.textContent = "Show them";
    status.replaceChildren("New notifications have arrived. ", link);
  }

  let fetching = false;

  // Without the stream: reads the first page of the API and shows what is new on it.
  async function fetchNew() {
    if (!firstPage || !list || !itemTemplate) {
      offerNewest();
      return;
    }
    if (fetching) {
      return;
    }
    fetching = true;
    try {
      const response = await fetch(body.dataset.listUrl, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "application/json" },
      });
      if (response.ok) {
        const data = await response.json();
        addNew(data.results);
        if (server > known) {
          known = server; // read elsewhere, or older than the page: nothing to add
        }
      }
    } catch (err) {
      offerNewest();
    } finally {
      fetching = false;
    }
  }

  // ---- the stream, and polling while it is down ----

  let timer = null;
  let delay = interval;
  let stream = null;

  function quietly(text) {
    if (connection) {
      connection.textContent = text;
    }
  }

  function schedule(ms) {
    clearTimeout(timer);
    timer = setTimeout(poll, ms);
  }

  async function poll() {
    timer = null;
    if (stream !== null && stream.readyState === 1) {
      return; // the stream is up: no periodic requests
    }
    if (document.hidden) {
      schedule(interval);
      return;
    }
    const seen = actions;
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
      if (Number.isInteger(data.unread) && seen === actions) {
        render(data.unread);
      }
      delay = interval;
    } catch (err) {
      delay = Math.min(delay * 2, maxDelay); // back off while the server is unreachable
    }
    schedule(delay);
  }

  // The stream's "state" event: the exact count, and the newest or just changed notifications.
  function onState(event) {
    const data = JSON.parse(event.data);
    const items = Array.isArray(data.notifications) ? data.notifications : [];
    items.forEach(changed);
    addNew(items);
    if (Number.isInteger(data.unread)) {
      known = data.unread; // the stream brings the items themselves: nothing to fetch
      server = data.unread;
      paint();
    }
  }

  // A notification changed elsewhere (read or unread in another tab): shown as it is now.
  function changed(n) {
    const item = document.getElementById("notification-" + n.id);
    if (item && !item.hidden && item.classList.contains("is-unread") === n.is_read) {
      showRead(item, n.is_read);
    }
  }

  function connect() {
    const streamUrl = body.dataset.streamUrl;
    if (!streamUrl || typeof window.EventSource !== "function") {
      schedule(interval);
      return;
    }
    stream = new EventSource(streamUrl);
    stream.addEventListener("state", onState);
    stream.addEventListener("open", function () {
      clearTimeout(timer);
      timer = null;
      body.dataset.live = "stream";
      quietly("");
    });
    stream.addEventListener("error", function () {
      // EventSource reconnects by itself; until it does, the count is polled.
      body.dataset.live = "polling";
      quietly("Live updates paused; checking every " + Math.round(interval / 1000) + " s.");
      if (stream.readyState === 2) {
        stream = null; // refused for good (logged out, or no stream here): polling only
      }
      if (timer === null) {
        schedule(interval);
      }
    });
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && (stream === null || stream.readyState !== 1)) {
      schedule(0);
    }
  });
  paint();
  connect();
  if (stream === null) {
    schedule(interval);
  }

  // ---- actions in place ----

  let toastTimer = null;
  let said = 0;

  // Says what an action did, in the toast, for a few seconds; returns the saying's number.
  function say(text) {
    said += 1;
    if (toast) {
      toast.textContent = text;
      clearTimeout(toastTimer);
      toastTimer = setTimeout(function () {
        toast.replaceChildren();
      }, 6000);
    }
    return said;
  }

  // Sends an API request with the form's CSRF token; resolves to the JSON answer.
  // Rejects (so the caller falls back to the form) unless the answer is a 2xx.
  async function send(form, method, target, payload, keepalive) {
    const token = form.querySelector("input[name=csrfmiddlewaretoken]");
    const headers = { Accept: "application/json", "X-CSRFToken": token ? token.value : "" };
    const options = { method: method, credentials: "same-origin", headers: headers };
    if (payload !== undefined) {
      headers["Content-Type"] = "application/json";
      options.body = JSON.stringify(payload);
    }
    if (keepalive) {
      options.keepalive = true;
    }
    actions += 1;
    let response;
    try {
      response = await fetch(target, options);
    } finally {
      actions += 1;
    }
    if (!response.ok) {
      const error = new Error("HTTP " + response.status);
      error.status = response.status;
      throw error;
    }
    return response.json();
  }

  // Shows an item read or unread: class, "Unread" pill, button label, form target.
  function showRead(item, isRead) {
    item.classList.toggle("is-unread", !isRead);
    const title = item.querySelector(".notification-title");
    const pill = title.querySelector(".pill");
    if (isRead && pill) {
      pill.remove();
    } else if (!isRead && !pill) {
      const span = document.createElement("span");
      span.className = "pill";
      span.textContent = "Unread";
      title.prepend(span, " ");
    }
    const button = item.querySelector(".toggle-read");
    button.setAttribute("aria-label", (isRead ? "Mark unread: " : "Mark read: ") + item.dataset.verb);
    button.querySelector(".label-read").hidden = isRead;
    button.querySelector(".label-unread").hidden = !isRead;
    item.querySelector(".toggle-form").action = isRead ? item.dataset.formUnread : item.dataset.formRead;
  }

  async function toggleRead(form, item) {
    const wasUnread = item.classList.contains("is-unread");
    const data = await send(form, "POST", wasUnread ? item.dataset.apiRead : item.dataset.apiUnread);
    if (data.changed) {
      known += data.notification.is_read ? -1 : 1;
      say((data.notification.is_read ? "Marked read: " : "Marked unread: ") + item.dataset.verb);
    }
    showRead(item, data.notification.is_read);
    render(data.unread);
  }

  async function markAllRead(form) {
    const raw = untilInput.value;
    const untilId = raw ? Number(raw) : null;
    const data = await send(form, "POST", body.dataset.readAllUrl, { until_id: untilId });
    known -= data.changed;
    document.querySelectorAll(".notification.is-unread").forEach(function (item) {
      if (untilId === null || Number(item.dataset.id) <= untilId) {
        showRead(item, true);
      }
    });
    say("Marked " + data.changed + " notification" + (data.changed === 1 ? "" : "s") + " read.");
    render(data.unread);
  }

  function deleteLater(form, item) {
    const row = document.createElement("li");
    row.className = "notification undo-row";
    const text = document.createElement("p");
    text.textContent = "Deleted: " + item.dataset.verb + ". ";
    const undo = document.createElement("button");
    undo.type = "button";
    undo.className = "button-link";
    undo.textContent = "Undo";
    undo.setAttribute("aria-label", "Undo delete: " + item.dataset.verb);
    text.append(undo);
    row.append(text);
    item.hidden = true;
    item.after(row);
    undo.focus({ preventScroll: true });
    const entry = { form: form, item: item, row: row, timer: null, unread: item.classList.contains("is-unread") };
    entry.timer = setTimeout(function () {
      deleteNow(entry, false);
    }, undoDelay);
    pending.set(item.dataset.id, entry);
    paint(); // the badge drops at once; Undo brings it back
    entry.said = say("Deleted: " + item.dataset.verb);
    undo.addEventListener("click", function () {
      clearTimeout(entry.timer);
      pending.delete(item.dataset.id);
      row.remove();
      item.hidden = false;
      paint();
      item.querySelector(".delete-form button").focus({ preventScroll: true });
      say("Kept: " + item.dataset.verb);
    });
  }

  async function deleteNow(entry, leaving) {
    const item = entry.item;
    pending.delete(item.dataset.id);
    const wasUnread = item.classList.contains("is-unread");
    try {
      const data = await send(entry.form, "DELETE", item.dataset.apiUrl, undefined, leaving);
      if (wasUnread) {
        known -= 1;
      }
      render(data.unread);
    } catch (err) {
      if (err.status !== 404) {
        if (!leaving) {
          entry.form.submit(); // let the form try, and show what went wrong
        }
        return;
      }
      // 404: it was already gone.
      paint();
    }
    const next = entry.row.nextElementSibling;
    const hadFocus = entry.row.contains(document.activeElement);
    entry.row.remove();
    item.remove();
    if (entry.said === said) {
      say("Deleted: " + item.dataset.verb); // still the last action: keep saying it
    }
    if ((hadFocus || document.activeElement === document.body) && next) {
      const button = next.querySelector("button");
      if (button) {
        button.focus({ preventScroll: true });
      }
    }
  }

  // Leaving the page sends the deletions still waiting for their undo time.
  window.addEventListener("pagehide", function () {
    pending.forEach(function (entry) {
      clearTimeout(entry.timer);
      deleteNow(entry, true);
    });
  });

  document.addEventListener("submit", function (event) {
    const form = event.target;
    const item = form.closest(".notification");
    let action = null;
    if (form === readAllForm) {
      event.preventDefault();
      if (readAllButton.getAttribute("aria-disabled") === "true") {
        return; // nothing left to mark
      }
      action = function () {
        return markAllRead(form);
      };
    } else if (item && form.classList.contains("toggle-form")) {
      action = function () {
        return toggleRead(form, item);
      };
    } else if (item && form.classList.contains("delete-form")) {
      event.preventDefault();
      deleteLater(form, item);
      return;
    }
    if (action === null) {
      return;
    }
    event.preventDefault();
    // Busy, not disabled: a disabled button would drop the keyboard focus to the page.
    if (form.dataset.busy === "true") {
      return;
    }
    const button = form.querySelector("button");
    form.dataset.busy = "true";
    button.setAttribute("aria-busy", "true");
    action()
      .catch(function (err) {
        if (err.status === 404 && item) {
          const next = item.nextElementSibling || item.previousElementSibling;
          item.remove(); // deleted elsewhere in the meantime
          say("Already deleted: " + item.dataset.verb);
          const other = next ? next.querySelector("button") : null;
          if (other) {
            other.focus({ preventScroll: true });
          }
          return;
        }
        form.submit(); // the API did not answer as expected: the plain form does it
      })
      .finally(function () {
        delete form.dataset.busy;
        button.removeAttribute("aria-busy");
      });
  });
})();
