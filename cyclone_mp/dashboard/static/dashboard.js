// cyclone-mp dashboard: keeps a page current without a full reload.
// Every page names its JSON API in <body data-api>; this script fetches it every
// data-refresh seconds and redraws the parts that change, with the same markup the
// server renders. DOM nodes are built with textContent (never innerHTML from data).
(function () {
  "use strict";

  var body = document.body;
  var api = body.dataset.api;
  var every = parseFloat(body.dataset.refresh || "0") * 1000;
  var page = body.dataset.page;
  var SVG = "http://www.w3.org/2000/svg";
  var STEP_STATES = ["pending", "available", "running", "waiting_signal", "waiting_timer", "paused",
                     "completed", "discarded", "cancelled"];
  var RUN_STATES = ["running", "paused", "completed", "discarded", "cancelled"];

  // -- tiny DOM helpers ---------------------------------------------------------------------

  function h(tag, attrs) {
    var node = document.createElement(tag);
    var kids = Array.prototype.slice.call(arguments, 2);
    Object.keys(attrs || {}).forEach(function (k) {
      if (attrs[k] !== null && attrs[k] !== undefined && attrs[k] !== false) node.setAttribute(k, attrs[k]);
    });
    kids.forEach(function (kid) { add(node, kid); });
    return node;
  }
  function add(node, kid) {
    if (kid === null || kid === undefined || kid === false) return;
    if (Array.isArray(kid)) { kid.forEach(function (k) { add(node, k); }); return; }
    node.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  function s(tag, attrs) {
    var node = document.createElementNS(SVG, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    Array.prototype.slice.call(arguments, 2).forEach(function (kid) {
      if (kid) node.appendChild(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    });
    return node;
  }
  function fill(id, rows) {
    var target = document.getElementById(id);
    if (!target) return;
    var open = {};
    target.querySelectorAll("[data-key] details[open]").forEach(function (d) {
      open[d.closest("[data-key]").dataset.key] = true;
    });
    target.replaceChildren.apply(target, rows);
    target.querySelectorAll("[data-key]").forEach(function (row) {
      var d = row.querySelector("details");
      if (d && open[row.dataset.key]) d.open = true;
    });
  }
  function setText(selector, value) {
    document.querySelectorAll(selector).forEach(function (node) { node.textContent = String(value); });
  }

  // -- formatting (mirrors the template filters) -----------------------------------------------

  function pad(n, w) { n = String(n); while (n.length < (w || 2)) n = "0" + n; return n; }
  function fmtTime(iso) {
    if (!iso) return "-";
    var d = new Date(iso);
    if (isNaN(d.getTime())) return "-";
    return d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate()) + " " +
      pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + ":" + pad(d.getUTCSeconds()) + "." +
      pad(d.getUTCMilliseconds(), 3);
  }
  function when(iso) { return iso ? h("time", {datetime: iso}, fmtTime(iso)) : "-"; }
  function secs(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits === undefined ? 2 : digits) + "s"; }
  function mib(bytes) { return bytes === null || bytes === undefined ? "-" : (bytes / 1048576).toFixed(1) + " MiB"; }
  function kib(kb) { return kb === null || kb === undefined ? "-" : (kb / 1024).toFixed(1) + " MiB"; }
  function pct(v) { return v === null || v === undefined ? "-" : Number(v).toFixed(0) + "%"; }
  function short(text, limit) {
    if (text === null || text === undefined) return "";
    var flat = String(text).split(/\s+/).join(" ").trim();
    return flat.length <= limit ? flat : flat.slice(0, limit - 1) + "\u2026";
  }
  function badge(state) { return h("span", {"class": "badge s-" + state}, state); }
  function yesno(v) { return v === null || v === undefined ? "-" : (v ? h("strong", {"class": "bad"}, "yes") : "no"); }
  function runLink(id) { return h("a", {href: "/runs/" + id, title: id}, h("code", {}, id.slice(0, 8))); }
  function td(content, cls) { return h("td", cls ? {"class": cls} : {}, content); }
  function emptyRow(cols, text) { return h("tr", {}, h("td", {colspan: cols, "class": "empty"}, text)); }
  function progress(p) {
    if (!p) return "";
    var out = [];
    if (p.total) {
      out.push(h("progress", {max: p.total, value: Math.min(p.done || 0, p.total)}), " " + p.done + "/" + p.total);
    } else if (p.done !== null && p.done !== undefined) {
      out.push(String(p.done));
    }
    if (p.message) out.push(" ", h("span", {"class": "muted"}, short(p.message, 40)));
    return out;
  }

  // -- overview -------------------------------------------------------------------------------

  function chart(tp) {
    var svg = document.getElementById("chart");
    if (!svg) return;
    var width = 600, height = 120, per = tp.per_minute, n = Math.max(1, per.length);
    var top = 0;
    per.forEach(function (p) { top = Math.max(top, p.completed + p.discarded); });
    var scale = top ? (height - 4) / top : 0, slot = width / n;
    var kids = [s("line", {"class": "axis", x1: 0, y1: height - 0.5, x2: width, y2: height - 0.5})];
    per.forEach(function (p, i) {
      var doneH = p.completed * scale, badH = p.discarded * scale, x = i * slot + 1, w = Math.max(1, slot - 2);
      kids.push(s("g", {},
        s("title", {}, p.minute + ": " + p.completed + " completed, " + p.discarded + " discarded"),
        s("rect", {"class": "bar-done", x: x, y: height - doneH, width: w, height: doneH}),
        s("rect", {"class": "bar-bad", x: x, y: height - doneH - badH, width: w, height: badH})));
    });
    svg.replaceChildren.apply(svg, kids);
  }

  // A chart whose geometry the API gives (views._bars): one bar per minute, in segments.
  function bars(id, c) {
    var svg = document.getElementById(id);
    if (!svg || !c) return;
    var kids = [s("line", {"class": "axis", x1: 0, y1: c.height - 0.5, x2: c.width, y2: c.height - 0.5})];
    c.bars.forEach(function (b) {
      var g = s("g", {}, s("title", {}, b.title));
      b.segments.forEach(function (seg) {
        g.appendChild(s("rect", {"class": seg.cls, x: b.x, y: seg.y, width: b.w, height: seg.h}));
      });
      kids.push(g);
    });
    svg.replaceChildren.apply(svg, kids);
  }

  function hourCharts(d) {
    if (!d.pickup) return;
    setText('[data-count="pickup.steps"]', d.pickup.steps);
    setText('[data-count="pickup.worst_p95"]', secs(d.pickup.worst_p95, 3));
    bars("pickup-chart", d.pickup.chart);
    bars("kills-chart", d.kill_triggers.chart);
    var legend = [];
    d.kill_triggers.by_trigger.forEach(function (t, i) {
      if (i) legend.push(" \u00b7 ");
      legend.push(h("span", {"class": "key " + t.cls}), " " + t.trigger + " ", h("strong", {}, t.n));
    });
    fill("kill-triggers", legend.length ? legend : ["no kills in the last hour"]);
    var rows = d.durations.map(function (r) {
      return h("tr", {"data-step": r.step}, td(r.step), td(r.n, "num"), td(secs(r.p50, 3), "num"),
        td(secs(r.p95, 3), "num"), td(secs(r.p99, 3), "num"), td(secs(r.max, 3), "num"));
    });
    fill("durations", rows.length ? rows : [emptyRow(6, "no step completed in the last hour")]);
  }

  function worker(w) {
    var rows = w.children.map(function (k) {
      return h("tr", k.busy ? {"class": "busy"} : {},
        td(k.pid), td(k.step || "idle"), td(k.node || ""), td(k.run_id ? runLink(k.run_id) : ""),
        td(k.attempt || "", "num"), td(k.busy ? secs(k.elapsed, 1) : "-", "num"), td(pct(k.cpu_percent), "num"),
        td(mib(k.rss), "num"), td(k.steps_run, "num"));
    });
    if (!rows.length) rows = [emptyRow(9, "no children")];
    var st = w.stats || {};
    var failing = w.failing || [];
    return h("article", {"class": "worker"},
      h("h3", {}, h("code", {}, w.id), w.draining ? [" ", h("span", {"class": "badge s-paused"}, "draining")] : null,
        failing.map(function (f) { return [" ", h("span", {"class": "badge s-discarded", "title": f.error}, f.task + " failing")]; })),
      failing.map(function (f) {
        return h("p", {"class": "failing"}, "maintenance task ", h("strong", {}, f.task), " failed " + f.failures +
          " times in a row (for " + secs(f["for"], 0) + "): " + f.error);
      }),
      h("p", {"class": "muted"}, "host " + w.hostname + " \u00b7 pid " + w.pid + " \u00b7 " + w.workers +
        " children \u00b7 queues " + w.queues.map(function (q) {
          return (w.paused_queues || []).indexOf(q) >= 0 ? q + " (paused)" : q;
        }).join(", ") + " \u00b7 up since ", when(w.started_at),
        " \u00b7 seen " + w.age + "s ago \u00b7 completed " + (st.completed || 0) + ", failed " + (st.failed || 0) +
        ", killed " + (st.killed || 0)),
      h("table", {"class": "grid"},
        h("thead", {}, h("tr", {}, ["pid", "step", "node", "run", "attempt", "elapsed", "CPU %", "RSS", "steps run"]
          .map(function (t, i) { return h("th", i >= 4 && i !== 3 ? {"class": "num"} : {}, t); }))),
        h("tbody", {}, rows)));
  }

  function overview(d) {
    RUN_STATES.forEach(function (st) { setText('[data-count="runs.' + st + '"]', d.runs.by_state[st]); });
    setText('[data-count="runs.total"]', d.runs.total);
    setText('[data-count="archived.total"]', d.archived.total);
    Object.keys(d.archived.by_state).forEach(function (st) { setText('[data-count="archived.' + st + '"]', d.archived.by_state[st]); });
    STEP_STATES.forEach(function (st) { setText('[data-count="steps.' + st + '"]', d.steps.by_state[st]); });
    setText('[data-count="steps.total"]', d.steps.total);
    setText('[data-count="throughput.completed"]', d.throughput.completed);
    setText('[data-count="throughput.discarded"]', d.throughput.discarded);
    setText('[data-count="throughput.max"]', d.throughput.max);
    setText('[data-count="workers.length"]', d.workers.length);
    chart(d.throughput);
    hourCharts(d);
    var byName = d.steps.by_name.map(function (g) {
      return h("tr", {}, td(g.name), td(g.queue), STEP_STATES.map(function (st) {
        return td(g.by_state[st], g.by_state[st] ? "num" : "num zero");
      }), td(h("strong", {}, g.total), "num"));
    });
    fill("by-name", byName.length ? byName : [emptyRow(STEP_STATES.length + 3, "no steps yet")]);
    var workers = d.workers.map(worker);
    fill("workers", workers.length ? workers :
      [h("p", {"class": "empty"}, "no live supervisors (none refreshed its registry row in the last 15 s)")]);
    var kills = d.kills.map(function (k) {
      var msg = td(short(k.message, 400), "msg");
      msg.title = k.message || "";
      return h("tr", {}, td(when(k.at)), td(runLink(k.run_id)), td(k.node), td(k.attempt, "num"),
        td(h("span", {"class": "kind"}, k.kind)), td(k.exit),
        td([yesno(k.killed_by_supervisor), k.trigger ? [" ", h("span", {"class": "muted"}, "after " + k.trigger)] : null]),
        td([secs(k.cpu_seconds, 3), h("div", {}, kib(k.peak_rss_kb)), h("div", {}, secs(k.elapsed))], "num"),
        td(badge(k.state)), msg);
    });
    fill("kills", kills.length ? kills : [emptyRow(10, "no kills")]);
  }

  // -- runs -----------------------------------------------------------------------------------

  function runs(d) {
    setText("#runs-total", d.total + (d.total_capped ? "+" : ""));
    var rows = d.runs.map(function (r) {
      var chips = STEP_STATES.filter(function (st) { return r.steps[st]; }).map(function (st) {
        return h("span", {"class": "chip s-" + st, title: st}, r.steps[st] + " " + st);
      });
      return h("tr", {"data-run": r.id}, td(runLink(r.id)),
        td([r.name, r.parent_id ? [" ", h("span", {"class": "muted sub"}, "spawned by ", runLink(r.parent_id))] : null]),
        td(r.kind), td(badge(r.state)),
        td(chips, "steps"), td(when(r.created_at)), td(when(r.finished_at)));
    });
    fill("runs-rows", rows.length ? rows : [emptyRow(7, "no runs match")]);
  }

  // -- one run --------------------------------------------------------------------------------

  function run(d) {
    fill("run-state", [badge(d.state)]);
    fill("run-updated", [when(d.updated_at)]);
    fill("run-finished", [when(d.finished_at)]);
    var actions = ["cancel", "retry", "pause", "resume", "signal"].filter(function (a) { return d.actions[a]; })
      .map(function (a) {
        return h("a", {"class": "button" + (a === "cancel" ? " danger" : ""), "data-action": a,
          href: "/runs/" + d.id + "/" + a}, a.charAt(0).toUpperCase() + a.slice(1) + (a === "signal" ? "\u2026" : ""));
      });
    fill("actions", actions);
    d.graph.nodes.forEach(function (n) {
      document.querySelectorAll("#graph g.node").forEach(function (g) {
        if (g.dataset.node !== n.name) return;
        g.setAttribute("class", "node s-" + n.state);
        var label = g.querySelector("text.state");
        if (label) label.textContent = n.state;
        var title = g.querySelector("title");
        if (title) title.textContent = n.name + " (" + n.kind + "): " + n.state;
      });
    });
    fill("steps-rows", d.steps.map(function (st) {
      var sched = st.kind === "timer" && st.due_at ? st.due_at : st.scheduled_at;
      var times = [["scheduled", sched], ["started", st.started_at], ["finished", st.finished_at],
                   ["heartbeat", st.heartbeat_at]].filter(function (t) { return t[1]; }).map(function (t) {
        return h("div", {}, h("span", {"class": "muted"}, t[0]), " ", when(t[1]));
      });
      var sub = st.kind + " \u00b7 " + st.queue + (st.timeout !== null && st.timeout !== undefined ?
        " \u00b7 timeout " + secs(st.timeout, 1) : "");
      return h("tr", {"data-node": st.name},
        td([h("strong", {}, st.name), st.step_name && st.step_name !== st.name ?
          [" ", h("span", {"class": "muted"}, "(" + st.step_name + ")")] : null, h("div", {"class": "muted sub"}, sub),
          st.limits ? h("div", {"class": "muted sub limits"}, st.limits) : null,
          st.items_summary ? h("div", {"class": "sub items"}, st.items_summary) : null]),
        td([badge(st.state), st.paused_from ? [" ", h("span", {"class": "muted"}, "from " + st.paused_from)] : null]),
        td(st.attempt_shown + "/" + st.max_attempts, "num"),
        td(st.reclaims + (st.max_reclaims !== null && st.max_reclaims !== undefined ? "/" + st.max_reclaims : ""), "num"),
        td(times, "times"), td(secs(st.elapsed), "num"), td(progress(st.progress), "progress"),
        td(st.lease_owner || "", "owner"),
        td([st.error_kind ? [h("span", {"class": "kind"}, st.error_kind), " "] : null, short(st.error, 300)], "msg"));
    }));
    var rows = [];
    d.attempts.forEach(function (a) {
      rows.push(h("tr", {"class": "attempt", "data-node": a.node, "data-attempt": a.attempt, "data-outcome": a.outcome},
        td(a.node), td(a.attempt, "num"), td(h("span", {"class": "kind o-" + a.outcome}, a.outcome)), td(a.exit, "exit"),
        td(yesno(a.killed_by_supervisor), "killed"), td(a.trigger || "-", "trigger"), td(secs(a.cpu_seconds, 3), "num"),
        td(kib(a.peak_rss_kb), "num"), td(secs(a.elapsed), "num"), td(when(a.at || a.finished_at || a.started_at)),
        td([a.type ? [h("code", {}, a.type), " "] : null, short(a.message, 300)], "msg")));
      if (a.traceback) {
        rows.push(h("tr", {"class": "tb", "data-key": a.node + "#" + a.attempt},
          h("td", {colspan: 11}, h("details", {}, h("summary", {}, "traceback"), h("pre", {}, a.traceback)))));
      }
    });
    fill("attempts-rows", rows.length ? rows : [emptyRow(11, "no attempt yet")]);
    var signals = d.signals.map(function (g) {
      return h("li", {}, h("code", {}, g.name), " at ", when(g.created_at), ": ", h("code", {}, JSON.stringify(g.payload)));
    });
    fill("signals", signals.length ? signals : [h("li", {"class": "empty"}, "none received")]);
    var outputs = [];
    d.outputs.forEach(function (o) {  // every finished task node: its output, or why it has none
      outputs.push(h("h3", {"data-node": o.node}, o.node));
      if (o.state === "completed") outputs.push(h("pre", {"class": "json"}, JSON.stringify(o.output, null, 2)));
      if (o.note) outputs.push(h("p", {"class": "empty"}, o.note));
    });
    if (d.outputs_note) outputs.push(h("p", {"class": "empty"}, d.outputs_note));
    fill("outputs", outputs);
  }

  // -- the refresh loop -------------------------------------------------------------------------

  var render = {overview: overview, runs: runs, run: run}[page];
  var live = document.getElementById("live");
  var count = 0;

  function schedule() { window.setTimeout(tick, every); }

  function tick() {
    if (document.hidden) { schedule(); return; }
    fetch(api, {credentials: "same-origin", headers: {Accept: "application/json"}, cache: "no-store"})
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) {
        render(data);
        if (data.now) {
          var clock = document.getElementById("db-now");
          if (clock) { clock.setAttribute("datetime", data.now); clock.textContent = fmtTime(data.now); }
        }
        count += 1;
        body.dataset.refreshed = String(count);
        if (live) { live.textContent = "live"; live.classList.remove("stale"); live.title = "updated from " + api; }
      })
      .catch(function (err) {
        if (live) { live.textContent = "stale: " + err.message; live.classList.add("stale"); }
      })
      .then(schedule);
  }

  if (render && api && every > 0) schedule();
})();
