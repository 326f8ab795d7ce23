// The manager's status page: poll api/status every second and redraw every section.
//
// Everything the manager sends is put into the page as text (never as HTML): agent IDs and
// refusal details come from the network. A failed poll shows the "manager unreachable" banner
// and greys out the last data rather than leaving it on screen as if it were current.
// Charts are inline SVG: rates per second are the deltas of the history's cumulative counters.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 3000;
const MIN_RATE_INTERVAL_S = 0.9; // rates over at least ~1 s, whatever the manager's tick
const MIN_CHART_WINDOW_S = 60;

const $ = (id) => document.getElementById(id);

const SVG_TAGS = new Set(["line", "polygon", "polyline"]);

/** An element with attributes and children; strings become text nodes. */
function h(tag, attrs = {}, ...children) {
  const el = SVG_TAGS.has(tag)
    ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined && value !== false) el.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) el.append(child);
  }
  return el;
}

// ---- formatting ---------------------------------------------------------------------------
const pad2 = (n) => String(n).padStart(2, "0");

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 60) return `${Math.round(seconds)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${pad2(Math.floor(seconds % 60))} s`;
  const hours = Math.floor(minutes / 60);
  if (hours < 24) return `${hours} h ${pad2(minutes % 60)} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

function clock(epochSeconds) {
  const d = new Date(epochSeconds * 1000);
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

function number(value, digits = 0) {
  return value.toLocaleString("en", { maximumFractionDigits: digits });
}

/** 1, 2 or 5 × 10^k, at least ``value``: a round top for a chart's scale. */
function niceCeiling(value) {
  if (value <= 1) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

// ---- small building blocks ----------------------------------------------------------------
function stateBadge(state) {
  return h("span", { class: `badge state-${state.toLowerCase()}`, "data-state": state }, state);
}

function usageBar(used, capacity) {
  const share = capacity > 0 ? Math.min(1, used / capacity) : 0;
  const level = share >= 1 ? "full" : share >= 0.75 ? "high" : "ok";
  return h(
    "div",
    { class: "usage", "data-used": used, "data-capacity": capacity },
    h(
      "div",
      { class: "bar", "aria-hidden": "true" },
      h("span", { class: `fill ${level}`, style: `width: ${(share * 100).toFixed(1)}%` }),
    ),
    h("span", { class: "usage-text" }, `${used} / ${capacity}`),
  );
}

function link(url, text) {
  return url ? h("a", { href: url, target: "_blank", rel: "noopener" }, text) : text;
}

/** Replace a table's rows; an empty list shows one row saying so. */
function fillTable(id, rows, emptyText) {
  const table = $(id);
  const body = table.tBodies[0];
  const columns = table.tHead.rows[0].cells.length;
  body.replaceChildren(
    ...(rows.length
      ? rows
      : [h("tr", { class: "empty" }, h("td", { colspan: columns }, emptyText))]),
  );
}

// "m0 0,3 · m1 (this one) 1,4 · 1 not held" (mesh.top.shard_line says the same)
function shardLine(shards, me) {
  const held = new Map();
  for (const row of shards.owners ?? []) {
    if (!held.has(row.owner)) held.set(row.owner, []);
    held.get(row.owner).push(row.shard);
  }
  const parts = [...held.keys()].sort().map((owner) => {
    const mine = owner === me ? " (this one)" : "";
    return `${owner}${mine} ${held.get(owner).sort((a, b) => a - b).join(",")}`;
  });
  const free = shards.count - (shards.owners ?? []).length;
  if (free > 0) parts.push(`${free} not held`);
  return `${shards.count}: ${parts.join(" · ")}`;
}

// ---- sections -----------------------------------------------------------------------------
function renderHeader(doc) {
  $("manager-id").textContent = doc.manager_id;
  $("namespace").textContent = doc.namespace;
  $("uptime").textContent = duration(doc.uptime_s);
  $("updated").textContent = clock(doc.served_at ?? Date.now() / 1000);
  // Several managers: who holds which shard; the agents on this page are this manager's.
  $("shards-fact").hidden = !doc.shards;
  if (doc.shards) $("shards").textContent = shardLine(doc.shards, doc.manager_id);
  const ui = doc.management_ui;
  $("management-link").replaceChildren(
    ...(ui ? [" · ", link(`${ui}/#/queues`, "RabbitMQ management UI")] : []),
  );
}

function renderSummary(doc) {
  const byState = doc.agents_by_state ?? {};
  const live = (byState.Ready ?? 0) + (byState.Busy ?? 0);
  const inFlight = doc.capabilities.reduce((sum, c) => sum + c.in_flight, 0);
  const capacity = doc.capabilities.reduce((sum, c) => sum + c.capacity, 0);
  const last = doc.history.at(-1) ?? { admitted: 0, refused: 0 };
  $("sum-ready").textContent = `${number(live)} of ${number(doc.agents_total ?? 0)}`;
  $("sum-in-flight").textContent = `${inFlight} / ${capacity}`;
  $("sum-queued").textContent = number(doc.queues.reduce((sum, q) => sum + q.messages, 0));
  $("sum-admitted").textContent = number(last.admitted);
  $("sum-refused").textContent = number(last.refused);
}

