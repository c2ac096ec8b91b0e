// The trainer's live view. One EventSource on /events: a "snapshot" (all history) on (re)connect,
// then a "tick" a second with the newest throughput point, new steps/evals and the overview.
"use strict";

const PALETTE = ["#3b6fd8", "#e07b00", "#2a9d8f", "#c2417a", "#7a5cd6", "#6b8e23", "#d64545", "#1f9bd1"];
const MAX_POINTS = 3600;  // the server keeps an hour of one-second samples
const $ = (id) => document.getElementById(id);

const state = { tp: null, steps: [], evals: [], ov: null, order: [] };
const charts = {};

function color(nodeId) {
  let i = state.order.indexOf(nodeId);
  if (i < 0) { state.order.push(nodeId); i = state.order.length - 1; }
  return PALETTE[i % PALETTE.length];
}
function fade(hex, a) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${a})`;
}
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function num(x, d = 0) {
  return x == null ? "–" : Number(x).toLocaleString(undefined, { minimumFractionDigits: d, maximumFractionDigits: d });
}
function dur(s) {
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${r}s` : `${r}s`;
}
function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
}
function width(el) { return Math.max(300, el.clientWidth); }

// ---- charts --------------------------------------------------------------------------------------

function axis(label, extra = {}) {
  return Object.assign({ label, labelSize: 18, size: 56, stroke: "#677086", grid: { stroke: "#eceff4" },
    ticks: { stroke: "#dde1e8" } }, extra);
}

function makeChart(key, el, opts, data) {
  if (charts[key]) charts[key].destroy();
  el.textContent = "";
  charts[key] = new uPlot(Object.assign({ width: width(el), height: 260, cursor: { drag: { x: false, y: false } } }, opts), data, el);
  return charts[key];
}

// Throughput: x = unix seconds; series per node, stacked (cumulative sums drawn largest first, so
// each band shows one node) or as lines with the swarm total.
function throughputData() {
  const tp = state.tp, metric = $("tp-metric").value, mode = $("tp-mode").value;
  const key = metric === "tokens" ? "tokens_per_s" : "rollouts_per_s";
  const ids = Object.keys(tp.nodes);
  ids.forEach(color);
  ids.sort((a, b) => state.order.indexOf(a) - state.order.indexOf(b));
  const own = ids.map((id) => tp.nodes[id][key]);
  const total = tp[key];
  const series = [], data = [tp.t], bands = [];
  const unit = metric === "tokens" ? "tokens/s" : "rollouts/s";
  const fmt = (v) => (v == null ? "–" : num(v, metric === "tokens" ? 0 : 2));
  if (mode === "stacked") {
    const cum = own.map(() => new Array(tp.t.length).fill(0));
    for (let i = 0; i < tp.t.length; i++) {
      let acc = 0;
      own.forEach((arr, k) => { acc += arr[i] || 0; cum[k][i] = acc; });
    }
    // Series k is the sum of nodes 0..k; the band between it and series k-1 is node k's own share.
    ids.forEach((id, k) => {
      const c = color(id), mine = own[k];
      series.push({ label: tp.nodes[id].name, stroke: c, width: 1, fill: k === 0 ? fade(c, 0.75) : undefined,
        value: (u, v, si, idx) => fmt(idx == null ? null : mine[idx]) });
      data.push(cum[k]);
      if (k > 0) bands.push({ series: [k + 1, k], fill: fade(c, 0.75) });
    });
  } else {
    if (mode === "lines") {
      ids.forEach((id, k) => { series.push({ label: tp.nodes[id].name, stroke: color(id), width: 1.5, value: (u, v) => fmt(v) }); data.push(own[k]); });
    }
    series.push({ label: "swarm total", stroke: "#1d2330", width: 2, fill: mode === "total" ? "rgba(59,111,216,0.15)" : undefined, value: (u, v) => fmt(v) });
    data.push(total);
  }
  return { series, data, bands, unit, stacked: mode === "stacked", sig: `${metric}/${mode}/${ids.join(",")}` };
}

function drawThroughput() {
  const el = $("throughput");
  if (!state.tp) return;
  const d = throughputData();
  el.dataset.points = String(state.tp.tokens_per_s.filter((v) => v > 0).length);
  el.dataset.unit = d.unit;  // axis labels are canvas pixels; this lets tests (and scripts) read the unit
  $("tp-note").textContent = `Accepted work only, averaged over the last ${state.tp.window_s} s. ` +
    "A rollout is one prompt's group of completions; the legend shows each node's own rate.";
  if (charts.tp && charts.tpSig === d.sig) { charts.tp.setData(d.data); return; }
  charts.tpSig = d.sig;
  makeChart("tp", el, {
    series: [{ label: "time" }, ...d.series],
    bands: d.bands,
    // Stacked: each node's legend marker takes its band's colour (uPlot would leave band-only series blank).
    legend: d.stacked ? { markers: { fill: (u, si) => (si > 0 ? fade(d.series[si - 1].stroke, 0.75) : "transparent") } } : {},
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.1, 1)] } },
    axes: [axis("time (local clock)", { size: 44, space: 90, values: (u, ts) => ts.map(clock) }), axis(d.unit, { size: 64 })],
  }, d.data);
}

