// rollq dashboard: polls /api/dashboard every second and draws it with uPlot.
"use strict";
const charts = {};
const select = document.getElementById("policy");
const text = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

function chart(id, series, data, opts = {}) {
  const el = document.getElementById(id);
  const width = Math.max(360, el.clientWidth || 480);
  // A chart whose series changed (a trainer began scoring) is drawn anew.
  const shape = series.map((x) => x.label).join("\u0000");
  if (charts[id] && charts[id].shape !== shape) { charts[id].destroy(); delete charts[id]; }
  if (!charts[id]) {
    charts[id] = new uPlot({width, height: 220, series: [{}, ...series], ...opts}, data, el);
    charts[id].shape = shape;
  } else {
    charts[id].setData(data);
  }
}

const COLORS = ["#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#c2255c", "#0c8599"];
const fmt = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function scoring(p) {
  const sc = p.scoring, s = sc.series, queued = p.series.scoring_waiting;
  // Scored groups generated before any scorer started wait: the section shows them too.
  const waiting = queued.length ? queued[queued.length - 1] : 0;
  const on = p.scorers.length > 0 || s.t.length > 0 || waiting > 0;
  document.querySelectorAll(".scoring").forEach((el) => { el.hidden = !on; });
  if (!on) return;
  // Per trainer: its mean reward each second, and a band of one standard deviation around it.
  const names = Object.keys(s.rewards).slice(0, COLORS.length);
  const series = [], data = [s.t], bands = [];
  names.forEach((name, i) => {
    const r = s.rewards[name], color = COLORS[i];
    const hi = r.mean.map((m, k) => (m === null ? null : m + r.std[k]));
    const lo = r.mean.map((m, k) => (m === null ? null : m - r.std[k]));
    const at = series.length + 1;
    series.push({label: name + " mean", stroke: color, width: 2, spanGaps: false},
                {label: name + " +std", stroke: color + "55", width: 1, dash: [4, 4]},
                {label: name + " -std", stroke: color + "55", width: 1, dash: [4, 4]});
    data.push(r.mean, hi, lo);
    bands.push({series: [at + 1, at + 2], fill: color + "22"});
  });
  chart("rewards", series, data, {bands});
  chart("scoring-rate", [{label: "groups scored/s", stroke: "#1c7ed6", width: 2},
                         {label: "ms per group", stroke: "#e8590c", width: 2, dash: [6, 4], scale: "ms"}],
        [s.t, s.scored_per_s, s.reward_ms],
        {axes: [{}, {label: "groups/s"}, {side: 1, scale: "ms", label: "ms per group", grid: {show: false}}]});
  const sr = p.scorers.map((x) => `<tr><td>${text(x.id)}</td>
    <td>${text(Object.entries(x.rewards).map(([n, v]) => n + " v" + v).join(", "))}</td>
    <td>${x.inflight}</td><td>${x.scored}</td><td>${x.reward_errors}</td><td>${x.restarts}</td>
    <td>${x.age_s} s</td></tr>`);
  document.getElementById("scorers").innerHTML =
    "<tr><th>scorer</th><th>rewards</th><th>held</th><th>scored</th><th>reward errors</th><th>child restarts</th><th>last beat</th></tr>" +
    (sr.join("") || `<tr><td class="empty" colspan="7">no live scorers${
      waiting ? ": " + waiting + " generated groups wait to be scored" : ""}</td></tr>`);
  const jr = sc.jobs.map((j) => {
    const r = j.record || {};
    return `<tr><td>${text(j.trainer)}</td><td>${text(j.job_id)}</td><td>${r.done ?? "–"}/${r.groups ?? "–"}</td>
      <td>${fmt(j.mean)} ± ${fmt(j.std)}</td><td>${j.rewards}</td><td>${j.missing}</td>
      <td>${r.ok ?? "–"}</td><td>${r.filtered ?? "–"}</td><td>${r.resampled ?? "–"}</td><td>${r.cancelled ?? "–"}</td>
      <td>${fmt(j.reward_ms, 1)}</td></tr>`;
  });
  document.getElementById("scored-jobs").innerHTML =
    "<tr><th>trainer</th><th>job</th><th>done</th><th>reward mean ± std</th><th>rewards</th><th>missing</th>" +
    "<th>ok</th><th>filtered</th><th>resampled</th><th>cancelled</th><th>ms per group</th></tr>" +
    (jr.join("") || '<tr><td class="empty" colspan="11">none yet</td></tr>');
}

