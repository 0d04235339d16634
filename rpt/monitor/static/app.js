// rpt monitor: polls the run store through /api every 2 s and redraws; no reload, no CDN.
"use strict";
const TOKEN = new URLSearchParams(location.search).get("token");
const TABLES = ["train", "ranks", "evals", "comm", "state", "stragglers", "profile"];
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
        const fresh = await (await api(`runs/${info.id}/${t}?after=${run.last[t]}`)).json();
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

const layout = (extra) => Object.assign({margin: {l: 50, r: 10, t: 10, b: 40}, legend: {orientation: "h"}}, extra);

function draw() {
  Plotly.react("loss", runs.map(r => ({name: `${r.name} train`, x: r.rows.train.map(p => p.step),
    y: r.rows.train.map(p => p.loss), mode: "lines"})), layout({xaxis: {title: "step"}, yaxis: {title: "loss (nats)"}}));
  Plotly.react("val", runs.map(r => ({name: `${r.name} val`, x: r.rows.evals.map(p => p.step),
    y: r.rows.evals.map(p => p.bpb), mode: "lines+markers"})), layout({xaxis: {title: "step"}, yaxis: {title: "bits per byte"}}));
  const run = runs[selected];
  if (!run) return;
  const perRank = groupBy(run.rows.ranks, p => p.rank);
  const tokensPerStep = (run.meta && run.meta.tokens_per_rank_step) || 0;
  Plotly.react("throughput", Object.entries(perRank).map(([rank, ps]) => ({name: `rank ${rank}`,
    x: ps.map(p => p.step), y: ps.map(p => tokensPerStep / p.step_s), mode: "lines"})),
    layout({xaxis: {title: "step"}, yaxis: {title: "tokens/s"}}));
  drawBreakdown(perRank);
  drawHeatmap(run.rows.comm);
  drawProfile(run.rows.profile);
  const layers = groupBy(run.rows.state, p => p.layer);
  Plotly.react("state", Object.entries(layers).map(([layer, ps]) => ({name: `layer ${layer}`,
    x: ps.map(p => p.step), y: ps.map(p => p.rms), mode: "lines"})), layout({xaxis: {title: "step"}, yaxis: {title: "RMS"}}));
  Plotly.react("gates", Object.entries(layers).map(([layer, ps]) => ({name: `layer ${layer}`,
    x: ps.map(p => p.step), y: ps.map(p => p.saturated), mode: "lines"})),
    layout({xaxis: {title: "step"}, yaxis: {title: "share saturated", rangemode: "tozero"}}));
  fillTable("stragglers", run.rows.stragglers.slice(-20).reverse().map(s =>
    [s.step, s.rank, s.compute_s.toFixed(4), s.reference_s.toFixed(4), s.ratio.toFixed(2)]), () => true);
  const flagged = new Set(run.rows.stragglers.filter(s => s.step === run.last.ranks).map(s => s.rank));
  fillTable("progress", Object.values(perRank).map(ps => ps[ps.length - 1]).map(p =>
    [p.rank, p.stage, p.step, (tokensPerStep / p.step_s).toFixed(0), p.compute_s.toFixed(4),
     (p.exposed_comm_s || 0).toFixed(4), (p.memory_bytes / 2 ** 20).toFixed(0)]), row => flagged.has(row[0]));
  drawConfig();
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
  Plotly.react("breakdown", Object.entries(parts).map(([name, f]) => ({name, type: "bar", x: ranks, y: latest.map(f)})),
    layout({barmode: "stack", yaxis: {title: "seconds per step"}}));
}

function drawProfile(rows) {
  const last = rows.length ? rows[rows.length - 1].step : null;
  const latest = rows.filter(p => p.step === last);
  const ranks = latest.map(p => `rank ${p.rank}`);
  const parts = {
    "compute only": p => p.compute_s - p.overlap_s, "compute + communication (overlap)": p => p.overlap_s,
    "communication only": p => p.comm_s - p.overlap_s, "idle": p => p.idle_s,
  };
  Plotly.react("profile", Object.entries(parts).map(([name, f]) => ({name, type: "bar", x: ranks,
    y: latest.map(p => f(p) / Math.max(1, p.steps))})), layout({barmode: "stack", yaxis: {title: "seconds per step"}}));
}

function drawHeatmap(comm) {
  const measure = document.getElementById("heat-measure").value;  // bytes or seconds
  const steps = [...new Set(comm.map(c => c.step))].sort((a, b) => a - b);
  const buckets = [...new Set(comm.map(c => c.bucket))].sort((a, b) => a - b);
  const z = buckets.map(b => steps.map(s => { const c = comm.find(c => c.step === s && c.bucket === b);
    return c ? c[measure] : null; }));
  Plotly.react("heatmap", [{type: "heatmap", x: steps, y: buckets.map(b => `bucket ${b}`), z, colorscale: "YlOrRd",
    name: measure}], layout({xaxis: {title: "step"}}));
  const totals = buckets.map((b, i) => [b, z[i].reduce((a, v) => a + (v || 0), 0)]).sort((a, b) => b[1] - a[1]);
  const sum = totals.reduce((a, t) => a + t[1], 0) || 1;
  const unit = measure === "bytes" ? "bytes" : "time";
  document.getElementById("hotspots").textContent = totals.length ? "hot spots: " + totals.slice(0, 3).map(([b, v]) =>
    `bucket ${b} ${(100 * v / sum).toFixed(0)}% of ${unit}`).join(", ") : "no communication recorded (one process)";
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
