/* rankwatch report.html: draws the timelines (uPlot) and the heat map (canvas)
   from the JSON data island, and, on the collector's live page, polls for new
   content. Text only ever goes in through textContent or canvas fillText:
   nothing from the data is parsed as markup here. */
(function () {
  "use strict";

  var CULPRIT = "#c62828";
  var PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22", "#ff7f0e",
                 "#4e79a7", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2", "#edc948", "#af7aa1", "#86bcb6"];
  var NONFINITE = "#ff00ff";
  var state = { data: null, plots: [], hmMetric: 0, timer: null, failures: 0 };

  function readData() {
    var el = document.getElementById("rw-data");
    if (!el) { return null; }
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  function value(v) {
    if (v === "NaN") { return NaN; }
    if (v === "Infinity") { return Infinity; }
    if (v === "-Infinity") { return -Infinity; }
    return typeof v === "number" ? v : null;
  }

  function fmt(v, unit) {
    if (v === null || v === undefined) { return "-"; }
    if (!isFinite(v)) { return isNaN(v) ? "NaN" : (v > 0 ? "Inf" : "-Inf"); }
    if (unit === "bytes") {
      var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, x = Math.abs(v);
      while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
      return (v < 0 ? "-" : "") + x.toFixed(x >= 100 ? 0 : 1) + " " + units[i];
    }
    if (unit === "s") {
      if (Math.abs(v) < 1) { return (v * 1000).toPrecision(3) + " ms"; }
      return v.toPrecision(3) + " s";
    }
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) { return v.toExponential(2); }
    return String(Number(v.toPrecision(4)));
  }

  // -- timelines -----------------------------------------------------------------------------
  function destroyPlots() {
    state.plots.forEach(function (p) { try { p.destroy(); } catch (e) { /* already gone */ } });
    state.plots = [];
  }

  function markerHook(markers, nonfinite) {
    return function (u) {
      var ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
      ctx.save();
      var configs = 0;
      markers.forEach(function (m) {
        var x = u.valToPos(m.step, "x", true);
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) { return; }
        // A rank's training-config change (train/eval, ...): thinner, dotted, its label stacked below the verdicts'.
        var config = m.kind === "train_config", row = config ? 2 + (configs++ % 6) : 1;
        ctx.strokeStyle = m.colour || CULPRIT;
        ctx.lineWidth = (config ? 1 : 2) * devicePixelRatio;
        ctx.setLineDash(config ? [2 * devicePixelRatio, 3 * devicePixelRatio] : [6 * devicePixelRatio, 4 * devicePixelRatio]);
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
        ctx.setLineDash([]);
        ctx.fillStyle = m.colour || CULPRIT;
        ctx.font = (11 * devicePixelRatio) + "px sans-serif";
        ctx.fillText(config ? String(m.label || m.kind) + " @ " + m.step : m.kind + " @ " + m.step,
                     x + 4 * devicePixelRatio, top + 12 * row * devicePixelRatio);
      });
      ctx.fillStyle = NONFINITE;
      nonfinite.forEach(function (step) {
        var x = u.valToPos(step, "x", true);
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) { return; }
        var s = 5 * devicePixelRatio;
        ctx.beginPath(); ctx.moveTo(x - s, top); ctx.lineTo(x + s, top); ctx.lineTo(x, top + 2 * s); ctx.fill();
      });
      ctx.restore();
    };
  }

  function drawTimelines(t) {
    destroyPlots();
    if (!t || !t.metrics || typeof uPlot === "undefined") { return; }
    var steps = (t.steps || []).map(value);
    // The x axis reaches the verdicts' steps too (a hang's step has no record yet).
    var lo = steps.length ? steps[0] : 0, hi = steps.length ? steps[steps.length - 1] : 1;
    (t.markers || []).forEach(function (m) { lo = Math.min(lo, m.step); hi = Math.max(hi, m.step); });
    var xRange = function () { return [lo, hi > lo ? hi : lo + 1]; };
    var culprits = {};
    (t.culprits || []).forEach(function (r) { culprits[String(r)] = true; });
    t.metrics.forEach(function (m) {
      var fig = document.querySelector('figure.chart[data-metric="' + m.key + '"] .plot');
      if (!fig) { return; }
      fig.textContent = "";
      var data = [steps], series = [{ label: "step" }], nonfinite = {};
      var bands = [];
      if (m.bands) {
        var add = function (key, opts) {
          data.push((m.bands[key] || []).map(function (v) { var x = value(v); return isFinite(x) ? x : null; }));
          series.push(opts);
          return data.length - 1;
        };
        var hi = add("max", { label: "highest of all ranks", stroke: "#9fb3c8", width: 1 });
        var lo = add("min", { label: "lowest of all ranks", stroke: "#9fb3c8", width: 1 });
        add("median", { label: "median of all ranks", stroke: "#5b7088", width: 1, dash: [4, 4] });
        bands.push({ series: [hi, lo], fill: "rgba(120,150,190,0.18)" });
      }
      var ranks = Object.keys(m.series || {}).sort(function (a, b) { return Number(a) - Number(b); });
      ranks.forEach(function (rank, i) {
        var isCulprit = culprits[rank] === true;
        data.push((m.series[rank] || []).map(function (v, j) {
          var x = value(v);
          if (x !== null && !isFinite(x)) { nonfinite[steps[j]] = true; return null; }
          return x;
        }));
        series.push({ label: "rank " + rank + (isCulprit ? " (culprit)" : ""),
                      stroke: isCulprit ? CULPRIT : PALETTE[i % PALETTE.length],
                      width: isCulprit ? 2.5 : 1.2, spanGaps: false,
                      // A sampled series (values at a few steps) as points: lines would be fragments.
                      paths: m.sampled ? function () { return null; } : undefined,
                      points: m.sampled ? { show: true, size: isCulprit ? 7 : 5 } : { show: steps.length < 40 } });
      });
      var width = Math.max(320, fig.clientWidth || 560);
      var unit = m.unit;
      var opts = {
        width: width, height: 220, series: series, bands: bands,
        scales: { x: { time: false, range: xRange } },
        axes: [{ label: "step", size: 36, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] },
               { size: 72, values: function (u, vals) { return vals.map(function (v) { return fmt(v, unit); }); } }],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
        hooks: { draw: [markerHook(t.markers || [], Object.keys(nonfinite).map(Number))] }
      };
      series.forEach(function (s, i) {
        if (i > 0) { s.value = function (u, v) { return fmt(v, unit); }; }
      });
      state.plots.push(new uPlot(opts, data, fig));
    });
  }

  // -- heat map ------------------------------------------------------------------------------
  var STOPS = [[0, [13, 8, 135]], [0.25, [126, 3, 168]], [0.5, [204, 71, 120]], [0.75, [248, 149, 64]],
               [1, [240, 249, 33]]];  // plasma

  function colour(x) {
    x = Math.max(0, Math.min(1, x));
    for (var i = 1; i < STOPS.length; i += 1) {
      if (x <= STOPS[i][0]) {
        var a = STOPS[i - 1], b = STOPS[i], f = (x - a[0]) / (b[0] - a[0]);
        var c = [0, 1, 2].map(function (k) { return Math.round(a[1][k] + f * (b[1][k] - a[1][k])); });
        return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")";
      }
    }
    return "rgb(240,249,33)";
  }

  function rowLabel(row) {
    return row.size > 1 ? "ranks " + row.ranks[0] + "\u2013" + row.ranks[1] : "rank " + row.ranks[0];
  }

  function drawHeatmap(h, markers) {
    var canvas = document.getElementById("rw-hm");
    if (!canvas || !h || !h.metrics || !h.metrics.length || !h.rows.length) { return; }
    var metric = h.metrics[Math.min(state.hmMetric, h.metrics.length - 1)];
    var rows = h.rows, steps = h.steps, values = metric.values;
    // The colour scale spans the values after the first two steps (start-up
    // is slow on every rank): the rank that stands out is the brightest.
    var skip = steps.length > 4 ? 2 : 0, vmin = Infinity, vmax = -Infinity;
    values.forEach(function (r) {
      for (var j = skip; j < r.length; j += 1) {
        var x = value(r[j]);
        if (x !== null && isFinite(x)) { vmin = Math.min(vmin, x); vmax = Math.max(vmax, x); }
      }
    });
    if (!isFinite(vmin)) { vmin = 0; vmax = 1; }
    if (vmax <= vmin) { vmax = vmin + (Math.abs(vmin) || 1); }
    var wrap = canvas.parentElement;
    var labelW = 120, top = 22, bottom = 26;
    var avail = Math.max(300, (wrap.clientWidth || 900) - labelW - 24);
    var cellW = Math.max(3, Math.min(40, Math.floor(avail / Math.max(1, steps.length))));
    var cellH = Math.max(2, Math.min(22, Math.floor(640 / rows.length)));
    var width = Math.max(560, labelW + cellW * steps.length + 10), height = top + cellH * rows.length + bottom;
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px sans-serif";
    ctx.textBaseline = "middle";
    var every = cellH >= 10 ? 1 : Math.ceil(12 / cellH);
    rows.forEach(function (row, i) {
      var y = top + i * cellH;
      var r = values[i] || [];
      for (var j = 0; j < steps.length; j += 1) {
        var x = value(r[j]);
        ctx.fillStyle = x === null ? "#eceff3" : (!isFinite(x) ? NONFINITE : colour((x - vmin) / (vmax - vmin)));
        ctx.fillRect(labelW + j * cellW, y, cellW - (cellW > 5 ? 1 : 0), cellH - (cellH > 5 ? 1 : 0));
      }
      if (row.culprit || i % every === 0) {
        ctx.fillStyle = row.culprit ? CULPRIT : "#5d6875";
        ctx.font = (row.culprit ? "bold " : "") + "11px sans-serif";
        ctx.fillText((row.culprit ? "\u25b6 " : "") + rowLabel(row), 4, y + cellH / 2);
      }
    });
    ctx.fillStyle = "#5d6875";
    ctx.font = "11px sans-serif";
    var labelEvery = Math.ceil(40 / cellW);
    steps.forEach(function (s, j) {
      if (j % labelEvery === 0) { ctx.fillText(String(s), labelW + j * cellW, top + rows.length * cellH + 12); }
    });
    ctx.fillText("step \u2192", labelW, 10);
    ctx.fillText("colour: " + fmt(vmin, metric.unit) + " \u2026 " + fmt(vmax, metric.unit) +
                 (skip ? " (after the first two steps)" : ""), labelW + 60, 10);
    (markers || []).forEach(function (m) {
      if (m.kind === "train_config") { return; }  // a rank's config change: on its timelines only
      var j = steps.indexOf(m.step);
      if (j < 0) { return; }
      var x = labelW + j * cellW + cellW / 2;
      ctx.strokeStyle = m.colour || CULPRIT; ctx.lineWidth = 2; ctx.setLineDash([5, 3]);
      ctx.beginPath(); ctx.moveTo(x, top - 4); ctx.lineTo(x, top + rows.length * cellH + 2); ctx.stroke();
      ctx.setLineDash([]);
    });
    var tip = document.getElementById("rw-hm-tip");
    canvas.onmousemove = function (ev) {
      var rect = canvas.getBoundingClientRect();
      var j = Math.floor((ev.clientX - rect.left - labelW) / cellW), i = Math.floor((ev.clientY - rect.top - top) / cellH);
      if (!tip) { return; }
      if (i < 0 || j < 0 || i >= rows.length || j >= steps.length) { tip.style.display = "none"; return; }
      var v = value((values[i] || [])[j]);
      tip.textContent = rowLabel(rows[i]) + (rows[i].size > 1 ? " (highest)" : "") + " \u00b7 step " + steps[j] +
        ": " + fmt(v, metric.unit);
      tip.style.display = "block";
      tip.style.left = (ev.clientX - wrap.getBoundingClientRect().left + 12 + wrap.scrollLeft) + "px";
      tip.style.top = (ev.clientY - wrap.getBoundingClientRect().top + 12) + "px";
    };
    canvas.onmouseleave = function () { if (tip) { tip.style.display = "none"; } };
  }

  // -- putting it together -----------------------------------------------------------------------
  function draw() {
    var charts = state.data && state.data.charts;
    if (!charts) { return; }
    drawTimelines(charts.timelines);
    drawHeatmap(charts.heatmap, charts.timelines && charts.timelines.markers);
    var select = document.getElementById("rw-hm-metric");
    if (select) {
      select.value = String(Math.min(state.hmMetric, select.options.length - 1));
      select.onchange = function () { state.hmMetric = Number(select.value) || 0; drawHeatmap(charts.heatmap, charts.timelines && charts.timelines.markers); };
    }
  }

  function poll() {
    var live = state.data && state.data.live;
    if (!live) { return; }
    fetch(live.url, { credentials: "same-origin", cache: "no-store", headers: { "Accept": "application/json" } })
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
      .then(function (update) {
        state.failures = 0;
        var root = document.getElementById("rw-root");
        if (root && typeof update.html === "string") { root.innerHTML = update.html; }  // the collector's escaped HTML
        state.data.charts = update.charts;
        draw();
        if (update.finished) { state.data.live = null; return; }
        schedule(update.refresh_s || live.refresh_s);
      })
      .catch(function () {
        state.failures += 1;
        var badge = document.getElementById("rw-live");
        if (badge) { badge.textContent = "live: collector not answering, retrying"; badge.className = "live stale"; }
        schedule(Math.min(60, (live.refresh_s || 2) * (1 + state.failures)));
      });
  }

  function schedule(seconds) {
    clearTimeout(state.timer);
    state.timer = setTimeout(poll, Math.max(1, Number(seconds) || 2) * 1000);
  }

  function start() {
    state.data = readData();
    if (!state.data) { return; }
    draw();
    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(draw, 200);
    });
    if (state.data.live) { schedule(state.data.live.refresh_s); }
    document.documentElement.setAttribute("data-rw-ready", "1");
  }

  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
}());
