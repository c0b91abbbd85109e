// Usage charts with uPlot (vendored in static/uplot): the data is in <script id="usage-data">.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("usage-data").textContent);
  const palette = ["#c2410c", "#2563eb", "#15803d", "#7c3aed", "#b45309", "#0891b2", "#be185d", "#4d7c0f"];
  // Requests are whole; a cent-less spend keeps two significant digits ($0.0000044).
  const usd = (u, v) => v == null ? "-" : v === 0 ? "$0" : "$" + (v >= 0.01 ? v.toFixed(2) : String(Number(v.toPrecision(2))));
  const whole = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6, 1e7];
  const width = (el) => Math.max(el.clientWidth, 320);
  const bars = uPlot.paths.bars({ size: [0.6, 48] });
  const charts = {};

  function daily(el) {
    return new uPlot({
      width: width(el), height: 260,
      scales: { x: { time: true }, req: { range: (u, min, max) => [0, Math.max(1, max)] }, usd: { range: (u, min, max) => [0, Math.max(0.000001, max)] } },
      axes: [{}, { scale: "req", label: "requests", incrs: whole },
             { scale: "usd", side: 1, size: 84, grid: { show: false }, values: (u, vs) => vs.map((v) => usd(u, v)) }],
      series: [{}, { label: "Requests", scale: "req", fill: "rgba(37,99,235,0.55)", stroke: "#2563eb", paths: bars, points: { show: false } },
               { label: "Spend", scale: "usd", stroke: "#c2410c", width: 2, value: usd }],
    }, [data.x, data.requests, data.cost], el);
  }

  function byModel(el) {
    const series = [{}].concat(data.models.map((m, i) => ({ label: m, stroke: palette[i % palette.length], width: 2, value: usd })));
    return new uPlot({
      width: width(el), height: 260,
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(0.000001, max)] } },
      axes: [{}, { size: 84, values: (u, vs) => vs.map((v) => usd(u, v)) }],
      series: series,
    }, [data.x].concat(data.models.map((m) => data.cost_by_model[m])), el);
  }

  charts.daily = daily(document.getElementById("chart-daily"));
  charts.models = byModel(document.getElementById("chart-models"));
  window.kilnCharts = charts;  // for the browser tests and the curious
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(charts)) {
      const el = document.getElementById(name === "daily" ? "chart-daily" : "chart-models");
      chart.setSize({ width: width(el), height: 260 });
    }
  });
})();