function tiles(p) {
  const s = p.series, last = (a) => (a.length ? a[a.length - 1] : 0);
  const done = Object.values(p.results).reduce((a, b) => a + b, 0);
  const items = [["newest version", p.latest ?? "–"], ["groups done", done], ["generated ok", p.groups.ok || 0],
                 ["failed", (p.groups.failed || 0) + (p.groups.expired || 0)],
                 ["groups/s", last(s.groups_per_s).toFixed(2)], ["tokens/s", last(s.tokens_per_s).toFixed(0)],
                 ["waiting", last(s.waiting)], ["running", last(s.running)], ["workers", p.workers.length]];
  if (p.scorers.length || last(s.scoring_waiting) || last(s.scoring_running)) {
    items.push(["to score", last(s.scoring_waiting) + last(s.scoring_running)], ["scorers", p.scorers.length]);
  }
  document.getElementById("tiles").innerHTML = items.map(
    ([k, v]) => `<div class="tile" data-name="${text(k)}"><b>${text(v)}</b>${text(k)}</div>`).join("");
}

// A worker's latest version canary check: a refusal colours its whole row.
function canary(c) {
  if (!c) return "–";
  const word = c.accepted ? "accepted" : "REFUSED";
  return `<span class="canary ${c.accepted ? "accepted" : "refused"}">v${c.version}${c.adapter ? " (adapter)" : ""} ${word}</span>
    max |Δ| ${fmt(c.max_abs, 4)} (≤ ${c.tolerance.max_abs}), mean ${fmt(c.mean_abs, 5)}, k3 ${Number(c.kl).toExponential(1)}`;
}

function tables(p) {
  const w = p.workers.map((x) => `<tr class="${x.canary && !x.canary.accepted ? "refused" : ""}" data-worker="${text(x.id)}">
    <td>${text(x.id)}${x.pinned ? " (pinned)" : ""}</td><td>v${x.version}</td>
    <td><span class="state ${text(x.state)}">${text(x.state)}</span></td><td>${x.inflight} in flight</td>
    <td>${canary(x.canary)}</td><td>${text(x.last_error || "")}</td></tr>`);
  document.getElementById("workers").innerHTML =
    "<tr><th>worker</th><th>version</th><th>state</th><th>load</th><th>canary</th><th>last error</th></tr>" +
    (w.join("") || '<tr><td class="empty" colspan="6">no live workers</td></tr>');
  const f = p.failures.map((x) => `<tr><td>${new Date(x.at * 1000).toLocaleTimeString()}</td>
    <td>${text(x.status)}</td><td>${text(x.job_id)}${x.group_index >= 0 ? "/" + x.group_index : ""}</td>
    <td>${text(x.reason)}</td></tr>`);
  document.getElementById("failures").innerHTML = f.join("") || '<tr><td class="empty">none</td></tr>';
}

