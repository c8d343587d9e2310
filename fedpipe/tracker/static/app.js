// fedpipe dashboard: polls the tracker's JSON API (/api/nodes, /api/jobs, /api/jobs/ID)
// and draws with plain DOM and SVG. No libraries, nothing fetched from the internet.
// Every string from the API goes through textContent, never innerHTML: node names and
// reasons come from nodes and clients.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

// -- formatting ---------------------------------------------------------------------
function fmt(x, digits) { return x === null || x === undefined ? "—" : x.toFixed(digits); }
function fmtLoss(x) { return fmt(x, 4); }
function fmtRate(x) { return x === null || x === undefined ? "—" : x.toFixed(1); }
function fmtSeconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  return s < 1 ? (s * 1e3).toFixed(1) + " ms" : s.toFixed(2) + " s";
}
function fmtBytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + units[i];
}
function fmtBandwidth(bps) {
  if (bps === null) return "unmeasured";
  const bits = bps * 8;
  return bits >= 1e9 ? (bits / 1e9).toFixed(2) + " Gbit/s" : (bits / 1e6).toFixed(1) + " Mbit/s";
}
function fmtTime(t) { return new Date(t * 1000).toLocaleTimeString(); }

// -- DOM helpers ----------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fill(tbody, rows) { tbody.replaceChildren(...rows); }
function setValue(id, text, value) {
  const e = $(id);
  e.textContent = text;
  e.dataset.value = value === null || value === undefined ? "" : String(value);
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// -- swarm ----------------------------------------------------------------------------
function renderSwarm(swarm) {
  const t = swarm.totals;
  $("totals").textContent = `${t.alive} node(s) alive${t.left ? `, ${t.left} left` : ""}, ` +
    `${t.lost} lost · ` +
    `${(t.flops / 1e9).toFixed(0)} GFLOP/s · ${fmtBytes(t.memory_bytes)}`;
  fill($("nodes").tBodies[0], swarm.nodes.map((n) => el("tr", { "data-node": n.id },
    el("td", {}, n.name), el("td", {}, n.address),
    el("td", { title: n.device_name }, n.device),
    el("td", { class: "num" }, (n.flops / 1e9).toFixed(1)),
    el("td", { class: "num" }, fmtBytes(n.memory_bytes)),
    el("td", { class: n.relay ? "relayed" : "" }, n.reach),
    el("td", { class: n.state, title: n.why }, n.alive ? "alive" : n.why))));
  renderMatrix(swarm.matrix);
}

function renderMatrix(m) {
  const box = $("matrix");
  const n = m.names.length;
  box.replaceChildren();
  if (n < 2) { $("matrix-legend").textContent = "fewer than two nodes"; return; }
  const label = n <= 40 ? 70 : 0;
  const cell = Math.max(4, Math.min(36, Math.floor(320 / n)));
  const size = label + n * cell;
  box.setAttribute("width", size); box.setAttribute("height", size);
  const logs = m.bandwidth.flat().filter((b) => b !== null && b > 0).map(Math.log10);
  const lo = Math.min(...logs), hi = Math.max(...logs);
  for (let i = 0; i < n; i++) {
    if (label) {
      box.append(svg("text", { x: label - 4, y: label + i * cell + cell / 2 + 4,
                               "text-anchor": "end" }, m.names[i].slice(0, 10)));
      box.append(svg("text", { x: 0, y: 0, "text-anchor": "start",
        transform: `translate(${label + i * cell + cell / 2 + 4},${label - 4}) rotate(-90)` },
        m.names[i].slice(0, 10)));
    }
    for (let j = 0; j < n; j++) {
      const b = m.bandwidth[i][j];
      let color = "#eee";
      if (i !== j && b !== null && b > 0) {
        const f = hi > lo ? (Math.log10(b) - lo) / (hi - lo) : 1;
        color = `hsl(${Math.round(f * 120)}, 65%, 50%)`;  // red: slowest, green: fastest
      }
      const r = svg("rect", { x: label + j * cell, y: label + i * cell, width: cell - 1,
                              height: cell - 1, fill: color });
      r.append(svg("title", {}, i === j ? m.names[i] :
        `${m.names[i]} → ${m.names[j]}: ${fmtBandwidth(b)}` +
        (m.latency[i][j] !== null ? `, ${(m.latency[i][j] * 1e3).toFixed(2)} ms` : "")));
      box.append(r);
    }
  }
  $("matrix-legend").textContent = logs.length ?
    `red ${fmtBandwidth(10 ** lo)} … green ${fmtBandwidth(10 ** hi)}` : "no link measured yet";
}

// -- jobs -----------------------------------------------------------------------------
function selectedJob(jobs) {
  const m = location.hash.match(/job=([\w-]+)/);
  if (m) return m[1];
  const active = jobs.find((j) => j.active);
  return active ? active.id : (jobs[0] ? jobs[0].id : null);
}

function renderJobs(jobs, selected) {
  fill($("jobs").tBodies[0], jobs.map((j) => {
    const tr = el("tr", { "data-job": j.id, class: j.id === selected ? "selected" : "" },
      el("td", {}, j.id), el("td", {}, j.name), el("td", { class: j.state }, j.state),
      el("td", {}, `${j.step}/${j.steps}`), el("td", { class: "num" }, fmtLoss(j.loss)),
      el("td", { class: "num" }, fmtRate(j.samples_per_second)),
      el("td", { class: "num" }, j.recoveries), el("td", { class: "wrap" }, j.reason));
    tr.addEventListener("click", () => { location.hash = "job=" + j.id; refresh(); });
    return tr;
  }));
}

function renderJob(job) {
  $("job").hidden = false;
  $("job-id").textContent = job.id;
  $("job-name").textContent = job.name;
  setValue("job-state", job.state, job.state);
  $("job-state").className = "state " + job.state;
  setValue("job-step", `${job.step} / ${job.steps}`, job.step);
  setValue("job-loss", fmtLoss(job.loss), job.loss);
  setValue("job-sps", fmtRate(job.samples_per_second), job.samples_per_second);
  setValue("step-predicted", fmtSeconds(job.step_seconds.predicted), job.step_seconds.predicted);
  setValue("step-measured", fmtSeconds(job.step_seconds.measured), job.step_seconds.measured);
  setValue("job-checkpoint", job.checkpoint_step ? `step ${job.checkpoint_step}` : "—",
           job.checkpoint_step);
  $("job-progress").style.width = (100 * job.progress).toFixed(1) + "%";
  $("job-reason").textContent = job.reason;
  const marks = job.recoveries.map((r) => r.time);
  const t0 = job.history.length ? job.history[0].time : 0;
  lineChart($("chart-loss"), latestPerStep(job.history).filter((r) => r.loss !== null)
    .map((r) => [r.step, r.loss]), "step", "loss", []);
  lineChart($("chart-sps"), job.history.filter((r) => r.samples_per_second !== null)
    .map((r) => [r.time - t0, r.samples_per_second]), "seconds since first step", "samples/s",
    marks.map((t) => t - t0));
  renderPlan(job);
  fill($("recoveries").tBodies[0], job.recoveries.map((r) => el("tr", {},
    el("td", {}, fmtTime(r.time)), el("td", {}, r.cause), el("td", {}, r.what),
    el("td", { class: "num" }, r.checkpoint_step), el("td", { class: "num" }, r.steps_recomputed),
    el("td", { class: "num" }, fmt(r.detect_seconds, 2)),
    el("td", { class: "num" }, fmt(r.replan_seconds, 2)),
    el("td", { class: "num" }, fmt(r.restore_seconds, 2)))));
  if (!job.recoveries.length) {
    fill($("recoveries").tBodies[0], [el("tr", {}, el("td", { colspan: 8, class: "muted" }, "none"))]);
  }
  fill($("events").tBodies[0], job.events.slice(-50).reverse().map((e) => el("tr", {},
    el("td", {}, fmtTime(e.time)), el("td", { class: e.state }, e.state),
    el("td", { class: "wrap" }, e.reason))));
}

function latestPerStep(history) {
  const last = new Map();
  for (const r of history) last.set(r.step, r);  // a replayed step wins
  return [...last.values()].sort((a, b) => a.step - b.step);
}

// A line chart of points [x, y] with labelled axes; marks: vertical dashed lines at x.
function lineChart(box, points, xlabel, ylabel, marks) {
  const W = 480, H = 220, L = 56, R = 12, T = 10, B = 36;
  box.replaceChildren();
  box.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
             svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
             svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xlabel),
             svg("text", { x: 0, y: 0, "text-anchor": "middle",
                           transform: `translate(12,${(T + H - B) / 2}) rotate(-90)` }, ylabel));
  if (!points.length) {
    box.append(svg("text", { x: (L + W) / 2, y: H / 2, "text-anchor": "middle",
                             class: "muted" }, "no steps yet"));
    return;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (const [v, anchor] of [[x0, "start"], [x1, "end"]]) {
    box.append(svg("text", { x: X(v), y: H - B + 14, "text-anchor": anchor }, +v.toPrecision(4)));
  }
  for (const v of [y0, y1]) {
    box.append(svg("text", { x: L - 4, y: Y(v) + 4, "text-anchor": "end" }, +v.toPrecision(3)));
  }
  for (const m of marks) {
    if (m >= x0 && m <= x1) box.append(svg("line", { class: "mark", x1: X(m), y1: T, x2: X(m), y2: H - B }));
  }
  box.append(svg("polyline", { class: "curve",
    points: points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") }));
}

// The plan: one row per replica group, one box per stage, codecs on the arrows between.
function renderPlan(job) {
  const box = $("plan"), plan = job.plan;
  box.replaceChildren();
  $("plan-summary").textContent = plan ? (plan.schedule ? `schedule ${plan.schedule}` : "") +
    (plan.bottleneck ? ` · bottleneck (${plan.bottleneck_basis}): group ${plan.bottleneck[0]} ` +
     `stage ${plan.bottleneck[1]}` : "") : "not planned yet";
  if (!plan) { fill($("stage-times").tBodies[0], []); return; }
  const BW = 170, BH = 74, GAP = 90, TOP = 22, ROW = BH + 40, LEFT = 70;
  const width = LEFT + Math.max(...plan.groups.map((g) => g.length)) * (BW + GAP);
  box.setAttribute("width", width);
  box.setAttribute("height", TOP + plan.groups.length * ROW);
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrowhead", markerWidth: 8, markerHeight: 8, refX: 7,
                                 refY: 4, orient: "auto" });
  marker.append(svg("path", { d: "M0,0 L8,4 L0,8 z", fill: "#6a737d" }));
  defs.append(marker); box.append(defs);
  const rows = [];
  plan.groups.forEach((group, r) => {
    const y = TOP + r * ROW;
    box.append(svg("text", { x: 4, y: y + BH / 2 + 4 }, `group ${r}`));
    group.forEach((s, i) => {
      const x = LEFT + i * (BW + GAP);
      box.append(svg("rect", { class: "box" + (s.bottleneck ? " bottleneck" : ""), x, y,
                               width: BW, height: BH, rx: 6, "data-stage": `${r}-${i}` }));
      const lines = [`stage ${i} · ${s.node_name}`,
                     `layers ${s.layer_start}–${s.layer_end - 1}` + (s.recompute ? " · recompute" : ""),
                     (s.device || "") + (s.relay ? " · outbound-only" : ""), s.measured ?
                       `measured ${fmtSeconds(s.measured.compute + s.measured.wait + s.measured.send)}` :
                       (s.predicted_compute !== null ? `predicted ${fmtSeconds(s.predicted_compute + (s.predicted_send || 0))}` : "")];
      lines.forEach((t, k) => box.append(svg("text", { x: x + 8, y: y + 16 + k * 15 }, t)));
      if (s.bottleneck) box.append(svg("text", { class: "tag", x: x + BW - 6, y: y - 5,
                                                 "text-anchor": "end" }, "bottleneck"));
      if (i + 1 < group.length) {
        const next = group[i + 1];
        const x1 = x + BW, x2 = x + BW + GAP;
        box.append(svg("line", { class: "arrow", x1, y1: y + BH / 2 - 8, x2: x2 - 2,
                                 y2: y + BH / 2 - 8, "marker-end": "url(#arrowhead)" }),
                   svg("line", { class: "arrow", x1: x2, y1: y + BH / 2 + 8, x2: x1 + 2,
                                 y2: y + BH / 2 + 8, "marker-end": "url(#arrowhead)" }),
                   svg("text", { class: "codec", x: (x1 + x2) / 2, y: y + BH / 2 - 13,
                                 "text-anchor": "middle" }, s.activation_codec),
                   svg("text", { class: "codec", x: (x1 + x2) / 2, y: y + BH / 2 + 22,
                                 "text-anchor": "middle" }, next.gradient_codec));
      }
      const m = s.measured;
      const bar = el("span", { class: "bar" });
      if (m) {
        const total = m.compute + m.wait + m.send || 1;
        for (const part of ["compute", "wait", "send"]) {
          const seg = el("span", { class: part, title: `${part} ${fmtSeconds(m[part])}` });
          seg.style.width = (100 * m[part] / total).toFixed(1) + "%";
          bar.append(seg);
        }
      }
      rows.push(el("tr", {}, el("td", {}, r), el("td", {}, i),
        el("td", s.relay ? { class: "relayed", title: s.reach } : {},
           s.relay ? `${s.node_name} (${s.reach})` : s.node_name),
        el("td", {}, `${s.layer_start}–${s.layer_end - 1}`),
        el("td", { "data-recompute": `${r}-${i}` }, s.recompute ? "yes" : "no"),
        el("td", { class: "num" }, fmtSeconds(s.predicted_compute)),
        el("td", { class: "num" }, fmtSeconds(s.predicted_send)),
        el("td", { class: "num" }, m ? fmtSeconds(m.compute) : "—"),
        el("td", { class: "num" }, m ? fmtSeconds(m.wait) : "—"),
        el("td", { class: "num" }, m ? fmtSeconds(m.send) : "—"),
        el("td", {}, m ? bar : el("span", { class: "muted" }, "not reported")),
        el("td", { class: "num", "data-memory": `${r}-${i}-predicted` },
           s.memory.predicted ? fmtBytes(s.memory.predicted) : "—"),
        el("td", { class: "num", "data-memory": `${r}-${i}-peak` },
           s.memory.peak ? fmtBytes(s.memory.peak) : "—")));
    });
  });
  fill($("stage-times").tBodies[0], rows);
}

// -- the loop ---------------------------------------------------------------------------
let timer = null;
async function refresh() {
  clearTimeout(timer);
  try {
    const [swarm, list] = await Promise.all([getJSON("/api/nodes"), getJSON("/api/jobs")]);
    renderSwarm(swarm);
    const id = selectedJob(list.jobs);
    renderJobs(list.jobs, id);
    if (id) renderJob(await getJSON(`/api/jobs/${encodeURIComponent(id)}`));
    else $("job").hidden = true;
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
  } catch (e) {
    $("status").textContent = "error: " + e.message;
    document.body.dataset.error = e.message;
  } finally {
    timer = setTimeout(refresh, POLL_MS);
  }
}
window.addEventListener("hashchange", refresh);
refresh();
