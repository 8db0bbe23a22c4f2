/* durable_agents live: keeps a page's transcript of a run in step with its event stream.
 *
 * No build step and no framework. Any element with data-live-events="<events URL>" is
 * followed when the page loads; inside it, these (all optional) are kept up to date:
 *   [data-live-status]     the run's status (the element's data-status too)
 *   [data-live-steps]      a list: one <li data-seq data-kind> per committed step, and one
 *                          <li class="progress"> per progress message
 *   [data-live-streaming]  the text of the model turn in flight
 * Without JavaScript the page is what the server rendered. Everything shown is set with
 * textContent: it is what a model or a tool wrote, never markup.
 *
 * The browser's EventSource reconnects by itself and sends the last event id; the server
 * resumes after it, so nothing is missed and nothing comes twice. It gives up for good on an
 * answer that is not a stream (a 503 when the server has as many readers as it serves): then
 * this script opens a new one after a growing, randomised wait, resuming after the last event
 * id with ?after=. Steps already on the page (rendered by the server, data-seq) are not added
 * again. follow(root) returns {source, close()}: the EventSource of the moment, and a way to
 * stop following.
 */
(function () {
  "use strict";

  function textOf(blocks) {
    if (typeof blocks === "string") return blocks;
    if (!Array.isArray(blocks)) return JSON.stringify(blocks);
    return blocks
      .map(function (block) {
        if (!block || typeof block !== "object") return String(block);
        if (block.type === "text") return block.text;
        if (block.type === "thinking") return "";
        if (block.type === "redacted_thinking") return "";
        if (block.type === "tool_use") return "[calls " + block.name + " " + JSON.stringify(block.input) + "]";
        if (block.type === "tool_result") {
          return (block.is_error ? "[error] " : "") + textOf(block.content);
        }
        return "[" + block.type + "]";
      })
      .filter(function (part) { return part; })
      .join(" ");
  }

  function describe(step) {
    if (step.truncated) return step.content.slice(0, 2000) + " [... " + step.truncated + " characters]";
    return textOf(step.content);
  }

  function follow(root) {
    var url = root.getAttribute("data-live-events");
    if (!url || !window.EventSource) return null;
    var status = root.querySelector("[data-live-status]");
    var steps = root.querySelector("[data-live-steps]");
    var streaming = root.querySelector("[data-live-streaming]");
    var draft = null; // the turn in flight: {seq, attempt, text}
    var lastId = null; // the id of the last event given: where a new connection resumes
    var failures = 0; // connections refused or lost in a row since the last event
    var retryTimer = null;
    var source = null;
    root.hidden = false; // hidden for browsers without JavaScript, which get no live part
    root.setAttribute("data-live", "following");

    function clearDraft() {
      draft = null;
      if (streaming) {
        streaming.textContent = "";
        streaming.removeAttribute("data-seq");
      }
    }

    function given(event) {
      if (event.lastEventId) lastId = event.lastEventId;
      failures = 0;
    }

    function onStep(event) {
      given(event);
      var step = JSON.parse(event.data);
      if (draft && draft.seq <= step.seq) clearDraft();
      if (!steps || steps.querySelector('[data-seq="' + step.seq + '"]')) return;
      var item = document.createElement("li");
      item.setAttribute("data-seq", String(step.seq));
      item.setAttribute("data-kind", step.kind);
      item.className = "live-step live-" + step.kind;
      item.textContent = "#" + step.seq + " " + step.kind + ": " + describe(step);
      steps.appendChild(item);
    }

    function onDelta(event) {
      given(event);
      var delta = JSON.parse(event.data);
      // n == 0: the turn's text starts over (a new attempt after a worker died mid-turn).
      if (!draft || delta.n === 0 || draft.seq !== delta.seq || draft.attempt !== delta.attempt) {
        draft = { seq: delta.seq, attempt: delta.attempt, text: "" };
      }
      draft.text += delta.text;
      if (streaming) {
        streaming.textContent = draft.text;
        streaming.setAttribute("data-seq", String(delta.seq));
      }
    }

    function onProgress(event) {
      given(event);
      var note = JSON.parse(event.data);
      if (!steps) return;
      var item = document.createElement("li");
      item.className = "live-progress";
      item.setAttribute("data-after", String(note.seq));
      item.textContent = note.text;
      steps.appendChild(item);
    }

    function onStatus(event) {
      given(event);
      var data = JSON.parse(event.data);
      root.setAttribute("data-status", data.status);
      if (status) {
        status.textContent = data.status + (data.waiting_for ? " (" + data.waiting_for + ")" : "");
        status.setAttribute("data-status", data.status);
      }
    }

    function onEnd(event) {
      given(event);
      var data = JSON.parse(event.data);
      source.close();
      clearDraft();
      root.setAttribute("data-status", data.status);
      root.setAttribute("data-live", "ended");
    }

    // The URL of a new connection: the page's, resuming after the last event given (a new
    // EventSource sends no Last-Event-ID of the one before it).
    function resumeUrl() {
      if (!lastId) return url;
      var bare = url.replace(/([?&])after=[^&]*(&|$)/, function (_, lead, tail) {
        return tail ? lead : "";
      });
      return bare + (bare.indexOf("?") < 0 ? "?" : "&") + "after=" + encodeURIComponent(lastId);
    }

    // The wait before the next try: doubling from 1 s up to 60 s, each a random part of it
    // (full jitter), so that a server that refused a crowd (503 past its readers' cap, a
    // restart) is not met by the whole crowd again at the same moment.
    function backoff() {
      var ceiling = Math.min(60000, 1000 * Math.pow(2, Math.min(failures, 6)));
      return Math.floor(ceiling / 2 + Math.random() * (ceiling / 2));
    }

    function onError() {
      if (root.getAttribute("data-live") === "ended") return;
      if (source.readyState === EventSource.CONNECTING) {
        // The browser reconnects by itself (with Last-Event-ID) after a stream that broke.
        root.setAttribute("data-live", "reconnecting");
        return;
      }
      // CLOSED: the browser gives up for good after an answer that is not a stream (a 503
      // past the server's cap, a 502 of a proxy, a restart): try again ourselves, later.
      source.close();
      failures += 1;
      root.setAttribute("data-live", "retrying");
      if (retryTimer === null) {
        retryTimer = window.setTimeout(function () {
          retryTimer = null;
          connect();
        }, backoff());
      }
    }

    function onOpen() {
      if (root.getAttribute("data-live") !== "ended") root.setAttribute("data-live", "following");
    }

    function connect() {
      source = new EventSource(resumeUrl());
      source.addEventListener("step", onStep);
      source.addEventListener("delta", onDelta);
      source.addEventListener("progress", onProgress);
      source.addEventListener("status", onStatus);
      source.addEventListener("end", onEnd);
      source.addEventListener("error", onError);
      source.addEventListener("open", onOpen);
      handle.source = source;
    }

    var handle = {
      source: null,
      close: function () {
        if (retryTimer !== null) window.clearTimeout(retryTimer);
        retryTimer = null;
        if (source) source.close();
      },
    };
    connect();
    return handle;
  }

  window.DurableAgentsLive = { follow: follow };
  function start() {
    var roots = document.querySelectorAll("[data-live-events]");
    for (var i = 0; i < roots.length; i++) follow(roots[i]);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