function renderAgents(doc) {
  const rows = doc.agents.map((a) =>
    h(
      "tr",
      { "data-agent-id": a.agent_id, "data-state": a.state, "data-deployment": a.deployment },
      h("th", { scope: "row", class: "mono" }, a.agent_id),
      h("td", {}, a.deployment),
      h("td", {}, stateBadge(a.state)),
      h("td", {}, usageBar(a.in_flight, a.capacity)),
      h("td", { class: "num" }, duration(a.last_heartbeat_age_s)),
      h("td", { class: "mono small" }, link(a.task_queue_url, a.task_queue)),
    ),
  );
  fillTable("agents", rows, "No agents registered.");
  const shown = doc.agents.length;
  const total = doc.agents_total ?? shown;
  $("agents-shown").textContent =
    shown < total ? `: the first ${number(shown)} of ${number(total)} (the figures above count all)` : "";
}

function renderPools(doc) {
  const rows = doc.pools.map((p) => {
    const epoch =
      p.descriptor_epoch === null
        ? "—"
        : p.active_epoch !== null && p.active_epoch !== p.descriptor_epoch
          ? `${p.descriptor_epoch} (active ${p.active_epoch})`
          : String(p.descriptor_epoch);
    const states = Object.entries(p.agents).map(([state, count]) =>
      h("span", { class: `badge state-${state.toLowerCase()}`, "data-state": state }, `${state} ${count}`),
    );
    return h(
      "tr",
      { "data-pool-id": p.pool_id, "data-epoch": p.descriptor_epoch ?? "" },
      h("th", { scope: "row" }, p.pool_id),
      h("td", { class: "num" }, epoch),
      h("td", { class: "small" }, p.capabilities.length ? p.capabilities.join(", ") : "no descriptor"),
      h("td", { class: "badges" }, states.length ? states : "none"),
    );
  });
  fillTable("pools", rows, "No pools.");
}

function renderCapabilities(doc) {
  const rows = doc.capabilities.map((c) =>
    h(
      "tr",
      { "data-capability": c.capability, "data-in-flight": c.in_flight, "data-capacity": c.capacity },
      h("th", { scope: "row", class: "mono" }, c.capability),
      h("td", {}, usageBar(c.in_flight, c.capacity)),
      h("td", { class: "num" }, c.agents),
    ),
  );
  fillTable("capabilities", rows, "No capabilities offered.");
}

function renderQueues(doc) {
  const prefix = `${doc.namespace}.`;
  const rows = doc.queues.map((q) =>
    h(
      "tr",
      { "data-queue": q.name, "data-messages": q.messages, class: q.messages > 0 ? "busy" : null },
      h(
        "th",
        { scope: "row", class: "mono small", title: q.name },
        link(q.url, q.name.startsWith(prefix) ? q.name.slice(prefix.length) : q.name),
      ),
      h("td", { class: "num" }, number(q.messages)),
      h("td", { class: "num" }, duration(q.oldest_age_s)),
    ),
  );
  $("queues-note").textContent = doc.management_ui ? `names after “${prefix}”` : "";
  fillTable(
    "queues",
    rows,
    doc.management_ui
      ? "No queue depths yet (read from the management API every few seconds)."
      : "Queue depths are not polled: the manager has no management_url.",
  );
}

function renderReservations(doc) {
  const rows = doc.reservations.map((r) =>
    h(
      "tr",
      { "data-pool": r.pool, "data-resource": r.resource },
      h("th", { scope: "row" }, r.pool),
      h("td", { class: "mono small" }, r.resource),
      h("td", {}, usageBar(r.used, r.capacity)),
    ),
  );
  fillTable("reservations", rows, "No reservations.");
}

function renderRefusals(doc) {
  const rows = doc.recent_refusals.map((r) =>
    h(
      "tr",
      { "data-reason": r.reason, "data-outcome": r.outcome, "data-admission-id": r.admission_id },
      h("td", { class: "time", title: new Date(r.at * 1000).toISOString() }, clock(r.at)),
      h("td", {}, h("code", { class: "reason" }, r.reason)),
      h("td", {}, r.outcome),
      h("td", { class: "mono small" }, r.admission_id),
      h("td", { class: "detail" }, r.detail || "—"),
    ),
  );
  fillTable("refusals", rows, "No refusals.");
}

// ---- charts -------------------------------------------------------------------------------
/** [at, per-second rate] from a cumulative counter, over intervals of at least ~1 s. */
function rates(history, key) {
  const points = [];
  let previous = history[0];
  for (const sample of history.slice(1)) {
    const dt = sample.at - previous.at;
    if (dt < MIN_RATE_INTERVAL_S) continue;
    // A counter that went down means the manager restarted: count from zero again.
    const delta = sample[key] >= previous[key] ? sample[key] - previous[key] : sample[key];
    points.push([sample.at, delta / dt]);
    previous = sample;
  }
  return points;
}

