// The built-in chat page. Every piece of server data is put on the page with textContent
// (never as HTML); the key lives in sessionStorage and goes only in the Authorization header
// of requests to this origin.
"use strict";

const KEY_STORE = "labrag.key";
const $ = (id) => document.getElementById(id);

const ui = {
  keyForm: $("key-form"), key: $("key"), keyForget: $("key-forget"), keyState: $("key-state"),
  askForm: $("ask-form"), collection: $("collection"), question: $("question"), ask: $("ask"),
  stop: $("stop"), status: $("status"), error: $("error"), answer: $("answer"),
  citations: $("citations"), noCitations: $("no-citations"),
  docPanel: $("doc-panel"), docTitle: $("doc-title"), docMeta: $("doc-meta"), docError: $("doc-error"),
  docText: $("doc-text"), docClose: $("doc-close"),
};

let running = null; // the AbortController of the answer being streamed

function getKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

function authHeaders(extra) {
  return Object.assign({ "Authorization": "Bearer " + getKey() }, extra || {});
}

function showError(el, message) {
  el.textContent = message;
  el.hidden = !message;
}

// What a failed response means, in words, from its status and its (OpenAI-shaped) error body.
async function describeFailure(resp, what) {
  let detail = "";
  try {
    const body = await resp.json();
    const err = body && body.error;
    detail = typeof err === "string" ? err : (err && err.message) || "";
  } catch (_) { /* not JSON */ }
  const suffix = detail ? " (" + detail + ")" : "";
  switch (resp.status) {
    case 401: return "401: the key was refused. Check it, or ask for a new one." + suffix;
    case 403: return "403: this key may not do that." + suffix;
    case 404: return "404: " + what + " was not found, or this key may not read it." + suffix;
    case 429: {
      const after = resp.headers.get("Retry-After");
      return "429: the service is busy" + (after ? "; try again in " + after + " s." : "; try again shortly.") + suffix;
    }
    case 503: return "503: the answer generator is unavailable; try again later." + suffix;
    case 504: return "504: the answer took too long." + suffix;
    default: return resp.status + ": " + (detail || resp.statusText || "request failed");
  }
}

function setKeyState(text) { ui.keyState.textContent = text; }

async function loadCollections() {
  ui.collection.replaceChildren();
  ui.collection.disabled = true;
  ui.ask.disabled = true;
  ui.keyForget.hidden = !getKey();
  if (!getKey()) {
    ui.collection.append(new Option("enter a key first", ""));
    setKeyState("no key");
    return;
  }
  setKeyState("checking the key\u2026");
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
  } catch (e) {
    setKeyState("");
    showError(ui.error, "Cannot reach the server: " + e.message);
    return;
  }
  if (!resp.ok) {
    // Read the reason first, so the key state and the reason appear together.
    const reason = await describeFailure(resp, "the collection list");
    setKeyState("key not accepted");
    ui.collection.append(new Option("no collections", ""));
    showError(ui.error, reason);
    return;
  }
  const models = ((await resp.json()).data || []).map((m) => String(m.id));
  showError(ui.error, "");
  if (!models.length) {
    ui.collection.append(new Option("this key can read no collection", ""));
    setKeyState("key accepted");
    return;
  }
  for (const id of models) ui.collection.append(new Option(id, id));
  ui.collection.value = models.includes("default") ? "default" : models[0];
  ui.collection.disabled = false;
  ui.ask.disabled = false;
  setKeyState("key accepted: " + models.length + (models.length === 1 ? " collection" : " collections"));
}

function resetAnswer() {
  ui.answer.textContent = "";
  ui.citations.replaceChildren();
  ui.noCitations.hidden = true;
  closeDocument();
  showError(ui.error, "");
}

function addCitations(annotations) {
  for (const a of annotations) {
    const c = a && a.type === "url_citation" && a.url_citation;
    if (!c) continue;
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "citation";
    open.textContent = String(c.title || c.url || "source");
    open.dataset.url = String(c.url || "");
    open.addEventListener("click", () => openDocument(c));
    li.append(open);
    if (c.source) {
      const src = document.createElement("span");
      src.className = "source muted";
      src.textContent = String(c.source);
      li.append(src);
    }
    // The server's calibrated 0-1 relevance (null when it has none: then no number is shown).
    if (typeof c.relevance === "number" && Number.isFinite(c.relevance)) {
      const rel = document.createElement("span");
      rel.className = "relevance muted";
      rel.textContent = `relevance ${c.relevance.toFixed(2)}`;
      li.append(rel);
    }
    ui.citations.append(li);
  }
}