function drawLearning() {
  const byStep = new Map();
  for (const r of state.steps) byStep.set(r.step, [r.reward_mean, null]);
  for (const e of state.evals) byStep.set(e.step, [byStep.get(e.step)?.[0] ?? null, e.accuracy]);
  const xs = [...byStep.keys()].sort((a, b) => a - b);
  const data = [xs, xs.map((x) => byStep.get(x)[0]), xs.map((x) => byStep.get(x)[1])];
  const el = $("learning");
  el.dataset.points = String(xs.length);
  if (charts.learn) { charts.learn.setData(data); return; }
  makeChart("learn", el, {
    series: [{ label: "step" },
      { label: "mean reward (batch)", stroke: "#3b6fd8", width: 1.5, spanGaps: true, value: (u, v) => num(v, 3) },
      { label: "held-out accuracy", stroke: "#1a7f37", width: 2, spanGaps: true, points: { size: 6 }, value: (u, v) => num(v, 3) }],
    scales: { x: { time: false }, y: { range: (u, min, max) => [Math.min(0, min ?? 0), Math.max(1, max ?? 1)] } },
    axes: [axis("optimizer step", { size: 44 }), axis("reward / accuracy (0–1)")],
  }, data);
}

function drawLag() {
  const xs = state.steps.map((r) => r.step), ys = state.steps.map((r) => r.lag_mean);
  const el = $("lag");
  el.dataset.points = String(xs.length);
  if (charts.lag) { charts.lag.setData([xs, ys]); } else {
    makeChart("lag", el, {
      series: [{ label: "step" }, { label: "mean lag of the batch", stroke: "#7a5cd6", width: 1.5, fill: "rgba(122,92,214,0.12)", value: (u, v) => num(v, 2) }],
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(2, Math.ceil(max ?? 0))] } },
      axes: [axis("optimizer step", { size: 44 }), axis("versions behind")],
    }, [xs, ys]);
  }
  const counts = state.ov ? state.ov.lag_counts : {};
  bars($("lag-dist"), [["accepted groups by lag", Object.entries(counts).map(([k, v]) => [`lag ${k}`, v, ""])]]);
}

// ---- tables and bars -----------------------------------------------------------------------------

function bars(el, groups) {
  const max = Math.max(1, ...groups.flatMap(([, rows]) => rows.map((r) => r[1])));
  let html = "";
  for (const [title, rows] of groups) {
    html += `<div class="group">${esc(title)}</div>`;
    if (!rows.length) html += `<div class="group" style="font-style:italic">none</div>`;
    for (const [label, n, cls] of rows) {
      html += `<span>${esc(label)}</span><div class="bar ${cls}" style="width:${(100 * n) / max}%"></div><span>${num(n)}</span>`;
    }
  }
  el.innerHTML = html;
}

function drawSubmissions() {
  const ov = state.ov;
  const sorted = (o) => Object.entries(o).sort((a, b) => b[1] - a[1]);
  bars($("submissions"), [
    ["accepted (groups)", [["accepted", ov.accepted_groups, "accepted"], ["trained on", ov.trained_groups, ""]]],
    ["refused, by reason (groups)", sorted(ov.refused).map(([k, v]) => [k, v, "refused"])],
    ["accepted but not trained on, by reason", sorted(ov.dropped).map(([k, v]) => [k, v, "dropped"])],
  ]);
}

// Multi-turn work: episodes/s, and per episode its mean turns, tool calls and the share of calls that failed.
function episodes(n) {
  if (!n.mean_turns) return "–";
  return `${num(n.episodes_per_s, 2)}/s · ${num(n.mean_turns, 2)} turns · ${num(n.tool_calls_per_episode, 2)} calls` +
    ` · ${num(100 * n.tool_error_rate, 1)}% tool errors`;
}

