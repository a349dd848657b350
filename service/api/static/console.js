// The jitserve console (service/api/routes/console.py): polls the JSON routes under
// /v1/console and draws them. Plain DOM and inline SVG; every value is set as text,
// never as markup (program names are the callers' own words). The API key stays in
// this tab's sessionStorage; "/console#key=..." sets it without a form.
"use strict";

(() => {
  const STORE = "jitserve.console.key";
  const POLL_MS = 2000;
  const DEVICES_EVERY = 3; // polls: the device memory walk costs the runtimes a little
  // The SVG namespace, as the HTML parser gives it (no address written here: the page
  // names nothing outside this server).
  const SVG = (() => {
    const t = document.createElement("template");
    t.innerHTML = "<svg></svg>";
    return t.content.firstChild.namespaceURI;
  })();
  const TIER_ORDER = ["memory", "disk", "redis", "compiled"];
  const $ = (id) => document.getElementById(id);

  // -- the key ---------------------------------------------------------------------

  function takeKeyFromHash() {
    const match = /(?:^#|&)key=([^&]*)/.exec(window.location.hash);
    if (match) {
      sessionStorage.setItem(STORE, decodeURIComponent(match[1]));
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
  }

  function key() {
    return sessionStorage.getItem(STORE);
  }

  async function get(path) {
    const headers = { Accept: "application/json" };
    if (key()) headers.Authorization = "Bearer " + key();
    const answer = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    const body = await answer.json().catch(() => null);
    if (!answer.ok) {
      const error = new Error((body && body.error && body.error.message) || answer.statusText);
      error.status = answer.status;
      throw error;
    }
    return body;
  }

  // -- formatting ------------------------------------------------------------------

  function bytes(n) {
    if (n === null || n === undefined) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function seconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(s < 10 ? 3 : 1) + " s";
  }

  function age(s) {
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return (s / 60).toFixed(0) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  }

  function percent(x) {
    return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
  }

  function programName(doc) {
    return doc.name ? doc.name + " (" + doc.program_id.slice(0, 12) + ")" : doc.program_id.slice(0, 12);
  }

  // -- DOM -------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
    }
    return node;
  }

  // Replace the rows of table ``id``: ``rows`` of [attrs, cells...]; ``empty`` if none.
  function fill(id, rows, empty) {
    const body = $(id).tBodies[0];
    const columns = $(id).tHead.rows[0].cells.length;
    body.replaceChildren();
    if (!rows.length) {
      body.append(el("tr", { class: "empty" }, el("td", { colspan: columns }, empty)));
      return;
    }
    for (const [attrs, ...cells] of rows) {
      body.append(el("tr", attrs, ...cells.map((c) => (c instanceof Node && c.nodeName === "TD" ? c : el("td", {}, c)))));
    }
  }

  function cell(cls, text, title) {
    return el("td", { class: cls, title }, text);
  }

  // -- charts (inline SVG) ---------------------------------------------------------

  const W = 360, H = 110, PAD = { l: 42, r: 6, t: 6, b: 16 };

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    return node;
  }

  function frame(container, top, format) {
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img" });
    const y0 = H - PAD.b;
    root.append(svg("line", { x1: PAD.l, y1: y0, x2: W - PAD.r, y2: y0, class: "axis" }));
    root.append(svg("line", { x1: PAD.l, y1: PAD.t, x2: PAD.l, y2: y0, class: "axis" }));
    const label = svg("text", { x: PAD.l - 4, y: PAD.t + 8, class: "tick", "text-anchor": "end" });
    label.textContent = format(top);
    const zero = svg("text", { x: PAD.l - 4, y: y0, class: "tick", "text-anchor": "end" });
    zero.textContent = format(0);
    const now = svg("text", { x: W - PAD.r, y: H - 3, class: "tick", "text-anchor": "end" });
    now.textContent = "now";
    root.append(label, zero, now);
    container.replaceChildren(root);
    return root;
  }

  function xOf(i, n) {
    return PAD.l + ((W - PAD.l - PAD.r) * (i + 0.5)) / Math.max(n, 1);
  }

  function yOf(v, top) {
    return H - PAD.b - ((H - PAD.t - PAD.b) * v) / (top || 1);
  }

  // Lines: ``series`` of {name, cls, values} (null: no value there).
  function lineChart(container, series, format) {
    const top = Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null))) || 1;
    const root = frame(container, top, format);
    for (const s of series) {
      const n = s.values.length;
      let path = "";
      s.values.forEach((v, i) => {
        if (v === null) return;
        path += (path ? " L" : "M") + xOf(i, n).toFixed(1) + "," + yOf(v, top).toFixed(1);
      });
      if (path) {
        const line = svg("path", { d: path, class: "line " + s.cls });
        const title = svg("title");
        title.textContent = s.name;
        line.append(title);
        root.append(line);
      }
    }
  }

  // Stacked bars: ``points`` of {name: count}, ``names`` in stacking order.
  function barChart(container, points, names, format, normalize) {
    const totals = points.map((p) => names.reduce((sum, k) => sum + (p[k] || 0), 0));
    const top = normalize ? 1 : Math.max(1, ...totals);
    const root = frame(container, top, format);
    const n = points.length, width = Math.max(1, (W - PAD.l - PAD.r) / Math.max(n, 1) - 1);
    points.forEach((p, i) => {
      let base = 0;
      names.forEach((k, j) => {
        const v = (p[k] || 0) / (normalize ? totals[i] || 1 : 1);
        if (!v) return;
        const y = yOf(base + v, top), h = yOf(base, top) - y;
        const bar = svg("rect", { x: (xOf(i, n) - width / 2).toFixed(1), y: y.toFixed(1),
                                  width: width.toFixed(1), height: h.toFixed(1), class: "bar s" + (j % 8) });
        const title = svg("title");
        title.textContent = `${k}: ${p[k]}`;
        bar.append(title);
        root.append(bar);
        base += v;
      });
    });
  }

  function legend(id, names) {
    $(id).replaceChildren(...names.map((k, j) => el("li", { class: "s" + (j % 8) }, k)));
  }

  // -- panels ------------------------------------------------------------------------

  function showDevices(doc) {
    const b = doc.backend;
    const kinds = [b.platform, b.device_kind].filter((k, i, all) => k && all.indexOf(k) === i).join(" ");
    $("devices-summary").textContent =
      `${kinds} · futures hold ${bytes(doc.device_bytes_in_use)} of ${bytes(doc.max_device_bytes)} ` +
      `(JITSERVE_MAX_DEVICE_BYTES) · ${doc.live_futures} of ${doc.max_live_futures} live futures`;
    fill("devices-table", doc.devices.map((d) => {
      const m = d.memory || {};
      return [{ "data-device": d.id }, cell("c-device", d.id + (d.default ? " (default)" : "")),
              cell("c-kind", d.device_kind || d.platform || ""), cell("c-group", d.group),
              meter(m.in_use || 0, m.limit), cell("c-limit", m.limit ? bytes(m.limit) : "not reported")];
    }), "no devices reported yet");
    fill("runtimes-table", doc.runtimes.map((r) => {
      const exit = r.last_exit ? (r.last_exit_at ? clock(r.last_exit_at) + " " : "") + r.last_exit +
        (r.last_exit_code ? " (" + r.last_exit_code + ")" : "") : "–";
      return [{ "data-runtime": r.index, class: "state-" + r.state }, cell("c-index", r.index),
              cell("c-group", r.group), cell("c-state", r.state), cell("c-pid", r.pid ?? "–"),
              cell("c-restarts", r.restarts), cell("c-in-flight", r.in_flight), cell("c-last-exit", exit)];
    }), "no runtimes");
    fill("holders-table", doc.holders.map((h) => [{ "data-key": h.key }, cell("c-key", h.key),
      cell("c-live", h.live_futures), cell("c-bytes", bytes(h.device_bytes), String(h.device_bytes))]),
      "no live futures");
  }

  function meter(used, limit) {
    const td = el("td", { class: "c-in-use", "data-bytes": used }, bytes(used));
    if (limit) {
      const bar = svg("svg", { viewBox: "0 0 100 6", class: "meter" });
      bar.append(svg("rect", { x: 0, y: 0, width: 100, height: 6, class: "meter-bg" }),
                 svg("rect", { x: 0, y: 0, width: Math.min(100, (100 * used) / limit).toFixed(1), height: 6, class: "meter-fg" }));
      td.append(bar);
    }
    return td;
  }

  function compileRow(c) {
    const why = c.error ? c.error.code + ": " + c.error.message
      : (c.recompiled_because || []).join("; ");
    return [{ "data-executable": c.executable_id, "data-program": c.program_id, "data-tier": c.tier, class: "tier-" + c.tier },
            cell("c-when", clock(c.at)), cell("c-key", c.key), cell("c-program", programName(c), c.program_id),
            cell("c-signature", c.signature), cell("c-tier", c.tier), cell("c-seconds", seconds(c.seconds)),
            cell(c.error ? "c-error" : "c-because", why)];
  }

  function showCompiles(doc) {
    const tiers = doc.hit_rate;
    const names = TIER_ORDER.concat(Object.keys(tiers.totals.tiers).filter((t) => !TIER_ORDER.includes(t)));
    barChart($("tiers-chart"), tiers.points.map((p) => p.tiers), names, (v) => percent(v), true);
    legend("tiers-legend", names);
    const totals = tiers.totals.tiers;
    $("hit-rate").textContent = tiers.totals.hit_rate === null ? "(no calls yet)"
      : `${percent(tiers.totals.hit_rate)} over ${Math.round(tiers.window_s / 60)} min · ` +
        names.filter((t) => totals[t]).map((t) => `${t} ${totals[t]}`).join(", ");
    fill("slowest-table", doc.slowest.map((c) => [{ "data-program": c.program_id },
      cell("c-program", programName(c), c.program_id), cell("c-signature", c.signature),
      cell("c-seconds", seconds(c.seconds))]), "no compiles yet");
    fill("recompiled-table", doc.most_recompiled.map((p) => [{ "data-program": p.program_id },
      cell("c-program", programName(p), p.program_id), cell("c-compiles", p.compiles),
      cell("c-because", (p.recompiled_because || []).join("; "))]), "no compiles yet");
    $("compiles-note").textContent = `(${doc.recent.length} of ${doc.kept} kept; ${doc.failed} refused)`;
    fill("compiles-table", doc.recent.map(compileRow), "no compiles yet");
  }

  function showWork(doc) {
    const t = doc.totals;
    const facts = [["calls", t.calls], ["calls per second", t.per_s], ["p50", seconds(t.p50_s)],
                   ["p90", seconds(t.p90_s)], ["p99", seconds(t.p99_s)],
                   ["window", Math.round(doc.window_s / 60) + " min, " + doc.step_s + " s points"]];
    const keys = ["calls", "per_s", "p50_s", "p90_s", "p99_s", "window"];
    $("work-totals").replaceChildren(...facts.map(([name, value], i) =>
      el("div", {}, el("dt", {}, name), el("dd", { "data-total": keys[i] }, value))));
    lineChart($("calls-chart"), [{ name: "calls/s", cls: "s0", values: doc.points.map((p) => p.per_s) }],
              (v) => (v >= 10 ? v.toFixed(0) : v.toFixed(1)));
    lineChart($("latency-chart"), ["p50_s", "p90_s", "p99_s"].map((k, j) =>
      ({ name: k, cls: "s" + j, values: doc.points.map((p) => p[k]) })), seconds);
    const codes = Object.keys(t.errors).sort();
    barChart($("errors-chart"), doc.points.map((p) => p.errors), codes, (v) => v.toFixed(0), false);
    legend("errors-legend", codes);
    fill("errors-table", Object.entries(t.errors).sort((a, b) => b[1] - a[1]).map(([code, n]) =>
      [{ "data-code": code }, cell("c-code", code), cell("c-count", n)]), "no errors");
    fill("quota-table", t.quota_refusals.map((q) => [{ "data-key": q.key, "data-quota": q.quota },
      cell("c-key", q.key), cell("c-quota", q.quota), cell("c-count", q.count)]), "no quota refusals");
  }

  function showSessions(doc) {
    $("sessions-note").textContent = doc.enabled ? `(${doc.sessions.length} open)`
      : "(the IFRT proxy is off: JITSERVE_IFRT_PORT)";
    fill("sessions-table", doc.sessions.map((s) => [{ "data-session": s.session },
      cell("c-session", s.session), cell("c-key", s.key), cell("c-runtime", s.runtime),
      cell("c-age", age(s.age_s)), cell("c-requests", s.requests),
      cell("c-bytes-in", bytes(s.bytes_in)), cell("c-bytes-out", bytes(s.bytes_out)),
      cell("c-device-bytes", bytes(s.device_bytes), String(s.device_bytes)),
      cell("c-compiles", Object.entries(s.compiles).map(([k, v]) => `${k} ${v}`).join(", "))]),
      doc.enabled ? "no open sessions" : "–");
  }

  // -- polling -----------------------------------------------------------------------

  const PANELS = [["/v1/console/devices", showDevices, DEVICES_EVERY],
                  ["/v1/console/compiles?seconds=600", showCompiles, 1],
                  ["/v1/console/work?seconds=300", showWork, 1],
                  ["/v1/console/sessions", showSessions, 1]];
  let round = 0, timer = null;

  async function poll() {
    const due = PANELS.filter(([, , every]) => round % every === 0);
    round += 1;
    const results = await Promise.allSettled(due.map(([path]) => get(path)));
    let failed = null;
    results.forEach((result, i) => {
      if (result.status === "fulfilled") {
        due[i][1](result.value);
        const v = result.value.viewer;
        $("viewer").textContent = v.admin ? `key ${v.key} · admin: every key's` : `key ${v.key} · only this key's`;
      } else {
        failed = result.reason;
      }
    });
    document.body.classList.toggle("needs-key", Boolean(failed && failed.status === 401));
    $("status").textContent = failed ? (failed.status === 401 ? "This server needs an API key: " : "") + failed.message
      : "updated " + clock(Date.now() / 1000);
    document.body.dataset.loaded = String(round);
  }

  function restart() {
    if (timer !== null) clearInterval(timer);
    round = 0;
    poll();
    timer = setInterval(poll, POLL_MS);
  }

  function start() {
    takeKeyFromHash();
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("key-input").value.trim();
      if (value) sessionStorage.setItem(STORE, value);
      $("key-input").value = "";
      restart();
    });
    $("key-forget").addEventListener("click", () => {
      sessionStorage.removeItem(STORE);
      restart();
    });
    restart();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
