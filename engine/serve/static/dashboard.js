// kvtier dashboard: polls the server's feed once a second and draws it (Chart.js, shipped
// beside this file). The page keeps the history it draws; the server keeps none.
"use strict";

const FEED = "/v1/kvtier/dashboard";
const ADMIN = "/v1/kvtier/admin";
const SOURCES = ["L1", "L2", "L3", "recomputed"];
const COLORS = { L1: "#0072b2", L2: "#009e73", L3: "#e69f00", recomputed: "#bbbbbb" };
const HISTORY = 120; // points kept per chart (two minutes)
const POLL_MS = 1000;

let previous = null; // the last feed, for per-second deltas
const strips = new Map(); // rid -> its row, built once

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function secs(s) {
  if (s == null) return "–";
  return s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s";
}

function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }

function cell(text, value, cls = "num") {
  const td = el("td", { class: cls }, text);
  if (value !== undefined) td.setAttribute("data-value", String(value));
  return td;
}

function setFigure(id, text, value) {
  const node = document.getElementById(id);
  node.textContent = text;
  node.setAttribute("data-value", value == null ? "" : String(value));
}

function fillBody(table, rows) {
  const body = document.querySelector(`#${table} tbody`);
  body.replaceChildren(...rows);
}

function lineChart(id, datasets, yTitle, stacked, yMax) {
  return new Chart(document.getElementById(id), {
    type: stacked ? "bar" : "line",
    data: { labels: [], datasets },
    options: {
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 14 } } },
      scales: {
        x: { stacked, ticks: { maxTicksLimit: 6, maxRotation: 0 } },
        y: { stacked, beginAtZero: true, max: yMax, title: { display: true, text: yTitle } },
      },
    },
  });
}

const sourcesChart = lineChart(
  "sources-chart",
  SOURCES.map((s) => ({ label: s, data: [], backgroundColor: COLORS[s], borderColor: "#555", borderWidth: s === "recomputed" ? 1 : 0 })),
  "prompt tokens",
  true,
);
const latencyChart = lineChart(
  "latency-chart",
  [
    { label: "TTFT p50", data: [], borderColor: "#0072b2", pointRadius: 0 },
    { label: "TTFT p95", data: [], borderColor: "#0072b2", borderDash: [6, 4], pointRadius: 0 },
    { label: "queue p50", data: [], borderColor: "#d55e00", pointRadius: 0 },
    { label: "queue p95", data: [], borderColor: "#d55e00", borderDash: [6, 4], pointRadius: 0 },
  ],
  "seconds",
  false,
);

function push(chart, label, values) {
  chart.data.labels.push(label);
  values.forEach((v, i) => chart.data.datasets[i].data.push(v));
  if (chart.data.labels.length > HISTORY) {
    chart.data.labels.shift();
    chart.data.datasets.forEach((d) => d.data.shift());
  }
  chart.update("none");
}

function renderTiers(stats) {
  const rows = Object.entries(stats.tiers || {}).map(([name, t]) => {
    const share = t.capacity ? Math.min(1, t.bytes_used / t.capacity) : 0;
    const fill = el("span");
    fill.style.width = (100 * share).toFixed(1) + "%";
    const used = el("td", {}, el("span", { class: "bar", title: pct(share) }, fill), " ", `${bytes(t.bytes_used)} of ${bytes(t.capacity)}`);
    used.setAttribute("data-value", String(t.bytes_used));
    const tr = el("tr", { "data-tier": name }, el("th", {}, name), used, cell(t.pages, t.pages), cell(t.hit_pages, t.hit_pages), cell(t.evictions, t.evictions));
    return tr;
  });
  fillBody("tiers", rows);
}

function renderFigures(feed) {
  const s = feed.stats, engine = s.engine || {}, src = engine.sources || {};
  const total = SOURCES.reduce((a, k) => a + (src[k] || 0), 0);
  const restored = total - (src.recomputed || 0);
  setFigure("waiting", s.server.waiting, s.server.waiting);
  setFigure("running", s.server.running, s.server.running);
  setFigure("served", engine.requests ?? "–", engine.requests);
  setFigure("prompt-tokens", engine.prompt_tokens ?? "–", engine.prompt_tokens);
  setFigure("reuse", total ? pct(restored / total) : "–", total ? restored / total : null);
  document.getElementById("cached-rate").textContent = s.windowed ? s.windowed.cached_tokens_per_s.toFixed(1) : "–";
}

function renderLinks(stats) {
  const profile = (stats.costmodel && stats.costmodel.links) || {};
  const rows = Object.entries(stats.links || {}).map(([name, l]) => {
    const measured = l.seconds > 0 ? l.bytes / l.seconds / 2 ** 30 : null;
    const fit = profile[name];
    return el("tr", { "data-link": name }, el("th", {}, name), cell(bytes(l.bytes), l.bytes), cell(secs(l.seconds), l.seconds),
      cell(measured == null ? "–" : measured.toFixed(2) + " GiB/s"), cell(fit ? fit.gib_s.toFixed(2) + " GiB/s" : "–"));
  });
  fillBody("links", rows);
}

function renderCostModel(stats) {
  const cm = stats.costmodel;
  document.getElementById("calibrated").textContent = cm ? (cm.calibrated ? "calibrated on this store" : "default profile (not calibrated)") : "no cost model";
  const parts = cm ? Object.entries(cm.links || {}).map(([k, v]) => [k, v.error]) : [];
  if (cm && cm.compute) parts.push(["prefill", cm.compute.error]);
  fillBody("costmodel", parts.map(([name, e]) => el("tr", {}, el("th", {}, name), cell(e.count, e.count), cell(pct(e.median)), cell(pct(e.p90)))));
}

