// The console: chat over /v1/responses, the live mesh picture and the request log over /api/events.

import { copySummary, progressLine, readNdjson } from "./copy.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import { renderSplit } from "./split.js";
import { readSse } from "./sse.js";
import { normaliseStatus, renderNodeTable, renderTopology } from "./topology.js";

const KEY_STORAGE = "mlx-mesh.api-key";
const MODEL_STORAGE = "mlx-mesh.model";
const INVITE_PATH = "/api/mesh/invite"; // mesh/http.py
const REMOVE_PATH = "/api/mesh/members/remove";
const CSRF_PATH = "/api/mesh/csrf";
const MODELS_PATH = "/api/mesh/models"; // mesh/copy/http.py
const PULL_PATH = "/api/mesh/models/pull";
const $ = (selector) => document.querySelector(selector);

// ---------------------------------------------------------------- API key and fetch

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askForKey(key ? "That API key was refused. Enter the gateway's key." : "This gateway needs an API key.");
  }
  return response;
}

// Admin POSTs carry the node's CSRF token, read same-origin (a page on another site cannot).
let csrfToken = null;

async function adminPost(path, body, signal) {
  if (csrfToken === null) {
    const response = await api(CSRF_PATH);
    csrfToken = response.ok ? (await response.json()).token : "";
  }
  return api(path, {
    method: "POST",
    headers: { "content-type": "application/json", "x-mesh-csrf": csrfToken },
    body: JSON.stringify(body),
    signal,
  });
}

async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body?.error?.message || body?.message || body?.detail || text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

function askForKey(reason) {
  const dialog = $("#key-dialog");
  if (dialog.open) return;
  $("#key-reason").textContent = reason || "Kept in this browser only; sent as a Bearer token.";
  $("#key-input").value = apiKey();
  dialog.returnValue = ""; // Escape leaves it untouched: do not replay the last choice
  dialog.showModal();
}

function setupKeyDialog() {
  $("#key-button").addEventListener("click", () => askForKey());
  // Enter in the field means Save (the form's first button is Cancel).
  $("#key-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      $("#key-save").click();
    }
  });
  $("#key-dialog").addEventListener("close", () => {
    const action = $("#key-dialog").returnValue;
    if (action === "save") localStorage.setItem(KEY_STORAGE, $("#key-input").value.trim());
    if (action === "forget") localStorage.removeItem(KEY_STORAGE);
    if (action === "save" || action === "forget") {
      loadModels();
      loadRequests();
      restartFeed();
    }
  });
}

// ---------------------------------------------------------------- tabs

function setupTabs() {
  for (const button of document.querySelectorAll("[data-tab]")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
}

function showTab(name) {
  for (const button of document.querySelectorAll("[data-tab]")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === name));
  }
  for (const panel of document.querySelectorAll("[data-tab-panel]")) {
    panel.hidden = panel.dataset.tabPanel !== name;
  }
  if (name === "mesh") loadMeshModels();
}

// ---------------------------------------------------------------- chat

const chat = { history: [], controller: null };

async function loadModels() {
  const select = $("#model");
  let ids = [];
  try {
    const response = await api("/v1/models");
    if (response.ok) ids = ((await response.json()).data || []).map((m) => m.id);
  } catch (err) {
    console.warn("models", err);
  }
  const wanted = select.value || localStorage.getItem(MODEL_STORAGE);
  const choices = [...new Set([...ids, "mesh"])];
  select.replaceChildren(
    ...choices.map((id) => {
      const option = document.createElement("option");
      option.value = id;
      option.textContent = id === "mesh" ? "mesh (mixture of agents)" : id;
      return option;
    }),
  );
  if (wanted && choices.includes(wanted)) select.value = wanted;
}

function addMessage(role) {
  $("#chat-hint")?.remove();
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  $("#messages").append(box);
  return box;
}

function scrollChat() {
  const list = $("#messages");
  list.scrollTop = list.scrollHeight;
}

// Follow a streaming answer only while the reader is at the bottom; scrolling up to read
// something earlier must not be undone by the next token.
function atBottom() {
  const list = $("#messages");
  return list.scrollHeight - list.scrollTop - list.clientHeight < 40;
}

function assistantView() {
  const box = addMessage("assistant");
  box.innerHTML = `<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-text"></div></details>
    <div class="body pending"></div><div class="footer"></div>`;
  return {
    box,
    details: box.querySelector(".reasoning"),
    reasoning: box.querySelector(".reasoning-text"),
    body: box.querySelector(".body"),
    footer: box.querySelector(".footer"),
  };
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").hidden = !busy;
}

