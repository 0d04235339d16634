// rpt monitor: polls the run store through /api every 2 s and redraws; no reload, no CDN.
"use strict";
const TOKEN = new URLSearchParams(location.search).get("token");
const TABLES = ["train", "ranks", "evals", "depths", "positions", "comm", "state", "stragglers", "profile"];
const runs = [];            // {id, name, live, meta, summary, rows: {table: [...]}, last: {table: step}}
let selected = 0;

function api(path) {
  const url = "api/" + path + (TOKEN ? (path.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : "");
  return fetch(url).then(r => { if (!r.ok) throw new Error(r.status + " " + path); return r; });
}

async function poll() {
  try {
    const listed = await (await api("runs")).json();
    for (const info of listed) {
      let run = runs[info.id];
      if (!run) {
        run = runs[info.id] = {rows: {}, last: {}};
        TABLES.forEach(t => { run.rows[t] = []; run.last[t] = -1; });
      }
      Object.assign(run, info);
      for (const t of TABLES) {
        // rows of the last step read may still come (another rank's, a final validation after a periodic one at
        // the same step): ask from that step again and keep the rows not held yet
        const from = run.last[t];
        const held = new Set(run.rows[t].filter(p => p.step === from).map(p => JSON.stringify(p)));
        const fresh = (await (await api(`runs/${info.id}/${t}?after=${from - 1}`)).json())
          .filter(p => !held.has(JSON.stringify(p)));
        if (fresh.length) {
          run.rows[t] = run.rows[t].concat(fresh);
          run.last[t] = fresh[fresh.length - 1].step;
        }
      }
    }
    draw();
    const live = runs.filter(r => r.live).length;
    document.getElementById("status").textContent =
      `${runs.length} run(s), ${live} live; updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    document.getElementById("status").textContent = "cannot reach the server: " + err.message;
  }
}

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];  // a run's colour
// plotly.js v2+ reads an axis title only as {text: ...}: every axis names its quantity and unit
const axis = (text, extra) => Object.assign({title: {text}, automargin: true}, extra);
const layout = (x, y, extra) => Object.assign({margin: {l: 60, r: 20, t: 10, b: 50}, legend: {orientation: "h", y: -0.3},
  xaxis: axis(x), yaxis: axis(y)}, extra);
// a panel with nothing to show says why, in the chart itself
const empty = (id, why) => Plotly.react(id, [], {margin: {l: 10, r: 10, t: 10, b: 10},
  xaxis: {visible: false}, yaxis: {visible: false},
  annotations: [{text: why, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: {size: 14, color: "#666"}}]});
const clock = s => s == null ? "?" : `${Math.floor(s / 3600) ? Math.floor(s / 3600) + ":" : ""}` +
  `${String(Math.floor(s / 60) % 60).padStart(Math.floor(s / 3600) ? 2 : 1, "0")}:${String(Math.floor(s % 60)).padStart(2, "0")}`;

function runLine(r) {
  const p = r.meta && r.meta.progress;
  const s = r.summary;
  if (s) return `${r.name}: finished, step ${s.steps}` + (s.ended_by ? ` (ended by ${s.ended_by})` : "") +
    `, val loss ${s.val_loss.toFixed(4)}, ${s.val_bpb.toFixed(4)} bits per byte`;
  if (!p) return `${r.name}: starting`;
  return `${r.name}: step ${p.step}` + (p.max_steps ? ` of ${p.max_steps}` : "") +
    `, ${(100 * p.spent).toFixed(0)}% of ${p.budget}, ETA ${clock(p.eta_s)}`;
}

// a looped model's depth curve: its latest validation (the final one once there is one) at each depth
function drawDepths() {
  const curves = runs.flatMap((r, i) => {
    const rows = r.rows.depths || [];
    if (!rows.length) return [];
    const final = rows.filter(p => p.final), periodic = rows.filter(p => !p.final);
    const step = Math.max(...periodic.map(p => p.step));
    const points = (final.length ? final : periodic.filter(p => p.step === step)).sort((a, b) => a.depth - b.depth);
    const color = PALETTE[i % PALETTE.length];
    return [{name: `${r.name} ${final.length ? "final (whole split)" : "step " + step}`, x: points.map(p => p.depth),
             y: points.map(p => p.bpb), mode: "lines+markers", line: {color}, marker: {color}}];
  });
  if (!curves.length) return empty("depth", "no looped model: model.loop_core loops one (docs/depth.md)");
  Plotly.react("depth", curves, layout("iterations of the loop (depth)", "validation (bits per byte)",
                                       {xaxis: axis("iterations of the loop (depth)", {type: "log"})}));
}

// validation by position in the documents: the latest validation that has it (the final one once there is one)
function drawPositions() {
  const curves = runs.flatMap((r, i) => {
    const rows = (r.rows.positions || []).filter(p => p.bpb !== null);
    if (!rows.length) return [];
    const final = rows.filter(p => p.final), periodic = rows.filter(p => !p.final);
    const step = Math.max(...periodic.map(p => p.step));
    const points = (final.length ? final : periodic.filter(p => p.step === step)).sort((a, b) => a.first - b.first);
    const color = PALETTE[i % PALETTE.length];
    return [{name: `${r.name} ${final.length ? "final (whole split)" : "step " + step}`,
             x: points.map(p => `from ${p.first}`), y: points.map(p => p.bpb), mode: "lines+markers",
             line: {color}, marker: {color}, text: points.map(p => `${p.tokens} tokens`)}];
  });
  if (!curves.length) return empty("position", "not measured: train the run with train.eval_by_position = true (rpt eval --by-position prints its own, to the terminal)");
  Plotly.react("position", curves, layout("position of the token in its document", "validation (bits per byte)"));
}

function draw() {
  document.getElementById("runs").innerHTML = runs.map(r => `<span class="run">${escape(runLine(r))}</span>`).join("");
  const series = (key, suffix) => runs.map((r, i) => ({name: `${r.name} ${suffix}`, x: r.rows.train.map(p => p.step),
    y: r.rows.train.map(p => p[key]), mode: "lines", line: {color: PALETTE[i % PALETTE.length]}}));
  Plotly.react("loss", series("loss", "train"), layout("step", "train loss (nats per token)"));
  Plotly.react("lr", series("lr", "lr"), layout("step", "learning rate"));
  Plotly.react("gradnorm", series("grad_norm", "grad norm"), layout("step", "gradient norm (before clipping)"));
  // periodic evaluations (the first train.eval_tokens) and the final one (the whole split) are different measures
  const evals = runs.flatMap((r, i) => {
    const color = PALETTE[i % PALETTE.length];
    const periodic = r.rows.evals.filter(p => !p.final), final = r.rows.evals.filter(p => p.final);
    const span = r.meta && r.meta.eval_tokens ? `first ${r.meta.eval_tokens.toLocaleString("en")} tokens` : "whole split";
    return [{name: `${r.name} val (${span})`, x: periodic.map(p => p.step), y: periodic.map(p => p.bpb),
             mode: "lines+markers", line: {color}, marker: {color}},
            {name: `${r.name} final (whole split)`, x: final.map(p => p.step), y: final.map(p => p.bpb),
             mode: "markers", marker: {symbol: "star", size: 12, color}}];
  }).filter(t => t.x.length);
  Plotly.react("val", evals, layout("step", "validation (bits per byte)"));
  drawDepths();
  drawPositions();
  const run = runs[selected];
  if (!run) return;
  document.querySelectorAll(".run-name").forEach(e => { e.textContent = run.name; });
  const perRank = groupBy(run.rows.ranks, p => p.rank);
  const tokensPerStep = (run.meta && run.meta.tokens_per_rank_step) || 0;
  if (!run.rows.ranks.length) empty("throughput", "no log interval recorded yet");
  else Plotly.react("throughput", Object.entries(perRank).map(([rank, ps]) => ({name: `rank ${rank}`,
    x: ps.map(p => p.step), y: ps.map(p => tokensPerStep / p.step_s), mode: "lines"})),
    layout("step", "tokens per second"));
  drawBreakdown(perRank);
  drawHeatmap(run.rows.comm, run);
  drawProfile(run.rows.profile);
  const layers = groupBy(run.rows.state, p => p.layer);
  if (!run.rows.state.length) { empty("state", "no log interval recorded yet"); empty("gates", "no log interval recorded yet"); }
  else {
    Plotly.react("state", Object.entries(layers).map(([layer, ps]) => ({name: `layer ${layer}`,
      x: ps.map(p => p.step), y: ps.map(p => p.rms), mode: "lines"})), layout("step", "state RMS"));
    Plotly.react("gates", Object.entries(layers).map(([layer, ps]) => ({name: `layer ${layer}`,
      x: ps.map(p => p.step), y: ps.map(p => p.saturated), mode: "lines"})),
      layout("step", "share of gate outputs saturated", {yaxis: axis("share of gate outputs saturated", {rangemode: "tozero"})}));
  }
  fillTable("stragglers", run.rows.stragglers.slice(-20).reverse().map(s =>
    [s.step, s.rank, s.compute_s.toFixed(4), s.reference_s.toFixed(4), s.ratio.toFixed(2)]), () => true);
  document.getElementById("stragglers-note").textContent = run.rows.stragglers.length ? "" :
    (run.meta && run.meta.world_size > 1 ? "no rank has computed slower than its peers" : "one process: no peers to compare");
  const flagged = new Set(run.rows.stragglers.filter(s => s.step === run.last.ranks).map(s => s.rank));
  fillTable("progress", Object.values(perRank).map(ps => ps[ps.length - 1]).map(p =>
    [p.rank, p.stage, p.step, (tokensPerStep / p.step_s).toFixed(0), p.compute_s.toFixed(4),
     (p.exposed_comm_s || 0).toFixed(4), (p.memory_bytes / 2 ** 20).toFixed(0)]), row => flagged.has(row[0]));
  drawConfig();
}

function escape(text) {
  return text.replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]);
}

function drawBreakdown(perRank) {
  const latest = Object.values(perRank).map(ps => ps[ps.length - 1]);
  const ranks = latest.map(p => `rank ${p.rank}`);
  const exposed = p => p.exposed_comm_s || 0;
  const parts = {
    "data": p => p.data_s, "forward": p => p.forward_s,
    "backward + optimizer": p => Math.max(0, p.backward_s + p.optimizer_s - exposed(p)),
    "exposed communication": exposed, "checkpoint": p => p.checkpoint_s, "evaluation": p => p.eval_s,
    "other": p => Math.max(0, p.step_s - p.data_s - p.forward_s - p.backward_s - p.optimizer_s - p.checkpoint_s - p.eval_s),
  };
  if (!latest.length) return empty("breakdown", "no log interval recorded yet");
  Plotly.react("breakdown", Object.entries(parts).map(([name, f]) => ({name, type: "bar", x: ranks, y: latest.map(f)})),
    layout("rank", "seconds per step", {barmode: "stack"}));
}

function drawProfile(rows) {
  const last = rows.length ? rows[rows.length - 1].step : null;
  const latest = rows.filter(p => p.step === last);
  const ranks = latest.map(p => `rank ${p.rank}`);
  const parts = {
    "compute only": p => p.compute_s - p.overlap_s, "compute + communication (overlap)": p => p.overlap_s,
    "communication only": p => p.comm_s - p.overlap_s, "idle": p => p.idle_s,
  };
  if (!latest.length) return empty("profile", "no profiled steps: rpt train --profile START:END records them");
  Plotly.react("profile", Object.entries(parts).map(([name, f]) => ({name, type: "bar", x: ranks,
    y: latest.map(p => f(p) / Math.max(1, p.steps))})), layout("rank", "seconds per step", {barmode: "stack"}));
}

function drawHeatmap(comm, run) {
  const measure = document.getElementById("heat-measure").value;  // bytes or seconds
  const steps = [...new Set(comm.map(c => c.step))].sort((a, b) => a - b);
  const buckets = [...new Set(comm.map(c => c.bucket))].sort((a, b) => a - b);
  const z = buckets.map(b => steps.map(s => { const c = comm.find(c => c.step === s && c.bucket === b);
    return c ? c[measure] : null; }));
  const quantity = measure === "bytes" ? "bytes per step" : "seconds per step";
  if (!comm.length) empty("heatmap", run.meta && run.meta.world_size > 1 ? "no communication recorded yet"
                                                                         : "one process: no gradient communication");
  else Plotly.react("heatmap", [{type: "heatmap", x: steps, y: buckets.map(b => `bucket ${b}`), z, colorscale: "YlOrRd",
    name: measure, colorbar: {title: {text: quantity, side: "right"}, thickness: 14}}],
    layout("step", "gradient bucket", {margin: {l: 80, r: 30, t: 10, b: 50}}));
  const totals = buckets.map((b, i) => [b, z[i].reduce((a, v) => a + (v || 0), 0)]).sort((a, b) => b[1] - a[1]);
  const sum = totals.reduce((a, t) => a + t[1], 0) || 1;
  const unit = measure === "bytes" ? "bytes" : "time";
  document.getElementById("hotspots").textContent = totals.length ? "hot spots: " + totals.slice(0, 3).map(([b, v]) =>
    `bucket ${b} ${(100 * v / sum).toFixed(0)}% of ${unit}`).join(", ") : "";  // the empty chart says why
}

function drawConfig() {
  const select = document.getElementById("config-run");
  if (select.options.length !== runs.length) {
    select.innerHTML = runs.map(r => `<option value="${r.id}">${r.name}</option>`).join("");
    select.value = selected;
  }
  const run = runs[selected];
  if (run.configText === undefined) {
    run.configText = "";
    api(`runs/${run.id}/config`).then(r => r.text()).then(t => { run.configText = t;
      document.getElementById("config").textContent = t; });
  }
  document.getElementById("config").textContent = run.configText;
  document.getElementById("summary").textContent = run.summary ? JSON.stringify(run.summary, null, 1) : "(still training)";
}

function fillTable(id, rows, flag) {
  document.querySelector(`#${id} tbody`).innerHTML = rows.map(r =>
    `<tr${flag(r) && id === "progress" ? ' class="flag"' : ""}>${r.map(v => `<td>${v}</td>`).join("")}</tr>`).join("");
}

function groupBy(rows, key) {
  const out = {};
  for (const r of rows) (out[key(r)] = out[key(r)] || []).push(r);
  return out;
}

document.getElementById("config-run").addEventListener("change", e => { selected = Number(e.target.value); draw(); });
document.getElementById("heat-measure").addEventListener("change", () => draw());
poll();
setInterval(poll, 2000);