/** Seconds as a short "how long ago" for a chart's time axis. */
function ago(seconds) {
  return seconds < 120 ? `${Math.round(seconds)} s ago` : `${Math.round(seconds / 60)} min ago`;
}

function drawChart(id, points, window, digits) {
  const figure = $(id);
  const svg = figure.querySelector("svg");
  const [width, height] = [300, 100];
  const latest = points.length ? points.at(-1)[1] : 0;
  const peak = points.reduce((max, [, v]) => Math.max(max, v), 0);
  const top = niceCeiling(peak);
  const [t0, t1] = window;
  const x = (t) => ((t - t0) / (t1 - t0)) * width;
  const y = (v) => height - (v / top) * (height - 2);
  const coords = points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
  const grid = [0.25, 0.5, 0.75].map((f) =>
    h("line", { class: "grid", x1: 0, x2: width, y1: height * f, y2: height * f }),
  );
  const shapes = coords.length
    ? [
        h("polygon", {
          class: "area",
          points: `${x(points[0][0]).toFixed(1)},${height} ${coords.join(" ")} ${width},${height}`,
        }),
        h("polyline", { class: "line", points: coords.join(" ") }),
      ]
    : [];
  svg.replaceChildren(...grid, ...shapes);
  const title = figure.querySelector("figcaption").firstChild.textContent.trim();
  svg.setAttribute(
    "aria-label",
    `${title} over the last ${duration(t1 - t0)}: now ${number(latest, digits)}, peak ${number(peak, digits)}`,
  );
  figure.dataset.latest = String(latest);
  figure.dataset.peak = String(peak);
  figure.dataset.points = String(points.length);
  figure.querySelector(".now").textContent = number(latest, digits);
  figure.querySelector(".ymax").textContent = number(top);
  figure.querySelector(".x0").textContent = ago(t1 - t0);
}

function renderCharts(doc) {
  const history = doc.history;
  // At least a minute wide, newest sample on the right edge: a young manager's line grows
  // from the right instead of being stretched across the chart.
  const t1 = history.length ? history.at(-1).at : (doc.served_at ?? 0);
  const t0 = Math.min(history.length ? history[0].at : t1, t1 - MIN_CHART_WINDOW_S);
  $("history-span").textContent = `${history.length} samples, one per manager tick`;
  drawChart("chart-admissions", rates(history, "admitted"), [t0, t1], 1);
  drawChart("chart-refusals", rates(history, "refused"), [t0, t1], 1);
  drawChart("chart-queue", history.map((s) => [s.at, s.queue_messages]), [t0, t1], 0);
}

// ---- the poll loop ------------------------------------------------------------------------
let lastGoodAt = null;
let unreachableSince = null; // the first failure of the current outage

function render(doc) {
  renderHeader(doc);
  renderSummary(doc);
  renderCharts(doc);
  renderAgents(doc);
  renderPools(doc);
  renderCapabilities(doc);
  renderQueues(doc);
  renderReservations(doc);
  renderRefusals(doc);
}

function showReachable(doc) {
  lastGoodAt = Date.now();
  unreachableSince = null;
  document.body.dataset.status = "ok";
  document.body.dataset.updatedAt = String(doc.served_at ?? lastGoodAt / 1000);
  $("unreachable").hidden = true;
}

/** The banner, and the last data greyed out: never stale data shown as if it were current. */
function showProblem(status, title, why) {
  unreachableSince ??= Date.now();
  document.body.dataset.status = status;
  const age =
    lastGoodAt === null
      ? "no data yet"
      : `the data below is ${duration((Date.now() - lastGoodAt) / 1000)} old`;
  $("unreachable-title").textContent = title;
  $("unreachable-detail").textContent =
    `${why} (since ${clock(unreachableSince / 1000)}; ${age}). Retrying every second.`;
  $("unreachable").hidden = false;
  $("updated").textContent = lastGoodAt === null ? "never" : clock(lastGoodAt / 1000);
}

async function poll() {
  const started = performance.now();
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
  let doc = null;
  try {
    const response = await fetch("api/status", { cache: "no-store", signal: abort.signal });
    if (!response.ok) throw new Error(`api/status answered HTTP ${response.status}`);
    doc = await response.json();
  } catch (err) {
    const why = err.name === "AbortError" ? "api/status did not answer in 3 s" : err.message;
    showProblem("unreachable", "Manager unreachable.", why || String(err));
  } finally {
    clearTimeout(timer);
  }
  if (doc !== null) {
    try {
      render(doc);
      showReachable(doc);
    } catch (err) {
      console.error(err);
      showProblem("error", "Cannot show the status.", `the page failed on the status document: ${err}`);
    }
  }
  setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
}

poll();