function drawNodes() {
  const ov = state.ov, body = $("nodes").tBodies[0];
  const rows = [...ov.nodes].sort((a, b) => state.order.indexOf(a.node_id) - state.order.indexOf(b.node_id));
  if (!rows.length) return;
  body.innerHTML = rows.map((n) => {
    const refused = Object.entries(n.refused).map(([k, v]) => `${k}: ${v}`).join(", ") || "–";
    const link = n.status_url ? `<a href="${esc(n.status_url)}" target="_blank" rel="noopener">status</a>` : "–";
    // The tracker's connect-back check of the node's relay: reachable, or a download-only leaf.
    const relay = n.relay_reachable === true ? `<span title="${esc(n.relay_url)}">reachable</span>`
      : n.relay_reachable === false ? `<span class="warn" title="${esc(n.relay_url)}">leaf: not reachable</span>`
      : n.relay_url ? "not checked" : "–";
    return `<tr data-node="${esc(n.node_id)}" data-state="${esc(n.state)}">
      <td><span class="swatch" style="background:${color(n.node_id)}"></span>${esc(n.name)}</td>
      <td class="id" title="${esc(n.node_id)}">${esc(n.node_id.slice(0, 12))}</td>
      <td><span class="state ${esc(n.state)}">${esc(n.state)}</span></td>
      <td title="probation: its groups wait in quarantine for the paired test">${esc(n.standing || "–")}</td>
      <td class="num">${n.version_loaded < 0 ? "–" : "v" + n.version_loaded}</td>
      <td class="num">${num(n.tokens_per_s)}</td><td class="num">${num(n.rollouts_per_s, 2)}</td>
      <td class="num">${num(n.reported_tokens_per_s)}</td><td class="num">${num(n.accepted_groups)}</td>
      <td><span class="share"><i style="width:${100 * n.share}%"></i></span>${num(100 * n.share, 1)}%</td>
      <td class="episodes">${episodes(n)}</td><td>${esc(refused)}</td><td class="num">${num(n.last_heartbeat_age_s, 1)} s ago</td><td>${relay}</td>
      <td>${link}</td></tr>`;
  }).join("");
  const healthy = rows.filter((n) => n.state === "healthy").length;
  const hidden = [ov.unlisted_keys ? `${num(ov.unlisted_keys)} more new keys with nothing accepted not listed` : "",
    ov.silent_keys ? `${num(ov.silent_keys)} silent keys not listed` : ""].filter(Boolean);
  $("nodes-note").textContent = [`${healthy} of ${rows.length} healthy`, ...hidden,
    `rates over the last ${state.tp ? state.tp.window_s : 10} s`].join(" · ");
}

// The relay tree (broadcast/ tracker's TreeView): per tree, origin -> children, with each peer's versions.
function drawTree() {
  const tv = state.ov.tree, el = $("tree");
  if (!tv) { el.innerHTML = `<p class="empty">no relay tree yet</p>`; $("tree-note").textContent = ""; return; }
  const peers = new Map(tv.peers.map((p) => [p.peer_id, p]));
  const ver = (p) => {
    const v = p.complete.length ? Math.max(...p.complete) : null;
    const cls = v == null ? "behind" : v === tv.latest ? "latest" : "behind";
    const prog = Object.entries(p.progress).map(([k, n]) => ` <span class="ver behind">v${esc(k)}: ${n} pieces</span>`).join("");
    return `<span class="ver ${cls}">${v == null ? "none" : "v" + v}</span>${prog}`;
  };
  const walk = (pid, t, depth) => {
    const p = peers.get(pid);
    if (!p || depth > 32) return "";
    const kids = p.children[t] || [];
    return `<li>${esc(p.name || pid.slice(0, 8))} ${ver(p)} <span class="note">${num(p.last_heartbeat_age, 1)} s${p.relay ? "" : p.reachable === false ? " · download-only: not reachable" : " · download-only"}${p.tier === 1 && p.children.some((c) => c.length) ? " · on trial" : ""}${p.uplink ? " · up " + num(p.uplink * 8 / 1e6, 1) + " Mbit/s" + (p.uplink_probed ? " (probed)" : "") : ""}${p.strikes ? " · strikes " + p.strikes : ""}</span>` +
      (kids.length ? `<ul>${kids.map((c) => walk(c, t, depth + 1)).join("")}</ul>` : "") + "</li>";
  };
  let html = "";
  for (let t = 0; t < tv.trees; t++) {
    html += `<div class="tname">tree ${t}</div><ul><li><b>origin</b> <span class="ver latest">v${tv.latest ?? "–"}</span><ul>` +
      (tv.origin_children[t] || []).map((c) => walk(c, t, 0)).join("") + "</ul></li></ul>";
  }
  for (const b of tv.banned) html += `<p class="note">banned ${esc(b.peer_id.slice(0, 12))}: ${esc(b.reason)}</p>`;
  el.innerHTML = html;
  $("tree-note").textContent = `${tv.peers.length} peers · fanout ${tv.fanout} · serving ${tv.versions.map((v) => "v" + v).join(", ")}`;
}

