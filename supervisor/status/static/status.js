// The status page's refresh: fetch /status/data every 2 s (the session cookie goes with
// it), put the server's display strings into the page, redraw the chart. Text goes in
// through textContent only: nothing from the server is ever parsed as markup.
(function () {
  "use strict";
  var REFRESH_MS = 2000;
  var SVG = "http://www.w3.org/2000/svg";
  var W = 1000, H = 280, L = 52, R = 60, T = 14, B = 30;
  var shownAmbiguous = null;
  // Seconds between the time axis's labels: the first that gives at most six.
  var TICKS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

  function $(id) { return document.getElementById(id); }

  function clock(t) { return new Date(t * 1000).toISOString().slice(11, 19) + " UTC"; }

  function duration(s) {
    s = Math.round(Math.max(0, s));
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s"; }
    return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  }

  function setFields(fields) {
    var els = document.querySelectorAll("[data-field]");
    for (var i = 0; i < els.length; i++) {
      var key = els[i].getAttribute("data-field");
      if (Object.prototype.hasOwnProperty.call(fields, key)) { els[i].textContent = fields[key]; }
    }
  }

  function renderCurrent(run) {
    $("no-run").hidden = run !== null;
    if (run === null) { return; }
    setFields(run.fields);
    document.querySelector("[data-field=verdict]").setAttribute("data-verdict", run.verdict);
    var progress = $("progress");
    progress.max = Math.max(1, run.discovered);
    progress.value = run.settled;
    document.body.setAttribute("data-run-state", run.state);
  }

  function renderRuns(runs) {
    var body = document.querySelector("#runs tbody");
    var rows = document.createDocumentFragment();
    runs.forEach(function (run) {
      var tr = document.createElement("tr");
      run.cells.forEach(function (cell) {
        var td = document.createElement("td");
        td.textContent = cell;
        tr.appendChild(td);
      });
      rows.appendChild(tr);
    });
    body.replaceChildren(rows);
  }

  function renderAmbiguous(total) {
    if (shownAmbiguous === null) { shownAmbiguous = Number($("ambiguous-total").textContent); }
    $("ambiguous-total").textContent = String(total);
    $("ambiguous-changed").hidden = total === shownAmbiguous;
  }

  function el(name, attrs, text) {
    var node = document.createElementNS(SVG, name);
    for (var k in attrs) { node.setAttribute(k, String(attrs[k])); }
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  function niceMax(v) {
    if (!(v > 0)) { return 1; }
    var p = Math.pow(10, Math.floor(Math.log10(v)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) { if (steps[i] * p >= v) { return steps[i] * p; } }
    return 10 * p;
  }

  function drawChart(chart) {
    var svg = $("chart");
    svg.replaceChildren();
    if (!chart) {
      svg.appendChild(el("text", {x: W / 2, y: H / 2, "class": "empty"}, "no run yet"));
      svg.setAttribute("data-points", "0");
      return;
    }
    var pts = chart.points;
    var start = chart.start, end = Math.max(chart.end, chart.start + 10);
    var top = 0, topRight = 0;
    pts.forEach(function (p) {
      top = Math.max(top, p.ceiling, p.rate, p.throughput);
      topRight = Math.max(topRight, p.throttled_per_min);
    });
    top = niceMax(top * 1.05);
    topRight = niceMax(Math.max(topRight * 1.1, 10));
    var x = function (t) { return L + (t - start) / (end - start) * (W - L - R); };
    var y = function (v) { return H - B - v / top * (H - T - B); };
    var yR = function (v) { return H - B - v / topRight * (H - T - B); };
    for (var g = 0; g <= 4; g++) {
      var gy = H - B - g / 4 * (H - T - B);
      svg.appendChild(el("line", {x1: L, x2: W - R, y1: gy, y2: gy, "class": "grid"}));
      svg.appendChild(el("text", {x: L - 6, y: gy + 4, "class": "axis left"},
                         (top * g / 4).toFixed(top >= 20 ? 0 : 1) + "/s"));
      svg.appendChild(el("text", {x: W - R + 6, y: gy + 4, "class": "axis right"},
                         (topRight * g / 4).toFixed(0) + "/min"));
    }
    var span = end - start, tick = TICKS[TICKS.length - 1];
    for (var j = 0; j < TICKS.length; j++) { if (span / TICKS[j] <= 6) { tick = TICKS[j]; break; } }
    for (var e = 0; e <= span; e += tick) {
      svg.appendChild(el("text", {x: x(start + e), y: H - 8, "class": "axis bottom"}, duration(e)));
    }
    if (pts.length === 0) {
      svg.appendChild(el("text", {x: W / 2, y: H / 2, "class": "empty"},
                         "no samples of this run in this process"));
      svg.setAttribute("data-points", "0");
      return;
    }
    var step = pts.length > 1 ? (x(pts[pts.length - 1].t) - x(pts[0].t)) / (pts.length - 1) : 4;
    var barW = Math.max(2, step * 0.8);
    pts.forEach(function (p) {
      if (p.paused) {
        svg.appendChild(el("rect", {x: x(p.t) - step, y: T, width: Math.max(step, 2),
                                    height: H - T - B, "class": "paused"}));
      }
      if (p.throttled_per_min > 0) {
        svg.appendChild(el("rect", {x: x(p.t) - barW, y: yR(p.throttled_per_min), width: barW,
                                    height: H - B - yR(p.throttled_per_min), "class": "throttled"}));
      }
    });
    ["ceiling", "throughput", "rate"].forEach(function (key) {
      var line = pts.map(function (p) { return x(p.t).toFixed(1) + "," + y(p[key]).toFixed(1); });
      svg.appendChild(el("polyline", {points: line.join(" "), "class": key}));
    });
    svg.appendChild(el("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "frame"}));
    svg.appendChild(el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "frame"}));
    svg.setAttribute("data-points", String(pts.length));
  }

  function render(d) {
    renderCurrent(d.current);
    renderRuns(d.runs);
    renderAmbiguous(d.ambiguous);
    drawChart(d.chart);
    $("updated").textContent = clock(d.now);
    document.body.removeAttribute("data-stale");
  }

  function refresh() {
    fetch("/status/data", {credentials: "same-origin", cache: "no-store",
                           headers: {"Accept": "application/json"}})
      .then(function (r) {
        if (r.status === 401) { window.location.assign("/login"); return null; }
        if (!r.ok) { throw new Error("status " + r.status); }
        return r.json();
      })
      .then(function (d) { if (d) { render(d); } })
      .catch(function () { document.body.setAttribute("data-stale", "true"); })
      .finally(function () { window.setTimeout(refresh, REFRESH_MS); });
  }

  refresh();
}());
