// The inbox without reloads. Keeps the unread badge live (polls the count
// endpoint) and does the actions in place through the JSON API: mark read /
// unread, mark all read, and delete with a few seconds to undo. Without
// JavaScript, or when a request fails, the forms do the same with a reload.
(function () {
  "use strict";

  const body = document.body;
  const url = body.dataset.countUrl;
  const badge = document.getElementById("unread-badge");
  const count = document.getElementById("unread-count");
  const status = document.getElementById("live-status");
  const toast = document.getElementById("toast");
  const readAllForm = document.querySelector(".read-all-form");
  if (!url || !badge || !count) {
    return;
  }

  const interval = Math.max(1, Number(body.dataset.pollSeconds) || 5) * 1000;
  const undoDelay = Math.max(0, Number(body.dataset.undoSeconds) || 0) * 1000;
  const maxDelay = 60000;
  const baseTitle = document.title.replace(/^\(\d+\) /, "");
  // The count this page accounts for: the one it was loaded with, moved by the
  // changes made here. A polled count above it means new notifications arrived.
  let known = Number(badge.dataset.unread) || 0;
  let delay = interval;
  let timer = null;
  // Bumped when an action starts and when it ends: a poll that overlapped an
  // action may carry a count from before it, so its answer is dropped.
  let actions = 0;

  function render(unread) {
    if (readAllForm) {
      readAllForm.querySelector("button").disabled = unread === 0;
    }
    if (String(unread) === badge.dataset.unread) {
      return;
    }
    badge.dataset.unread = String(unread);
    count.textContent = String(unread);
    document.title = (unread > 0 ? "(" + unread + ") " : "") + baseTitle;
    if (status) {
      status.replaceChildren();
      if (unread > known) {
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

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden) {
      schedule(0);
    }
  });
  schedule(interval);

  // ---- actions in place ----

  let toastTimer = null;

  // Says what an action did, in the toast, for a few seconds.
  function say(text) {
    if (toast) {
      toast.textContent = text;
      clearTimeout(toastTimer);
      toastTimer = setTimeout(function () {
        toast.replaceChildren();
      }, 6000);
    }
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
    const raw = form.querySelector("input[name=until_id]").value;
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

  // Deletions waiting for their undo time, by item id: {form, item, row, timer}.
  const pending = new Map();

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
    const entry = { form: form, item: item, row: row, timer: null };
    entry.timer = setTimeout(function () {
      deleteNow(entry, false);
    }, undoDelay);
    pending.set(item.dataset.id, entry);
    undo.addEventListener("click", function () {
      clearTimeout(entry.timer);
      pending.delete(item.dataset.id);
      row.remove();
      item.hidden = false;
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
    }
    const next = entry.row.nextElementSibling;
    entry.row.remove();
    item.remove();
    say("Deleted: " + item.dataset.verb);
    if (document.activeElement === document.body && next) {
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
    const button = form.querySelector("button");
    button.disabled = true;
    action()
      .catch(function (err) {
        if (err.status === 404 && item) {
          item.remove(); // deleted elsewhere in the meantime
          say("Already deleted: " + item.dataset.verb);
          return;
        }
        form.submit(); // the API did not answer as expected: the plain form does it
      })
      .finally(function () {
        if (form !== readAllForm) {
          button.disabled = false;
        }
      });
  });
})();
