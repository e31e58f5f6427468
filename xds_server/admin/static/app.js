// trimtab status page: polls the admin API and renders pools, weight charts, rollouts, NACKs.
// No dependencies, no other origin: the chart is plain SVG drawn below.
"use strict";

(() => {
  const POLL_MS = 2000;
  const WINDOW_S = 600;          // the chart shows at most the last 10 minutes
  const MIN_SPAN_S = 60;         // ... and at least one minute, growing from the right edge
  const CONFIG_EVERY = 15;       // re-read /v1/config every 15 polls (30 s)
  const STUCK_MS = 15000;        // warn when no new tick arrived for this long
  const CHART_H = 170;
  const PAD = { l: 34, r: 10, t: 10, b: 20 };
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#8cd17d"];

  // The commands each rollout phase accepts (xds_server/control/rollouts/machine.py: command).
  const PHASE_COMMANDS = {
    progressing: ["pause", "promote", "abort"],
    paused: ["resume", "promote", "abort"],
    rolled_back: ["resume", "promote", "abort"],
    aborted: ["resume", "promote"],
    promoted: [],
  };
  const CONFIRM = {
    promote: (pool) => `Promote ${pool}: send all of its traffic to the canary?`,
    abort: (pool) => `Abort ${pool}: send all of its traffic back to stable?`,
  };

  const state = {
    points: [], latestAt: null, latestSeenMs: Date.now(), weights: null, config: null,
    nacks: null, rollouts: null, admission: null, polls: 0, hover: new Map(), errors: [], pendingPool: null,
  };

  // ---- small DOM helpers -------------------------------------------------------------------
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value !== null && value !== undefined && value !== false) node.setAttribute(key, value);
    }
    node.append(...children.filter((c) => c !== null && c !== undefined));
    return node;
  }

  function svg(tag, attrs = {}, text = null) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== null) node.textContent = text;
    return node;
  }

  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }

  function fmtNumber(value) {
    if (typeof value !== "number" || !Number.isFinite(value)) return String(value);
    if (Number.isInteger(value)) return String(value);
    return Math.abs(value) >= 10 ? value.toFixed(1) : value.toPrecision(3);
  }

  function fmtAge(seconds) {
    if (seconds === null || !Number.isFinite(seconds)) return "never";
    const s = Math.max(0, Math.round(seconds));
    if (s < 120) return `${s}s`;
    if (s < 7200) return `${Math.round(s / 60)}m`;
    return `${Math.round(s / 3600)}h`;
  }

  function fmtRelative(seconds) {
    if (Math.abs(seconds) < 0.5) return "now";
    const s = Math.round(-seconds);
    const m = Math.floor(s / 60);
    return m ? `-${m}m${s % 60 ? `${s % 60}s` : ""}` : `-${s}s`;
  }

  function fmtClock(at) {
    // Unix seconds as local wall time; small numbers (test clocks) as plain seconds.
    if (at > 1e9) return new Date(at * 1000).toLocaleTimeString([], { hour12: false });
    return `t=${fmtNumber(at)}`;
  }

  function nowSeconds() {
    return state.latestAt ?? Date.now() / 1000;  // the controller's clock when we know it
  }

  // ---- polling -------------------------------------------------------------------------------
  async function getJson(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  async function postJson(path) {
    // A request that changes state must be JSON (xds_server/security/admin_origin.py): a page on
    // another site cannot send that type without a CORS preflight, which the admin API refuses.
    const response = await fetch(path, {
      method: "POST", cache: "no-store", headers: { "Content-Type": "application/json" }, body: "{}",
    });
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new Error(body?.error?.message || `HTTP ${response.status}`);
    return body;
  }

  async function poll() {
    const since = state.latestAt === null ? "" : `?since=${state.latestAt}`;
    const wantConfig = state.config === null || state.polls % CONFIG_EVERY === 0;
    const results = await Promise.allSettled([
      getJson("/v1/weights"), getJson(`/v1/history${since}`), getJson("/v1/nacks"),
      getJson("/v1/rollouts"), wantConfig ? getJson("/v1/config") : Promise.resolve(state.config),
      getJson("/v1/admission"),
    ]);
    const [weights, history, nacks, rollouts, config, admission] = results;
    state.errors = results.filter((r) => r.status === "rejected").map((r) => String(r.reason.message || r.reason));
    if (weights.status === "fulfilled") state.weights = weights.value;
    if (history.status === "fulfilled") mergeHistory(history.value);
    if (nacks.status === "fulfilled") state.nacks = nacks.value;
    if (rollouts.status === "fulfilled") state.rollouts = rollouts.value.rollouts || {};
    if (config.status === "fulfilled") state.config = config.value;
    if (admission.status === "fulfilled") state.admission = admission.value.pools || {};
    state.polls += 1;
    render();
  }

  async function loop() {
    try {
      await poll();
    } catch (error) {
      state.errors = [String(error)];
      renderConnection();
    }
    setTimeout(loop, POLL_MS);
  }

  function mergeHistory(doc) {
    if (doc.latest_at === null || (state.latestAt !== null && doc.latest_at < state.latestAt)) {
      state.points = [];        // the history restarted (trimtab restarted, or its clock stepped)
      state.latestAt = null;    // the next poll fetches all of it
      return;
    }
    if (doc.latest_at !== state.latestAt) state.latestSeenMs = Date.now();
    state.points.push(...doc.points);
    const oldest = doc.latest_at - WINDOW_S;
    const keepFrom = Math.max(0, state.points.length - doc.max_points);
    state.points = state.points.slice(keepFrom).filter((p) => p.at >= oldest);
    state.latestAt = doc.latest_at;
  }

  // ---- rendering: whole page -------------------------------------------------------------------
  function render() {
    renderConnection();
    if (state.weights) renderPools();
    renderSummary();
    renderRollouts();
    renderNacks();
    document.body.dataset.polls = String(state.polls);
  }

  function renderConnection() {
    const conn = document.getElementById("conn");
    const stuck = Date.now() - state.latestSeenMs > STUCK_MS && state.latestAt !== null;
    let text = `live · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
    let mode = "live";
    if (stuck) [mode, text] = ["warn", `no new tick for ${fmtAge((Date.now() - state.latestSeenMs) / 1000)}`];
    if (state.errors.length) [mode, text] = ["error", `unreachable: ${state.errors[0]} (retrying)`];
    conn.dataset.state = mode;
    setText(document.getElementById("conn-text"), text);
  }

  function renderSummary() {
    const pools = state.weights ? Object.values(state.weights.pools) : [];
    const endpoints = pools.flatMap((p) => Object.values(p));
    const stale = endpoints.filter((e) => e.stale).length;
    const nacks = state.nacks ? state.nacks.total : 0;
    const rollouts = state.rollouts ? Object.keys(state.rollouts).length : 0;
    const chip = (text, bad) => el("span", { class: bad ? "chip bad" : "chip" }, text);
    document.getElementById("summary").replaceChildren(
      chip(`${pools.length} pools`), chip(`${endpoints.length} endpoints`),
      chip(`${stale} stale`, stale > 0), chip(`${nacks} NACKs`, nacks > 0),
      chip(`${rollouts} rollouts`));
  }

  // ---- pools ------------------------------------------------------------------------------------
  function poolOrder() {
    const names = Object.keys(state.weights.pools);
    const configured = state.config ? state.config.pools.map((p) => p.name) : [];
    return [...configured.filter((n) => names.includes(n)), ...names.filter((n) => !configured.includes(n))];
  }

  function renderPools() {
    const container = document.getElementById("pools");
    const order = poolOrder();
    document.getElementById("pools-empty").hidden = order.length > 0;
    for (const section of container.querySelectorAll("section.pool")) {
      if (!order.includes(section.dataset.pool)) section.remove();
    }
    for (const name of order) {
      const section = container.querySelector(`section.pool[data-pool="${CSS.escape(name)}"]`)
        || createPoolSection(container, name);
      container.append(section);  // keeps the configured order
      renderPool(section, name, state.weights.pools[name]);
    }
  }

  function createPoolSection(container, name) {
    const section = el("section", { class: "panel pool", "data-pool": name },
      el("div", { class: "pool-head" }, el("h2", {}, name), el("span", { class: "pool-meta muted" }),
        el("span", { class: "pool-flags" })),
      el("div", { class: "pool-admission muted" }),
      el("div", { class: "chart-box" }),
      el("table", { class: "grid legend" },
        el("thead", {}, el("tr", {}, ...["", "endpoint", "weight", "locality", "share", "Envoy", "signals", "flags", "age", "reason"]
          .map((h) => el("th", {}, h)))),
        el("tbody")));
    container.append(section);
    attachHover(section, name);
    return section;
  }

  function renderPool(section, name, endpoints) {
    const addresses = Object.keys(endpoints).sort();
    const pool = state.config ? state.config.pools.find((p) => p.name === name) : null;
    const stale = addresses.filter((a) => endpoints[a].stale).length;
    const meta = pool ? `${pool.model} · ${pool.lb_policy} · ` : "";
    setText(section.querySelector(".pool-meta"), `${meta}${addresses.length} endpoints`);
    const failStatic = new Set(state.weights.fail_static_pools || []);
    const clusters = new Set(addresses.map((a) => endpoints[a].cluster));
    const flags = [];
    if ([...clusters].some((c) => failStatic.has(c))) flags.push(el("span", { class: "flag bad" }, "FAIL-STATIC"));
    if (stale) flags.push(el("span", { class: "flag bad" }, `${stale} stale`));
    section.querySelector(".pool-flags").replaceChildren(...flags);
    renderAdmission(section.querySelector(".pool-admission"), name);
    renderChart(section.querySelector(".chart-box"), name, addresses, endpoints);
    renderLegend(section.querySelector("tbody"), name, addresses, endpoints);
  }

  // Per cluster: the admission budget in force (/v1/admission: the trimtab_admission_* gauges)
  // and what the Envoys' load reports (LRS) say they admitted and refused, per second.
  function admissionText(cluster, c) {
    const parts = [];
    if (c.budget === null) parts.push("no budget: everything admitted");
    else {
      parts.push(`budget ${c.budget} in flight`);
      if (c.limit) parts.push(`${c.limit.interactive} per Envoy (batch ${c.limit.batch}) × ${c.envoys} Envoy${c.envoys === 1 ? "" : "s"}`);
    }
    if (c.tenant_rate !== null) parts.push(`tenant cap ${fmtNumber(c.tenant_rate)}/s${c.tenant_enforced ? " enforced" : ""}`);
    const e = c.envoy;
    if (e) {
      parts.push(`Envoy: ${fmtNumber(e.issued_per_s)}/s admitted, ${fmtNumber(e.dropped_per_s)}/s refused, ${e.in_progress} in flight (${e.issued} / ${e.dropped} in all)`);
    } else parts.push("no load reports from Envoy");
    return `${cluster}: ${parts.join(" · ")}`;
  }

  function renderAdmission(box, name) {
    const pool = state.admission ? state.admission[name] : null;
    if (!pool) { box.replaceChildren(); return; }
    const lines = Object.entries(pool.clusters).map(([cluster, c]) => {
      const refusing = c.envoy && c.envoy.dropped_per_s > 0;
      return el("div", { class: refusing ? "admission refusing" : "admission", "data-cluster": cluster },
        admissionText(cluster, c));
    });
    if (pool.spill > 0) lines.push(el("div", { class: "admission" }, `spilling ${fmtNumber(pool.spill * 100)} % to its fallback`));
    const text = lines.map((l) => l.textContent).join("\n");
    if (box.dataset.text !== text) { box.dataset.text = text; box.replaceChildren(...lines); }
  }

  function colorOf(addresses, address) {
    return PALETTE[addresses.indexOf(address) % PALETTE.length];
  }

  // ---- the chart --------------------------------------------------------------------------------
  function chartGeometry(width, pool) {
    const t1 = state.latestAt ?? 0;
    const first = state.points.length ? state.points[0].at : t1;
    const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, t1 - first));
    let yMax = state.config ? state.config.weights.max_weight : 100;
    for (const p of state.points) {
      for (const w of Object.values(p.weights[pool] || {})) yMax = Math.max(yMax, w);
    }
    const x = (t) => PAD.l + ((t - (t1 - span)) / span) * (width - PAD.l - PAD.r);
    const y = (w) => PAD.t + (1 - w / yMax) * (CHART_H - PAD.t - PAD.b);
    return { t0: t1 - span, t1, span, yMax, x, y, width };
  }

  function typicalGap() {
    const gaps = [];
    for (let i = 1; i < state.points.length; i++) gaps.push(state.points[i].at - state.points[i - 1].at);
    gaps.sort((a, b) => a - b);
    return gaps.length ? gaps[Math.floor(gaps.length / 2)] : Infinity;
  }

  function isStale(point, pool, address) {
    return ((point.stale || {})[pool] || []).includes(address);
  }

  function seriesPath(pool, address, g) {
    // A step line (a weight holds until the next tick), broken where the endpoint is missing
    // or the history has a hole (a restart). `band` covers the stretches it was stale.
    const maxGap = 3 * typicalGap();
    let d = "";
    let band = "";
    let last = null;
    for (const p of state.points) {
      const w = (p.weights[pool] || {})[address];
      if (w === undefined) { last = null; continue; }
      const px = g.x(p.at).toFixed(1);
      const py = g.y(w).toFixed(1);
      const joined = last !== null && p.at - last.at <= maxGap;
      d += joined ? `H${px}V${py}` : `M${px},${py}`;
      if (joined && last.stale) band += `M${g.x(last.at).toFixed(1)},${g.y(last.w).toFixed(1)}H${px}V${py}`;
      last = { at: p.at, w, stale: isStale(p, pool, address) };
    }
    return { d, band, last };
  }

  function drawAxes(root, g) {
    for (let i = 0; i <= 4; i++) {
      const w = (g.yMax * i) / 4;
      const yy = g.y(w);
      root.append(svg("line", { class: "grid-line", x1: PAD.l, x2: g.width - PAD.r, y1: yy, y2: yy }));
      root.append(svg("text", { class: "axis", x: PAD.l - 6, y: yy + 4, "text-anchor": "end" }, fmtNumber(Math.round(w))));
    }
    const step = [10, 15, 30, 60, 120, 300].find((s) => g.span / s <= 6) || 600;
    for (let back = 0; back <= g.span + 1e-9; back += step) {
      const xx = g.x(g.t1 - back);
      root.append(svg("line", { class: "grid-line vertical", x1: xx, x2: xx, y1: PAD.t, y2: CHART_H - PAD.b }));
      const anchor = back ? "middle" : "end";
      root.append(svg("text", { class: "axis", x: xx, y: CHART_H - 5, "text-anchor": anchor }, fmtRelative(-back)));
    }
  }

  function renderChart(box, pool, addresses, endpoints) {
    const width = Math.max(box.clientWidth || 0, 320);
    const g = chartGeometry(width, pool);
    const root = svg("svg", { class: "chart", width, height: CHART_H, viewBox: `0 0 ${width} ${CHART_H}`,
      role: "img", "aria-label": `weights of pool ${pool} over time`, "data-pool": pool,
      "data-latest-at": state.latestAt ?? "" });
    drawAxes(root, g);
    const series = addresses.map((address) => ({ address, ...seriesPath(pool, address, g) }))
      .filter((s) => s.last);
    for (const s of series.filter((s) => s.band)) {
      root.append(svg("path", { class: "stale-band", d: s.band, "data-endpoint": s.address }));
    }
    for (const { address, d, last } of series) {
      const color = colorOf(addresses, address);
      const path = svg("path", { class: "series", d, stroke: color, "data-endpoint": address, "data-weight": last.w });
      path.append(svg("title", {}, `${address}: ${last.w}`));
      root.append(path, svg("circle", { class: endpoints[address].stale ? "last-point stale" : "last-point",
        cx: g.x(last.at), cy: g.y(last.w), r: 3.5, fill: color, "data-endpoint": address, "data-weight": last.w }));
    }
    if (series.some((s) => s.band)) {
      root.append(svg("text", { class: "axis band-note", x: g.width - PAD.r, y: PAD.t - 1, "text-anchor": "end" },
        "red band: stale telemetry"));
    }
    if (!state.points.length) {
      root.append(svg("text", { class: "axis", x: width / 2, y: CHART_H / 2, "text-anchor": "middle" }, "no history yet"));
    }
    root.append(svg("line", { class: "cursor", x1: 0, x2: 0, y1: PAD.t, y2: CHART_H - PAD.b, visibility: "hidden" }));
    const tip = box.querySelector(".tip") || el("div", { class: "tip", hidden: "" });
    box.replaceChildren(root, tip);
    box._geometry = { g, addresses };
    if (state.hover.has(pool)) showHover(box, pool, state.hover.get(pool));
  }

  function attachHover(section, pool) {
    const box = section.querySelector(".chart-box");
    box.addEventListener("mousemove", (event) => {
      const offset = event.clientX - box.getBoundingClientRect().left;
      state.hover.set(pool, offset);
      showHover(box, pool, offset);
    });
    box.addEventListener("mouseleave", () => {
      state.hover.delete(pool);
      box.querySelector(".tip").hidden = true;
      box.querySelector(".cursor")?.setAttribute("visibility", "hidden");
    });
  }

  function showHover(box, pool, offset) {
    if (!box._geometry) return;
    const { g, addresses } = box._geometry;
    const visible = state.points.filter((p) => p.at >= g.t0);
    if (!visible.length) return;
    const point = visible.reduce((best, p) => (Math.abs(g.x(p.at) - offset) < Math.abs(g.x(best.at) - offset) ? p : best));
    const xx = g.x(point.at);
    const cursor = box.querySelector(".cursor");
    cursor.setAttribute("x1", xx);
    cursor.setAttribute("x2", xx);
    cursor.setAttribute("visibility", "visible");
    const weights = point.weights[pool] || {};
    const rows = addresses.filter((a) => a in weights).map((a) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = colorOf(addresses, a);
      return el("div", {}, swatch, ` ${a} `, el("b", {}, String(weights[a])),
        isStale(point, pool, a) ? el("span", { class: "flag bad" }, "stale") : null);
    });
    const tip = box.querySelector(".tip");
    tip.replaceChildren(el("div", { class: "muted" }, `${fmtRelative(point.at - g.t1)} · ${fmtClock(point.at)}`), ...rows);
    tip.hidden = false;
    tip.style.left = `${Math.min(xx + 12, g.width - 200)}px`;
  }

  // ---- the legend table ----------------------------------------------------------------------------
  function trafficShare(pool, ep) {
    // Expected share of the pool's traffic, in percent: the share of its cluster's new
    // requests Envoy gives it (/v1/weights `share`: locality weight x host weight, priorities
    // and health included, computed once in weight_calculator/localities.py), times the
    // cluster's share when a canary rollout splits the pool.
    if (typeof ep.share !== "number") return null;
    const rollout = (state.rollouts || {})[pool];
    let clusterShare = 1;
    if (rollout) clusterShare = (ep.version === "canary" ? rollout.percent : 100 - rollout.percent) / 100;
    return 100 * ep.share * clusterShare;
  }

  function flagsOf(ep) {
    const flags = [];
    if (ep.stale) flags.push(["STALE", "bad"]);
    if (ep.saturated) flags.push(["SATURATED", "warn"]);
    if (ep.health && !["HEALTHY", "STALE"].includes(ep.health)) flags.push([ep.health, "warn"]);
    if (ep.drain) flags.push(["DRAIN", "info"]);
    if (ep.version && ep.version !== "stable") flags.push([ep.version.toUpperCase(), "info"]);
    return flags;
  }

  function renderLegend(tbody, pool, addresses, endpoints) {
    for (const row of tbody.querySelectorAll("tr")) {
      if (!addresses.includes(row.dataset.endpoint)) row.remove();
    }
    for (const address of addresses) {
      const row = tbody.querySelector(`tr[data-endpoint="${CSS.escape(address)}"]`) || createLegendRow(tbody, address);
      tbody.append(row);
      fillLegendRow(row, endpoints[address], trafficShare(pool, endpoints[address]),
        colorOf(addresses, address));
      fillEnvoyCell(row.querySelector(".envoy"), pool, address, endpoints[address]);
    }
  }

  function createLegendRow(tbody, address) {
    const row = el("tr", { "data-endpoint": address },
      el("td", {}, el("span", { class: "swatch" })), el("td", { class: "mono" }, address),
      el("td", { class: "num weight" }),
      el("td", { class: "locality", title: "Envoy locality (capacity tier) and its weight" }),
      el("td", { class: "num share", title: "expected share of the pool's new requests, as Envoy routes them: locality weight x host weight, priorities and health, and the canary split" }),
      el("td", { class: "num envoy", title: "what the Envoys' load reports (LRS) say they sent this endpoint: requests per second, errors per second, in flight" }),
      el("td", { class: "signals" }), el("td", { class: "flags" }), el("td", { class: "num age" }),
      el("td", { class: "reason" }));
    tbody.append(row);
    return row;
  }

  function fillLegendRow(row, ep, share, color) {
    const flags = flagsOf(ep);
    const degraded = ep.saturated || (ep.health && ep.health !== "HEALTHY");
    row.className = ep.stale ? "row-stale" : degraded ? "row-degraded" : ep.drain ? "row-drain" : "";
    row.dataset.weight = String(ep.weight);
    row.querySelector(".swatch").style.background = color;
    const weight = row.querySelector(".weight");
    weight.dataset.weight = String(ep.weight);
    setText(weight, String(ep.weight));
    setText(row.querySelector(".locality"), ep.locality ? `${ep.locality} · ${ep.locality_weight ?? 1}` : "–");
    row.querySelector(".share").dataset.share = share === null ? "" : String(share);
    setText(row.querySelector(".share"), share === null ? "–" : `${share < 10 ? share.toFixed(1) : Math.round(share)}%`);
    replaceIfChanged(row.querySelector(".signals"), Object.entries(ep.signals || {}).sort()
      .map(([k, v]) => el("span", { class: "signal" }, `${k} `, el("b", {}, fmtNumber(v)))));
    replaceIfChanged(row.querySelector(".flags"), flags.map(([text, cls]) => el("span", { class: `flag ${cls}` }, text)));
    setText(row.querySelector(".age"), ep.updated_at === null ? "never" : fmtAge(nowSeconds() - ep.updated_at));
    setText(row.querySelector(".reason"), ep.reason || "");
  }

  // What Envoy sees of one endpoint (/v1/admission: the load reports' per-endpoint counts):
  // a dead endpoint shows its errors and nothing in flight, not an idle weight.
  function fillEnvoyCell(cell, pool, address, ep) {
    const cluster = ((state.admission || {})[pool] || { clusters: {} }).clusters[ep.cluster];
    const envoy = cluster ? cluster.envoy : null;
    let text = "–";
    let mode = "none";
    if (envoy) {
      const e = (envoy.endpoints || {})[address];
      if (!e) [text, mode] = ["not routed", "idle"];
      else {
        text = `${fmtNumber(e.issued_per_s)}/s · ${e.in_progress} in flight`;
        mode = "ok";
        if (e.errors_per_s > 0) [text, mode] = [`${text} · ${fmtNumber(e.errors_per_s)}/s errors`, "errors"];
      }
    }
    cell.dataset.envoy = mode;
    cell.className = mode === "errors" ? "num envoy bad" : "num envoy";
    setText(cell, text);
  }

  function replaceIfChanged(cell, children) {
    const signature = children.map((c) => c.outerHTML).join("");
    if (cell.dataset.signature !== signature) {
      cell.replaceChildren(...children);
      cell.dataset.signature = signature;
    }
  }

  // ---- rollouts ----------------------------------------------------------------------------------
  function renderRollouts() {
    const rollouts = state.rollouts || {};
    const names = Object.keys(rollouts).sort();
    document.getElementById("rollouts-empty").hidden = names.length > 0;
    document.getElementById("rollouts").hidden = names.length === 0;
    const rows = names.flatMap((name) => [rolloutRow(name, rollouts[name]),
      rolloutCommands(name, rollouts[name].phase)]);
    replaceIfChanged(document.querySelector("#rollouts tbody"), rows);
  }

  function rolloutCommands(name, phase) {
    // A second row under the rollout's: the commands its phase accepts (none once promoted).
    const busy = state.pendingPool === name;
    return el("tr", { class: "rollout-commands", "data-commands-for": name },
      el("td", { colspan: 5, class: "commands" }, ...(PHASE_COMMANDS[phase] || []).map((action) =>
        el("button", { type: "button", "data-pool": name, "data-action": action, disabled: busy }, action))));
  }

  async function onRolloutClick(event) {
    const button = event.target.closest("button[data-action]");
    if (!button || state.pendingPool !== null) return;
    const { pool, action } = button.dataset;
    if (CONFIRM[action] && !window.confirm(CONFIRM[action](pool))) return;
    state.pendingPool = pool;
    renderRollouts();
    try {
      const result = await postJson(`/v1/rollouts/${encodeURIComponent(pool)}/${encodeURIComponent(action)}`);
      state.rollouts = { ...(state.rollouts || {}), ...(result.rollouts || {}) };
      showCommandResult(`${action} ${pool}: ${result.phase.replace("_", " ")} at ${fmtNumber(result.percent)}%`, false);
    } catch (error) {
      showCommandResult(`${action} ${pool} refused: ${error.message}`, true);
    } finally {
      state.pendingPool = null;
      renderRollouts();
    }
  }

  function showCommandResult(text, bad) {
    const node = document.getElementById("rollout-result");
    node.className = bad ? "command-result bad" : "command-result";
    node.textContent = text;
    node.hidden = false;
  }

  function rolloutRow(name, r) {
    const percent = Math.max(0, Math.min(100, Number(r.percent) || 0));
    const fill = el("div", { class: `fill phase-${r.phase}` });
    fill.style.width = `${percent}%`;
    const since = r.step_started_at ? ` · ${fmtAge(nowSeconds() - r.step_started_at)} ago` : "";
    return el("tr", { "data-pool": name, "data-percent": String(percent) },
      el("td", { class: "mono" }, name),
      el("td", {}, el("span", { class: `flag phase-${r.phase}` }, r.phase.replace("_", " "))),
      el("td", { class: "progress-cell" }, el("div", { class: "bar", role: "progressbar", "aria-valuenow": percent,
        "aria-valuemin": 0, "aria-valuemax": 100 }, fill), el("span", { class: "num" }, `${fmtNumber(percent)}%`)),
      el("td", { class: "num" }, `${r.step}${since}`),
      el("td", { class: "reason", title: r.reason || "" }, r.reason || ""));
  }

  // ---- NACKs -------------------------------------------------------------------------------------
  function renderNacks() {
    const doc = state.nacks || { total: 0, recent: [] };
    setText(document.getElementById("nack-total"), String(doc.total));
    document.getElementById("nack-total").className = doc.total ? "count bad" : "count";
    document.getElementById("nacks-empty").hidden = doc.recent.length > 0;
    document.getElementById("nacks").hidden = doc.recent.length === 0;
    const tbody = document.querySelector("#nacks tbody");
    const signature = doc.recent.map((n) => `${n.at}|${n.node}|${n.nonce}`).join(",");
    if (tbody.dataset.signature === signature) return;  // keeps opened details open
    tbody.dataset.signature = signature;
    tbody.replaceChildren(...doc.recent.slice(0, 50).flatMap(nackRows));
  }

  function nackRows(n) {
    // Two rows per NACK: who rejected what, then Envoy's message (folded; it can be long).
    const rejected = Object.entries(n.rejected || {}).map(([name, version]) => `${name}@${version.slice(0, 8)}`);
    const firstLine = (n.detail || "").split("\n")[0];
    return [
      el("tr", { class: "nack" },
        el("td", { class: "num" }, fmtClock(n.at)),
        el("td", { class: "mono", title: `${n.peer} (${n.api})` }, n.node || n.peer),
        el("td", {}, el("span", { class: "flag bad" }, n.type)),
        el("td", { class: "mono", title: "resource@version Envoy refused" }, rejected.join(", ") || "–")),
      el("tr", { class: "nack-detail" }, el("td", { colspan: 4, class: "detail" }, el("details", {},
        el("summary", {}, firstLine.length > 140 ? `${firstLine.slice(0, 140)}…` : firstLine),
        el("pre", {}, n.detail || "")))),
    ];
  }

  // ---- start -------------------------------------------------------------------------------------
  let resizeQueued = false;
  window.addEventListener("resize", () => {
    if (resizeQueued) return;
    resizeQueued = true;
    requestAnimationFrame(() => { resizeQueued = false; if (state.weights) renderPools(); });
  });
  document.querySelector("#rollouts tbody").addEventListener("click", onRolloutClick);
  loop();
})();
