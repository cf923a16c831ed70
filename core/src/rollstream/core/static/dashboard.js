// rollstream dashboard: polls /api/pipeline and /api/steps and draws the stage table, the last
// held-out round and the curves as hand-written SVG (no library, no build step). Text from the server is set with
// textContent only, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const num = v => (typeof v === "number" && isFinite(v) ? v : null);
// The step log's curves: [data-metric, title, colour, value of a step record]. A curve whose
// values are all equal over the run so far (the demo's KL and staleness are 0 every step)
// is not charted; the line under the charts names it with its value.
const CURVES = [
  ["reward_mean", "reward (train, mean)", "#d62728", r => num(r.reward_mean)],
  ["completion_tokens", "completion length (tokens trained / completions)", "#8c564b", r => (r.completions ? num(r.tokens / r.completions) : null)],
  ["entropy", "entropy (nats per token)", "#17becf", r => num(r.entropy)],
  ["grad_norm", "gradient norm (before clipping)", "#e377c2", r => num(r.grad_norm)],
  ["loss", "loss", "#7f7f7f", r => num(r.loss)],
  ["kl", "KL to reference", "#1f77b4", r => num(r.kl)],
  ["train_tokens_per_s", "trained tokens/s", "#2ca02c", r => num(r.train_tokens_per_s)],
  ["mean_staleness", "staleness (versions)", "#9467bd", r => num(r.mean_staleness)],
  ["delta_bytes", "delta size (KiB)", "#ff7f0e", r => (num(r.delta_bytes) === null ? null : r.delta_bytes / 1024)],
];
const ALWAYS = new Set(["reward_mean"]);  // charted even when flat: the run's headline
// The step's phases, one chart of several lines (seconds).
const PHASES = [["forward_s", "#1f77b4"], ["backward_s", "#ff7f0e"], ["optimizer_s", "#2ca02c"],
                ["delta_encode_s", "#d62728"], ["push_s", "#9467bd"], ["commit_s", "#8c564b"]];
// Held-out rounds (the step log's eval lines): points at the steps they evaluated, always
// charted when there is one.
const HELD_OUT = [
  ["eval_accuracy", "held-out accuracy (%)", "#2ca02c", e => (num(e.eval_accuracy) === null ? null : 100 * e.eval_accuracy)],
  ["eval_reward_mean", "held-out reward (mean)", "#d62728", e => num(e.eval_reward_mean)],
];
const SVG = "http://www.w3.org/2000/svg";
let steps = [], evals = [];

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