async function send(text) {
  const model = $("#model").value || "mesh";
  localStorage.setItem(MODEL_STORAGE, model);
  addMessage("user").textContent = text;
  // "New" during an answer swaps in a fresh history; this answer belongs to the old one.
  const history = chat.history;
  history.push({ role: "user", content: text });
  const view = assistantView();
  scrollChat();
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);

  const run = { text: "", reasoning: "", started: performance.now(), first: null, last: null };
  run.deltas = 0;
  run.usage = null;
  let outcome = "ok";
  let headers = null;
  try {
    const response = await api("/v1/responses", {
      method: "POST",
      headers: { "content-type": "application/json", accept: "text/event-stream" },
      body: JSON.stringify({ model, input: history, stream: true }),
      signal: controller.signal,
    });
    headers = response.headers;
    if (!response.ok) throw new Error(await errorText(response));
    await readSse(response, ({ data }) => {
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      handleResponseEvent(event, run, view);
    });
    if (run.error) {
      outcome = "failed";
      throw new Error(run.error);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "failed";
      const note = document.createElement("div");
      note.className = "error";
      note.textContent = err.message || String(err);
      view.box.insertBefore(note, view.footer);
    }
  } finally {
    chat.controller = null;
    setBusy(false);
    view.body.classList.remove("pending");
    if (run.text) history.push({ role: "assistant", content: run.text });
    else history.pop(); // nothing said: do not leave a dangling user turn
    renderFooter(view.footer, run, headers, model, outcome);
    scrollChat();
  }
}

function handleResponseEvent(event, run, view) {
  const type = event.type || "";
  const now = performance.now();
  if (type === "response.output_text.delta") {
    run.first ??= now;
    run.last = now;
    run.deltas += 1;
    run.text += event.delta || "";
    const follow = atBottom();
    view.body.innerHTML = renderMarkdown(run.text);
    if (follow) scrollChat();
  } else if (type.includes("reasoning") && type.endsWith(".delta")) {
    run.first ??= now;
    run.last = now;
    run.deltas += 1;
    run.reasoning += event.delta || "";
    view.details.hidden = false;
    view.reasoning.textContent = run.reasoning;
  } else if (type === "response.completed" || type === "response.incomplete") {
    run.usage = event.response?.usage || null;
  } else if (type === "response.failed") {
    run.error = event.response?.error?.message || "the response failed";
  } else if (type === "error") {
    run.error = event.message || event.error?.message || "stream error";
  }
}

function renderFooter(footer, run, headers, model, outcome) {
  const parts = [];
  const header = (name) => headers?.get(name);
  const route = header("x-route");
  const peer = header("x-peer");
  const winner = header("x-moa-winner");
  if (route) parts.push(`<span class="tag" title="route">${escapeHtml(route)}</span>`);
  if (peer && peer !== "local" && peer !== route) parts.push(`<span class="tag" title="peer">peer ${escapeHtml(peer.slice(0, 12))}</span>`);
  if (winner) parts.push(`<span class="tag" title="MoA winner">winner ${escapeHtml(winner)}</span>`);
  if (!route && !peer) parts.push(`<span class="tag">${escapeHtml(model)}</span>`);
  if (run.first != null) parts.push(`<span>TTFT ${Math.round(run.first - run.started)} ms</span>`);
  const tokens = run.usage?.output_tokens ?? run.deltas;
  const seconds = run.first != null && run.last > run.first ? (run.last - run.first) / 1000 : 0;
  if (seconds > 0 && tokens > 1) parts.push(`<span>${(tokens / seconds).toFixed(1)} tok/s</span>`);
  if (run.usage?.output_tokens != null) parts.push(`<span>${run.usage.output_tokens} tokens</span>`);
  if (outcome !== "ok") parts.push(`<span class="${outcome}">${outcome}</span>`);
  footer.innerHTML = parts.join("");
  footer.dataset.outcome = outcome;
}

function setupChat() {
  const prompt = $("#prompt");
  $("#composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || chat.controller) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#composer").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", () => chat.controller?.abort());
  $("#clear").addEventListener("click", () => {
    chat.controller?.abort();
    chat.history = [];
    $("#messages").replaceChildren();
  });
}

// ---------------------------------------------------------------- live feed: mesh + requests

const feed = { controller: null, retry: 1000, lastBeat: 0 };

function restartFeed() {
  feed.controller?.abort();
  runFeed();
}

