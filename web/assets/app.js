// Stagehand web dashboard: subscribes to /api/stream (snapshot first, then events), keeps the
// snapshot up to date with a port of the reducer for what it shows, and renders it.
"use strict";
(function () {
  const STATES = ["unloaded", "host_staged", "prefetching", "gpu_ready", "evicting", "gpu_freeing"];
  const VRAM_HISTORY = 600, PHASE_SPANS = 96, RECENT_TRANSFERS = 64, RECENT_DENIALS = 32, LOG_LINES = 200;
  const $ = (id) => document.getElementById(id);
  const q = (tid) => document.querySelector(`[data-testid="${tid}"]`);
  let snap = null, mode = "live", received = 0, dirty = true, es = null;
  const log = [];

  function mib(b) {
    if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + " GiB";
    if (b >= 1 << 20) return (b / (1 << 20)).toFixed(1) + " MiB";
    if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + " KiB";
    return b + " B";
  }
  function set(tid, value, text) {
    const el = q(tid);
    if (!el) return;
    if (value !== undefined && el.dataset.value !== undefined) el.dataset.value = String(value);
    const t = text !== undefined ? text : String(value);
    if (el.textContent !== t) el.textContent = t;
  }
  function push(arr, item, cap) { if (arr.length >= cap) arr.shift(); arr.push(item); }
  function bump(map, key) { map[key] = (map[key] || 0) + 1; }

  // ---- the reducer (a port of Snapshot::apply for the fields shown here) -------------------
  function pool(name) {
    const k = name === "weights" ? "weight_pool" : "activation_pool";
    if (!snap[k]) snap[k] = { pinned: false, classes: [], pageable_fallbacks: 0, pageable_bytes: 0, total_wait_ms: 0 };
    return snap[k];
  }
  function cls(name, i) {
    const p = pool(name);
    while (p.classes.length <= i) p.classes.push({ slab_bytes: 0, slabs: 0, in_use: 0, peak_in_use: 0, hits: 0, exhausted: 0 });
    return p.classes[i];
  }
  function apply(e) {
    const s = snap;
    s.last_seq = Math.max(s.last_seq, e.seq);
    s.events_applied += 1;
    s.t_ns = Math.max(s.t_ns, e.t_ns);
    if (e.step > s.step) s.step = e.step;
    bump(s.event_counts, e.kind);
    const w = s.weights, a = s.activations, c = s.conductor;
    switch (e.kind) {
      case "run_started":
        s.run = { run_id: e.run_id, wall_clock_unix_ms: e.wall_clock_unix_ms, device: e.device, model: e.model, versions: e.versions, config: e.config };
        s.ended = false; break;
      case "run_ended": s.ended = true; break;
      case "phase_changed":
        if (e.from !== "idle" && e.from !== e.to)
          push(s.phase_spans, { step: e.step, phase: e.from, start_ns: s.phase_started_ns, end_ns: e.t_ns }, PHASE_SPANS);
        s.phase = e.to; s.phase_started_ns = e.t_ns; s.step = e.step; break;
      case "block_registered":
        while (s.blocks.length <= e.block) s.blocks.push({ id: s.blocks.length, state: "unloaded", name: "", bytes: 0 });
        s.blocks[e.block] = { id: e.block, name: e.name, bytes: e.bytes, state: "unloaded", refcount: 0, protected: false, loads: 0, evictions: 0 };
        break;
      case "residency": {
        const b = s.blocks[e.block];
        if (b) { b.state = e.to; b.refcount = e.refcount; if (e.to === "gpu_ready") b.loads += 1; }
        break;
      }
      case "protection": { const b = s.blocks[e.block]; if (b) b.protected = e.protected; break; }
      case "prefetch_hit": w.prefetch_hits += 1; break;
      case "prefetch_miss": w.prefetch_misses += 1; w.stall_time_ms += e.stall_ms; break;
      case "eviction": w.evictions += 1; { const b = s.blocks[e.block]; if (b) b.evictions += 1; } break;
      case "transfer_issued": s.transfers[e.dir].inflight += 1; break;
      case "transfer_completed": {
        const d = s.transfers[e.dir];
        d.inflight = Math.max(0, d.inflight - 1); d.count += 1; d.bytes += e.bytes; d.busy_ms += e.duration_ms;
        if (e.duration_ms > 0) d.last_gbps = e.bytes / (e.duration_ms * 1e6);
        push(s.transfers.recent, { seq: e.seq, t_ns: e.t_ns, id: e.id, dir: e.dir, owner: e.owner, bytes: e.bytes, duration_ms: e.duration_ms }, RECENT_TRANSFERS);
        break;
      }
      case "pool_configured": {
        const p = pool(e.pool);
        p.pinned = e.pinned; p.pageable_fallbacks = 0; p.pageable_bytes = 0; p.total_wait_ms = 0;
        p.classes = e.classes.map((k) => ({ slab_bytes: k.slab_bytes, slabs: k.slabs, in_use: 0, peak_in_use: 0, hits: 0, exhausted: 0 }));
        break;
      }
      case "slab_acquired": { const k = cls(e.pool, e.class); k.in_use += 1; k.hits += 1; k.peak_in_use = Math.max(k.peak_in_use, k.in_use); break; }
      case "slab_released": { const k = cls(e.pool, e.class); k.in_use = Math.max(0, k.in_use - 1); break; }
      case "pool_exhausted": cls(e.pool, e.class).exhausted += 1; break;
      case "pack":
        a.saved += 1;
        if (e.decision === "kept") a.kept += 1;
        else if (e.decision === "spilled") a.spilled += 1, a.spill_bytes += e.bytes;
        else if (e.decision === "weight_handle") a.weight_handles += 1;
        else if (e.decision === "duplicate") a.duplicates += 1;
        break;
      case "restored":
        a.restored += 1; a.restore_bytes += e.bytes;
        if (e.predicted) a.predicted += 1;
        if (e.stall_ms > 0) a.stall_count += 1, a.stall_time_ms += e.stall_ms;
        break;
      case "spilling_toggled": a.spilling = e.on; break;
      case "reservation":
        if (e.outcome === "granted") c.grants += 1;
        else if (e.outcome === "partial") c.partials += 1;
        else if (e.outcome === "denied") c.denials += 1;
        else c.ceilings += 1;
        if (e.outcome === "granted" || e.outcome === "partial") c.active_reservations += 1, c.active_bytes += e.granted_bytes;
        if (e.reason) {
          bump(c.denials_by_reason, e.reason);
          push(c.recent_denials, { seq: e.seq, step: e.step, phase: e.phase, owner: e.owner, what: e.mode + " reservation", reason: e.reason }, RECENT_DENIALS);
        }
        break;
      case "reservation_released":
        c.active_reservations = Math.max(0, c.active_reservations - 1); c.active_bytes = Math.max(0, c.active_bytes - e.bytes); break;
      case "slot_granted": c.slot_grants += 1; if (e.dir === "h2d") c.h2d_inflight = e.inflight; else c.d2h_inflight = e.inflight; break;
      case "slot_released": if (e.dir === "h2d") c.h2d_inflight = e.inflight; else c.d2h_inflight = e.inflight; break;
      case "slot_denied":
        c.slot_denials += 1; bump(c.denials_by_reason, e.reason);
        push(c.recent_denials, { seq: e.seq, step: e.step, phase: e.phase, owner: e.owner, what: e.dir + " slot" + (e.speculative ? " (speculative)" : ""), reason: e.reason }, RECENT_DENIALS);
        break;
      case "hints_changed": c.hints = e.hints; c.hints_rule = e.rule; c.hint_changes += 1; break;
      case "vram_sample": {
        const r = { t_ns: e.t_ns, allocated_bytes: e.allocated_bytes, reserved_bytes: e.reserved_bytes, peak_allocated_bytes: e.peak_allocated_bytes };
        s.vram = r; push(s.vram_history, r, VRAM_HISTORY); break;
      }
      case "limits_set":
        s.limits = s.limits || {};
        s.limits[e.owner] = { budget_bytes: e.budget_bytes, high_watermark_bytes: e.high_watermark_bytes ?? null, low_watermark_bytes: e.low_watermark_bytes ?? null };
        break;
      case "events_dropped": s.dropped_events = Math.max(s.dropped_events, e.total); break;
      default: break;
    }
  }

  // ---- log --------------------------------------------------------------------------------
  const SKIP = new Set(["kind", "v", "seq", "t_ns", "step", "phase"]);
  function logLine(e) {
    const rest = Object.keys(e).filter((k) => !SKIP.has(k)).map((k) => {
      const v = e[k];
      return k + "=" + (typeof v === "object" ? JSON.stringify(v) : v);
    }).join(" ");
    push(log, { seq: e.seq, kind: e.kind, where: "s" + e.step + " " + e.phase, rest, warn: e.kind === "warning" || e.kind === "events_dropped" || e.kind === "slot_denied" || (e.kind === "reservation" && e.outcome === "denied") }, LOG_LINES);
  }

  // ---- charts -----------------------------------------------------------------------------
  let vramPlot = null, tputPlot = null;
  function chartWidth(el) { return Math.max(200, el.clientWidth - 4); }
  function makeCharts() {
    if (typeof uPlot === "undefined") return;
    const axes = [{ stroke: "#8a96a3", grid: { stroke: "#26303b" }, ticks: { stroke: "#26303b" } },
                  { stroke: "#8a96a3", grid: { stroke: "#26303b" }, ticks: { stroke: "#26303b" }, values: (u, v) => v.map((x) => (x / 1048576).toFixed(0) + " MiB"), size: 70 }];
    const ve = $("vram-chart");
    vramPlot = new uPlot({ width: chartWidth(ve), height: 220, legend: { show: true }, scales: { x: { time: false } },
      axes: [Object.assign({}, axes[0], { values: (u, v) => v.map((x) => x.toFixed(2) + " s") }), axes[1]],
      series: [{ label: "t" },
        { label: "allocated", stroke: "#3fb950", fill: "rgba(63,185,80,0.12)", width: 2 },
        { label: "reserved", stroke: "#58a6ff", width: 1 },
        { label: "high watermark", stroke: "#f85149", dash: [6, 4], width: 1.5 },
        { label: "low watermark", stroke: "#e0b341", dash: [6, 4], width: 1.5 },
        { label: "budget", stroke: "#8a96a3", dash: [2, 4], width: 1 }] }, [[], [], [], [], [], []], ve);
    const te = $("tput-chart");
    const dot = (color) => ({ stroke: color, width: 0, spanGaps: true, points: { show: true, size: 5, fill: color, stroke: color }, paths: () => null });
    tputPlot = new uPlot({ width: chartWidth(te), height: 150, legend: { show: true }, scales: { x: { time: false } },
      axes: [Object.assign({}, axes[0], { values: (u, v) => v.map((x) => x.toFixed(2) + " s") }), Object.assign({}, axes[1], { values: (u, v) => v.map((x) => (x / 1e9).toFixed(1) + " GB/s") })],
      series: [{ label: "t" }, Object.assign({ label: "H2D" }, dot("#58a6ff")), Object.assign({ label: "D2H" }, dot("#f78166"))] },
      [[], [], []], te);
    window.addEventListener("resize", () => {
      vramPlot.setSize({ width: chartWidth(ve), height: 220 });
      tputPlot.setSize({ width: chartWidth(te), height: 150 });
    });
  }
  function drawThroughput() {
    if (!tputPlot || !snap) return;
    const rec = snap.transfers.recent || [];
    const x = [], h = [], d = [];
    for (const r of rec) {
      if (!(r.duration_ms > 0)) continue;
      x.push(r.t_ns / 1e9);
      const gbps = r.bytes / (r.duration_ms * 1e6) * 1e9;
      h.push(r.dir === "h2d" ? gbps : null); d.push(r.dir === "d2h" ? gbps : null);
    }
    tputPlot.setData([x, h, d]);
  }

  // ---- render -----------------------------------------------------------------------------
  function render() {
    if (!snap || !dirty) return;
    dirty = false;
    const s = snap;
    set("events-applied", s.events_applied, String(s.events_applied));
    set("last-seq", s.last_seq);
    set("events-received", received);
    set("run-ended", s.ended);
    set("step", s.step);
    const ph = q("phase"); ph.textContent = s.phase; ph.className = "phase-chip ph-" + s.phase;
    if (s.run) set("run-model", undefined, `${s.run.model} on ${s.run.device.name}${s.ended ? " (ended)" : ""}`);
    const dr = $("dropped");
    dr.dataset.value = String(s.dropped_events);
    dr.classList.toggle("hidden", !s.dropped_events);
    dr.textContent = s.dropped_events ? `${s.dropped_events} events were dropped: the bus queue was full, so these figures miss some events.` : "";

    const v = s.vram;
    const lim = s.limits || {};
    const budget = (lim.device || lim.conductor || {}).budget_bytes ?? (s.run ? s.run.device.total_bytes : 0);
    const high = (lim.activations || {}).high_watermark_bytes ?? 0;
    const low = (lim.activations || {}).low_watermark_bytes ?? 0;
    if (v) {
      set("vram-allocated", v.allocated_bytes, mib(v.allocated_bytes));
      set("vram-reserved", v.reserved_bytes, mib(v.reserved_bytes));
      set("vram-peak", v.peak_allocated_bytes, mib(v.peak_allocated_bytes));
      set("vram-high", high, mib(high));
      set("vram-low", low, mib(low));
      set("vram-budget", budget, mib(budget));
    }
    if (vramPlot) {
      const h = s.vram_history;
      vramPlot.setData([h.map((r) => r.t_ns / 1e9), h.map((r) => r.allocated_bytes), h.map((r) => r.reserved_bytes),
        h.map(() => high), h.map(() => low), h.map(() => budget)]);
    }

    // Residency grid and legend.
    const grid = $("grid");
    while (grid.children.length < s.blocks.length) { const d = document.createElement("div"); d.className = "cell"; grid.appendChild(d); }
    while (grid.children.length > s.blocks.length) grid.removeChild(grid.lastChild);
    const counts = {}; STATES.forEach((x) => (counts[x] = 0));
    s.blocks.forEach((b, i) => {
      counts[b.state] = (counts[b.state] || 0) + 1;
      const d = grid.children[i];
      d.style.background = `var(--${b.state})`;
      d.textContent = String(b.id);
      d.title = `${b.name}: ${b.state}, ${mib(b.bytes)}, loads ${b.loads}`;
      d.dataset.state = b.state;
      d.classList.toggle("protected", !!b.protected);
    });
    $("legend").innerHTML = STATES.map((x) => `<span><i style="background:var(--${x})"></i>${x.replace("_", " ")} <b data-testid="residency-${x}" data-value="${counts[x]}">${counts[x]}</b></span>`).join("");
    const w = s.weights;
    set("prefetch-hits", w.prefetch_hits); set("prefetch-misses", w.prefetch_misses); set("evictions", w.evictions);
    const n = w.prefetch_hits + w.prefetch_misses;
    set("hit-rate", undefined, n ? (100 * w.prefetch_hits / n).toFixed(1) + "%" : "-");

    // Pools.
    const parts = [];
    for (const [name, p] of [["weights", s.weight_pool], ["activations", s.activation_pool]]) {
      if (!p) continue;
      parts.push(`<div class="pool"><h3>${name}${p.pinned ? " (pinned)" : ""}</h3>` + p.classes.map((k, i) => {
        const pct = k.slabs ? (100 * k.in_use / k.slabs) : 0;
        return `<div class="cls"><span>${mib(k.slab_bytes)}</span><div class="bar"><div style="width:${pct}%"></div></div>` +
          `<span data-testid="pool-${name}-${i}" data-value="${k.in_use}">${k.in_use}/${k.slabs}</span></div>`;
      }).join("") + "</div>");
    }
    const poolsHtml = parts.join("") || `<div class="muted">no pools configured</div>`;
    if ($("pools").innerHTML !== poolsHtml) $("pools").innerHTML = poolsHtml;

    for (const d of ["h2d", "d2h"]) {
      const t = s.transfers[d];
      set(d + "-inflight", t.inflight); set(d + "-count", t.count); set(d + "-bytes", t.bytes, mib(t.bytes));
      set(d + "-gbps", undefined, t.busy_ms > 0 ? (t.bytes / (t.busy_ms * 1e6)).toFixed(2) + " GB/s" : "-");
      set(d + "-last", undefined, t.last_gbps ? t.last_gbps.toFixed(2) + " GB/s" : "-");
    }
    const c = s.conductor;
    set("slot-grants", c.slot_grants); set("slot-denials", c.slot_denials);
    set("cond-h2d", c.h2d_inflight); set("cond-d2h", c.d2h_inflight);

    const a = s.activations;
    set("act-saved", a.saved); set("act-kept", a.kept); set("act-spilled", a.spilled);
    set("act-restored", a.restored); set("act-predicted", a.predicted);
    set("act-spill-bytes", a.spill_bytes, mib(a.spill_bytes)); set("act-restore-bytes", a.restore_bytes, mib(a.restore_bytes));
    set("act-stall", undefined, a.stall_time_ms.toFixed(1) + " ms"); set("act-spilling", undefined, a.spilling ? "on" : "off");

    set("cond-grants", c.grants); set("cond-partials", c.partials); set("cond-denials", c.denials);
    set("cond-active", c.active_reservations); set("cond-active-bytes", c.active_bytes, mib(c.active_bytes));
    const h = c.hints || {};
    const hs = [h.max_inflight_h2d != null ? `H2D <= ${h.max_inflight_h2d}` : null, h.max_inflight_d2h != null ? `D2H <= ${h.max_inflight_d2h}` : null,
      h.prefetch_window_cap != null ? `window <= ${h.prefetch_window_cap}` : null, h.suppress_speculative ? "no speculative" : null].filter(Boolean);
    set("hints", undefined, (hs.length ? hs.join(", ") : "none") + (c.hints_rule ? ` (rule ${c.hints_rule})` : ""));
    // The last steps' phases, laid end to end (idle time between steps left out).
    const lastSteps = [...new Set(s.phase_spans.map((p) => p.step))].slice(-3);
    const spans = s.phase_spans.filter((p) => lastSteps.includes(p.step));
    const tl = spans.map((p, i) => {
      const ms = (p.end_ns - p.start_ns) / 1e6;
      const sep = i > 0 && spans[i - 1].step !== p.step ? " sep" : "";
      return `<div class="ph-${p.phase}${sep}" style="flex-grow:${Math.max(ms * 1000, 1)}" title="step ${p.step} ${p.phase}: ${ms.toFixed(2)} ms"></div>`;
    }).join("");
    if ($("timeline").innerHTML !== tl) $("timeline").innerHTML = tl;
    set("phase-legend", undefined, lastSteps.length ? `steps ${lastSteps[0]}-${lastSteps[lastSteps.length - 1]}: ` +
      ["forward", "backward", "optimizer"].map((ph) => {
        const ms = spans.filter((p) => p.phase === ph).reduce((acc, p) => acc + (p.end_ns - p.start_ns) / 1e6, 0);
        return `${ph} ${ms.toFixed(1)} ms`;
      }).join(", ") : "no completed phases yet");
    $("denials").innerHTML = c.recent_denials.slice(-6).reverse().map((d) =>
      `<tr><td>step ${d.step}</td><td>${d.phase}</td><td>${d.owner}</td><td>${d.what}</td><td class="reason">${d.reason}</td></tr>`).join("");

    drawThroughput();
    const lg = $("log");
    const atBottom = lg.scrollTop + lg.clientHeight >= lg.scrollHeight - 4;
    lg.innerHTML = log.map((l) => `<div class="${l.warn ? "warn" : ""}"><span class="s">#${l.seq} ${l.where}</span> <span class="k">${l.kind}</span> ${escapeHtml(l.rest)}</div>`).join("");
    if (atBottom) lg.scrollTop = lg.scrollHeight;
  }
  function escapeHtml(t) { return t.replace(/[&<>"]/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[ch])); }

  // ---- connection -------------------------------------------------------------------------
  function badge(state, text) { const b = $("conn"); b.className = "badge " + state; b.textContent = text; b.dataset.state = state; }
  function connect() {
    badge("connecting", "connecting");
    es = new EventSource("/api/stream");
    es.addEventListener("snapshot", (m) => {
      const msg = JSON.parse(m.data);
      snap = msg.snapshot;
      for (const k of ["event_counts", "denials_by_reason"]) if (!snap[k] && k === "event_counts") snap[k] = {};
      dirty = true;
      badge(mode === "replay" ? "replay" : "live", mode === "replay" ? "replaying" : "live");
    });
    es.addEventListener("event", (m) => {
      if (!snap) return;
      const e = JSON.parse(m.data).event;
      apply(e); logLine(e); received += 1; dirty = true;
    });
    es.addEventListener("lagged", (m) => {
      const missed = JSON.parse(m.data).missed;
      push(log, { seq: "-", kind: "lagged", where: "", rest: `this page fell behind and missed ${missed} events; resynced`, warn: true }, LOG_LINES);
      dirty = true;
    });
    es.onerror = () => badge("disconnected", "disconnected, retrying");
  }

  // ---- replay controls --------------------------------------------------------------------
  async function control(path, body) {
    const r = await fetch("/api/replay/" + path, { method: "POST", headers: { "content-type": "application/json" }, body: body ? JSON.stringify(body) : undefined });
    const st = await r.json();
    if (r.ok) showReplay(st);
  }
  let seeking = false;
  function showReplay(st) {
    $("rp-play").innerHTML = st.paused ? "&#9654;" : "&#10074;&#10074;";
    $("rp-play").dataset.paused = String(st.paused);
    if (!seeking) $("rp-seek").value = st.total ? Math.round(1000 * st.position / st.total) : 0;
    set("replay-status", undefined, `${st.paused ? "paused" : "playing"} ${st.speed}x, event ${st.position}/${st.total}, step ${st.step}`);
  }
  async function pollReplay() {
    try { const r = await fetch("/api/replay/status"); if (r.ok) showReplay(await r.json()); } catch (_) { /* shown by the badge */ }
  }
  async function init() {
    try {
      const run = await (await fetch("/api/run")).json();
      mode = run.mode || "live";
    } catch (_) { mode = "live"; }
    if (mode === "replay") {
      $("replay").classList.remove("hidden");
      $("rp-play").onclick = () => control($("rp-play").dataset.paused === "false" ? "pause" : "play");
      $("rp-back").onclick = () => control("step", { steps: -1 });
      $("rp-fwd").onclick = () => control("step", { steps: 1 });
      $("rp-speed").onchange = (ev) => control("speed", { speed: Number(ev.target.value) });
      $("rp-seek").oninput = () => { seeking = true; };
      $("rp-seek").onchange = (ev) => { seeking = false; control("seek", { fraction: Number(ev.target.value) / 1000 }); };
      setInterval(pollReplay, 500); pollReplay();
    }
    makeCharts();
    connect();
    setInterval(render, 100);
  }
  window.__stagehand = { snapshot: () => snap, received: () => received };
  init();
})();
