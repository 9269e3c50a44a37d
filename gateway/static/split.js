// Split models on the Mesh tab: a model too big for one node runs as stages (one rank per
// node, in layer order); each is drawn as a bar of segments sized by its layer count. Also the
// models waiting for members to offer memory (with the head's one sentence why), the memory
// each node offers for ranks, and the ranks this node runs for others.
//
// Reads the /api/status picture: ModelAd.stages in node.models and peers[].models (gossip),
// node.split (the split coordinator's status), peers[].share_memory(_used), workers[].split.

import { escapeHtml } from "./markdown.js";

const drawn = { key: "" };

// A size as the planner prints it (mesh/split/plan.py _size): decimal units.
export function formatBytes(n) {
  const value = Number(n) || 0;
  for (const [unit, scale] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (Math.abs(value) >= scale) return `${(value / scale).toFixed(1)} ${unit}`;
  }
  return `${value} B`;
}

// Layers [start, end) as people count them: "layers 0–2", or "layer 5" for one.
export function layerRange(start, end) {
  const [a, b] = [Number(start), Number(end) - 1];
  return b > a ? `layers ${a}–${b}` : `layer ${a}`;
}

const shortId = (id) => String(id).slice(0, 8);

function stagesOf(raw) {
  return (Array.isArray(raw) ? raw : []).map((s) => ({
    rank: Number(s.rank),
    nodeId: String(s.node_id ?? "?"),
    start: Number(s.start ?? s.layers?.[0] ?? 0),
    end: Number(s.end ?? s.layers?.[1] ?? 0),
  }));
}

// Everything split the status picture tells, as plain data (no DOM): what renderSplit draws.
export function splitPicture(status) {
  const node = status?.node || {};
  const selfId = String(node.node_id || node.id || "local");
  const split = node.split || {};
  const peers = (Array.isArray(status?.peers) ? status.peers : []).filter(
    (p) => (p.state ?? "up") === "up",
  );

  const models = [];
  const seen = new Set();
  const add = (name, stages, head) => {
    const key = `${name}\n${head}`;
    if (!stages.length || seen.has(key)) return;
    seen.add(key);
    models.push({ name: String(name), head, stages, layers: Math.max(...stages.map((s) => s.end)) });
  };
  for (const m of node.models || []) if (m && typeof m === "object") add(m.name, stagesOf(m.stages), selfId);
  for (const [name, stages] of Object.entries(split.groups || {})) add(name, stagesOf(stages), selfId);
  for (const peer of peers) {
    for (const m of peer.models || []) {
      if (m && typeof m === "object") add(m.name, stagesOf(m.stages), String(peer.node_id));
    }
  }

  // Waiting (and forming) models are this node's own: the head is the only one that knows why.
  const waiting = Object.entries(split.waiting || {}).map(([name, why]) => ({ name, why: String(why) }));
  const forming = [];
  for (const [name, worker] of Object.entries(status?.workers || {})) {
    const own = worker?.split;
    if (!own || waiting.some((w) => w.name === name)) continue;
    if (own.waiting) waiting.push({ name, why: String(own.waiting) });
    else if (own.forming && !seen.has(`${name}\n${selfId}`)) forming.push(name);
  }

  const offers = [{ ...node, node_id: selfId }, ...peers]
    .filter((n) => Number(n.share_memory) > 0)
    .map((n) => ({ nodeId: String(n.node_id), bytes: Number(n.share_memory), used: Number(n.share_memory_used) || 0 }));
  const ranks = (split.ranks || []).map((r) => ({
    model: String(r.model),
    rank: Number(r.rank),
    head: String(r.head ?? "?"),
  }));
  return { selfId, models, waiting, forming, offers, ranks };
}

function nodeLabel(nodeId, selfId) {
  return nodeId === selfId ? "this node" : shortId(nodeId);
}

function drawModel(model, selfId) {
  const head = model.head === selfId ? "this node" : shortId(model.head);
  const stages = model.stages
    .map((s) => {
      const layers = Math.max(1, s.end - s.start);
      const mine = s.nodeId === selfId ? " self" : "";
      return `<div class="stage${mine}" style="flex-grow: ${layers}" data-rank="${s.rank}"
          data-node-id="${escapeHtml(s.nodeId)}" title="${escapeHtml(s.nodeId)}">
        <span class="stage-node">${escapeHtml(nodeLabel(s.nodeId, selfId))}</span>
        <span class="stage-layers">${escapeHtml(layerRange(s.start, s.end))}</span>
        <span class="stage-rank">rank ${s.rank}${s.rank === 0 ? " · serves" : ""}</span>
      </div>`;
    })
    .join("");
  const count = model.stages.length;
  return `<div class="split" data-model="${escapeHtml(model.name)}" data-head="${escapeHtml(model.head)}">
      <div class="split-head"><b>${escapeHtml(model.name)}</b>
        <span class="muted">${model.layers} layers over ${count} rank${count === 1 ? "" : "s"},
          served by ${escapeHtml(head)}</span></div>
      <div class="stages">${stages}</div>
    </div>`;
}

function drawWaiting({ name, why }) {
  return `<div class="split waiting" data-model="${escapeHtml(name)}">
      <div class="split-head"><b>${escapeHtml(name)}</b> <span class="warn-text">waiting for memory</span></div>
      <div class="split-why">${escapeHtml(why)}</div>
    </div>`;
}

function drawForming(name) {
  return `<div class="split forming" data-model="${escapeHtml(name)}">
      <div class="split-head"><b>${escapeHtml(name)}</b> <span class="muted">forming its group…</span></div>
    </div>`;
}

// Draw into the Mesh tab's split section; hidden while nothing in the mesh is split.
export function renderSplit(section, status) {
  const picture = splitPicture(status);
  const key = JSON.stringify(picture);
  if (key === drawn.key) return; // unchanged (status events come often): keep the DOM still
  drawn.key = key;
  const { selfId, models, waiting, forming, offers, ranks } = picture;
  section.hidden = !(models.length || waiting.length || forming.length || offers.length || ranks.length);
  section.querySelector("#split-models").innerHTML = [
    ...models.map((m) => drawModel(m, selfId)),
    ...waiting.map(drawWaiting),
    ...forming.map(drawForming),
  ].join("");
  section.querySelector("#split-offers").innerHTML = offers
    .map(
      (o) => `<span class="tag offer" data-node-id="${escapeHtml(o.nodeId)}" title="${escapeHtml(o.nodeId)}">${escapeHtml(
        `${nodeLabel(o.nodeId, selfId)} offers ${formatBytes(o.bytes)} (${formatBytes(o.used)} in use)`,
      )}</span>`,
    )
    .join("");
  section.querySelector("#split-ranks").innerHTML = ranks
    .map(
      (r) => `<li>this node runs rank ${r.rank} of <b>${escapeHtml(r.model)}</b> for
        <span title="${escapeHtml(r.head)}">${escapeHtml(nodeLabel(r.head, selfId))}</span></li>`,
    )
    .join("");
}