// The cited text: fetched from this origin only (the key never goes to another host).
function documentPath(url) {
  let u;
  try { u = new URL(url, location.href); } catch (_) { return null; }
  return u.pathname.startsWith("/v1/documents/") ? u.pathname : null;
}

async function openDocument(c) {
  ui.docPanel.hidden = false;
  ui.docTitle.textContent = String(c.title || "source");
  ui.docMeta.textContent = "loading\u2026";
  ui.docText.textContent = "";
  showError(ui.docError, "");
  const path = documentPath(String(c.url || ""));
  if (!path) {
    ui.docMeta.textContent = "";
    showError(ui.docError, "This citation has no document link on this server.");
    return;
  }
  let resp;
  try {
    resp = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  } catch (e) {
    ui.docMeta.textContent = "";
    showError(ui.docError, "Cannot reach the server: " + e.message);
    return;
  }
  if (!resp.ok) {
    ui.docMeta.textContent = "";
    showError(ui.docError, await describeFailure(resp, "the document"));
    return;
  }
  const doc = await resp.json();
  const meta = [doc.source, doc.heading, doc.chunk != null ? "chunk " + doc.chunk : ""].filter(Boolean);
  ui.docMeta.textContent = meta.map(String).join(" \u00b7 ");
  ui.docText.textContent = String(doc.text || "");
}

function closeDocument() {
  ui.docPanel.hidden = true;
  ui.docTitle.textContent = "";
  ui.docMeta.textContent = "";
  ui.docText.textContent = "";
  showError(ui.docError, "");
}

function finish(state, status) {
  ui.answer.dataset.state = state;
  ui.status.textContent = status;
  ui.ask.disabled = ui.collection.disabled;
  ui.stop.hidden = true;
  if (state === "done" && !ui.citations.children.length) ui.noCitations.hidden = false;
  running = null;
}

// One server-sent event's data: a chunk (text, annotations, finish reason) or an error object.
function handleEvent(data) {
  const obj = JSON.parse(data);
  if (obj.error) {
    const err = obj.error;
    throw new Error(typeof err === "string" ? err : err.message || "the answer failed");
  }
  const choice = (obj.choices || [])[0];
  if (!choice) return null;
  const delta = choice.delta || {};
  if (delta.content) ui.answer.textContent += String(delta.content);
  if (Array.isArray(delta.annotations)) addCitations(delta.annotations);
  return choice.finish_reason || null;
}

async function ask(event) {
  event.preventDefault();
  const question = ui.question.value.trim();
  const model = ui.collection.value;
  if (!question || !model || running) return;
  resetAnswer();
  running = new AbortController();
  ui.answer.dataset.state = "streaming";
  ui.ask.disabled = true;
  ui.stop.hidden = false;
  ui.status.textContent = "searching and generating\u2026";
  let resp;
  try {
    resp = await fetch("/v1/chat/completions", {
      method: "POST", signal: running.signal, cache: "no-store",
      headers: authHeaders({ "Content-Type": "application/json", "Accept": "text/event-stream" }),
      body: JSON.stringify({ model, stream: true, messages: [{ role: "user", content: question }] }),
    });
  } catch (e) {
    showError(ui.error, e.name === "AbortError" ? "" : "Cannot reach the server: " + e.message);
    finish(e.name === "AbortError" ? "stopped" : "error", e.name === "AbortError" ? "stopped" : "");
    return;
  }
  if (!resp.ok) {
    showError(ui.error, await describeFailure(resp, "the collection " + JSON.stringify(model)));
    finish("error", "");
    return;
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", finishReason = null, done = false;
  try {
    while (!done) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while (!done && (cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") { done = true; break; }
        finishReason = handleEvent(data) || finishReason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") { finish("stopped", "stopped"); return; }
    showError(ui.error, "The answer failed: " + e.message);
    finish("error", "");
    return;
  }
  if (!done) {
    showError(ui.error, "The connection closed before the answer was complete.");
    finish("error", "");
    return;
  }
  finish("done", finishReason === "length" ? "done (cut at the token limit)" : "done");
}

ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = ui.key.value.trim();
  ui.key.value = "";
  if (key) sessionStorage.setItem(KEY_STORE, key);
  loadCollections();
});
ui.keyForget.addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORE);
  resetAnswer();
  loadCollections();
});
ui.askForm.addEventListener("submit", ask);
ui.question.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) ui.askForm.requestSubmit();
});
ui.stop.addEventListener("click", () => { if (running) running.abort(); });
ui.docClose.addEventListener("click", closeDocument);

loadCollections();
