// The mesh picture: this node in the middle, peers around it, one link per peer labelled with
// its round-trip time. Accepts the /api/status shape loosely (field names vary by version).

import { escapeHtml } from "./markdown.js";
import { formatBytes } from "./split.js";

const SVG = "http://www.w3.org/2000/svg";

export function normaliseStatus(status) {
  const self = status.node || status.self || status.this || {};
  const peers = Array.isArray(status.peers) ? status.peers : [];
  return { self: normaliseNode(self, true), peers: peers.map((p) => normaliseNode(p, false)) };
}

function normaliseNode(raw, isSelf) {
  const id = String(raw.id || raw.node_id || (isSelf ? "local" : "?"));
  const models = (raw.models || []).map((m) => (typeof m === "string" ? m : m.id || m.name || "?"));
  const rtt = raw.rtt_ms ?? raw.rtt ?? null;
  let state = String(raw.state || (isSelf ? "up" : "unknown")).toLowerCase();
  if (state === "up" && raw.connected === false) state = "connecting";
  return {
    id,
    name: raw.name || raw.hostname || (id.length > 12 ? id.slice(0, 8) : id),
    self: isSelf,
    state,
    addresses: raw.addresses || (raw.address ? [raw.address] : []),
    gateway: raw.gateway || raw.gateway_url || null,
    models,
    load: raw.load ?? loadOf(raw),
    // Memory offered for ranks of split models (mesh up --share-memory), and what they use now.
    offer: Number(raw.share_memory) > 0 ? { bytes: raw.share_memory, used: raw.share_memory_used || 0 } : null,
    // Each model's prompt cache in brief (gossiped: mesh/cache_stats.py); {} from older nodes.
    caches: raw.cache_stats && typeof raw.cache_stats === "object" ? raw.cache_stats : {},
    rttMs: typeof rtt === "number" ? rtt : null,
    // Either an absolute time (last_seen, unix s or ms) or an age (last_seen_s, seconds ago).
    lastSeen: raw.last_seen ?? (raw.last_seen_s != null ? Date.now() / 1000 - raw.last_seen_s : null),
  };
}

// The mesh's gossip state carries queue_depth / in_flight / tok_s at the top level.
function loadOf(raw) {
  if (raw.queue_depth == null && raw.in_flight == null && raw.tok_s == null) return null;
  return { queue_depth: raw.queue_depth ?? 0, active: raw.in_flight ?? 0, tok_s: raw.tok_s ?? 0 };
}

// A load is a number (queued + active work) or an object with queue/active/tok_s fields.
export function describeLoad(load) {
  if (load == null) return "–";
  if (typeof load === "number") return String(load);
  const parts = [];
  const queued = load.queue_depth ?? load.queued ?? load.queue;
  if (queued != null) parts.push(`queued ${queued}`);
  if (load.active != null) parts.push(`active ${load.active}`);
  const tps = load.tok_s ?? load.tokens_per_s ?? load.recent_tok_s;
  if (tps != null) parts.push(`${Number(tps).toFixed(1)} tok/s`);
  return parts.join(" · ") || "–";
}

function loadFraction(load) {
  if (load == null) return 0;
  const work =
    typeof load === "number" ? load : (load.queue_depth ?? load.queued ?? 0) + (load.active ?? 0);
  return Math.max(0, Math.min(1, work / 8));
}

