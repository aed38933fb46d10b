// durably console: the token field, live refresh of the runs table, and the action forms.
// Every action asks for confirmation, calls the JSON API (/api/...) and reloads the page;
// errors are shown inline. Loaded as a file: the Content-Security-Policy allows no inline script.
(function () {
  "use strict";
  var TOKEN_KEY = "durably.apiToken";
  var TOKEN_COOKIE = "durably_token";

  function token() {
    try { return localStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
  }

  // Page loads cannot carry the Authorization header; where reads need the token, the server
  // also accepts it from this cookie, for reads only (actions always send the header).
  function setCookie(value) {
    var secure = window.location.protocol === "https:" ? "; Secure" : "";
    document.cookie = TOKEN_COOKIE + "=" + encodeURIComponent(value) + "; Path=/; SameSite=Strict" +
      (value ? "" : "; Max-Age=0") + secure;
  }

  function setupToken() {
    var form = document.getElementById("token-form");
    var input = document.getElementById("api-token");
    var state = document.getElementById("token-state");
    if (!form || !input) return;
    input.value = token();
    state.textContent = token() ? "saved" : "";
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      try {
        if (input.value) localStorage.setItem(TOKEN_KEY, input.value);
        else localStorage.removeItem(TOKEN_KEY);
      } catch (e) { /* storage disabled: the token lasts for this page only */ }
      setCookie(input.value);
      state.textContent = input.value ? "saved" : "cleared";
      if (input.value && document.body.dataset.needsToken) window.location.reload();
    });
  }

  function messageOf(status, body) {
    if (body && typeof body === "object") {
      if (typeof body.message === "string") return body.message;
      if (body.error && typeof body.error === "object" && body.error.message) return body.error.message;
      if (typeof body.error === "string") return body.error;
      if (typeof body.detail === "string") return body.detail;
      if (body.detail && typeof body.detail === "object" && body.detail.message) return body.detail.message;
      if (Array.isArray(body.detail)) {
        return body.detail.map(function (d) { return (d.loc || []).join(".") + ": " + d.msg; }).join("; ");
      }
    }
    if (typeof body === "string" && body) return body;
    return "request failed (HTTP " + status + ")";
  }

  function post(url, payload) {
    var headers = { "Content-Type": "application/json", "Accept": "application/json" };
    var t = token();
    if (t) headers["Authorization"] = "Bearer " + t;
    return fetch(url, { method: "POST", headers: headers, body: JSON.stringify(payload || {}) })
      .then(function (res) {
        return res.text().then(function (text) {
          var body = text;
          try { body = text ? JSON.parse(text) : null; } catch (e) { /* not JSON */ }
          if (!res.ok) throw new Error(messageOf(res.status, body));
          return body;
        });
      });
  }

  var enc = encodeURIComponent;

  // Returns null when the operator does not confirm: then nothing is sent.
  function request(form, submitter) {
    var run = "/api/runs/" + enc(form.dataset.run);
    var data = new FormData(form);
    var by = (data.get("by") || "").toString().trim();
    switch (form.dataset.kind) {
      case "approval": {
        var decision = submitter && submitter.dataset.decision === "reject" ? "reject" : "approve";
        var holder = form.closest(".approval");
        var tool = holder && holder.querySelector("code.tool") ? holder.querySelector("code.tool").textContent : "this";
        var question = decision === "approve"
          ? "Approve " + tool + " for run " + form.dataset.run + "? The effect will be executed as shown."
          : "Reject " + tool + " for run " + form.dataset.run + "?";
        if (!window.confirm(question)) return null;
        var body = { approval_id: form.dataset.approval };
        var comment = (data.get("comment") || "").toString().trim();
        if (by) body.by = by;
        if (comment) body.comment = comment;
        return { url: run + "/approvals/" + decision, body: body };
      }
      case "resolve": {
        var outcome = (data.get("outcome") || "").toString();
        var raw = (data.get("result") || "").toString().trim();
        var payload = { outcome: outcome };
        if (raw && outcome === "succeeded") {
          try { payload.result = JSON.parse(raw); } catch (e) { throw new Error("result is not valid JSON: " + e.message); }
        }
        if (!window.confirm("Record that the effect at " + form.dataset.step + " " +
            outcome.replace("_", " ") + "? This settles it for good.")) return null;
        if (by) payload.by = by;
        return { url: run + "/effects/" + enc(form.dataset.step) + "/resolve", body: payload };
      }
      case "resume":
        if (!window.confirm("Resume run " + form.dataset.run + "? It continues now, with its effects.")) return null;
        return { url: run + "/resume", body: {} };
      case "fork": {
        var at = (data.get("at") || "").toString().trim();
        var replay = (data.get("replay") || "DISABLED").toString();
        if (!window.confirm("Fork run " + form.dataset.run + (at ? " after " + at : "") +
            "? New tool calls: " + replay + ".")) return null;
        var spec = { replay: replay };
        if (at) spec.at = at;
        // The fork has a page of its own: go there.
        return { url: run + "/fork", body: spec, next: function (forked) { return "/runs/" + enc(forked.run_id); } };
      }
      case "pause": {
        var reason = (data.get("reason") || "").toString().trim();
        if (!window.confirm("Pause run " + form.dataset.run + "? A call in flight finishes first; nothing more runs until it is unpaused.")) return null;
        var pause = {};
        if (reason) pause.reason = reason;
        if (by) pause.by = by;
        return { url: run + "/pause", body: pause };
      }
      case "unpause": {
        var unpause = {};
        if (by) unpause.by = by;
        return { url: run + "/unpause", body: unpause };
      }
      case "cancel": {
        var compensate = data.get("compensate") !== null;
        if (!window.confirm("Cancel this run" + (compensate ? " and compensate its effects" : "") + "? This is final.")) return null;
        return { url: run + "/cancel", body: { compensate: compensate } };
      }
    }
    throw new Error("unknown action " + form.dataset.kind);
  }

  function setupForms() {
    document.querySelectorAll("form.api-form").forEach(function (form) {
      form.addEventListener("submit", function (ev) {
        ev.preventDefault();
        var errorBox = form.querySelector(".form-error");
        var buttons = form.querySelectorAll("button");
        if (errorBox) errorBox.textContent = "";
        var req;
        try { req = request(form, ev.submitter); } catch (e) {
          if (errorBox) errorBox.textContent = e.message;
          return;
        }
        if (!req) return;
        buttons.forEach(function (b) { b.disabled = true; });
        form.classList.add("busy");
        post(req.url, req.body).then(function (answer) {
          if (req.next) window.location.href = req.next(answer);
          else window.location.reload();
        }).catch(function (e) {
          if (errorBox) errorBox.textContent = e.message;
          buttons.forEach(function (b) { b.disabled = false; });
          form.classList.remove("busy");
        });
      });
    });
  }

  function setupFilters() {
    document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
      select.addEventListener("change", function () { select.form.submit(); });
    });
  }

  function setupRefresh() {
    var table = document.getElementById("runs-table");
    if (table && table.dataset.refresh) {
      window.setInterval(function () {
        if (document.hidden) return;
        fetch(table.dataset.refresh, { headers: { "Accept": "text/html" } })
          .then(function (res) { return res.ok ? res.text() : null; })
          .then(function (html) { if (html !== null) table.innerHTML = html; })
          .catch(function () { /* server briefly away: try again next tick */ });
      }, 3000);
    }
    // A run page of a run that is executing right now reloads until it settles.
    if (document.querySelector("[data-live='1']")) {
      window.setTimeout(function () {
        if (!document.querySelector("form.busy")) window.location.reload();
      }, 3000);
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    setupToken();
    setupForms();
    setupFilters();
    setupRefresh();
  });
})();
