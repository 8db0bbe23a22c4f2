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
 * resumes after it, so nothing is missed and nothing comes twice. Steps already on the page
 * (rendered by the server, data-seq) are not added again.
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
    var source = new EventSource(url);
    root.hidden = false; // hidden for browsers without JavaScript, which get no live part
    root.setAttribute("data-live", "following");

    function clearDraft() {
      draft = null;
      if (streaming) {
        streaming.textContent = "";
        streaming.removeAttribute("data-seq");
      }
    }

    source.addEventListener("step", function (event) {
      var step = JSON.parse(event.data);
      if (draft && draft.seq <= step.seq) clearDraft();
      if (!steps || steps.querySelector('[data-seq="' + step.seq + '"]')) return;
      var item = document.createElement("li");
      item.setAttribute("data-seq", String(step.seq));
      item.setAttribute("data-kind", step.kind);
      item.className = "live-step live-" + step.kind;
      item.textContent = "#" + step.seq + " " + step.kind + ": " + describe(step);
      steps.appendChild(item);
    });

    source.addEventListener("delta", function (event) {
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
    });

    source.addEventListener("progress", function (event) {
      var note = JSON.parse(event.data);
      if (!steps) return;
      var item = document.createElement("li");
      item.className = "live-progress";
      item.setAttribute("data-after", String(note.seq));
      item.textContent = note.text;
      steps.appendChild(item);
    });

    source.addEventListener("status", function (event) {
      var data = JSON.parse(event.data);
      root.setAttribute("data-status", data.status);
      if (status) {
        status.textContent = data.status + (data.waiting_for ? " (" + data.waiting_for + ")" : "");
        status.setAttribute("data-status", data.status);
      }
    });

    source.addEventListener("end", function (event) {
      var data = JSON.parse(event.data);
      source.close();
      clearDraft();
      root.setAttribute("data-status", data.status);
      root.setAttribute("data-live", "ended");
    });

    source.addEventListener("error", function () {
      // The browser reconnects by itself (with Last-Event-ID) unless the server refused.
      if (source.readyState === EventSource.CLOSED && root.getAttribute("data-live") !== "ended") {
        root.setAttribute("data-live", "closed");
      } else if (source.readyState === EventSource.CONNECTING) {
        root.setAttribute("data-live", "reconnecting");
      }
    });
    source.addEventListener("open", function () {
      if (root.getAttribute("data-live") !== "ended") root.setAttribute("data-live", "following");
    });
    return source;
  }

  window.DurableAgentsLive = { follow: follow };
  function start() {
    var roots = document.querySelectorAll("[data-live-events]");
    for (var i = 0; i < roots.length; i++) follow(roots[i]);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
