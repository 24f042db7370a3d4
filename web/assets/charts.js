// Stagehand web dashboard: the charts. They draw what the server computed (values, value-axis
// ticks and labels); the only arithmetic here is layout: where labels fit, how bands stack.
"use strict";
window.StagehandCharts = (function () {
  const FONT = "11px system-ui, -apple-system, 'Segoe UI', sans-serif";
  const AXIS = { stroke: "#8a96a3", font: FONT, grid: { stroke: "#26303b" }, ticks: { stroke: "#26303b", size: 6 }, gap: 4 };
  const measurer = document.createElement("canvas").getContext("2d");
  measurer.font = FONT;
  const textWidth = (t) => measurer.measureText(String(t)).width;
  const charts = {};

  // Seconds or milliseconds along x, with as many decimals as the span needs.
  function timeFormat(unit, span) {
    const d = span >= 100 ? 0 : span >= 10 ? 1 : span >= 1 ? 2 : 3;
    return (v) => v.toFixed(d) + " " + unit;
  }
  // x: labels never overlap, because ticks are spaced by the widest label plus a margin.
  function xAxis(unit) {
    return Object.assign({}, AXIS, {
      space: (u, i, min, max) => {
        const f = timeFormat(unit, max - min);
        return Math.max(textWidth(f(min)), textWidth(f(max))) + 24;
      },
      values: (u, splits) => {
        const f = timeFormat(unit, u.scales.x.max - u.scales.x.min);
        return splits.map(f);
      },
    });
  }
  // y: the server's ticks and labels, and room for the widest label.
  function yAxis(axisOf) {
    return Object.assign({}, AXIS, {
      splits: () => axisOf().ticks,
      values: (u, splits) => splits.map((s) => {
        const a = axisOf();
        const i = a.ticks.indexOf(s);
        return i >= 0 ? a.labels[i] : "";
      }),
      size: (u, values) => Math.ceil(Math.max(30, ...(values || []).map(textWidth))) + AXIS.ticks.size + AXIS.gap + 8,
    });
  }
  function width(el) { return Math.max(220, el.clientWidth - 4); }

  function make(name, el, height, opts, series, axisOf, unit) {
    if (typeof uPlot === "undefined") return null;
    let axis = { max: 1, ticks: [0, 1], labels: ["", ""] };
    const u = new uPlot(Object.assign({
      width: width(el), height, legend: { show: true },
      scales: { x: { time: false }, y: { range: () => [0, axis.max] } },
      axes: [xAxis(unit), yAxis(() => axis)],
      series: [{ label: unit === "s" ? "t" : "t (ms)" }].concat(series),
    }, opts), series.concat([0]).map(() => []), el);
    charts[name] = { u, el, height, setAxis: (a) => { axis = a; } };
    return charts[name];
  }
  window.addEventListener("resize", () => {
    for (const c of Object.values(charts)) c.u.setSize({ width: width(c.el), height: c.height });
  });

  function vram(el) {
    const line = (o) => Object.assign({ points: { show: false } }, o);
    return make("vram", el, 220, {}, [
      line({ label: "allocated", stroke: "#3fb950", fill: "rgba(63,185,80,0.12)", width: 2 }),
      line({ label: "reserved", stroke: "#58a6ff", width: 1 }),
      line({ label: "high watermark", stroke: "#f85149", dash: [6, 4], width: 1.5 }),
      line({ label: "low watermark", stroke: "#e0b341", dash: [6, 4], width: 1.5 }),
      line({ label: "budget", stroke: "#8a96a3", dash: [2, 4], width: 1 }),
    ], null, "s");
  }
  function throughput(el) {
    const dot = (color) => ({ stroke: color, width: 0, spanGaps: true, points: { show: true, size: 5, fill: color, stroke: color }, paths: () => null });
    return make("throughput", el, 160, {}, [Object.assign({ label: "H2D" }, dot("#58a6ff")), Object.assign({ label: "D2H" }, dot("#f78166"))], null, "s");
  }
  const OWNER_COLORS = ["#3fb950", "#58a6ff", "#bc8cff", "#e0b341", "#6e7681"];
  function owners(el, parts) {
    // Drawn top band first: each series is the top of its band, so later (lower) ones paint over.
    // The table below the chart is its legend.
    const series = parts.map((p, i) => ({ label: p.label, stroke: OWNER_COLORS[i], fill: OWNER_COLORS[i] + "cc", width: 1, points: { show: false } })).reverse();
    return make("owners", el, 190, { legend: { show: false } }, series, null, "ms");
  }

  // Stacked bars of each recent step's time, drawn as boxes; labels are placed so they never
  // overlap (every k-th step, k from the widest label).
  const PART_COLORS = ["#3fb950", "#58a6ff", "#f78166", "#e0b341", "#bc8cff", "#f0883e", "#6e7681"];
  function steps(el, t) {
    el.textContent = "";
    if (!t.steps.length) {
      const note = document.createElement("div");
      note.className = "empty-note";
      note.dataset.testid = "time-empty";
      note.textContent = "No step has said where its time went yet: a run reports it (step_time) at the end of each step.";
      el.appendChild(note);
      return;
    }
    const plot = document.createElement("div"); plot.className = "plot";
    const yl = document.createElement("div"); yl.className = "ylabels";
    const xl = document.createElement("div"); xl.className = "xlabels";
    t.axis.ticks.forEach((v, i) => {
      const pct = 100 * v / t.axis.max;
      const g = document.createElement("div"); g.className = "gridline"; g.style.bottom = pct + "%"; plot.appendChild(g);
      const l = document.createElement("span"); l.textContent = t.axis.labels[i]; l.style.bottom = pct + "%"; yl.appendChild(l);
    });
    const n = t.steps.length;
    const every = Math.max(1, Math.ceil((textWidth(String(t.steps[n - 1] || 0)) + 10) / Math.max(1, (el.clientWidth - 60) / Math.max(1, n))));
    t.steps.forEach((step, i) => {
      const bar = document.createElement("div"); bar.className = "tbar"; bar.dataset.step = String(step);
      bar.title = `step ${step}: ${t.step_ms[i]} ms\n` + t.parts.map((p, k) => `${p.label}: ${t.ms[k][i]} ms`).join("\n");
      t.parts.forEach((p, k) => {
        const seg = document.createElement("div");
        seg.style.height = (100 * t.ms[k][i] / t.axis.max) + "%";
        seg.style.background = PART_COLORS[k];
        bar.appendChild(seg);
      });
      plot.appendChild(bar);
      const x = document.createElement("span"); x.className = "xl";
      x.textContent = (n - 1 - i) % every === 0 ? String(step) : "";
      xl.appendChild(x);
    });
    const body = document.createElement("div"); body.className = "body";
    body.appendChild(yl); body.appendChild(plot);
    el.appendChild(body); el.appendChild(xl);
  }

  // For the browser test: every axis of every chart, with its labels' places and widths.
  function axes() {
    const out = [];
    for (const [name, c] of Object.entries(charts)) {
      c.u.axes.forEach((a, i) => {
        const splits = a._splits || [], values = a._values || [];
        const scale = i === 0 ? "x" : "y";
        out.push({
          chart: name, axis: i, size: a._size, tick: AXIS.ticks.size, gap: AXIS.gap,
          labels: values.map((v) => (v == null ? "" : String(v))),
          positions: splits.map((s) => c.u.valToPos(s, scale)),
          widths: values.map((v) => (v == null ? 0 : textWidth(v))),
        });
      });
    }
    return out;
  }

  return { vram, throughput, owners, steps, charts, axes, PART_COLORS, OWNER_COLORS };
})();
