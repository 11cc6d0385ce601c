// The report's curves: a panel per metric, a line per stage folder, drawn as SVG from the points in
// the page's "curve-data" element ({metric: [[stage folder, [[step, value], ...]], ...]}).
// The reading aids TensorBoard has, written for this page: the smoothing slider (an exponential
// moving average, debiased at the start as TensorBoard's is; the raw values stay drawn faintly
// behind it), a log scale per panel (offered where every value is above 0), the values at the
// step under the pointer, and ticks at round numbers on both axes. It fetches nothing.
"use strict";
(function () {
  const dataElement = document.getElementById("curve-data");
  if (!dataElement) return; // a run without curves
  const curves = JSON.parse(dataElement.textContent);
  const slider = document.getElementById("smoothing");
  const width = 330, height = 200;
  const plot = { left: 56, right: 12, top: 10, bottom: 32 };
  const plotWidth = width - plot.left - plot.right, plotHeight = height - plot.top - plot.bottom;
  const palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  // One colour per stage folder on every panel, in the order the folders first appear.
  const colours = new Map();
  for (const series of Object.values(curves)) {
    for (const [name] of series) if (!colours.has(name)) colours.set(name, palette[colours.size % palette.length]);
  }
  // SVG's namespace, read from an <svg> the HTML parser made (so the page names no URL).
  const template = document.createElement("template");
  template.innerHTML = "<svg></svg>";
  const svgNamespace = template.content.firstChild.namespaceURI;

  function element(tag, attributes, text) {
    return fill(document.createElement(tag), attributes, text);
  }

  function shape(tag, attributes, text) {
    return fill(document.createElementNS(svgNamespace, tag), attributes, text);
  }

  function fill(e, attributes, text) {
    for (const [key, value] of Object.entries(attributes || {})) e.setAttribute(key, value);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Bounds by a loop: Math.min(...values) overflows the stack on a long run's series.
  function bounds(values) {
    let low = Infinity, high = -Infinity;
    for (const v of values) { if (v < low) low = v; if (v > high) high = v; }
    return [low, high];
  }

  // Exponential moving average with TensorBoard's debiasing: the first values are not pulled
  // towards 0, which the average starts from.
  function smooth(values, weight) {
    const out = [];
    let last = 0;
    values.forEach((v, i) => {
      last = last * weight + (1 - weight) * v;
      out.push(weight > 0 ? last / (1 - Math.pow(weight, i + 1)) : v);
    });
    return out;
  }

  // The round step (1, 2 or 5 times a power of ten) nearest to cutting `span` into `count` parts
  // (nearest on a log scale: the thresholds are the geometric means of 1, 2, 5 and 10).
  function roundStep(span, count) {
    const raw = span / count;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const m = raw / power;
    return (m >= Math.sqrt(50) ? 10 : m >= Math.sqrt(10) ? 5 : m >= Math.sqrt(2) ? 2 : 1) * power;
  }

  function linearTicks(low, high, count, integers) {
    let step = roundStep(high - low, count);
    if (integers) step = Math.max(1, Math.round(step));
    const ticks = [];
    for (let v = Math.ceil(low / step - 1e-9) * step; v <= high + step * 1e-9; v += step) ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return { ticks, step };
  }

  // Ticks at 1, 2 and 5 times the powers of ten inside the range (only the powers when it spans
  // many decades); round linear ticks when fewer than two fall inside.
  function logTicks(low, high) {
    const first = Math.floor(Math.log10(low)), last = Math.ceil(Math.log10(high));
    const decades = last - first;
    const every = Math.max(1, Math.ceil(decades / 6));
    const ticks = [];
    for (let e = first; e <= last; e++) {
      for (const m of decades > 3 ? [1] : [1, 2, 5]) {
        const v = m * Math.pow(10, e);
        if (v >= low * (1 - 1e-9) && v <= high * (1 + 1e-9) && (m !== 1 || (e - first) % every === 0)) ticks.push(v);
      }
    }
    return ticks.length >= 2 ? { ticks, step: null } : linearTicks(low, high, 5, false);
  }

  // An axis's labels in one style: powers of ten written as such when the values are very large
  // or very small, else as many decimals as the step between ticks needs (log ticks: 3 digits).
  function labels(ticks, step) {
    const largest = Math.max(...ticks.map(Math.abs));
    if (largest >= 1e5 || largest < 1e-3) return ticks.map((v) => (v === 0 ? "0" : v.toExponential(2).replace(/\.?0+e/, "e").replace("e+", "e")));
    if (step) return ticks.map((v) => v.toFixed(Math.min(6, Math.max(0, -Math.floor(Math.log10(step) + 1e-9)))));
    return ticks.map((v) => String(Number(v.toPrecision(3))));
  }

  function formatValue(v) {
    const a = Math.abs(v);
    if (v !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  // The value axis: round bounds on a linear scale, the data's own on a log scale.
  function valueAxis(values, log) {
    let [low, high] = bounds(values);
    if (log) {
      if (low === high) { low /= 2; high *= 2; }
      const { ticks, step } = logTicks(low, high);
      const at = (v) => plot.top + plotHeight * (1 - (Math.log10(v) - Math.log10(low)) / (Math.log10(high) - Math.log10(low)));
      return { ticks, step, at };
    }
    if (low === high) { low -= Math.abs(low) / 2 || 0.5; high += Math.abs(high) / 2 || 0.5; }
    const { step } = linearTicks(low, high, 5, false);
    low = Math.floor(low / step + 1e-9) * step;
    high = Math.ceil(high / step - 1e-9) * step;
    const ticks = linearTicks(low, high, 5, false).ticks;
    return { ticks, step, at: (v) => plot.top + plotHeight * (1 - (v - low) / (high - low)) };
  }

  function stepAxis(steps) {
    const [low, last] = bounds(steps);
    const high = last > low ? last : low + 1;
    const { ticks, step } = linearTicks(low, high, 5, steps.every(Number.isInteger));
    const at = (x) => plot.left + plotWidth * (x - low) / (high - low);
    return { ticks, step, at, invert: (px) => low + (px - plot.left) / plotWidth * (high - low) };
  }

  function Panel(figure) {
    const name = figure.dataset.curve;
    const series = curves[name];
    const all = series.flatMap(([, points]) => points.map((p) => p[1]));
    const head = element("div", { class: "chart-head" });
    head.appendChild(element("b", { title: name }, name.split("/").pop()));
    const logLabel = element("label", { class: "log" });
    const logBox = element("input", { type: "checkbox" });
    if (!all.every((v) => v > 0)) {
      logBox.disabled = true;
      logLabel.title = "a log scale needs every value above 0";
    }
    logLabel.append(logBox, " log");
    head.appendChild(logLabel);
    figure.appendChild(head);
    const svg = figure.appendChild(shape("svg", { class: "curve", viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": name }));
    const axes = svg.appendChild(shape("g", { class: "axes" }));
    const lines = svg.appendChild(shape("g", { class: "lines" }));
    const pointer = svg.appendChild(shape("g", { class: "pointer", visibility: "hidden" }));
    const overlay = svg.appendChild(shape("rect", { class: "overlay", x: plot.left, y: plot.top, width: plotWidth, height: plotHeight }));
    const tooltip = figure.appendChild(element("div", { class: "tooltip", hidden: "" }));
    const legend = figure.appendChild(element("figcaption"));
    for (const [seriesName] of series) {
      legend.appendChild(element("span", { style: "color:" + colours.get(seriesName) }, "\u25a0 "));
      legend.appendChild(document.createTextNode(seriesName + " "));
    }
    const x = stepAxis(series.flatMap(([, points]) => points.map((p) => p[0])));
    let y = null, smoothed = [];

    function draw() {
      const weight = Number(slider.value);
      y = valueAxis(all, logBox.checked);
      axes.replaceChildren(shape("rect", { class: "frame", x: plot.left, y: plot.top, width: plotWidth, height: plotHeight }));
      const yLabels = labels(y.ticks, y.step), xLabels = labels(x.ticks, x.step);
      y.ticks.forEach((v, i) => {
        const py = y.at(v).toFixed(1);
        axes.appendChild(shape("line", { class: "grid", x1: plot.left, x2: plot.left + plotWidth, y1: py, y2: py }));
        axes.appendChild(shape("text", { class: "tick y", x: plot.left - 4, y: py, "text-anchor": "end", "dominant-baseline": "middle" }, yLabels[i]));
      });
      x.ticks.forEach((v, i) => {
        const px = x.at(v).toFixed(1);
        axes.appendChild(shape("line", { class: "grid", x1: px, x2: px, y1: plot.top, y2: plot.top + plotHeight }));
        axes.appendChild(shape("text", { class: "tick x", x: px, y: plot.top + plotHeight + 12, "text-anchor": "middle" }, xLabels[i]));
      });
      axes.appendChild(shape("text", { class: "tick", x: plot.left + plotWidth, y: height - 2, "text-anchor": "end" }, "step"));
      lines.replaceChildren();
      smoothed = series.map(([seriesName, points]) => {
        const values = smooth(points.map((p) => p[1]), weight);
        const colour = colours.get(seriesName);
        const path = (vs) => points.map((p, i) => x.at(p[0]).toFixed(1) + "," + y.at(vs[i]).toFixed(1)).join(" ");
        if (weight > 0) lines.appendChild(shape("polyline", { class: "raw", stroke: colour, points: path(points.map((p) => p[1])) }));
        lines.appendChild(shape("polyline", { class: "smoothed", stroke: colour, points: path(values) }));
        if (points.length === 1) lines.appendChild(shape("circle", { cx: x.at(points[0][0]), cy: y.at(values[0]), r: 2.5, fill: colour }));
        return values;
      });
    }

    // The point of a series nearest to a step (the series are sorted by step).
    function nearest(points, step) {
      let low = 0, high = points.length - 1;
      while (low < high) {
        const middle = (low + high) >> 1;
        if (points[middle][0] < step) low = middle + 1; else high = middle;
      }
      return low > 0 && step - points[low - 1][0] < points[low][0] - step ? low - 1 : low;
    }

    function hover(event) {
      const box = svg.getBoundingClientRect();
      const step = x.invert((event.clientX - box.left) * width / box.width);
      const found = series.map(([, points]) => nearest(points, step));
      // the step nearest the pointer among the series' points; a series without a point there
      // shows its nearest, with its step
      let shownStep = null;
      series.forEach(([, points], s) => {
        const at = points[found[s]][0];
        if (shownStep === null || Math.abs(at - step) < Math.abs(shownStep - step)) shownStep = at;
      });
      pointer.replaceChildren();
      tooltip.replaceChildren(element("div", {}, "step " + shownStep));
      series.forEach(([seriesName, points], s) => {
        const [at, raw] = points[found[s]];
        pointer.appendChild(shape("circle", { cx: x.at(at), cy: y.at(smoothed[s][found[s]]), r: 3, fill: colours.get(seriesName) }));
        const line = element("div");
        line.appendChild(element("span", { style: "color:" + colours.get(seriesName) }, "\u25a0 "));
        const text = seriesName + (at !== shownStep ? " (step " + at + ")" : "") + ": " + formatValue(smoothed[s][found[s]]) +
          (Number(slider.value) > 0 ? " (raw " + formatValue(raw) + ")" : "");
        line.appendChild(document.createTextNode(text));
        tooltip.appendChild(line);
      });
      pointer.appendChild(shape("line", { class: "guide", x1: x.at(shownStep), x2: x.at(shownStep), y1: plot.top, y2: plot.top + plotHeight }));
      pointer.setAttribute("visibility", "visible");
      tooltip.hidden = false;
      const left = event.clientX - figure.getBoundingClientRect().left;
      tooltip.style.left = Math.max(0, Math.min(left + 12, figure.clientWidth - tooltip.offsetWidth)) + "px";
    }

    overlay.addEventListener("mousemove", hover);
    overlay.addEventListener("mouseleave", () => { pointer.setAttribute("visibility", "hidden"); tooltip.hidden = true; });
    logBox.addEventListener("change", draw);
    draw();
    return draw;
  }

  const panels = [...document.querySelectorAll("figure.chart[data-curve]")].map(Panel);
  slider.addEventListener("input", () => {
    document.getElementById("smoothing-value").textContent = slider.value;
    for (const draw of panels) draw();
  });
})();