function stripOf(record) {
  const strip = el("div", { class: "strip", "data-rid": record.rid });
  for (const [source, n] of record.strip) {
    for (let i = 0; i < n; i++) strip.append(el("span", { class: "src-" + source, "data-source": source, title: source }));
  }
  strip.addEventListener("mouseenter", () => loadText(record.rid, strip), { once: true });
  return strip;
}

async function loadText(rid, strip) {
  const answer = await fetch(`${ADMIN}/requests/${rid}/tokens`, { headers: authHeaders() });
  if (!answer.ok) return; // no operator key, or the request left the ring: the cells keep their source
  const body = await answer.json();
  body.tokens.forEach((t, i) => { if (strip.children[i]) strip.children[i].title = `${t.source}: ${JSON.stringify(t.text)}`; });
}

function planText(plan) {
  if (!plan) return "no store";
  const matched = plan.matched.length;
  return `restore ${plan.restore_pages}/${matched} pages` + (plan.overlap_pages ? ` (${plan.overlap_pages} overlapped)` : "") +
    `, predicted ${secs(plan.predicted_s)} vs recompute ${secs(plan.recompute_s)}`;
}

function renderRequests(feed) {
  const pinned = new Set(feed.pins.map((p) => p.rid));
  const rows = feed.requests.map((r) => {
    if (!strips.has(r.rid)) {
      const counts = SOURCES.map((s) => `${s} ${r.sources[s] || 0}`).join(" · ");
      strips.set(r.rid, el("td", {}, stripOf(r), el("div", { class: "counts" }, counts)));
    }
    const pin = el("button", { type: "button" }, pinned.has(r.rid) ? "Unpin" : "Pin");
    pin.addEventListener("click", () => act(pinned.has(r.rid) ? "unpin" : "pin", { rid: r.rid },
      `${pinned.has(r.rid) ? "Unpin" : "Pin"} the prompt of request ${r.rid} in the fast tiers?`));
    return el("tr", { "data-rid": r.rid }, cell(r.rid, r.rid), cell(r.prompt_tokens, r.prompt_tokens), strips.get(r.rid),
      el("td", { class: "wrap" }, planText(r.plan)), cell(secs(r.ttft_s), r.ttft_s ?? ""), cell(secs(r.queue_s), r.queue_s ?? ""), el("td", {}, pin));
  });
  for (const rid of strips.keys()) if (!feed.requests.some((r) => r.rid === rid)) strips.delete(rid);
  fillBody("requests", rows);
}

function renderNamespaces(feed) {
  if (!feed.namespaces.length) {
    fillBody("namespaces", [el("tr", {}, el("td", { class: "muted wrap", colSpan: 7 }, "no pages in L3 yet: they reach it as L1 and L2 evict them, and when the server stops"))]);
    return;
  }
  fillBody("namespaces", feed.namespaces.map((ns) => {
    const clear = el("button", { type: "button" }, "Clear");
    clear.addEventListener("click", () => act("clear", { namespace: ns.namespace },
      `Delete the ${ns.pages} pages (${bytes(ns.bytes)}) of namespace ${ns.namespace.slice(0, 12)} (${ns.model}) from L3?`));
    const used = ns.last_use ? new Date(ns.last_use * 1000).toLocaleString() : "–";
    return el("tr", { "data-namespace": ns.namespace }, el("td", { class: "num", title: ns.namespace }, ns.namespace.slice(0, 12) + (ns.current ? " (this model)" : "")),
      el("td", {}, ns.model), cell(ns.page_size), cell(ns.pages, ns.pages), cell(bytes(ns.bytes), ns.bytes), el("td", {}, used), el("td", {}, clear));
  }));
}

function authHeaders() {
  const key = document.getElementById("key").value;
  return key ? { Authorization: "Bearer " + key } : {};
}

async function act(action, body, question) {
  if (!window.confirm(question)) return;
  const status = document.getElementById("action-status");
  const answer = await fetch(`${ADMIN}/${action}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
  });
  const reply = await answer.json().catch(() => ({}));
  status.textContent = answer.ok ? `${action}: ${JSON.stringify(reply)}` : `${action} refused: ${reply.error ? reply.error.message : answer.status}`;
  status.setAttribute("data-ok", String(answer.ok));
}

document.getElementById("resize").addEventListener("submit", (event) => {
  event.preventDefault();
  const mib = Number(document.getElementById("resize-mib").value);
  act("resize", { l3_bytes: Math.round(mib * 2 ** 20) }, `Set L3's cap to ${mib} MiB, evicting the least recently used pages beyond it?`);
});

function render(feed) {
  const s = feed.stats;
  document.getElementById("model").textContent = feed.model;
  renderTiers(s);
  renderFigures(feed);
  renderLinks(s);
  renderCostModel(s);
  renderRequests(feed);
  renderNamespaces(feed);
  const label = new Date(feed.time * 1000).toTimeString().slice(0, 8); // HH:MM:SS, short on a phone
  if (previous && previous.stats.engine && s.engine) {
    const was = previous.stats.engine.sources, now = s.engine.sources;
    push(sourcesChart, label, SOURCES.map((k) => Math.max(0, (now[k] || 0) - (was[k] || 0))));
  }
  const lat = feed.latency;
  push(latencyChart, label, [lat.ttft_p50_s, lat.ttft_p95_s, lat.queue_p50_s, lat.queue_p95_s]);
  previous = feed;
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const answer = await fetch(FEED, { cache: "no-store", headers: authHeaders() });
    if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
    render(await answer.json());
    status.textContent = "live";
    status.setAttribute("data-updated", String(Date.now()));
  } catch (err) {
    status.textContent = `no answer from the server (${err.message}); retrying`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
