"use strict";
// The status page's latency plots (inlined into /dashboard when served: the page's CSP
// allows inline scripts only). One SVG per series: x = the last 60 windows, y = seconds
// from 0 to a rounded maximum; a window without samples leaves a gap in the lines, and
// every window with samples gets a dot, so a single one shows too.
const drawLatency = (function () {
  const NS = "http://www.w3.org/2000/svg";
  const BOX = {w: 600, h: 170, left: 46, right: 8, top: 8, bottom: 18};
  const QUANTILES = ["p50", "p90", "p99"];

  function node(tag, attrs, text) {
    const el = document.createElementNS(NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, value);
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function seconds(s) {
    if (s === null || s === undefined) return "\u2013";
    if (s >= 1) return s.toFixed(2) + " s";
    return (1000 * s).toFixed(s < 0.01 ? 2 : s < 0.1 ? 1 : 0) + " ms";
  }

  function niceMax(v) {
    if (!(v > 0)) return 0.001;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  return function draw(svg, caption, points, windowSeconds, now) {
    const span = 60 * windowSeconds;
    const shown = (points || []).filter((p) => p.t > now - span - windowSeconds);
    const withData = shown.filter((p) => p.count > 0 && p.p99 !== null);
    const top = niceMax(Math.max(0, ...withData.map((p) => p.p99)));
    const x = (t) => BOX.left + (BOX.w - BOX.left - BOX.right) * Math.max(0, 1 - (now - t) / span);
    const y = (v) => BOX.h - BOX.bottom - (BOX.h - BOX.top - BOX.bottom) * Math.min(1, v / top);
    const out = [];
    for (const f of [0, 0.5, 1]) {
      const gy = y(f * top);
      out.push(node("line", {class: "grid", x1: BOX.left, x2: BOX.w - BOX.right, y1: gy, y2: gy}));
      out.push(node("text", {x: 2, y: gy + 3}, seconds(f * top)));
    }
    out.push(node("text", {x: BOX.left, y: BOX.h - 4}, "-" + span / 60 + " min"));
    out.push(node("text", {x: BOX.w - BOX.right - 24, y: BOX.h - 4}, "now"));
    for (const q of QUANTILES) {
      let run = [];
      const line = () => {
        if (run.length > 1) out.push(node("polyline", {class: q, "data-q": q, points: run.join(" ")}));
        run = [];
      };
      for (const p of shown) {
        if (p.count > 0 && p[q] !== null) {
          const px = x(p.t).toFixed(1), py = y(p[q]).toFixed(1);
          run.push(px + "," + py);
          out.push(node("circle", {class: q, "data-q": q, cx: px, cy: py, r: 2}));
        } else {
          line();
        }
      }
      line();
    }
    svg.replaceChildren(...out);
    svg.setAttribute("data-points", String(withData.length));
    const last = withData[withData.length - 1];
    caption.textContent = last ? "p50 " + seconds(last.p50) + " \u00b7 p90 " + seconds(last.p90) +
      " \u00b7 p99 " + seconds(last.p99) + " (" + last.count.toLocaleString() + " samples)"
      : "no data yet";
  };
})();