async function runFeed() {
  const controller = new AbortController();
  feed.controller = controller;
  while (!controller.signal.aborted) {
    try {
      const response = await api("/api/events", { signal: controller.signal });
      if (!response.ok) throw new Error(`events: ${response.status}`);
      feed.retry = 1000;
      await readSse(response, onFeedEvent);
    } catch (err) {
      if (controller.signal.aborted) return;
      console.warn("feed", err);
    }
    setLive("bad", "reconnecting…");
    await new Promise((resolve) => setTimeout(resolve, feed.retry));
    feed.retry = Math.min(feed.retry * 2, 15000);
  }
}

function onFeedEvent({ event, data }) {
  feed.lastBeat = Date.now();
  setLive("ok", "live");
  const payload = JSON.parse(data);
  if (event === "status") {
    if (payload.error) {
      setLive("bad", payload.error);
      return;
    }
    renderTopology($("#topology"), payload);
    renderNodeTable($("#nodes tbody"), payload);
    renderSplit($("#split-section"), payload);
    renderMembers($("#members tbody"), payload.members || []);
    loadMeshModels({ soon: true }); // who holds what moves with the peers
    // A peer joining or leaving changes what can be chosen: refresh the model picker then.
    const { self, peers } = normaliseStatus(payload);
    const served = [self, ...peers.filter((p) => p.state === "up")].flatMap((n) => n.models);
    const key = [...new Set(served)].sort().join("\n");
    if (feed.models !== undefined && key !== feed.models) loadModels();
    feed.models = key;
  } else if (event === "request") {
    addRequestRow(payload, true);
  }
}

function setLive(state, text) {
  const live = $("#live");
  live.className = `live ${state}`;
  live.textContent = text;
}

setInterval(() => {
  if (feed.lastBeat && Date.now() - feed.lastBeat > 15000) setLive("bad", "no heartbeat");
}, 5000);

const fmt = (value, digits = 0) => (value == null ? "–" : Number(value).toFixed(digits));

function addRequestRow(row, fresh) {
  const tbody = $("#requests tbody");
  const tr = document.createElement("tr");
  if (fresh) tr.className = "fresh";
  const at = row.at ?? row.started_at ?? row.time;
  const time = at ? new Date((at > 1e12 ? at : at * 1000)).toLocaleTimeString() : "–";
  const peer = row.peer && row.peer !== "local" && row.peer !== row.route ? String(row.peer).slice(0, 8) : null;
  const winner = row.moa_winner ? `winner ${row.moa_winner}` : null;
  const route = [row.route, peer, winner].filter(Boolean).join(" → ");
  // Why the mesh sent it there (x-mesh-route-reason: "cache 18432/20100", "load", "sticky"…).
  const hedge = row.mesh_hedge ? ` (hedge ${row.mesh_hedge})` : "";
  const why = (row.route_reason ?? row.mesh_route_reason ?? "–") + hedge;
  const outcome = String(row.outcome ?? row.status ?? "–");
  const good = outcome === "ok" || outcome === "200" || outcome === "done";
  const ttft = row.ttft_ms ?? (row.ttft_s != null ? row.ttft_s * 1000 : null);
  tr.innerHTML = `<td>${escapeHtml(time)}</td><td>${escapeHtml(row.api ?? "–")}</td>
    <td>${escapeHtml(row.model ?? "–")}</td><td>${escapeHtml(route || "–")}</td><td>${escapeHtml(why)}</td>
    <td class="num">${escapeHtml(fmt(row.attempts))}</td><td class="num">${escapeHtml(fmt(ttft))} ms</td>
    <td class="num">${escapeHtml(fmt(row.tok_s ?? row.tokens_per_s, 1))}</td>
    <td class="${good ? "ok-text" : "bad-text"}">${escapeHtml(outcome)}</td>`;
  tbody.prepend(tr);
  while (tbody.rows.length > 200) tbody.deleteRow(-1);
  $("#requests-empty").hidden = true;
}

async function loadRequests() {
  try {
    const response = await api("/api/requests");
    if (!response.ok) return;
    const { requests } = await response.json();
    $("#requests tbody").replaceChildren();
    for (const row of requests || []) addRequestRow(row, false);
  } catch (err) {
    console.warn("requests", err);
  }
}

// ---------------------------------------------------------------- invites

