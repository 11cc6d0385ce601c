// The report's trajectory browser: filters over a small index, a list shown a page at a time, and
// one trajectory in full. Full records live in JSON chunks, parsed the first time a page needs one.
"use strict";
(function () {
  const indexElement = document.getElementById("index");
  if (!indexElement) return; // a run without trajectories
  const index = JSON.parse(indexElement.textContent);
  const chunkSize = JSON.parse(document.getElementById("chunk-size").textContent);
  const chunks = new Map();
  const perPage = 50;
  let matches = [];
  let page = 0;
  let selected = -1;

  function record(i) {
    const k = Math.floor(i / chunkSize);
    if (!chunks.has(k)) chunks.set(k, JSON.parse(document.getElementById("chunk-" + k).textContent));
    return chunks.get(k)[i - k * chunkSize];
  }

  function element(tag, attributes, text) {
    const e = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) e.setAttribute(key, value);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function fill(select, values) {
    for (const v of [...new Set(values)].sort()) select.appendChild(element("option", { value: v }, v));
  }
  fill(document.getElementById("f-stage"), index.map((t) => t.stage));
  fill(document.getElementById("f-kind"), index.map((t) => t.kind));

  function value(id) {
    return document.getElementById(id).value;
  }

  function applyFilters() {
    const stage = value("f-stage"), kind = value("f-kind"), correct = value("f-correct"), behaviour = value("f-behaviour");
    const low = value("f-reward-min"), high = value("f-reward-max"), text = value("f-text").toLowerCase();
    matches = [];
    index.forEach((t, i) => {
      if (stage && t.stage !== stage) return;
      if (kind && t.kind !== kind) return;
      if (correct && t.correct !== (correct === "1")) return;
      if (behaviour && t[behaviour] !== true) return;
      if (low !== "" && !(t.reward !== null && t.reward >= Number(low))) return;
      if (high !== "" && !(t.reward !== null && t.reward <= Number(high))) return;
      if (text && !t.q.toLowerCase().includes(text)) return;
      matches.push(i);
    });
    page = 0;
    showList();
  }

  function verdict(t) {
    if (t.correct === null || t.correct === undefined) return element("span", {}, "unscored");
    return element("span", { class: t.correct ? "right" : "wrong" }, t.correct ? "correct" : "wrong");
  }

  function showList() {
    const pages = Math.max(1, Math.ceil(matches.length / perPage));
    page = Math.min(page, pages - 1);
    document.getElementById("count").textContent = matches.length + " of " + index.length + " trajectories match";
    document.getElementById("page").textContent = "page " + (page + 1) + " of " + pages;
    document.getElementById("prev").disabled = page === 0;
    document.getElementById("next").disabled = page >= pages - 1;
    const list = document.getElementById("list");
    list.replaceChildren();
    list.start = page * perPage + 1;
    for (const i of matches.slice(page * perPage, (page + 1) * perPage)) {
      const t = index[i];
      const item = element("li", { "data-index": String(i) });
      if (i === selected) item.classList.add("selected");
      item.appendChild(element("div", {}, t.q));
      const meta = element("div", { class: "meta" });
      meta.appendChild(verdict(t));
      let line = " · " + t.stage + " · " + t.kind + " · " + t.calls + " tool calls";
      if (t.reward !== null) line += " · reward " + t.reward.toFixed(3);
      if (t.redundant) line += " · redundant";
      if (t.insufficient) line += " · insufficient";
      meta.appendChild(document.createTextNode(line));
      item.appendChild(meta);
      item.addEventListener("click", () => showDetail(i));
      list.appendChild(item);
    }
  }

  // The response, split at the protocol's tags (reasoning, tool calls, results, answer set
  // apart), each piece underlined by the origin of its tokens.
  function response(segments) {
    const pre = element("pre", { class: "response" });
    const tag = /<(\/?)(think|search|python|result|answer)>/g;
    let part = "think";
    for (const [origin, text] of segments) {
      const originClass = "origin-" + (origin || "unknown");
      let last = 0;
      for (const m of text.matchAll(tag)) {
        if (m.index > last) pre.appendChild(element("span", { class: "part-" + part + " " + originClass }, text.slice(last, m.index)));
        pre.appendChild(element("span", { class: "tag " + originClass }, m[0]));
        part = m[1] ? "think" : m[2];
        last = m.index + m[0].length;
      }
      if (last < text.length) pre.appendChild(element("span", { class: "part-" + part + " " + originClass }, text.slice(last)));
    }
    return pre;
  }

  function showDetail(i) {
    selected = i;
    for (const li of document.querySelectorAll("#list li")) li.classList.toggle("selected", Number(li.dataset.index) === i);
    const t = record(i);
    const detail = document.getElementById("detail");
    detail.replaceChildren();
    detail.appendChild(element("h3", {}, t.question));
    const head = element("p");
    head.appendChild(verdict(t));
    head.appendChild(document.createTextNode(" · gold: " + (t.answer || []).join(" | ") + " · " + t.stage + " · " + t.source +
      " (" + t.kind + ") · finish: " + (t.finish || "?") + " · id " + t.id));
    detail.appendChild(head);
    detail.appendChild(response(t.segments));
    const terms = Object.entries(t.terms || {});
    if (terms.length) {
      const table = element("table", { class: "numbers terms" });
      for (const [key, v] of terms) {
        const row = element("tr");
        row.appendChild(element("th", {}, key));
        row.appendChild(element("td", {}, typeof v === "number" ? String(Math.round(v * 10000) / 10000) : String(v)));
        table.appendChild(row);
      }
      detail.appendChild(element("h4", {}, t.reward !== null ? "Reward terms" : "Scores"));
      detail.appendChild(table);
    }
    if (t.judgement) {
      detail.appendChild(element("h4", {}, "Judgement"));
      detail.appendChild(element("pre", {}, JSON.stringify(t.judgement, null, 1)));
    }
  }

  for (const id of ["f-stage", "f-kind", "f-correct", "f-behaviour", "f-reward-min", "f-reward-max", "f-text"]) {
    document.getElementById(id).addEventListener("input", applyFilters);
  }
  document.getElementById("prev").addEventListener("click", () => { page -= 1; showList(); });
  document.getElementById("next").addEventListener("click", () => { page += 1; showList(); });
  applyFilters();
})();