// The last held-out round, as `rollstream status` says it (core/status.py eval_line).
function heldOutLine(e) {
  const pct = v => (v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%");
  const atK = e.eval_samples > 1 ? " (pass@" + e.eval_samples + " " + pct(e.eval_pass_at_k) + ")" : "";
  const version = e.eval_version_max > e.eval_version ? "versions " + e.eval_version + "-" + e.eval_version_max : "version " + e.eval_version;
  const prompts = e.eval_prompts >= e.eval_prompts_fed ? e.eval_prompts + " prompts" : e.eval_prompts + " of " + e.eval_prompts_fed + " prompts (incomplete)";
  return "held-out: accuracy " + pct(e.eval_accuracy) + atK + ", reward " + fmt(e.eval_reward_mean) + " at step " + e.step + ", " + version + ", " + prompts;
}

// A curve's number in 4 significant digits ("0.95", "16.41", "1.2e-8": a loss of ~1e-8 is
// not 0.0000).
function short(v) {
  if (v === null || v === undefined) return "–";
  return Math.abs(v) >= 1e4 ? v.toFixed(0) : String(Number(v.toPrecision(4)));
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
  const e = p.last_eval;
  document.getElementById("held-out").textContent = e ? heldOutLine(e) : "";
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

// Whether every value of every series is the same one (a flat line tells nothing).
function flat(series) {
  const values = new Set(series.flatMap(s => s.pts.map(p => p[1])));
  return values.size === 1 ? [...values][0] : null;
}

// One chart: the series ({label, colour, pts: [[step, value]]}) as SVG polylines; the axes'
// min/max as labels; `rounds`: every point a dot, joined by a dashed line (held-out rounds).
function chart(field, title, series, rounds) {
  const all = series.flatMap(s => s.pts);
  const first = series[0].pts;
  const box = el("div", {class: "chart"});
  const last = first.length && series.length === 1 ? " · last " + short(first[first.length - 1][1]) : "";
  const head = el("h2", {}, title + last);
  if (series.length > 1) {
    for (const s of series) head.append(" ", el("span", {style: "color:" + s.colour}, "■ " + s.label));
  }
  box.append(head);
  const W = 360, H = 160, L = 48, R = 8, T = 8, B = 20;
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, class: "curve", "data-metric": field, "data-points": String(first.length),
                             preserveAspectRatio: "none"});
  svg.append(el("svg:rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccc"}));
  if (all.length) {
    let x0 = Math.min(...all.map(p => p[0])), x1 = Math.max(...all.map(p => p[0]));
    let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const label = (x, y, text, anchor) => el("svg:text", {x, y, "font-size": 10, fill: "#666", "text-anchor": anchor}, text);
    svg.append(label(L - 4, T + 8, short(y1), "end"), label(L - 4, H - B, short(y0), "end"),
               label(L, H - 6, "step " + x0, "start"), label(W - R, H - 6, "step " + x1, "end"));
    for (const s of series) {
      const line = s.pts.map(p => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ");
      svg.append(el("svg:polyline", {points: line, fill: "none", stroke: s.colour, "stroke-width": rounds ? 1.5 : 3,
                                     "stroke-dasharray": rounds ? "4 3" : "none",
                                     "vector-effect": "non-scaling-stroke", "stroke-linejoin": "round"}));
      for (const p of rounds || s.pts.length <= 60 ? s.pts : []) {
        svg.append(el("svg:circle", {cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: rounds ? 4 : 3, fill: s.colour, class: "point"}));
      }
    }
  } else {
    svg.append(el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999", "font-size": 12}, "no steps yet"));
  }
  box.append(svg);
  return box;
}

// [step, value] for every record where `value` has a number.
function points(records, value) {
  return records.map(r => [r.step, value(r)]).filter(p => p[1] !== null);
}

function renderCurves() {
  const charts = [], leftOut = [];
  const consider = (field, title, series) => {
    const value = flat(series);
    if (value !== null && !ALWAYS.has(field)) leftOut.push(title + " = " + short(value));
    else charts.push(chart(field, title, series));
  };
  const [reward, ...rest] = CURVES;
  consider(reward[0], reward[1], [{label: reward[1], colour: reward[2], pts: points(steps, reward[3])}]);
  for (const [field, title, colour, value] of evals.length ? HELD_OUT : []) {
    charts.push(chart(field, title, [{label: title, colour, pts: points(evals, value)}], true));
  }
  for (const [field, title, colour, value] of rest) {
    const pts = points(steps, value);
    if (pts.length) consider(field, title, [{label: title, colour, pts}]);
  }
  const phases = PHASES.map(([field, colour]) => ({label: field.replace(/_s$/, ""), colour, pts: points(steps, r => num(r[field]))}))
                       .filter(s => s.pts.length);
  if (phases.length) {
    // All flat, the chart goes; some flat, those lines stay (they are the scale of the others).
    if (phases.every(s => flat([s]) !== null)) leftOut.push("step phases (constant)");
    else charts.push(chart("phases", "step phases (s)", phases));
  }
  document.getElementById("charts").replaceChildren(...charts);
  document.getElementById("left-out").textContent = leftOut.length ? "constant over the run, not charted: " + leftOut.join("; ") : "";
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
    evals = got.evals || [];  // every round each time: a round is reported after later steps
    renderCurves();
  } catch (e) {
    /* the pipeline line already says what is wrong */
  }
  document.body.setAttribute("data-refreshed", String(Date.now()));
}

refresh();
setInterval(refresh, REFRESH_MS);