async function createInvite() {
  const box = $("#invite-result");
  box.hidden = false;
  box.className = "invite-result";
  box.textContent = "Creating an invite…";
  try {
    const response = await adminPost(INVITE_PATH, {});
    if (response.status === 404 || response.status === 405) {
      throw new Error(
        "This node has no invite endpoint: the mesh is not running here. Use `mesh invite` in a terminal.",
      );
    }
    if (!response.ok) throw new Error(await errorText(response));
    const body = await response.json();
    if (!body.token) throw new Error("the node answered without an invite token");
    const command = `mesh up --join ${body.token}`;
    const expires = body.expires_at ? new Date(body.expires_at * 1000).toLocaleString() : null;
    box.innerHTML = `Run this on the other Mac${expires ? ` (valid until ${escapeHtml(expires)})` : ""}:
      <code id="invite-command">${escapeHtml(command)}</code>
      <button type="button" class="ghost" id="invite-copy">Copy</button>`;
    $("#invite-copy").addEventListener("click", () => copyText($("#invite-command"), $("#invite-copy")));
  } catch (err) {
    box.className = "invite-result error";
    box.textContent = err.message || String(err);
  }
}

// ---------------------------------------------------------------- members

function renderMembers(tbody, members) {
  // Only when it changed: every status push re-rendered it, and a Remove button replaced under
  // the pointer swallowed the click.
  const html = members
    .map((m) => {
      const link = m.self ? "this node" : m.connected ? "linked" : "–";
      const button = m.self
        ? ""
        : `<button type="button" class="ghost" data-remove="${escapeHtml(m.node_id)}">Remove</button>`;
      return `<tr><td title="${escapeHtml(m.node_id)}">${escapeHtml(m.node_id.slice(0, 16))}</td>
        <td>${escapeHtml((m.addresses || []).join(", "))}</td><td>${link}</td><td>${button}</td></tr>`;
    })
    .join("");
  if (tbody.dataset.rendered === html) return;
  tbody.dataset.rendered = html;
  tbody.innerHTML = html;
}

async function removeMember(nodeId) {
  const box = $("#members-result");
  if (!confirm(`Remove ${nodeId.slice(0, 16)} from the mesh? It can come back only with a new invite.`)) return;
  box.hidden = false;
  box.className = "invite-result";
  box.textContent = "Removing…";
  try {
    const response = await adminPost(REMOVE_PATH, { node: nodeId });
    if (!response.ok) throw new Error(await errorText(response));
    box.textContent = `Removed ${nodeId.slice(0, 16)}: every member drops it.`;
  } catch (err) {
    box.className = "invite-result error";
    box.textContent = err.message || String(err);
  }
}

// The clipboard API needs a secure context (localhost is one; a LAN address is not): there,
// select the text so that one keystroke copies it.
async function copyText(element, button) {
  try {
    await navigator.clipboard.writeText(element.textContent);
    button.textContent = "Copied";
  } catch {
    getSelection().selectAllChildren(element);
    button.textContent = "Selected – press ⌘C";
  }
}

// ---------------------------------------------------------------- models held in the mesh, copies

// name → { controller, events, box } for every copy this page runs (the node runs the copy;
// leaving the page or Stop cancels it, and what was copied waits on the node to be resumed).
const copies = new Map();
const meshModels = { loading: false, again: false, at: 0, drawn: "" };
const MESH_MODELS_EVERY_MS = 2000; // status events come often (RTTs move); holders rarely do

// { soon: true }: at most every couple of seconds (the status feed's calls); else right now.
async function loadMeshModels({ soon = false } = {}) {
  if (soon && Date.now() - meshModels.at < MESH_MODELS_EVERY_MS) return;
  if (meshModels.loading) {
    meshModels.again = true;
    return;
  }
  meshModels.loading = true;
  meshModels.at = Date.now();
  try {
    const response = await api(MODELS_PATH);
    if (response.status === 404) {
      $("#mesh-models-section").hidden = true; // no mesh here, or one that serves no copies
      return;
    }
    if (!response.ok) return;
    $("#mesh-models-section").hidden = false;
    renderMeshModels(await response.json());
  } catch (err) {
    console.warn("mesh models", err);
  } finally {
    meshModels.loading = false;
    if (meshModels.again) {
      meshModels.again = false;
      loadMeshModels();
    }
  }
}

