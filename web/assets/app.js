// Stagehand web dashboard: renders the view the server computes (/api/view/stream: the view,
// then a fresh one at most every 200 ms, each with the log lines since the last). There is no
// reducer here: every figure is the server's, so the page cannot disagree with the API.
//
// The token (when the server has one) comes in the address's fragment (#token=...), which the
// browser never sends; the page keeps it in this origin's session storage (no other port can
// read it) and sends it in the Authorization header itself. It is never a cookie: a cookie
// would go to every other server on this host.
"use strict";
(function () {
  const C = window.StagehandCharts;
  const LOG_LINES = 200;
  const SPEEDS = [0.0625, 0.25, 0.5, 1, 2, 4, 8, 16, 64, 256, 1024];
  const $ = (id) => document.getElementById(id);
  const q = (tid) => document.querySelector(`[data-testid="${tid}"]`);
  let view = null, received = 0, runId = null, connected = false, needsToken = false;
  let log = [];
  let charts = {};

  // ---- the token ------------------------------------------------------------------------------------
  const TOKEN_KEY = "stagehand-token";
  function takeToken() {
    const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
    if (m) {
      try { sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1])); } catch (_) { /* storage off: kept below */ }
      // Out of the address bar and the history.
      history.replaceState(null, "", location.pathname + location.search);
      return decodeURIComponent(m[1]);
    }
    try { return sessionStorage.getItem(TOKEN_KEY); } catch (_) { return null; }
  }
  const token = takeToken();
  // Request options with the token, when there is one.
  function authed(init) {
    const o = Object.assign({ cache: "no-store" }, init || {});
    o.headers = Object.assign({}, o.headers || {});
    if (token) o.headers.authorization = "Bearer " + token;
    return o;
  }

  function bytes(b) {
    if (b == null) return "-";
    if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + " GiB";
    if (b >= 1 << 20) return (b / (1 << 20)).toFixed(1) + " MiB";
    if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + " KiB";
    return b + " B";
  }
  function ms(x) { return x == null ? "-" : (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2)) + " ms"; }
  // Sets a figure: data-value keeps the server's number (what tests compare), the text shows it.
  function set(tid, value, text) {
    const el = q(tid);
    if (!el) return;
    if (el.dataset.value !== undefined) el.dataset.value = value == null ? "" : String(value);
    const t = text !== undefined ? text : String(value);
    if (el.textContent !== t) el.textContent = t;
  }
  function h(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("data-")) e.setAttribute(k, v);
      else if (k === "style") e.setAttribute("style", v);
      else e[k] = v;
    }
    for (const k of kids) if (k != null) e.appendChild(typeof k === "string" ? document.createTextNode(k) : k);
    return e;
  }
  function fill(el, nodes) { el.replaceChildren(...nodes); }

  // ---- header, banners, badge ----------------------------------------------------------------
  function badge(state, text) {
    const b = $("conn");
    if (b.dataset.state === state && b.textContent === text) return;
    b.className = "badge " + state; b.textContent = text; b.dataset.state = state;
  }
  function showBadge() {
    if (needsToken) return badge("disconnected", "this server needs its token: open the address it printed (ending in #token=...)");
    if (!connected) return badge("disconnected", "disconnected, retrying");
    if (!view) return badge("connecting", "connecting");
    if (view.header.ended) return badge("ended", "run ended");
    if (view.replay) return view.replay.paused ? badge("paused", "replay paused") : badge("replaying", "replaying");
    badge("live", "live");
  }
  function header(v) {
    const hd = v.header;
    set("events-applied", hd.events_applied); set("last-seq", hd.last_seq);
    set("step", hd.step);
    const ph = q("phase"); ph.textContent = hd.phase; ph.className = "phase-chip ph-" + hd.phase;
    set("run-ended", hd.ended);
    set("views-received", received);
    const run = hd.model ? `${hd.model} on ${hd.device}${hd.host_simulated ? " (VRAM simulated on the host)" : ""}` : "waiting for a run";
    set("run-model", undefined, run);
    // On the host device a "copy" is a memcpy in host memory: its GB/s say nothing about PCIe.
    $("pcie-sub").textContent = hd.host_simulated
      ? "copies, and GB/s of the recent ones (simulated: host-memory copies on the host device, not PCIe)"
      : "copies, and GB/s of the recent ones";
    const dr = $("dropped");
    dr.dataset.value = String(hd.dropped_events);
    dr.classList.toggle("hidden", !hd.dropped_events);
    dr.textContent = hd.dropped_events ? `${hd.dropped_events} events were dropped: the bus queue was full, so these figures miss some events.` : "";
    const lost = $("lost");
    lost.dataset.value = String(hd.telemetry_lost);
    lost.classList.toggle("hidden", !hd.telemetry_lost);
    lost.textContent = hd.telemetry_lost ? `${hd.telemetry_lost} events could not be written to the telemetry file.` : "";
    showBadge();
    if (hd.run_id !== runId) { runId = hd.run_id; loadRun(); }
  }

  // ---- insight ---------------------------------------------------------------------------------
  function findings(list, note) {
    const el = $("findings");
    el.dataset.value = String(list.length);
    if (!list.length) return fill(el, [h("li", { class: "none", "data-testid": "findings-note" }, note)]);
    fill(el, list.map((f) => h("li", { class: "finding " + f.severity, "data-testid": "finding", "data-id": f.id, "data-severity": f.severity },
      h("span", { class: "sev" }, f.severity), h("span", { class: "msg" }, f.message),
      f.knob ? h("span", { class: "knob" }, "knob: ", h("b", {}, f.knob)) : null)));
  }
  function stepTime(t) {
    C.steps($("time-chart"), t);
    const n = t.newest;
    set("time-step", n ? n.step : null, n ? String(n.step) : "-");
    set("time-total", n ? n.step_ms : null, n ? ms(n.step_ms) : "-");
    fill($("time-parts"), t.parts.map((p, k) => {
      const f = n ? n.parts[k] : null;
      return h("tr", {}, h("td", {}, h("i", { class: "sw", style: `background:${C.PART_COLORS[k]}` })), h("td", {}, p.label),
        h("td", { "data-testid": "time-" + p.key, "data-value": f ? String(f.ms) : "" }, f ? ms(f.ms) : "-"),
        h("td", { class: "muted" }, f ? f.share.toFixed(1) + "%" : ""));
    }));
    const o = n && n.host_optimizer;
    set("host-steps", o ? o.during_backward : null,
      o ? `host optimizer: ${o.during_backward} of ${o.stepped} blocks given to it while backward ran` : "");
  }
  function owners(o) {
    set("owners-step", o.step, o.step == null ? "-" : String(o.step));
    $("owners-empty").classList.toggle("hidden", o.step != null);
    $("owners-chart").classList.toggle("hidden", o.step == null);
    // Made once there is something to draw, when the chart has its width.
    if (!charts.owners && o.step != null) charts.owners = C.owners($("owners-chart"), o.owners);
    if (charts.owners) {
      const tops = [];
      let acc = o.t_ms.map(() => 0);
      o.bytes.forEach((b) => { acc = acc.map((a, i) => a + b[i]); tops.push(acc); });
      charts.owners.setAxis(o.axis);
      charts.owners.u.setData([o.t_ms].concat(tops.slice().reverse()));
    }
    const p = o.at_peak;
    set("peak-step", p ? p.step : null, p ? String(p.step) : "-");
    set("peak-allocated", p ? p.allocated_bytes : null, p ? bytes(p.allocated_bytes) : "-");
    fill($("peak-parts"), o.owners.map((w, k) => {
      const f = p ? p.parts[k] : null;
      return h("tr", {}, h("td", {}, h("i", { class: "sw", style: `background:${C.OWNER_COLORS[k]}` })), h("td", {}, w.label),
        h("td", { "data-testid": "peak-" + w.key, "data-value": f ? String(f.bytes) : "" }, f ? bytes(f.bytes) : "-"));
    }));
  }

  // ---- state panels ------------------------------------------------------------------------------
  function vram(v) {
    set("vram-allocated", v.allocated_bytes ?? 0, bytes(v.allocated_bytes));
    set("vram-reserved", v.reserved_bytes ?? 0, bytes(v.reserved_bytes));
    set("vram-peak", v.peak_allocated_bytes ?? 0, bytes(v.peak_allocated_bytes));
    set("vram-last-step", v.last_step ?? "", v.last_step == null ? "-" : String(v.last_step));
    set("vram-step-peak", v.last_step_peak_bytes ?? "", bytes(v.last_step_peak_bytes));
    const moved = $("vram-moved");
    moved.classList.toggle("hidden", !v.watermarks_moved);
    moved.textContent = v.watermarks_moved ? "spill watermarks moved " + v.watermarks_moved : "";
    set("vram-high", v.high_watermark_bytes ?? 0, bytes(v.high_watermark_bytes));
    set("vram-low", v.low_watermark_bytes ?? 0, bytes(v.low_watermark_bytes));
    set("vram-budget", v.budget_bytes ?? 0, bytes(v.budget_bytes));
    if (charts.vram) {
      const line = (x) => v.t_s.map(() => x ?? null);
      charts.vram.setAxis(v.axis);
      charts.vram.u.setData([v.t_s, v.allocated, v.reserved, line(v.high_watermark_bytes), line(v.low_watermark_bytes), line(v.budget_bytes)]);
    }
  }
  const STATES = ["unloaded", "host_staged", "prefetching", "gpu_ready", "evicting", "gpu_freeing"];
  function residency(r) {
    const grid = $("grid");
    while (grid.children.length < r.blocks.length) grid.appendChild(h("div", { class: "cell" }));
    while (grid.children.length > r.blocks.length) grid.removeChild(grid.lastChild);
    r.blocks.forEach((b, i) => {
      const d = grid.children[i];
      d.style.background = `var(--${b.state})`;
      d.textContent = String(b.id);
      d.title = `${b.name}: ${b.state}, ${bytes(b.bytes)}, loads ${b.loads}, evictions ${b.evictions}`;
      d.dataset.state = b.state;
      d.classList.toggle("protected", !!b.protected);
    });
    $("more-blocks").textContent = r.more_blocks ? `and ${r.more_blocks} more blocks` : "";
    fill($("legend"), r.counts.map((c) => h("span", {}, h("i", { style: `background:var(--${c.state})` }), c.state.replace("_", " ") + " ",
      h("b", { "data-testid": "residency-" + c.state, "data-value": String(c.blocks) }, String(c.blocks)))));
    set("prefetch-hits", r.prefetch_hits); set("prefetch-misses", r.prefetch_misses); set("evictions", r.evictions);
    set("hit-rate", undefined, r.hit_rate == null ? "-" : r.hit_rate.toFixed(1) + "%");
  }
  function pools(list) {
    if (!list.length) return fill($("pools"), [h("div", { class: "muted" }, "no pools configured")]);
    fill($("pools"), list.map((p) => p.note ? h("div", { class: "pool" }, h("h3", {}, p.name),
      h("div", { class: "note", "data-testid": `pool-${p.name}-note` }, p.note)) : h("div", { class: "pool" }, h("h3", {}, p.name + (p.pinned ? " (pinned)" : " (pageable)")),
      ...p.classes.map((k, i) => h("div", { class: "cls" }, h("span", {}, bytes(k.slab_bytes)),
        h("div", { class: "bar" }, h("div", { style: `width:${k.slabs ? 100 * k.in_use / k.slabs : 0}%` })),
        h("span", { "data-testid": `pool-${p.name}-${i}`, "data-value": String(k.in_use) }, `${k.in_use}/${k.slabs}`))))));
  }
  function transfers(t) {
    for (const d of ["h2d", "d2h"]) {
      const x = t[d];
      set(d + "-inflight", x.inflight); set(d + "-count", x.count); set(d + "-bytes", x.bytes, bytes(x.bytes));
      set(d + "-gbps", undefined, x.mean_gbps == null ? "-" : x.mean_gbps.toFixed(2) + " GB/s");
      set(d + "-last", undefined, x.last_gbps == null ? "-" : x.last_gbps.toFixed(2) + " GB/s");
    }
    set("slot-grants", t.slot_grants); set("slot-denials", t.slot_denials);
    set("cond-h2d", t.conductor_h2d_inflight); set("cond-d2h", t.conductor_d2h_inflight);
    if (charts.throughput) {
      charts.throughput.setAxis(t.axis);
      charts.throughput.u.setData([t.t_s, t.h2d_gbps, t.d2h_gbps]);
    }
  }
  function activations(a) {
    set("act-saved", a.saved); set("act-kept", a.kept); set("act-spilled", a.spilled);
    set("act-restored", a.restored); set("act-predicted", a.predicted);
    set("act-spill-bytes", a.spill_bytes, bytes(a.spill_bytes)); set("act-restore-bytes", a.restore_bytes, bytes(a.restore_bytes));
    set("act-recomputed", a.recomputed); set("act-recompute-bytes", a.recompute_bytes, bytes(a.recompute_bytes));
    set("act-stall", a.stall_ms, ms(a.stall_ms)); set("act-spilling", undefined, a.spilling ? "on" : "off");
  }
  function conductor(c) {
    set("cond-grants", c.grants); set("cond-partials", c.partials); set("cond-denials", c.denials);
    set("cond-active", c.active_reservations); set("cond-active-bytes", c.active_bytes, bytes(c.active_bytes));
    set("hints", undefined, c.hints);
    const spans = c.timeline;
    fill($("timeline"), spans.map((p, i) => h("div", {
      class: `ph-${p.phase}` + (i > 0 && spans[i - 1].step !== p.step ? " sep" : ""),
      style: `flex-grow:${Math.max(p.ms * 1000, 1)}`, title: `step ${p.step} ${p.phase}: ${ms(p.ms)}` })));
    const stepsShown = [...new Set(spans.map((p) => p.step))];
    set("phase-legend", undefined, stepsShown.length ? `steps ${stepsShown[0]}-${stepsShown[stepsShown.length - 1]}: ` +
      ["forward", "backward", "optimizer"].map((ph) => `${ph} ${ms(spans.filter((p) => p.phase === ph).reduce((s, p) => s + p.ms, 0))}`).join(", ")
      : "no completed phases yet");
    // Every reason with what it means and whether it is bad, then the latest refusals.
    fill($("reasons"), c.denial_reasons.map((r) => h("div", { class: r.concern, "data-testid": "denial-reason", "data-reason": r.reason, "data-value": String(r.count) },
      h("b", {}, `${r.reason} \u00d7${r.count}`), ": " + r.meaning + " ", h("span", { class: "verdict" }, "(" + r.verdict + ")"))));
    fill($("denials"), c.recent_denials.map((d) => h("tr", {}, h("td", {}, "step " + d.step), h("td", {}, d.phase), h("td", {}, d.owner),
      h("td", {}, d.what), h("td", { class: "reason " + d.concern }, d.reason))));
  }

  // ---- a data-parallel run's GPUs --------------------------------------------------------------
  function gpus(list) {
    $("gpus-card").classList.toggle("hidden", !list.length);
    if (!list.length) return;
    $("gpus-first").textContent = String(list[0].device);
    fill($("gpus-rows"), list.map((g) => h("tr", { "data-testid": "gpu", "data-device": String(g.device) },
      h("td", {}, "GPU " + g.device), h("td", { "data-testid": "gpu-step", "data-value": String(g.step) }, String(g.step)),
      h("td", {}, h("span", { class: "phase-chip ph-" + g.phase }, g.phase)),
      h("td", {}, g.loss == null ? "-" : g.loss.toFixed(4)),
      h("td", {}, ms(g.step_ms)), h("td", {}, ms(g.compute_ms)), h("td", {}, ms(g.h2d_wait_ms)), h("td", {}, ms(g.optimizer_ms)),
      h("td", { "data-testid": "gpu-collective-ms", "data-value": g.collective_ms == null ? "" : String(g.collective_ms) }, ms(g.collective_ms)),
      h("td", { "data-testid": "gpu-collective-bytes", "data-value": String(g.collective_bytes) }, bytes(g.collective_bytes)),
      h("td", { "data-testid": "gpu-host-steps", "data-value": String(g.host_steps_during_backward) },
        g.host_steps ? `${g.host_steps_during_backward} of ${g.host_steps}` : "-"),
      h("td", {}, bytes(g.h2d_bytes)), h("td", {}, bytes(g.d2h_bytes)),
      h("td", {}, bytes(g.allocated_bytes)), h("td", {}, bytes(g.peak_bytes)), h("td", {}, bytes(g.budget_bytes)))));
  }

  // ---- the run's own description (/api/run), nested config included -------------------------------
  function tree(value) {
    if (value === null || typeof value !== "object") return h("span", { class: "val" }, JSON.stringify(value));
    const entries = Array.isArray(value) ? value.map((v, i) => [String(i), v]) : Object.entries(value);
    if (!entries.length) return h("span", { class: "val" }, Array.isArray(value) ? "[]" : "{}");
    return h("dl", {}, ...entries.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, tree(v))]));
  }
  async function loadRun() {
    try {
      const r = await fetch("/api/run", authed());
      if (!r.ok) return;
      const run = await r.json();
      const info = run.run;
      fill($("run-info"), info ? [h("div", {}, `run ${info.run_id}, device ${info.device.name} (${bytes(info.device.total_bytes)})`),
        h("div", { class: "muted" }, Object.entries(info.versions || {}).map(([k, v]) => `${k} ${v}`).join(", "))] : [h("div", { class: "muted" }, "no run yet")]);
      fill($("run-config"), info ? [tree(info.config)] : []);
    } catch (_) { /* the badge shows the connection */ }
  }

  // ---- log -------------------------------------------------------------------------------------------
  function takeLog(batch) {
    if (batch.reset) log = [];
    for (const l of batch.lines) {
      const last = log.length ? log[log.length - 1] : null;
      if (last && l.i <= last.i) continue;
      if (last && l.i > last.i + 1) log.push({ gap: l.i - last.i - 1, i: l.i - 1 });
      log.push(l);
    }
    if (log.length > LOG_LINES) log = log.slice(log.length - LOG_LINES);
    const lg = $("log");
    const atBottom = lg.scrollTop + lg.clientHeight >= lg.scrollHeight - 4;
    fill(lg, log.map((l) => l.gap
      ? h("div", { class: "gap" }, `... ${l.gap} events not shown (they came faster than the page updates) ...`)
      : h("div", { class: l.warn ? "warn" : "" }, h("span", { class: "s" }, `#${l.seq} s${l.step} ${l.phase}`), " ",
          h("span", { class: "k" }, l.kind), " ", l.text)));
    if (atBottom) lg.scrollTop = lg.scrollHeight;
  }

  // ---- replay controls ---------------------------------------------------------------------------------
  let seeking = false;
  async function control(path, body) {
    $("rp-error").textContent = "";
    try {
      const r = await fetch("/api/replay/" + path, authed({ method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body || {}) }));
      if (!r.ok) $("rp-error").textContent = (await r.json()).error || ("error " + r.status);
    } catch (e) { $("rp-error").textContent = String(e); }
  }
  function speedLabel(s) { return (s < 1 ? String(s) : String(Math.round(s * 100) / 100)) + "\u00d7"; }
  function replay(r) {
    $("replay").classList.toggle("hidden", !r);
    if (!r) return;
    $("rp-play").innerHTML = r.paused ? "&#9654;" : "&#10074;&#10074;";
    $("rp-play").dataset.paused = String(r.paused);
    if (!seeking) $("rp-seek").value = r.total ? Math.round(1000 * r.position / r.total) : 0;
    const sel = $("rp-speed");
    const speeds = SPEEDS.includes(r.speed) ? SPEEDS : SPEEDS.concat([r.speed]).sort((a, b) => a - b);
    const key = speeds.join(",");
    if (sel.dataset.key !== key) { fill(sel, speeds.map((s) => h("option", { value: String(s) }, speedLabel(s)))); sel.dataset.key = key; }
    if (document.activeElement !== sel) sel.value = String(r.speed);
    set("replay-status", undefined, `${r.paused ? "paused" : "playing"} at ${speedLabel(r.speed)}, event ${r.position}/${r.total}, ` +
      `step ${r.step}, ${r.t_s.toFixed(2)} s of ${r.end_t_s.toFixed(2)} s`);
  }
  function wireReplay() {
    $("rp-play").onclick = () => control($("rp-play").dataset.paused === "false" ? "pause" : "play");
    $("rp-back").onclick = () => control("step", { steps: -1 });
    $("rp-fwd").onclick = () => control("step", { steps: 1 });
    $("rp-speed").onchange = (ev) => control("speed", { speed: Number(ev.target.value) });
    $("rp-seek").oninput = () => { seeking = true; };
    $("rp-seek").onchange = (ev) => { seeking = false; control("seek", { fraction: Number(ev.target.value) / 1000 }); };
    $("rp-go").onclick = () => control("seek", { step: Number($("rp-step").value) });
  }

  // ---- the stream ----------------------------------------------------------------------------------------
  function render(msg) {
    view = msg.view;
    received += 1;
    header(view);
    findings(view.findings, view.findings_note);
    stepTime(view.step_time);
    owners(view.owners);
    vram(view.vram);
    residency(view.residency);
    pools(view.pools);
    transfers(view.transfers);
    activations(view.activations);
    conductor(view.conductor);
    gpus(view.gpus);
    replay(view.replay);
    takeLog(msg.log);
  }
  // Server-Sent Events over fetch (EventSource cannot send a header): blocks of "event:" and
  // "data:" lines, each ended by a blank line.
  function takeMessages(text, onMessage) {
    let at;
    while ((at = text.indexOf("\n\n")) >= 0) {
      const block = text.slice(0, at);
      text = text.slice(at + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onMessage(name, data.join("\n"));
    }
    return text;
  }
  async function streamOnce() {
    const r = await fetch("/api/view/stream", authed({ headers: { accept: "text/event-stream" } }));
    if (r.status === 401) { needsToken = true; showBadge(); return false; }
    if (!r.ok || !r.body) throw new Error("status " + r.status);
    connected = true; showBadge();
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return true;
      text = takeMessages(text + decoder.decode(value, { stream: true }), (name, data) => {
        if (name === "view") { connected = true; render(JSON.parse(data)); }
      });
    }
  }
  async function connect() {
    for (;;) {
      try {
        if (!(await streamOnce())) return;
      } catch (_) { /* retried below */ }
      connected = false; showBadge();
      await new Promise((res) => setTimeout(res, 1000));
    }
  }
  function init() {
    charts = { vram: C.vram($("vram-chart")), throughput: C.throughput($("tput-chart")) };
    wireReplay();
    connect();
    connected = true;
    showBadge();
  }
  window.__stagehand = { view: () => view, received: () => received, axes: C.axes, takeLog };
  init();
})();