function el(name, attrs = {}, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function shorten(text, max) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

// Peers sit on an ellipse around this node, the first one to its right; labels hang below
// each circle, so the ellipse is wide rather than tall.
export function renderTopology(svg, status) {
  const { self, peers } = normaliseStatus(status);
  const [middle, cy, rx, ry] = [450, 190, 300, 120];
  const offsets = peers.map((_, i) => (2 * Math.PI * i) / peers.length);
  // Centre the drawing as a whole (one peer: the pair sits side by side in the middle).
  const xs = [0, ...offsets.map((a) => Math.cos(a) * rx)];
  const cx = middle - (Math.min(...xs) + Math.max(...xs)) / 2;
  const positions = offsets.map((a) => [cx + Math.cos(a) * rx, cy + Math.sin(a) * ry]);
  svg.replaceChildren();
  const links = el("g", { class: "links" });
  const nodes = el("g", { class: "nodes" });
  svg.append(links, nodes);
  peers.forEach((peer, i) => {
    const [x, y] = positions[i];
    const down = peer.state === "down" || peer.state === "left";
    links.append(el("line", { class: `link${down ? " down" : ""}`, x1: cx, y1: cy, x2: x, y2: y }));
    const label = peer.rttMs == null ? "?" : `${peer.rttMs.toFixed(peer.rttMs < 10 ? 1 : 0)} ms`;
    links.append(el("text", { class: "rtt", x: (cx + x) / 2, y: (cy + y) / 2 - 8 }, label));
  });
  nodes.append(drawNode(self, cx, cy));
  peers.forEach((peer, i) => nodes.append(drawNode(peer, ...positions[i])));
}

function drawNode(node, x, y) {
  const g = el("g", {
    class: `node ${node.self ? "self" : "peer"} ${node.state}`,
    "data-node-id": node.id,
    transform: `translate(${x},${y})`,
  });
  g.append(el("title", {}, `${node.id}\n${node.addresses.join(", ")}`));
  g.append(el("circle", { r: 42 }));
  g.append(el("text", { y: -3 }, shorten(node.name, 12)));
  g.append(el("text", { class: "sub", y: 14 }, node.self ? `${node.state} · you` : node.state));
  const models = node.models.length ? node.models.join(", ") : "no models";
  g.append(el("text", { class: "models", y: 62 }, shorten(models, 34)));
  g.append(el("rect", { class: "loadbar-bg", x: -30, y: 70, width: 60, height: 5, rx: 2 }));
  const fill = Math.max(2, 60 * loadFraction(node.load));
  g.append(el("rect", { class: "loadbar", x: -30, y: 70, width: fill, height: 5, rx: 2 }));
  g.append(el("text", { class: "sub", y: 90 }, describeLoad(node.load)));
  return g;
}

function ago(seconds) {
  if (seconds == null) return "–";
  const unix = seconds > 1e12 ? seconds / 1000 : seconds;
  const delta = Math.max(0, Date.now() / 1000 - unix);
  if (delta < 1.5) return "just now";
  if (delta < 90) return `${Math.round(delta)} s ago`;
  return `${Math.round(delta / 60)} min ago`;
}

function offerNote(offer) {
  if (!offer) return "";
  const text = `offers ${formatBytes(offer.bytes)} (${formatBytes(offer.used)} in use)`;
  return ` <span class="muted offer">· ${escapeHtml(text)}</span>`;
}

// One line per model: memory tier, disk tier, prefixes held, hit rate, and the budget in use.
export function describeCaches(caches) {
  const lines = Object.keys(caches)
    .sort()
    .map((model) => {
      const c = caches[model] || {};
      const parts = [`mem ${formatBytes(c.memory_bytes)}`, `disk ${formatBytes(c.disk_bytes)}`];
      parts.push(`${Number(c.prefixes) || 0} prefixes`);
      const lookups = Number(c.lookups) || 0;
      parts.push(c.hit_rate == null ? "no lookups" : `${Math.round(c.hit_rate * 100)}% hits of ${lookups}`);
      if (c.cached_share != null) parts.push(`${Math.round(c.cached_share * 100)}% of tokens cached`);
      if (c.budget_bytes != null) parts.push(`budget ${formatBytes(c.budget_used_bytes)} / ${formatBytes(c.budget_bytes)}`);
      return { model, text: parts.join(" · ") };
    });
  return lines;
}

function cacheCell(caches) {
  const lines = describeCaches(caches);
  if (!lines.length) return "–";
  return lines
    .map(
      ({ model, text }) =>
        `<div class="cache-line" data-model="${escapeHtml(model)}"><b>${escapeHtml(model)}</b> <span class="muted">${escapeHtml(text)}</span></div>`,
    )
    .join("");
}

export function renderNodeTable(tbody, status) {
  const { self, peers } = normaliseStatus(status);
  tbody.innerHTML = [self, ...peers]
    .map(
      (n) => `<tr data-node-id="${escapeHtml(n.id)}">
        <td title="${escapeHtml(n.id)}">${escapeHtml(n.name)}${n.self ? " <span class=muted>(you)</span>" : ""}</td>
        <td class="${n.state === "up" ? "ok-text" : n.state === "down" ? "bad-text" : ""}">${escapeHtml(n.state)}</td>
        <td class="num">${escapeHtml(n.addresses.join(", ") || "–")}</td>
        <td>${escapeHtml(n.models.join(", ") || "–")}${offerNote(n.offer)}</td>
        <td>${escapeHtml(describeLoad(n.load))}</td>
        <td class="caches">${cacheCell(n.caches)}</td>
        <td class="num">${n.self ? "–" : n.rttMs == null ? "?" : `${n.rttMs.toFixed(1)} ms`}</td>
        <td>${n.self ? "–" : ago(n.lastSeen)}</td>
      </tr>`,
    )
    .join("");
}