function drawHeadline() {
  const ov = state.ov, ev = state.evals[state.evals.length - 1];
  const healthy = ov.nodes.filter((n) => n.state === "healthy").length;
  $("headline").innerHTML = [
    `step <b>${ov.step}</b>/${ov.max_steps}`, `policy <b>v${ov.version}</b>`, `RL time <b>${dur(ov.elapsed_s)}</b>`,
    `swarm <b>${num(ov.tokens_per_s)}</b> tokens/s`, `<b>${num(ov.rollouts_per_s, 2)}</b> rollouts/s`,
    ov.episodes_per_s ? `<b>${num(ov.episodes_per_s, 2)}</b> episodes/s` : "",
    `nodes <b>${healthy}</b>/${ov.nodes.length} healthy`,
    ev ? `held-out accuracy <b>${num(ev.accuracy, 3)}</b> @ step ${ev.step}` : "no eval yet",
    ov.done ? "<b>run finished</b>" : "",
  ].filter(Boolean).join(" · ");
}

// What the operator must know about newcomers: keys waiting with nobody to pair them with, and the lab
// setting that releases them unchecked.
function drawBanners() {
  const pg = state.ov.pairing, out = [];
  if (pg && pg.waiting_keys > 0) {
    out.push(`<div class="banner" id="banner-unpaired"><b>${num(pg.waiting_keys)} node(s) on probation with nobody to pair them with:</b> ` +
      `${num(pg.waiting_groups)} group(s) wait in quarantine and nothing of theirs trains. Give the run a reference of its own ` +
      `(<code>swarm train --reference</code>), or run a node yourself and trust its key (<code>swarm train --trust KEY</code>).</div>`);
  }
  if (pg && pg.release_unpaired) {
    out.push(`<div class="banner" id="banner-release-unpaired"><b>guard.release_unpaired is on:</b> nodes with no reference ` +
      `to be paired with are released after their audited groups, unchecked for cherry-picking (a lab setting; ` +
      `two colluding keys can release each other).</div>`);
  }
  $("banners").innerHTML = out.join("");
}

function drawAll() {
  if (!state.ov) return;
  drawBanners(); drawHeadline(); drawThroughput(); drawLearning(); drawLag(); drawSubmissions(); drawNodes(); drawTree();
}

// ---- data flow -----------------------------------------------------------------------------------

function appendPoint(p) {
  const tp = state.tp, n = tp.t.length;
  tp.t.push(p.t); tp.tokens_per_s.push(p.tokens_per_s); tp.rollouts_per_s.push(p.rollouts_per_s);
  for (const [id, [tok, roll]] of Object.entries(p.nodes)) {
    if (!tp.nodes[id]) {
      const nv = state.ov.nodes.find((x) => x.node_id === id);
      tp.nodes[id] = { name: nv ? nv.name : id.slice(0, 8), tokens_per_s: new Array(n).fill(null), rollouts_per_s: new Array(n).fill(null) };
    }
    tp.nodes[id].tokens_per_s.push(tok); tp.nodes[id].rollouts_per_s.push(roll);
  }
  for (const s of Object.values(tp.nodes)) {  // a node missing from this point: keep the arrays aligned
    if (s.tokens_per_s.length === n) { s.tokens_per_s.push(null); s.rollouts_per_s.push(null); }
  }
  if (tp.t.length > MAX_POINTS) {
    const cut = tp.t.length - MAX_POINTS;
    for (const a of [tp.t, tp.tokens_per_s, tp.rollouts_per_s, ...Object.values(tp.nodes).flatMap((s) => [s.tokens_per_s, s.rollouts_per_s])]) a.splice(0, cut);
  }
}

function connect() {
  const es = new EventSource("/events");
  es.addEventListener("open", () => { $("live").textContent = "live"; $("live").classList.remove("off"); });
  es.addEventListener("error", () => { $("live").textContent = "reconnecting…"; $("live").classList.add("off"); });
  es.addEventListener("snapshot", (e) => {
    const v = JSON.parse(e.data);
    state.tp = v.throughput; state.steps = v.steps; state.evals = v.evals; state.ov = v.overview;
    for (const k of Object.keys(charts)) { if (charts[k] && charts[k].destroy) charts[k].destroy(); delete charts[k]; }
    drawAll();
  });
  es.addEventListener("tick", (e) => {
    const t = JSON.parse(e.data);
    state.ov = t.overview;
    if (t.point) appendPoint(t.point);
    state.steps.push(...t.steps); state.evals.push(...t.evals);
    drawAll();
  });
}

for (const id of ["tp-metric", "tp-mode"]) $(id).addEventListener("change", drawThroughput);
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    for (const [key, el] of [["tp", "throughput"], ["learn", "learning"], ["lag", "lag"]]) {
      if (charts[key]) charts[key].setSize({ width: width($(el)), height: 260 });
    }
  }, 150);
});
connect();
