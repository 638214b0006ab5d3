// rollq dashboard: polls /api/dashboard every second and draws it with uPlot.
"use strict";
const charts = {};
const select = document.getElementById("policy");
const text = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

function chart(id, series, data, opts = {}) {
  const el = document.getElementById(id);
  const width = Math.max(360, el.clientWidth || 480);
  if (!charts[id]) {
    charts[id] = new uPlot({width, height: 220, series: [{}, ...series], ...opts}, data, el);
  } else {
    charts[id].setData(data);
  }
}

function tiles(p) {
  const s = p.series, last = (a) => (a.length ? a[a.length - 1] : 0);
  const done = Object.values(p.groups).reduce((a, b) => a + b, 0);
  const items = [["newest version", p.latest ?? "–"], ["groups done", done], ["ok", p.groups.ok || 0],
                 ["failed", (p.groups.failed || 0) + (p.groups.expired || 0)],
                 ["groups/s", last(s.groups_per_s).toFixed(2)], ["tokens/s", last(s.tokens_per_s).toFixed(0)],
                 ["waiting", last(s.waiting)], ["running", last(s.running)], ["workers", p.workers.length]];
  document.getElementById("tiles").innerHTML = items.map(
    ([k, v]) => `<div class="tile" data-name="${text(k)}"><b>${text(v)}</b>${text(k)}</div>`).join("");
}

function tables(p) {
  const w = p.workers.map((x) => `<tr><td>${text(x.id)}${x.pinned ? " (pinned)" : ""}</td><td>v${x.version}</td>
    <td><span class="state ${text(x.state)}">${text(x.state)}</span></td><td>${x.inflight} in flight</td>
    <td>${text(x.last_error || "")}</td></tr>`);
  document.getElementById("workers").innerHTML =
    "<tr><th>worker</th><th>version</th><th>state</th><th>load</th><th>last error</th></tr>" +
    (w.join("") || '<tr><td class="empty" colspan="5">no live workers</td></tr>');
  const f = p.failures.map((x) => `<tr><td>${new Date(x.at * 1000).toLocaleTimeString()}</td>
    <td>${text(x.status)}</td><td>${text(x.job_id)}${x.group_index >= 0 ? "/" + x.group_index : ""}</td>
    <td>${text(x.reason)}</td></tr>`);
  document.getElementById("failures").innerHTML = f.join("") || '<tr><td class="empty">none</td></tr>';
}

function draw(p) {
  const s = p.series;
  chart("throughput", [{label: "groups/s", stroke: "#1c7ed6", width: 2},
                       {label: "tokens/s", stroke: "#2f9e44", width: 2, dash: [6, 4], scale: "tok"}],
        [s.t, s.groups_per_s, s.tokens_per_s],
        {axes: [{}, {label: "groups/s"}, {side: 1, scale: "tok", label: "tokens/s", grid: {show: false}}]});
  chart("depth", [{label: "waiting", stroke: "#f08c00", fill: "#f08c0022", width: 2},
                  {label: "running", stroke: "#7048e8", width: 2}], [s.t, s.waiting, s.running]);
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