// The gap trainers reported: a line per worker over versions, and a table where a worker that
// disagrees with the version's others stands out.
function gap(p) {
  const g = p.gap, on = g.versions.length > 0;
  document.querySelectorAll(".gap").forEach((el) => { el.hidden = !on; });
  if (!on) return;
  const xs = g.versions.map((v) => v.version);
  const names = [...new Set(g.workers.map((r) => r.worker))].slice(0, COLORS.length);
  const at = (worker) => xs.map((v) => { const r = g.workers.find((x) => x.version === v && x.worker === worker);
                                         return r ? r.mean_abs : null; });
  chart("gap-chart", [{label: "all workers", stroke: "#1d2330", width: 2},
                      ...names.map((n, i) => ({label: n || "(unnamed)", stroke: COLORS[i], width: 1.5,
                                               points: {show: true}}))],
        [xs, g.versions.map((v) => v.mean_abs), ...names.map(at)],
        {scales: {x: {time: false}}, axes: [{label: "version"}, {label: "mean |Δ logprob|"}]});
  const rows = [];
  for (const v of [...g.versions].reverse()) {
    for (const r of [v, ...g.workers.filter((x) => x.version === v.version)]) {
      rows.push(`<tr class="${r.outlier ? "outlier" : ""}" data-version="${r.version}" data-worker="${text(r.worker)}">
        <td>v${r.version}</td><td>${r.worker === "*" ? "<b>all</b>" : text(r.worker || "(unnamed)")}${r.outlier ? " ⚠ stands out" : ""}</td>
        <td>${r.tokens}</td><td>${fmt(r.mean_abs, 4)}</td><td>${Number(r.kl).toExponential(2)}</td>
        <td>${(100 * r.over_1).toFixed(2)}%</td><td>${fmt(r.ratio_mean, 4)} ± ${fmt(r.ratio_std, 4)}</td></tr>`);
    }
  }
  document.getElementById("gap").innerHTML =
    "<tr><th>version</th><th>worker</th><th>tokens</th><th>mean |Δ|</th><th>KL (k3)</th><th>|Δ| &gt; 1</th><th>ratio mean ± std</th></tr>" +
    rows.join("");
}

function draw(p) {
  const s = p.series;
  chart("throughput", [{label: "groups/s", stroke: "#1c7ed6", width: 2},
                       {label: "tokens/s", stroke: "#2f9e44", width: 2, dash: [6, 4], scale: "tok"}],
        [s.t, s.groups_per_s, s.tokens_per_s],
        {axes: [{}, {label: "groups/s"}, {side: 1, scale: "tok", label: "tokens/s", grid: {show: false}}]});
  chart("depth", [{label: "waiting", stroke: "#f08c00", fill: "#f08c0022", width: 2},
                  {label: "running", stroke: "#7048e8", width: 2},
                  {label: "to score", stroke: "#0c8599", width: 2, dash: [6, 4]},
                  {label: "scoring", stroke: "#ae3ec9", width: 2, dash: [2, 3]}],
        [s.t, s.waiting, s.running, s.scoring_waiting, s.scoring_running]);
  // Every lag from 0 to the largest seen (at least 4), so the bars read as a histogram.
  const top = Math.max(4, ...Object.keys(p.lag).map(Number));
  const xs = Array.from({length: top + 1}, (_, k) => k);
  chart("lag", [{label: "samples", stroke: "#c2255c", fill: "#c2255c55", paths: uPlot.paths.bars({size: [0.6]})}],
        [xs, xs.map((k) => p.lag[String(k)] || 0)],
        {scales: {x: {time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5]}},
         axes: [{label: "versions behind", incrs: [1], values: (u, vals) => vals.map((v) => Number.isInteger(v) ? v : "")},
                {label: "samples"}]});
  tiles(p);
  tables(p);
  gap(p);
  scoring(p);
}

async function refresh() {
  try {
    // The token comes in the URL's fragment (/#token=...), which the browser never sends.
    const token = new URLSearchParams(location.hash.slice(1)).get("token");
    const r = await fetch("/api/dashboard", token ? {headers: {Authorization: "Bearer " + token}} : {});
    const d = await r.json();
    const names = Object.keys(d.policies);
    if (names.join() !== [...select.options].map((o) => o.value).join()) {
      // Keep the policy shown; at first, the one the URL names (?policy=...).
      const keep = select.value || new URLSearchParams(location.search).get("policy");
      select.innerHTML = names.map((n) => `<option>${text(n)}</option>`).join("");
      if (names.includes(keep)) select.value = keep;
    }
    document.getElementById("health").textContent = d.healthy ? "live · " + new Date().toLocaleTimeString()
                                                              : "redis unreachable";
    document.body.dataset.updated = String(d.now);
    if (select.value) draw(d.policies[select.value]);
  } catch (e) {
    document.getElementById("health").textContent = "gateway unreachable";
  }
}
select.addEventListener("change", () => {
  for (const k in charts) { charts[k].destroy(); delete charts[k]; }
  history.replaceState(null, "", "?policy=" + encodeURIComponent(select.value));
  refresh();
});
refresh();
setInterval(refresh, 1000);
