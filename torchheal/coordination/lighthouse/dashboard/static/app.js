/* torchheal lighthouse dashboard: polls api/status every second and renders it.
 *
 * Everything shown comes from the one status document (see docs/dashboard.md). Text from the
 * network (replica ids, reason strings) is only ever set as textContent, never parsed as HTML.
 * Rows are kept by key and updated in place, so a button never disappears under the pointer.
 */
"use strict";
(function () {
  const POLL_MS = 1000;
  const MAX_POINTS = 3600;
  const PALETTE = ["#e8590c", "#2b8a3e", "#862e9c", "#1971c2", "#c2255c", "#5c940d",
                   "#0c8599", "#e67700", "#5f3dc4", "#a61e4d", "#087f5b", "#364fc7"];

  // Exposed for people poking in the console (and for the browser test).
  const state = {
    status: null,
    data: { t: [], job: [], groups: {}, size: [] },
    lastT: 0,
    windowS: 900,
    charts: { rate: null, size: null },
    chartKey: "",
    colors: {},
    confirming: null,
    failedPolls: 0,
    polls: 0,
  };
  window.torchhealDashboard = state;

  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  // ---------------------------------------------------------------------------------------
  // Formatting

  function fmtDuration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.floor(s / 60) + " m " + String(Math.round(s % 60)).padStart(2, "0") + " s";
    return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " m";
  }
  function fmtTime(t) {
    if (!t) return "–";
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  }
  function fmtRate(r) {
    if (r === null || r === undefined) return "–";
    return r < 10 ? r.toFixed(2) : r.toFixed(1);
  }
  const fmtNum = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString());
  const since = (t0, t1) => (t0 && t1 ? "+" + fmtDuration(Math.max(0, t1 - t0)) : "–");
  function shortReplica(rid, group) {
    const rest = rid.startsWith(group + ":") ? rid.slice(group.length + 1) : rid;
    return rest.length > 12 ? rest.slice(0, 8) + "…" : rest;
  }
  function color(group) {
    if (!(group in state.colors)) {
      state.colors[group] = PALETTE[Object.keys(state.colors).length % PALETTE.length];
    }
    return state.colors[group];
  }
  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }
  function pill(text, kind, title) {
    return el("span", { class: "pill " + kind, text, title });
  }
  function groupCell(group, title) {
    return el("span", { class: "group", title }, el("span", { class: "swatch", style: null }), group);
  }
  function paintSwatches(root) {
    for (const cell of root.querySelectorAll(".group")) {
      const sw = cell.querySelector(".swatch");
      if (sw) sw.style.background = color(cell.lastChild.textContent);
    }
  }

  // Set a cell's content only when it changed; ``content`` is text or a node.
  function setCell(cell, content, sig) {
    const key = sig !== undefined ? sig : typeof content === "string" ? "t:" + content : null;
    if (key !== null && cell.dataset.sig === key) return;
    if (typeof content === "string") cell.textContent = content;
    else cell.replaceChildren(content);
    if (key !== null) cell.dataset.sig = key;
  }

  // Keep one row per key: reuse, add, remove, and order rows like ``items``.
  function syncRows(tbody, items, keyOf, build, update) {
    const old = new Map([...tbody.rows].map((r) => [r.dataset.key, r]));
    let prev = null;
    for (const item of items) {
      const key = keyOf(item);
      let row = old.get(key);
      if (row) old.delete(key);
      else { row = build(item); row.dataset.key = key; row.classList.add("new"); }
      update(row, item);
      const want = prev ? prev.nextSibling : tbody.firstChild;
      if (want !== row) tbody.insertBefore(row, want);
      prev = row;
    }
    for (const row of old.values()) row.remove();
  }

  // ---------------------------------------------------------------------------------------
  // Header, reason, banners

  function renderHeader(s) {
    $("lh-address").textContent = s.address || "";
    const q = s.quorum;
    $("kpi-quorum").textContent = q.id ? "#" + q.id : "–";
    $("kpi-quorum-age").textContent = q.age_s !== null ? "age " + fmtDuration(q.age_s) : "";
    $("kpi-step").textContent = fmtNum(s.job.step);
    $("kpi-rate").textContent = fmtRate(s.job.rate);
    $("kpi-members").textContent = String(q.size);
    $("kpi-min").textContent = "min " + s.config.min_replicas;
    $("kpi-heartbeating").textContent = String(s.heartbeating);
    const down = s.failures.filter((f) => f.state !== "healed").length;
    $("kpi-failures").textContent = String(s.failures.length);
    $("kpi-lost").textContent = down ? down + " not healed" : "";
    $("kpi-failures").parentElement.classList.toggle("bad", down > 0);
    $("kpi-members").parentElement.classList.toggle("bad", q.size < s.config.min_replicas);
    $("token-box").hidden = !s.token_required;
    const c = s.config;
    $("config").textContent = `min_replicas ${c.min_replicas} · join timeout ${c.join_timeout_ms} ms · ` +
      `quorum tick ${c.quorum_tick_ms} ms · heartbeat timeout ${c.heartbeat_timeout_ms} ms`;
    document.title = `torchheal · q${q.id || "–"} · ${q.size} groups · step ${s.job.step ?? "–"}`;
  }

  function renderReason(s) {
    // The reason is what a decision taken right now would say: between the rounds of a healthy
    // job "not ready, 0 participants". next_quorum says what is true then (the groups train).
    const box = $("reason");
    $("reason-text").textContent = s.next_quorum || s.reason || "–";
    const found = /^(Fast quorum found|Valid quorum found)/.test(s.reason || "");
    const hb = s.config.heartbeat_timeout_ms / 1000;
    const age = s.quorum.age_s;
    // Before the first quorum the job is starting, not stuck.
    const level = found || (age !== null && age < hb) ? "" : age === null || age < 2 * hb ? " waiting" : " stuck";
    box.className = "reason" + level;
    const waitedS = s.reason_since ? s.now - s.reason_since : 0;
    $("reason-since").textContent = level && waitedS > 2 ? "for " + fmtDuration(waitedS) : "";
  }

  function renderBanners(s) {
    const banners = [];
    if (typeof uPlot === "undefined" || (s && s.missing_assets.length)) {
      const missing = s && s.missing_assets.length ? s.missing_assets.join(", ") : "vendor/uPlot.iife.min.js";
      banners.push(`Charts unavailable: dashboard asset(s) missing (${missing}). This torchheal was ` +
        "installed without its dashboard assets; in a source checkout run 'bash scripts/setup_env.sh' " +
        "(or 'make setup') and restart the lighthouse. Everything else on this page works.");
    }
    const box = $("banners");
    const sig = banners.join("\n");
    if (box.dataset.sig === sig) return;
    box.dataset.sig = sig;
    box.replaceChildren(...banners.map((text) => el("div", { class: "banner", text })));
  }

  // ---------------------------------------------------------------------------------------
  // Tables

  function renderMembers(s) {
    const tbody = $("members").tBodies[0];
    const timeout = s.config.heartbeat_timeout_ms / 1000;
    syncRows(tbody, s.quorum.members, (m) => m.replica_id, (m) => {
      const row = el("tr", { "data-replica-id": m.replica_id, "data-group": m.group });
      for (let i = 0; i < 11; i++) row.append(el("td"));
      for (const i of [3, 4, 5, 6, 7, 8, 9]) row.cells[i].className = "num";
      row.cells[1].className = "mono";
      row.cells[10].className = "mono dim";
      const btn = el("button", { class: "kill", text: "kill", title: "ask this group's manager to exit" });
      btn.addEventListener("click", () => onKill(btn, row.dataset.replicaId));
      row.append(el("td", {}, btn));
      return row;
    }, (row, m) => {
      const silent = m.heartbeat_age_s === null || m.heartbeat_age_s >= timeout;
      row.classList.toggle("healing", m.healing);
      row.classList.toggle("silent", silent);
      setCell(row.cells[0], groupCell(m.group, m.replica_id), "g:" + m.group);
      setCell(row.cells[1], shortReplica(m.replica_id, m.group));
      row.cells[1].title = m.replica_id;
      const st = silent ? ["silent", "bad"] : m.healing ? ["healing", "warn"] : ["training", "ok"];
      setCell(row.cells[2], pill(st[0], st[1]), "p:" + st[0]);
      setCell(row.cells[3], fmtNum(m.step));
      setCell(row.cells[4], m.behind ? fmtNum(m.behind) : "");
      setCell(row.cells[5], fmtRate(m.rate));
      setCell(row.cells[6], m.heartbeat_age_s === null ? "never" : fmtDuration(m.heartbeat_age_s) + " ago");
      setCell(row.cells[7], m.commit_failures ? String(m.commit_failures) : "0");
      row.cells[7].classList.toggle("minus", m.commit_failures > 0);
      setCell(row.cells[8], String(m.world_size));
      // The guard's last verified step (–: no report: the guard off, or a reference group).
      const ver = m.verified === null ? "–" : m.verified < 0 ? "not yet" : fmtNum(m.verified);
      setCell(row.cells[9], m.mismatches ? `${ver} · ${m.mismatches} mismatch(es)` : ver);
      row.cells[9].classList.toggle("minus", m.mismatches > 0);
      setCell(row.cells[10], m.address);
    });
    paintSwatches(tbody);
    $("members-empty").hidden = s.quorum.members.length > 0;
    $("members-count").textContent = s.quorum.members.length ? `(${s.quorum.members.length})` : "";
  }

  const OUTSIDE = {
    waiting: ["waiting to join", "warn"],
    idle: ["heartbeating, not asking", "idle"],
    lost: ["silent", "bad"],
  };

  function renderOutside(s) {
    const tbody = $("outside").tBodies[0];
    syncRows(tbody, s.outside, (o) => o.replica_id, (o) => {
      const row = el("tr", { "data-replica-id": o.replica_id, "data-group": o.group });
      for (let i = 0; i < 4; i++) row.append(el("td"));
      row.cells[3].className = "num";
      return row;
    }, (row, o) => {
      setCell(row.cells[0], groupCell(o.group, o.replica_id), "g:" + o.group);
      setCell(row.cells[1], shortReplica(o.replica_id, o.group));
      row.cells[1].title = o.replica_id;
      const [text, kind] = OUTSIDE[o.state] || [o.state, "idle"];
      setCell(row.cells[2], pill(text, kind), "p:" + o.state);
      row.dataset.state = o.state;
      setCell(row.cells[3], o.heartbeat_age_s === null ? "never" : fmtDuration(o.heartbeat_age_s) + " ago");
    });
    paintSwatches(tbody);
    $("outside-empty").hidden = s.outside.length > 0;
    $("outside-count").textContent = s.outside.length ? `(${s.outside.length})` : "";
  }

  const FAILURE_STATE = {
    noticed: ["noticed", "bad"], down: ["down", "bad"], returning: ["returning", "warn"],
    healing: ["healing", "warn"], healed: ["healed", "ok"],
  };

  function renderFailures(s) {
    const tbody = $("failures").tBodies[0];
    const scale = Math.max(1, ...s.failures.map((f) => f.down_s || 0));
    syncRows(tbody, s.failures, (f) => f.replica_id + "@" + f.noticed, () => {
      const row = el("tr");
      for (let i = 0; i < 10; i++) row.append(el("td"));
      for (const i of [3, 4, 5, 6, 7, 8]) row.cells[i].className = "num";
      row.cells[9].append(el("div", { class: "tbar" }));
      return row;
    }, (row, f) => {
      row.dataset.group = f.group;
      row.dataset.state = f.state;
      setCell(row.cells[0], groupCell(f.group, f.replica_id), "g:" + f.group);
      setCell(row.cells[1], f.cause);
      setCell(row.cells[2], fmtTime(f.noticed));
      setCell(row.cells[3], since(f.noticed, f.went_on));
      setCell(row.cells[4], since(f.noticed, f.returned));
      setCell(row.cells[5], since(f.noticed, f.rejoined));
      const [text, kind] = FAILURE_STATE[f.state] || [f.state, "idle"];
      setCell(row.cells[6], f.healed ? el("span", { text: since(f.noticed, f.healed) }) : pill(text, kind),
        f.healed ? "h:" + f.healed : "p:" + f.state);
      setCell(row.cells[7], f.lost_s === null ? "–" : fmtDuration(f.lost_s));
      setCell(row.cells[8], fmtDuration(f.down_s));
      const end = f.healed || s.now;
      const segs = [
        ["seg-stall", f.noticed, f.went_on || end, "job stalled"],
        ["seg-down", f.went_on || end, f.rejoined || end, "group down"],
        ["seg-heal", f.rejoined || end, end, "healing"],
      ];
      const bar = row.cells[9].firstChild;
      bar.replaceChildren(...segs.map(([cls, a, b, title]) => {
        const span = el("span", { class: cls, title: `${title}: ${fmtDuration(b - a)}` });
        span.style.width = (100 * Math.max(0, b - a)) / scale + "%";
        return span;
      }));
    });
    paintSwatches(tbody);
    $("failures-empty").hidden = s.failures.length > 0;
  }

  function renderHistory(s) {
    const tbody = $("history").tBodies[0];
    syncRows(tbody, s.changes.slice(0, 200), (c) => c.t + ":" + c.quorum_id, (c) => {
      const row = el("tr");
      for (let i = 0; i < 6; i++) row.append(el("td"));
      row.cells[1].className = "num"; row.cells[2].className = "num"; row.cells[5].className = "num";
      row.cells[4].className = "reason-cell";
      row.cells[0].textContent = fmtTime(c.t);
      row.cells[1].textContent = "#" + c.quorum_id;
      row.cells[2].textContent = String(c.size);
      const lines = [];
      for (const j of c.joined) lines.push(el("div", { class: "change-line plus", title: j.replica_id, text: `+ ${j.group} — ${j.why}` }));
      for (const l of c.left) lines.push(el("div", { class: "change-line minus", title: l.replica_id, text: `− ${l.group} — ${l.why}` }));
      for (const f of c.commit_failures) lines.push(el("div", { class: "change-line", text: `${f.replica_id}: ${f.commit_failures} failed commit(s)` }));
      if (!lines.length) lines.push(el("div", { class: "dim", text: "new quorum id" }));
      row.cells[3].append(...lines);
      row.cells[4].textContent = c.reason;
      row.cells[5].textContent = c.round_s < 1 ? (c.round_s * 1000).toFixed(1) + " ms" : fmtDuration(c.round_s);
      return row;
    }, () => {});
    $("history-empty").hidden = s.changes.length > 0;
  }

  // ---------------------------------------------------------------------------------------
  // Charts (uPlot)

  function appendSeries(series) {
    if (!series || !series.t.length) return;
    const d = state.data;
    const n0 = d.t.length;
    for (const g of Object.keys(series.groups)) {
      if (!(g in d.groups)) d.groups[g] = new Array(n0).fill(null);
    }
    d.t.push(...series.t);
    d.job.push(...series.job);
    d.size.push(...series.quorum_size);
    for (const g of Object.keys(d.groups)) {
      const add = series.groups[g] || new Array(series.t.length).fill(null);
      d.groups[g].push(...add);
    }
    const extra = d.t.length - MAX_POINTS;
    if (extra > 0) {
      d.t.splice(0, extra); d.job.splice(0, extra); d.size.splice(0, extra);
      for (const g of Object.keys(d.groups)) d.groups[g].splice(0, extra);
    }
    state.lastT = d.t[d.t.length - 1];
  }

  function windowed() {
    const d = state.data;
    const from = (state.status ? state.status.now : Date.now() / 1000) - state.windowS;
    let i = 0;
    while (i < d.t.length && d.t[i] < from) i++;
    const groups = Object.keys(d.groups).sort();
    return {
      groups,
      rate: [d.t.slice(i), d.job.slice(i), ...groups.map((g) => d.groups[g].slice(i))],
      size: [d.t.slice(i), d.size.slice(i)],
    };
  }

  function chartWidth(node) {
    return Math.max(300, node.clientWidth || 800);
  }

  function buildCharts(groups, view) {
    for (const c of Object.values(state.charts)) if (c) c.destroy();
    const accent = cssVar("--accent") || "#2f6fde";
    const axis = { stroke: cssVar("--dim"), grid: { stroke: cssVar("--line"), width: 1 }, ticks: { stroke: cssVar("--line") } };
    // Buckets are whole seconds: no sub-second ticks on the time axis.
    const timeAxis = Object.assign({ incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200], space: 60 }, axis);
    const rateEl = $("rate-chart");
    const sizeEl = $("size-chart");
    rateEl.replaceChildren();
    sizeEl.replaceChildren();
    const rateOpts = {
      width: chartWidth(rateEl), height: 240,
      cursor: { sync: { key: "torchheal" } },
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, (max || 0) * 1.15)] } },
      axes: [timeAxis, Object.assign({ label: "steps/s", size: 50 }, axis)],
      series: [
        {},
        { label: "job", stroke: accent, width: 3, value: (u, v) => fmtRate(v) },
        // Groups of a synchronous job commit together, so their lines lie on the job's: they
        // are drawn thin and translucent over it and part from it only around failures.
        ...groups.map((g) => ({ label: g, stroke: color(g), width: 1.5, alpha: 0.7, value: (u, v) => fmtRate(v) })),
      ],
      plugins: [window.torchhealMarks(() => state.status)],
    };
    const sizeOpts = {
      width: chartWidth(sizeEl), height: 130,
      cursor: { sync: { key: "torchheal" } },
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(2, (max || 0) + 1)] } },
      axes: [timeAxis, Object.assign({ label: "groups", size: 50, incrs: [1, 2, 5, 10, 20, 50, 100] }, axis)],
      series: [{}, { label: "quorum size", stroke: accent, width: 2, fill: "rgba(47,111,222,0.10)", paths: uPlot.paths.stepped({ align: 1 }) }],
    };
    state.charts.rate = new uPlot(rateOpts, view.rate, rateEl);
    state.charts.size = new uPlot(sizeOpts, view.size, sizeEl);
    state.chartKey = groups.join("\u0000");
  }

  function renderCharts() {
    if (typeof uPlot === "undefined") return;
    const view = windowed();
    const key = view.groups.join("\u0000");
    if (!state.charts.rate || key !== state.chartKey) buildCharts(view.groups, view);
    else {
      state.charts.rate.setData(view.rate);
      state.charts.size.setData(view.size);
    }
  }

  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(state.charts)) {
      if (chart) chart.setSize({ width: chartWidth($(name + "-chart")), height: chart.height });
    }
  });

  for (const btn of $("windows").querySelectorAll("button")) {
    btn.addEventListener("click", () => {
      state.windowS = Number(btn.dataset.window);
      for (const b of $("windows").querySelectorAll("button")) b.classList.toggle("on", b === btn);
      renderCharts();
    });
  }

  // ---------------------------------------------------------------------------------------
  // Actions

  function toast(text, kind) {
    const node = el("div", { class: "toast " + kind, text, role: "status" });
    $("toasts").append(node);
    setTimeout(() => node.remove(), 8000);
  }

  const tokenInput = $("token");
  tokenInput.value = sessionStorage.getItem("torchheal-token") || "";
  tokenInput.addEventListener("input", () => sessionStorage.setItem("torchheal-token", tokenInput.value));

  async function onKill(btn, replicaId) {
    // Two clicks: the first arms the button for a few seconds, the second kills.
    if (state.confirming !== replicaId) {
      state.confirming = replicaId;
      btn.textContent = "confirm kill";
      btn.classList.add("confirm");
      setTimeout(() => {
        if (state.confirming === replicaId && !btn.disabled) {
          state.confirming = null;
          btn.textContent = "kill";
          btn.classList.remove("confirm");
        }
      }, 4000);
      return;
    }
    state.confirming = null;
    btn.disabled = true;
    btn.textContent = "killing…";
    const headers = {};
    const token = tokenInput.value.trim();
    if (token) headers.Authorization = "Bearer " + token;
    try {
      const r = await fetch("api/replicas/" + encodeURIComponent(replicaId) + "/kill", { method: "POST", headers });
      const body = await r.json().catch(() => ({}));
      if (r.ok) toast(body.message || "asked " + replicaId + " to exit", "ok");
      else toast(body.error || "kill failed: HTTP " + r.status, "bad");
    } catch (e) {
      toast("kill failed: " + e, "bad");
    } finally {
      btn.disabled = false;
      btn.textContent = "kill";
      btn.classList.remove("confirm");
    }
  }

  // ---------------------------------------------------------------------------------------
  // Polling

  function setLive(ok, text) {
    const live = $("live");
    live.className = "live " + (ok ? "ok" : "bad");
    $("live-text").textContent = text;
    document.body.classList.toggle("stale", !ok);
  }

  async function poll() {
    try {
      const r = await fetch("api/status?series_since=" + state.lastT, { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const s = await r.json();
      state.status = s;
      state.polls++;
      state.failedPolls = 0;
      appendSeries(s.series);
      renderHeader(s);
      renderReason(s);
      renderBanners(s);
      renderMembers(s);
      renderOutside(s);
      renderFailures(s);
      renderHistory(s);
      renderCharts();
      setLive(true, "live · " + fmtTime(s.now));
    } catch (e) {
      state.failedPolls++;
      setLive(false, "lighthouse unreachable, retrying (" + e.message + ")");
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  renderBanners(null);
  poll();
})();
