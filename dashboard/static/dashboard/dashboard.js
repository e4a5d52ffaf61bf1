// Live queue dashboard: one websocket, rebuilt tables on every snapshot, SVG sparklines.
// Reconnects by itself with capped exponential backoff and shows a banner while down.
(function () {
  "use strict";
  var script = document.currentScript;
  var wsPath = (script && script.dataset.wsPath) || "/ws/dashboard/";
  var banner = document.getElementById("conn-banner");
  var connState = document.getElementById("conn-state");
  var attempt = 0;
  var socket = null;

  function fmtAge(s) {
    if (s === null || s === undefined) return "—";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function pct(x) { return (x * 100).toFixed(1) + " %"; }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function setText(id, text) { document.getElementById(id).textContent = text; }

  var SVG = "http://www.w3.org/2000/svg";
  var HISTORY_TICK_S = 1;  // a cell's history has one point per dashboard tick
  // A policy change as a marker on a time chart: a vertical line at x, its summary on hover.
  function changeMarker(m, x, top, bottom) {
    var line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", x); line.setAttribute("x2", x);
    line.setAttribute("y1", top); line.setAttribute("y2", bottom);
    line.setAttribute("class", "policy-change");
    line.setAttribute("data-change", m.id);
    var title = document.createElementNS(SVG, "title");
    title.textContent = new Date(m.ts * 1000).toLocaleTimeString() + " " + m.text +
      (m.user ? " (" + m.user + ", " + m.source + ")" : " (" + m.source + ")");
    line.appendChild(title);
    return line;
  }
  function sparkline(values, objective, changes, nowTs) {
    var w = 120, h = 28;
    var svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    if (!values.length) return svg;
    var max = Math.max(objective * 2, Math.max.apply(null, values)) || 1;
    var step = values.length > 1 ? w / (values.length - 1) : w;
    function y(v) { return (h - 1 - (v / max) * (h - 2)).toFixed(1); }
    var line = document.createElementNS(SVG, "line");  // the objective
    line.setAttribute("x1", 0); line.setAttribute("x2", w);
    line.setAttribute("y1", y(objective)); line.setAttribute("y2", y(objective));
    line.setAttribute("class", "objective");
    svg.appendChild(line);
    var pts = values.map(function (v, i) { return (i * step).toFixed(1) + "," + y(v); }).join(" ");
    var poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute("points", pts);
    poly.setAttribute("class", "age");
    svg.appendChild(poly);
    (changes || []).forEach(function (m) {
      var i = values.length - 1 - (nowTs - m.ts) / HISTORY_TICK_S;
      if (i >= 0 && i <= values.length - 1) svg.appendChild(changeMarker(m, (i * step).toFixed(1), 0, h));
    });
    return svg;
  }

  function renderPool(p) {
    setText("pool-slots", p.slots);
    setText("pool-busy", p.busy);
    setText("pool-in-flight", p.in_flight);
    setText("pool-batch", p.batch_in_flight);
    setText("pool-utilisation", pct(p.utilisation));
    setText("pool-batch-share", pct(p.batch_share));
    setText("pool-target", p.target);
    setText("pool-workers", p.workers);
  }

  function renderGrid(snap) {
    var grid = document.getElementById("grid");
    var head = el("tr");
    head.appendChild(el("th", null, "Shard"));
    snap.classes.forEach(function (c) { head.appendChild(el("th", null, c)); });
    grid.tHead.replaceChildren(head);
    var byKey = {};
    snap.cells.forEach(function (c) { byKey[c.shard + "\u0000" + c["class"]] = c; });
    var rows = snap.shards.map(function (shard) {
      var tr = el("tr");
      tr.appendChild(el("th", null, shard));
      snap.classes.forEach(function (cls) {
        var c = byKey[shard + "\u0000" + cls];
        var td = el("td", { "class": "cell " + (c ? c.state : ""), "data-shard": shard, "data-class": cls });
        if (c) {
          td.appendChild(el("div", { "class": "age" }, fmtAge(c.oldest_age_s)));
          td.appendChild(el("div", { "class": "sub" }, c.waiting + " waiting · objective " + fmtAge(c.objective_s)));
          td.appendChild(sparkline(c.history, c.objective_s, snap.policy_changes, snap.generated_ts));
          td.title = shard + " / " + cls + ": " + c.state;
        }
        tr.appendChild(td);
      });
      return tr;
    });
    grid.tBodies[0].replaceChildren.apply(grid.tBodies[0], rows);
  }

  function renderTenants(snap) {
    var body = document.querySelector("#tenants tbody");
    var rows = snap.tenants.map(function (t) {
      var tr = el("tr", { "data-tenant": t.slug, "class": t.active ? "" : "inactive" });
      tr.appendChild(el("td", { "class": "slug" }, t.slug));
      tr.appendChild(el("td", null, t.shard));
      tr.appendChild(el("td", { "class": "floor" }, t.floor));
      tr.appendChild(el("td", { "class": "limit" }, t.limit));
      var inflight = el("td", { "class": "in-flight" }, t.in_flight);
      if (t.in_flight >= t.limit && t.parked > 0) inflight.classList.add("throttled");
      tr.appendChild(inflight);
      var parts = Object.keys(t.parked_by_class).sort().map(function (k) { return k + " " + t.parked_by_class[k]; });
      tr.appendChild(el("td", { "class": "parked" }, t.parked + (parts.length ? " (" + parts.join(", ") + ")" : "")));
      tr.appendChild(el("td", { "class": "oldest" }, fmtAge(t.oldest_wait_s)));
      tr.appendChild(el("td", { "class": "rate" }, t.rate_per_min.toFixed(1)));
      tr.appendChild(el("td", { "class": "mean" }, fmtAge(t.mean_job_s)));
      return tr;
    });
    body.replaceChildren.apply(body, rows);
  }

  function renderRed(snap) {
    var list = document.getElementById("red-list");
    if (!snap.red.length) { list.replaceChildren(el("li", { "class": "none" }, "None.")); return; }
    list.replaceChildren.apply(list, snap.red.map(function (c) {
      return el("li", null, c.shard + " / " + c["class"] + ": oldest " + fmtAge(c.oldest_age_s) +
        " (objective " + fmtAge(c.objective_s) + "), " + c.waiting + " waiting");
    }));
  }

  // Capacity: slots live, slots desired and the forecast over the recorded hours, and the
  // forecast ahead of now (dashed). Plain SVG, no library.
  function fmtMinutes(s) { return s >= 3600 ? (s / 3600).toFixed(1) + " h" : Math.round(s / 60) + " min"; }
  function svgEl(tag, attrs) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    return e;
  }
  function capacityChart(cap, nowTs, changes) {
    var W = 760, H = 220, L = 40, R = 34, T = 10, B = 24;
    var hist = cap.history || [], ahead = cap.ahead || [];
    var t0 = hist.length ? Math.min(hist[0][0], nowTs - 3600) : nowTs - 3600;
    var t1 = ahead.length ? ahead[ahead.length - 1][0] : nowTs + 3600;
    var ymax = 4;
    hist.forEach(function (p) { ymax = Math.max(ymax, p[1], p[3], p[4]); });
    ahead.forEach(function (p) { ymax = Math.max(ymax, p[1]); });
    ymax = Math.max(ymax, cap.desired, cap.slots) * 1.1;
    function x(t) { return (L + (t - t0) / (t1 - t0) * (W - L - R)).toFixed(1); }
    function y(v) { return (T + (1 - v / ymax) * (H - T - B)).toFixed(1); }
    var svg = svgEl("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    var grid = svgEl("g", { "class": "grid" });
    var step = Math.max(1, Math.ceil(ymax / 5));
    for (var v = 0; v <= ymax; v += step) {
      grid.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      var label = svgEl("text", { x: L - 6, y: +y(v) + 4, "text-anchor": "end" });
      label.textContent = v;
      grid.appendChild(label);
    }
    for (var t = Math.ceil(t0 / 3600) * 3600; t <= t1; t += 3600) {
      var tl = svgEl("text", { x: x(t), y: H - 6, "text-anchor": "middle" });
      tl.textContent = new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
      grid.appendChild(tl);
    }
    svg.appendChild(grid);
    svg.appendChild(svgEl("line", { "class": "now", x1: x(nowTs), x2: x(nowTs), y1: T, y2: H - B }));
    function line(points, cls) {
      if (points.length < 2) return;
      svg.appendChild(svgEl("polyline", {
        "class": cls, points: points.map(function (p) { return x(p[0]) + "," + y(p[1]); }).join(" ")
      }));
    }
    var live = hist.map(function (p) { return [p[0], p[1]]; }).concat([[nowTs, cap.slots]]);
    var desired = hist.map(function (p) { return [p[0], p[3]]; }).concat([[nowTs, cap.desired]]);
    var forecast = hist.map(function (p) { return [p[0], p[4]]; }).concat([[nowTs, cap.forecast]]);
    // Desired is drawn wide underneath: where it equals the forecast, both stay visible.
    line(desired, "desired");
    line(live, "live");
    line(forecast, "forecast");
    line([[nowTs, cap.forecast]].concat(ahead.map(function (p) { return [p[0], p[1]]; })), "ahead");
    (changes || []).forEach(function (m) {
      if (m.ts >= t0 && m.ts <= nowTs) svg.appendChild(changeMarker(m, x(m.ts), T, H - B));
    });
    return svg;
  }

  function renderCapacity(snap) {
    var cap = snap.capacity;
    if (!cap) return;
    setText("cap-slots", cap.slots);
    setText("cap-needed", cap.needed_now);
    setText("cap-forecast", cap.forecast);
    setText("cap-desired", cap.desired);
    setText("cap-warmup", fmtMinutes(cap.warmup_s));
    document.getElementById("capacity-chart").replaceChildren(capacityChart(cap, snap.generated_ts, snap.policy_changes));
  }

  function renderWorkers(snap) {
    var body = document.querySelector("#workers tbody");
    var rows = (snap.workers || []).map(function (w) {
      var tr = el("tr", { "data-worker": w.hostname, "class": w.slots < w.capacity ? "pressured" : "" });
      tr.appendChild(el("td", null, w.hostname));
      tr.appendChild(el("td", { "class": "offered" }, w.slots));
      tr.appendChild(el("td", { "class": "configured" }, w.capacity));
      tr.appendChild(el("td", null, w.busy));
      tr.appendChild(el("td", { "class": "reason" }, w.reason || "—"));
      return tr;
    });
    body.replaceChildren.apply(body, rows);
  }

  function renderResources(snap) {
    var body = document.querySelector("#resources tbody");
    var rows = (snap.resources || []).map(function (r) {
      var tr = el("tr", { "data-resource": r.name, "class": r.effective < r.limit ? "pressured" : "" });
      tr.appendChild(el("td", null, r.name));
      tr.appendChild(el("td", { "class": "configured" }, r.limit));
      var effective = r.paused_for_s !== null ? "0 (paused " + r.paused_for_s + " s)" : String(r.effective);
      tr.appendChild(el("td", { "class": "effective" }, effective));
      tr.appendChild(el("td", null, r.refusals));
      return tr;
    });
    if (!rows.length) {
      var none = el("tr", { "class": "none" });
      none.appendChild(el("td", { colspan: "4" }, "None configured."));
      rows = [none];
    }
    body.replaceChildren.apply(body, rows);
  }

  function render(snap) {
    setText("generated-at", new Date(snap.generated_ts * 1000).toLocaleTimeString());
    renderPool(snap.pool);
    renderGrid(snap);
    renderTenants(snap);
    renderRed(snap);
    renderCapacity(snap);
    renderWorkers(snap);
    renderResources(snap);
  }

  function setConnected(ok, text) {
    banner.hidden = ok;
    document.body.classList.toggle("disconnected", !ok);
    connState.textContent = text;
  }

  function connect() {
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(proto + location.host + wsPath);
    socket.onopen = function () { attempt = 0; setConnected(true, "live"); };
    socket.onmessage = function (ev) { render(JSON.parse(ev.data)); };
    socket.onclose = function (ev) {
      if (ev.code === 4403) {
        banner.textContent = "Not authorised — log in as staff and reload.";
        setConnected(false, "refused");
        return;
      }
      var delay = Math.min(30000, 500 * Math.pow(2, attempt)) * (0.75 + Math.random() * 0.5);
      attempt += 1;
      banner.textContent = "Disconnected — reconnecting…";
      setConnected(false, "reconnecting in " + (delay / 1000).toFixed(1) + " s");
      setTimeout(connect, delay);
    };
  }
  connect();
})();
