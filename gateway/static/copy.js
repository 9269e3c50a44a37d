// Peer copy on the console: read the node's NDJSON progress stream and sum it up for display.
// The node runs the copy (POST /api/mesh/models/pull, mesh/copy/http.py); the page only draws
// its events: {"type": "progress", name, total, done, resumed, by_source, dropped, elapsed_s},
// then {"type": "done", path} or {"type": "error", message}.

import { readFrames } from "./sse.js";

// Call onEvent(object) for every JSON line of the response body.
export async function readNdjson(response, onEvent) {
  await readFrames(response, "\n", (line) => {
    if (line.trim()) onEvent(JSON.parse(line));
  });
}

const RATE_WINDOW_S = 3;

// A copy's figures from its progress events so far (oldest first): bytes, the rate over the
// last few seconds (what was found on disk at the start is not "transferred"), the ETA at that
// rate, and the peers it comes from (a dropped one with its reason).
export function copySummary(events) {
  const last = events.at(-1) || {};
  const total = last.total || 0;
  const done = last.done || 0;
  const now = last.elapsed_s || 0;
  const since = events.find((e) => now - (e.elapsed_s || 0) <= RATE_WINDOW_S) || last;
  let rate = null;
  if (now - (since.elapsed_s || 0) > 0.2) {
    rate = (done - (since.done || 0)) / (now - since.elapsed_s);
  } else if (now > 0.2) {
    rate = (done - (last.resumed || 0)) / now;
  }
  const eta = rate > 0 ? (total - done) / rate : null;
  const dropped = last.dropped || {};
  const ids = [...new Set([...Object.keys(last.by_source || {}), ...Object.keys(dropped)])];
  const sources = ids.map((id) => ({
    id,
    bytes: (last.by_source || {})[id] || 0,
    dropped: id in dropped ? dropped[id] : null,
  }));
  return { name: last.name, total, done, resumed: last.resumed || 0, rate, eta, sources };
}

export function formatBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let value = Number(n);
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

export function formatEta(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

// One line for a progress event list: "1.2 of 4.0 MB · 2.1 MB/s · ETA 1 s · from a1b2c3d4".
export function progressLine(summary) {
  const parts = [`${formatBytes(summary.done)} of ${formatBytes(summary.total)}`];
  parts.push(summary.rate == null ? "– MB/s" : `${formatBytes(summary.rate)}/s`);
  parts.push(summary.done >= summary.total && summary.total > 0 ? "finishing" : `ETA ${formatEta(summary.eta)}`);
  const live = summary.sources.filter((s) => s.dropped === null).map((s) => s.id.slice(0, 8));
  if (live.length) parts.push(`from ${live.join(", ")}`);
  return parts.join(" · ");
}
