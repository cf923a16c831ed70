// rollstream dashboard: polls /api/pipeline and /api/steps and draws the stage table and the
// curves as hand-written SVG (no library, no build step). Text from the server is set with
// textContent only, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const CURVES = [
  // [step-record field, title, colour, scale]
  ["reward_mean", "reward (mean)", "#d62728", 1],
  ["kl", "KL to reference", "#1f77b4", 1],
  ["train_tokens_per_s", "trained tokens/s", "#2ca02c", 1],
  ["mean_staleness", "staleness (versions)", "#9467bd", 1],
  ["delta_bytes", "delta size (KiB)", "#ff7f0e", 1 / 1024],
];
const SVG = "http://www.w3.org/2000/svg";
let steps = [];

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1000 ? v.toFixed(0) : v.toFixed(digits === undefined ? 2 : digits);
}

function renderPipeline(p) {
  document.getElementById("run").textContent = p.run || "";
  const head = document.getElementById("headline");
  if (!p.ok) {
    head.className = "down";
    head.textContent = (p.headline || "no data") + (p.error ? ": " + p.error : "");
    return;
  }
  const t = p.trainer || {};
  const gens = (p.generators || []).map(g => g.id + " v" + (g.version === null ? "?" : g.version)).join(", ") || "none registered";
  document.getElementById("summary").textContent =
    "trainer step " + t.step + ", policy version " + t.version + " · generators: " + gens + " · dead letters: " + p.dead;
  head.className = (p.findings[0] || {}).level || "ok";
  head.textContent = p.headline;
  head.setAttribute("data-level", head.className);

  const body = document.querySelector("#stages tbody");
  body.replaceChildren();
  for (const s of p.stages) {
    if (!s.active) continue;
    const consumers = s.consumers.length ? s.consumers.map(c => c.name + " (" + c.idle_s.toFixed(0) + ")").join(", ")
                                         : (s.group ? s.group + ": no consumer" : "no consumer group");
    let versions = "";
    if (s.name === "generator") versions = (p.generators || []).map(g => "v" + (g.version === null ? "?" : g.version)).join(" ");
    if (s.name === "trainer") versions = "v" + t.version;
    const row = el("tr", {id: "stage-" + s.name, "data-stage": s.name});
    row.append(el("td", {}, s.name), el("td", {class: "text dim"}, s.stream), el("td", {}, fmt(s.rate)),
               el("td", {}, fmt(s.backlog, 0)), el("td", {}, fmt(s.lag, 0)), el("td", {}, fmt(s.pending, 0)),
               el("td", {}, fmt(s.length, 0)), el("td", {class: "text"}, consumers), el("td", {class: "text"}, versions),
               el("td", {class: "text dim"}, s.last_dead || ""));
    body.append(row);
  }
  const list = document.getElementById("findings");
  list.replaceChildren();
  for (const f of p.findings.slice(1)) {
    if (f.level === "stuck" || f.level === "warn") list.append(el("li", {class: f.level}, f.line));
  }
}

// One curve as an SVG line chart: axes' min/max as labels, the points as a polyline.
function chart(field, title, colour, scale) {
  const pts = steps.filter(r => typeof r[field] === "number").map(r => [r.step, r[field] * scale]);
  const box = el("div", {class: "chart"});
  box.append(el("h2", {}, title + (pts.length ? " · last " + fmt(pts[pts.length - 1][1], 4) : "")));
  const W = 360, H = 160, L = 48, R = 8, T = 8, B = 20;
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, class: "curve", "data-metric": field, "data-points": String(pts.length),
                             preserveAspectRatio: "none"});
  svg.append(el("svg:rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccc"}));
  if (pts.length) {
    let [x0, x1] = [pts[0][0], pts[pts.length - 1][0]];
    let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const label = (x, y, text, anchor) => el("svg:text", {x, y, "font-size": 10, fill: "#666", "text-anchor": anchor}, text);
    svg.append(label(L - 4, T + 8, fmt(y1, 3), "end"), label(L - 4, H - B, fmt(y0, 3), "end"),
               label(L, H - 6, "step " + pts[0][0], "start"), label(W - R, H - 6, "step " + pts[pts.length - 1][0], "end"));
    const line = pts.map(p => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ");
    svg.append(el("svg:polyline", {points: line, fill: "none", stroke: colour, "stroke-width": 3,
                                   "vector-effect": "non-scaling-stroke", "stroke-linejoin": "round"}));
    for (const p of pts.length <= 60 ? pts : []) {
      svg.append(el("svg:circle", {cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: 3, fill: colour, class: "point"}));
    }
  } else {
    svg.append(el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999", "font-size": 12}, "no steps yet"));
  }
  box.append(svg);
  return box;
}

function renderCurves() {
  const charts = document.getElementById("charts");
  charts.replaceChildren(...CURVES.map(c => chart(...c)));
}

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store"});
  if (!r.ok) throw new Error(url + ": HTTP " + r.status);
  return r.json();
}

async function refresh() {
  try {
    renderPipeline(await getJSON("api/pipeline"));
  } catch (e) {
    const head = document.getElementById("headline");
    head.className = "down";
    head.textContent = "dashboard cannot reach the trainer: " + e.message;
  }
  try {
    const since = steps.length ? steps[steps.length - 1].step : 0;
    const got = await getJSON("api/steps?since=" + since);
    // A resumed trainer trains step numbers again: the newest record of a step wins.
    const byStep = new Map(steps.map(r => [r.step, r]));
    for (const r of got.steps) byStep.set(r.step, r);
    steps = [...byStep.values()].sort((a, b) => a.step - b.step);
    renderCurves();
  } catch (e) {
    /* the pipeline line already says what is wrong */
  }
  document.body.setAttribute("data-refreshed", String(Date.now()));
}

refresh();
setInterval(refresh, REFRESH_MS);