function renderMeshModels({ stored = [], holders = {} }) {
  // Redraw only on change: a table replaced under the pointer would swallow a click.
  const key = JSON.stringify([stored, holders, [...copies.keys()]]);
  if (key === meshModels.drawn) return;
  meshModels.drawn = key;
  const names = [...new Set([...stored, ...Object.keys(holders)])].sort();
  const here = new Set(stored);
  $("#mesh-models tbody").innerHTML = names
    .map((name) => {
      const nodes = holders[name] || [];
      const held = nodes.map((n) => `<span class="tag" title="${escapeHtml(n)}">${escapeHtml(n.slice(0, 8))}</span>`);
      let action = "";
      if (copies.has(name)) action = `<span class="muted">copying…</span>`;
      else if (!here.has(name) && nodes.length) {
        action = `<button type="button" data-copy="${escapeHtml(name)}">Copy here</button>`;
      }
      return `<tr data-model="${escapeHtml(name)}"><td>${escapeHtml(name)}</td>
        <td>${held.join(" ") || "–"}</td><td>${here.has(name) ? "yes" : "–"}</td><td>${action}</td></tr>`;
    })
    .join("");
  $("#mesh-models-empty").hidden = names.length > 0;
}

function copyBox(name) {
  const box = document.createElement("div");
  box.className = "copy";
  box.dataset.copy = name;
  box.innerHTML = `<div class="copy-head"><b>${escapeHtml(name)}</b>
      <button type="button" class="ghost" data-stop-copy="${escapeHtml(name)}">Stop</button></div>
    <progress max="1" value="0"></progress>
    <div class="copy-line muted">asking the members…</div>
    <div class="copy-sources"></div>`;
  $("#copies").prepend(box);
  return box;
}

function drawCopy(box, events) {
  const summary = copySummary(events);
  const bar = box.querySelector("progress");
  bar.max = summary.total || 1;
  bar.value = summary.done;
  box.querySelector(".copy-line").textContent = progressLine(summary);
  box.querySelector(".copy-sources").innerHTML = summary.sources
    .map((s) =>
      s.dropped === null
        ? `<span class="tag" title="${escapeHtml(s.id)}">${escapeHtml(s.id.slice(0, 8))} · ${(s.bytes / 1e6).toFixed(1)} MB</span>`
        : `<span class="tag dropped" title="${escapeHtml(s.dropped)}">${escapeHtml(s.id.slice(0, 8))} ✗ ${escapeHtml(s.dropped)}</span>`,
    )
    .join("");
}

function endCopy(box, ok, text) {
  box.classList.add(ok ? "done" : "failed");
  box.dataset.outcome = ok ? "done" : "failed";
  const line = box.querySelector(".copy-line");
  line.className = `copy-line ${ok ? "ok-text" : "bad-text"}`;
  line.textContent = text;
  box.querySelector("[data-stop-copy]")?.remove();
}

async function startCopy(name) {
  if (copies.has(name)) return;
  const controller = new AbortController();
  const copy = { controller, events: [], box: copyBox(name) };
  copies.set(name, copy);
  loadMeshModels();
  let ended = false;
  try {
    const response = await adminPost(PULL_PATH, { name }, controller.signal);
    if (!response.ok) throw new Error(await errorText(response));
    await readNdjson(response, (event) => {
      if (event.type === "progress") {
        copy.events.push(event);
        drawCopy(copy.box, copy.events);
      } else if (event.type === "done") {
        ended = true;
        endCopy(copy.box, true, `Copied ${name} into this node's store: serve it with mesh up --model ${name}.`);
      } else if (event.type === "error") {
        ended = true;
        endCopy(copy.box, false, event.message || "The copy failed.");
      }
    });
    if (!ended) throw new Error("The node ended the copy without saying how it went; copy again to resume.");
  } catch (err) {
    if (err.name === "AbortError") {
      endCopy(copy.box, false, "Stopped. What was copied is kept on the node; copying again resumes.");
    } else if (err instanceof TypeError) {
      // fetch() itself failed: the node went away mid-stream
      endCopy(copy.box, false, "Lost the node during the copy; what was copied is kept, and copying again resumes.");
    } else {
      endCopy(copy.box, false, err.message || String(err));
    }
  } finally {
    copies.delete(name);
    loadMeshModels();
  }
}

// ---------------------------------------------------------------- start

setupTabs();
setupKeyDialog();
setupChat();
$("#invite-button").addEventListener("click", createInvite);
$("#mesh-models").addEventListener("click", (event) => {
  const name = event.target?.dataset?.copy;
  if (name) startCopy(name);
});
$("#copies").addEventListener("click", (event) => {
  const name = event.target?.dataset?.stopCopy;
  if (name) copies.get(name)?.controller.abort();
});
$("#members").addEventListener("click", (event) => {
  const nodeId = event.target?.dataset?.remove;
  if (nodeId) removeMember(nodeId);
});
renderTopology($("#topology"), { node: { name: "this node" }, peers: [] });
loadModels();
loadRequests();
runFeed();
