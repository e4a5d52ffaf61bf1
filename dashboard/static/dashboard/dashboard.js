// Live queue dashboard: one websocket; the first picture whole, then only what changed
// (dashboard/frames.py). Only the rows shown are rendered, and DOM nodes are updated in
// place, so a fleet of any size costs the page the same few hundred nodes.
// Reconnects by itself with capped exponential backoff and shows a banner while down.
(function () {
  "use strict";
  var script = document.currentScript;
  var wsPath = script.dataset.wsPath; // the page says where (the host's prefix)
  var adminUrl = (script && script.dataset.tenantAdmin) || "/dashboard/tenants/__slug__/admin/";
  var HISTORY_LEN = +((script && script.dataset.historyLen) || 120);
  var PINS_KEY = "fairqueue.dashboard.pins";
  var PINS_MAX = 50;
  var SEARCH_DELAY_MS = 150;
  var banner = document.getElementById("conn-banner");
  var connState = document.getElementById("conn-state");
  var attempt = 0;
  var socket = null;

  // What the page holds: the last picture with every delta applied.
  var S = null;
  var pinned = pinsLoad();
  var search = { query: "", matches: [], total: 0, info: {} };  // info: slug -> {name, shard, active}
  var opened = null;
  var openedHistory = [];  // [ts, in_flight, waiting, oldest] oldest first
  // Figures the browser test reads: the page's own cost of each frame.
  var stats = window.fqDashboard = { frames: 0, firstRenderAt: null, lastHandleMs: 0, maxHandleMs: 0 };

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
  function put(node, text) {  // textContent, written only when it changes
    text = String(text);
    if (node.textContent !== text) node.textContent = text;
  }
  function setText(id, text) { put(document.getElementById(id), text); }
  function send(message) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(message));
  }

  var SVG = "http://www.w3.org/2000/svg";
  function svgEl(tag, attrs) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    return e;
  }
  var HISTORY_TICK_S = 1;  // a cell's history has one point per dashboard tick
  // A policy change as a marker on a time chart: a vertical line at x, its summary on hover.
  function changeMarker(m, x, top, bottom) {
    var line = svgEl("line", { x1: x, x2: x, y1: top, y2: bottom, "class": "policy-change", "data-change": m.id });
    var title = document.createElementNS(SVG, "title");
    title.textContent = new Date(m.ts * 1000).toLocaleTimeString() + " " + m.text +
      (m.user ? " (" + m.user + ", " + m.source + ")" : " (" + m.source + ")");
    line.appendChild(title);
    return line;
  }
  // A sparkline drawn once and then moved in place: an SVG, a dashed reference line, a
  // polyline, and the policy changes of its time span as markers.
  function sparkMake(svg, w, h) {
    svg = svg || svgEl("svg", {});
    svg.setAttribute("class", svg.getAttribute("class") || "spark");
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    var line = svgEl("line", { "class": "objective", x1: 0, x2: w, y1: -5, y2: -5 });
    var poly = svgEl("polyline", { "class": "age", points: "" });
    var marks = svgEl("g", { "class": "changes" });
    svg.replaceChildren(line, poly, marks);
    return { svg: svg, line: line, poly: poly, marks: marks, w: w, h: h, points: null, ref: null, drawn: "" };
  }
  // values: numbers, one per tick up to nowTs; ref: the dashed line's value (null: none);
  // changes: policy changes ({ts, ...}) to mark where they fall in the span.
  function sparkDraw(sp, values, ref, changes, nowTs) {
    var w = sp.w, h = sp.h;
    var max = 1;
    for (var i = 0; i < values.length; i++) if (values[i] > max) max = values[i];
    if (ref !== null) max = Math.max(max, ref * 2);
    function y(v) { return (h - 1 - (v / max) * (h - 2)).toFixed(1); }
    var step = values.length > 1 ? w / (values.length - 1) : w;
    var pts = "";
    for (var j = 0; j < values.length; j++) pts += (j ? " " : "") + (j * step).toFixed(1) + "," + y(values[j]);
    if (pts !== sp.points) { sp.poly.setAttribute("points", pts); sp.points = pts; }
    var refY = ref === null ? "-5" : y(ref);
    if (refY !== sp.ref) { sp.line.setAttribute("y1", refY); sp.line.setAttribute("y2", refY); sp.ref = refY; }
    var shown = (changes || []).map(function (m) {
      return [m, values.length - 1 - (nowTs - m.ts) / HISTORY_TICK_S];
    }).filter(function (mi) { return mi[1] >= 0 && mi[1] <= values.length - 1; });
    var drawn = shown.map(function (mi) { return mi[0].id + "@" + (mi[1] * step).toFixed(1); }).join(" ");
    if (drawn !== sp.drawn) {  // most ticks: no change in the span, nothing to move
      sp.marks.replaceChildren.apply(sp.marks, shown.map(function (mi) {
        return changeMarker(mi[0], (mi[1] * step).toFixed(1), 0, h);
      }));
      sp.drawn = drawn;
    }
  }

  // --- Pool, totals ------------------------------------------------------------------------
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
  function renderQuarantine(q) {
    if (!q) return;
    setText("quarantine-slots", q.slots);
    setText("quarantine-running", q.running);
    setText("quarantine-waiting", q.waiting);
    setText("quarantine-oldest", q.oldest_wait_s == null ? "—" : q.oldest_wait_s.toFixed(1) + " s");
    setText("quarantine-workers", q.workers == null ? "—" : q.workers);
    document.getElementById("quarantine-unstaffed").hidden = !(q.waiting > 0 && q.workers === 0);
  }
  function bytes(n) {
    if (n == null) return "—";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }
  function renderEngineMemory(m) {
    if (!m) return;
    setText("engine-memory-used", bytes(m.used_bytes));
    setText("engine-memory-max", m.max_bytes ? bytes(m.max_bytes) : "no limit");
    setText("engine-memory-ratio", m.used_ratio == null ? "—" : pct(m.used_ratio));
    setText("engine-memory-headroom", m.headroom_bytes == null ? "—" : bytes(m.headroom_bytes) +
      " (threshold " + m.threshold_pct + " %)");
    setText("engine-memory-guard", m.guard_active ? "refusing: at most " + m.guard_cap + " waiting jobs per tenant" : "off");
    document.getElementById("engine-memory-panel").classList.toggle("alert", !!m.guard_active);
  }
  function renderDocuments() {
    var d = S.documents || { in_flight: 0, top: [] };
    setText("documents-in-flight", d.in_flight);
    var body = document.querySelector("#documents tbody");
    var rows = d.top.map(function (doc) {
      var tr = el("tr", { "data-document": doc.id });
      tr.appendChild(el("td", null, doc.id));
      tr.appendChild(el("td", null, doc.tenant));
      tr.appendChild(el("td", { "class": "children" }, doc.children));
      tr.appendChild(el("td", { "class": "running" }, doc.running));
      tr.appendChild(el("td", null, doc.cap == null ? "—" : doc.cap));
      return tr;
    });
    if (!rows.length) {
      var none = el("tr", { "class": "none" });
      none.appendChild(el("td", { colspan: "5" }, "None."));
      rows = [none];
    }
    body.replaceChildren.apply(body, rows);
  }
  function renderTotals(t) {
    setText("total-tenants", t.tenants);
    setText("total-busy", t.busy);
    setText("total-in-flight", t.in_flight);
    setText("total-waiting", t.waiting);
    setText("total-parked", t.parked);
    setText("total-throttled", t.throttled);
    setText("total-red", t.red);
    setText("total-orange", t.orange);
    var order = "red and orange waits first, then waiting jobs, in flight, pressure";
    setText("tenants-summary", t.tenants <= S.top_n ? "(all " + t.tenants + ", " + order + ")" :
      "(the " + S.top_n + " of " + t.tenants + " that need attention most: " + order +
      "; pinned and found ones above them)");
  }

  // --- The grid: one row per shown shard, one cell per class, updated in place -------------
  var gridRows = {};   // shard -> tr
  var gridCells = {};  // "shard/class" -> {td, age, sub, spark}
  var gridClasses = null;
  function renderGrid() {
    var g = S.grid;
    var table = document.getElementById("grid");
    var classesKey = g.classes.join("\u0000");
    if (classesKey !== gridClasses) {  // new columns: start the body afresh
      gridClasses = classesKey;
      var head = el("tr");
      head.appendChild(el("th", null, "Shard"));
      g.classes.forEach(function (c) { head.appendChild(el("th", null, c)); });
      table.tHead.replaceChildren(head);
      table.tBodies[0].replaceChildren();
      gridRows = {};
      gridCells = {};
    }
    var body = table.tBodies[0];
    var shown = {};
    g.shards.forEach(function (shard, i) {
      shown[shard] = true;
      var tr = gridRows[shard];
      if (!tr) {
        tr = gridRows[shard] = el("tr", { "data-shard": shard });
        tr.appendChild(el("th", null, shard));
        g.classes.forEach(function (cls) {
          var td = el("td", { "class": "cell", "data-shard": shard, "data-class": cls });
          var age = el("div", { "class": "age" }), sub = el("div", { "class": "sub" });
          var sp = sparkMake(null, 120, 28);
          td.appendChild(age); td.appendChild(sub); td.appendChild(sp.svg);
          tr.appendChild(td);
          gridCells[shard + "/" + cls] = { td: td, age: age, sub: sub, spark: sp };
        });
      }
      if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    });
    Object.keys(gridRows).forEach(function (shard) {
      if (!shown[shard]) { gridRows[shard].remove(); delete gridRows[shard]; }
    });
    Object.keys(gridCells).forEach(function (key) {
      var ce = gridCells[key], c = g.cells[key];
      if (!gridRows[key.slice(0, key.lastIndexOf("/"))]) { delete gridCells[key]; return; }
      if (!c) { put(ce.age, ""); put(ce.sub, ""); return; }
      var cls = "cell " + c.state;
      if (ce.td.className !== cls) ce.td.className = cls;
      put(ce.age, fmtAge(c.oldest_age_s));
      put(ce.sub, c.waiting + " waiting · objective " + fmtAge(c.objective_s));
      ce.td.title = c.shard + " / " + c["class"] + ": " + c.state;
      sparkDraw(ce.spark, c.history, c.objective_s, S.policy_changes, S.ts);
    });
    var counts = g.counts;
    setText("grid-summary", (g.shards.length < g.shards_total ?
      "The " + g.shards.length + " of " + g.shards_total + " shards that need attention most (red and orange first). " :
      g.shards_total + (g.shards_total === 1 ? " shard. " : " shards. ")) + "In all: " + counts.red + " red, " + counts.orange + " orange, " + counts.green + " green cells.");
  }

  function renderRed() {
    var list = document.getElementById("red-list");
    var red = S.red;
    var more = document.getElementById("red-more");
    if (!red.cells.length) {
      list.replaceChildren(el("li", { "class": "none" }, "None."));
    } else {
      list.replaceChildren.apply(list, red.cells.map(function (c) {
        return el("li", null, c.shard + " / " + c["class"] + ": oldest " + fmtAge(c.oldest_age_s) +
          " (objective " + fmtAge(c.objective_s) + "), " + c.waiting + " waiting");
      }));
    }
    more.hidden = red.total <= red.cells.length;
    put(more, "and " + (red.total - red.cells.length) + " more red cells.");
  }

  // --- Tenants: pinned, found, then the top N; each tenant once, its row kept and moved ----
  var tenantRows = {};  // slug -> {tr, tds..., shown}
  var GROUPS = [
    { id: "tenants-pinned", title: "Pinned" },
    { id: "tenants-search", title: "Found" },
    { id: "tenants-top", title: "Need attention most" }
  ];
  function tenantRowMake(slug) {
    var tr = el("tr", { "data-tenant": slug });
    var pin = el("button", { type: "button", "class": "pin", "aria-label": "Pin " + slug });
    pin.addEventListener("click", function () { pinToggle(slug); });
    var open = el("button", { type: "button", "class": "open", title: "Live row and sparklines" });
    open.addEventListener("click", function () { tenantOpen(slug); });
    var slugText = el("span", { "class": "slug-text" }, slug);
    var name = el("small", { "class": "name" });
    open.appendChild(slugText);
    var e = {
      tr: tr, pin: pin, name: name,
      shard: el("td"), floor: el("td", { "class": "floor" }), limit: el("td", { "class": "limit" }),
      inflight: el("td", { "class": "in-flight" }), parked: el("td", { "class": "parked" }),
      oldest: el("td", { "class": "oldest" }), rate: el("td", { "class": "rate" }), mean: el("td", { "class": "mean" }),
      admin: el("a", { href: adminUrl.replace("__slug__", encodeURIComponent(slug)), "class": "admin" }, "admin")
    };
    var pinTd = el("td", { "class": "pin" }); pinTd.appendChild(pin);
    var slugTd = el("td", { "class": "slug" }); slugTd.appendChild(open); slugTd.appendChild(name);
    var adminTd = el("td"); adminTd.appendChild(e.admin);
    [pinTd, slugTd, e.shard, e.floor, e.limit, e.inflight, e.parked, e.oldest, e.rate, e.mean, adminTd]
      .forEach(function (td) { tr.appendChild(td); });
    return e;
  }
  function tenantRowFill(e, slug) {
    var t = S.rows[slug];
    var isPinned = pinned.indexOf(slug) >= 0;
    put(e.pin, isPinned ? "★" : "☆");
    e.pin.setAttribute("aria-pressed", isPinned ? "true" : "false");
    if (!t) {  // asked for, its live row not here yet
      var info = search.info[slug];
      put(e.name, info ? info.name : "");
      put(e.shard, info ? info.shard : "");
      [e.floor, e.limit, e.inflight, e.parked, e.oldest, e.rate, e.mean].forEach(function (td) { put(td, "…"); });
      return;
    }
    var cls = t.active ? "" : "inactive";
    if (e.tr.className !== cls) e.tr.className = cls;
    put(e.name, t.name !== slug ? t.name : "");
    put(e.shard, t.shard);
    put(e.floor, t.floor);
    put(e.limit, t.limit);
    put(e.inflight, t.in_flight);
    e.inflight.classList.toggle("throttled", t.in_flight >= t.limit && t.parked > 0);
    var parts = Object.keys(t.parked_by_class).sort().map(function (k) { return k + " " + t.parked_by_class[k]; });
    put(e.parked, t.parked + (parts.length ? " (" + parts.join(", ") + ")" : ""));
    put(e.oldest, fmtAge(t.oldest_wait_s));
    var ratio = t.oldest_wait_ratio;
    var state = ratio === null || ratio === undefined || ratio < 1 ? "" : ratio < 2 ? "orange" : "red";
    if (e.oldest.className !== "oldest " + state) e.oldest.className = "oldest " + state;
    put(e.rate, t.rate_per_min.toFixed(1));
    put(e.mean, fmtAge(t.mean_job_s));
  }
  function renderTenants() {
    var seen = {};
    var lists = [pinned, search.matches, S.top];
    var shown = {};
    GROUPS.forEach(function (group, g) {
      var body = document.getElementById(group.id);
      var slugs = lists[g].filter(function (slug) {
        if (seen[slug]) return false;
        seen[slug] = true;
        return true;
      });
      var head = body.firstElementChild;
      if (!head || !head.classList.contains("group")) {
        head = el("tr", { "class": "group" });
        head.appendChild(el("th", { colspan: "11" }));
        body.insertBefore(head, body.firstChild);
      }
      head.hidden = !slugs.length || (g === 2 && !pinned.length && !search.matches.length);
      put(head.firstChild, group.title + " (" + slugs.length + ")");
      slugs.forEach(function (slug, i) {
        var e = tenantRows[slug] || (tenantRows[slug] = tenantRowMake(slug));
        shown[slug] = true;
        tenantRowFill(e, slug);
        if (body.children[i + 1] !== e.tr) body.insertBefore(e.tr, body.children[i + 1] || null);
      });
      while (body.children.length > slugs.length + 1) body.lastElementChild.remove();
    });
    Object.keys(tenantRows).forEach(function (slug) {
      if (!shown[slug]) { tenantRows[slug].tr.remove(); delete tenantRows[slug]; }
    });
  }

  // --- Pins (kept in this browser), search, one tenant opened -------------------------------
  function pinsLoad() {
    try {
      var list = JSON.parse(window.localStorage.getItem(PINS_KEY) || "[]");
      return Array.isArray(list) ? list.filter(function (s) { return typeof s === "string"; }).slice(0, PINS_MAX) : [];
    } catch (err) {
      return [];
    }
  }
  function pinsSave() {
    try { window.localStorage.setItem(PINS_KEY, JSON.stringify(pinned)); } catch (err) { /* private mode: this page only */ }
  }
  function pinToggle(slug) {
    var i = pinned.indexOf(slug);
    if (i >= 0) pinned.splice(i, 1);
    else if (pinned.length < PINS_MAX) pinned.push(slug);
    else { setText("search-status", "At most " + PINS_MAX + " tenants can be pinned."); return; }
    pinsSave();
    send({ type: "pins", slugs: pinned });
    if (S) renderTenants();
    renderDetail();
  }
  var searchTimer = null;
  function searchSend() {
    var query = document.getElementById("tenant-search").value.trim();
    if (query === search.query) return;
    search.query = query;
    if (!query) {
      search.matches = []; search.total = 0; search.info = {};
      setText("search-status", "");
      if (S) renderTenants();
    }
    send({ type: "search", query: query });
  }
  function searchShow(m) {
    if (m.query !== search.query) return;  // an answer to an older query
    search.matches = m.matches.map(function (x) { return x.slug; });
    search.total = m.total;
    search.info = {};
    m.matches.forEach(function (x) { search.info[x.slug] = x; });
    setText("search-status", !m.query ? "" : !m.total ? "No tenant matches." :
      m.total > m.matches.length ? m.total + " matches; the first " + m.matches.length + " shown." :
      m.total + (m.total === 1 ? " match." : " matches."));
    renderTenants();
  }
  function tenantOpen(slug) {
    opened = slug;
    openedHistory = [];
    send({ type: "open", slug: slug });
    renderDetail();
  }
  function detailShow(m) {
    if (m.slug !== opened) return;
    openedHistory = (m.history || []).slice(-HISTORY_LEN);
    renderDetail();
  }
  var detailSparks = null;
  function renderDetail() {
    var panel = document.getElementById("tenant-detail");
    panel.hidden = !opened;
    if (!opened) return;
    if (!detailSparks) {
      detailSparks = {
        inflight: sparkMake(document.getElementById("detail-spark-in-flight"), 240, 40),
        waiting: sparkMake(document.getElementById("detail-spark-waiting"), 240, 40),
        oldest: sparkMake(document.getElementById("detail-spark-oldest"), 240, 40)
      };
    }
    var t = S && S.rows[opened];
    setText("detail-slug", opened);
    setText("detail-name", t && t.name !== opened ? t.name : "");
    document.getElementById("detail-admin").href = adminUrl.replace("__slug__", encodeURIComponent(opened));
    setText("detail-pin", pinned.indexOf(opened) >= 0 ? "Unpin" : "Pin");
    setText("detail-limit", t ? t.limit : "…");
    setText("detail-in-flight", t ? t.in_flight : "…");
    setText("detail-waiting", t ? t.waiting : "…");
    setText("detail-parked", t ? t.parked : "…");
    setText("detail-oldest", t ? fmtAge(t.oldest_wait_s) : "…");
    setText("detail-rate", t ? t.rate_per_min.toFixed(1) : "…");
    var h = openedHistory;
    sparkDraw(detailSparks.inflight, h.map(function (p) { return p[1]; }), t ? t.limit : null);
    sparkDraw(detailSparks.waiting, h.map(function (p) { return p[2]; }), null);
    sparkDraw(detailSparks.oldest, h.map(function (p) { return p[3] || 0; }), null);
  }
  function openedRecord() {  // each tick adds its point to the opened tenant's sparklines
    var t = opened && S.rows[opened];
    if (!t) return;
    openedHistory.push([S.ts, t.in_flight, t.waiting, t.oldest_wait_s]);
    if (openedHistory.length > HISTORY_LEN) openedHistory.shift();
  }

  // --- Workers, resources, capacity (small; drawn again when they change) -------------------
  function renderWorkers() {
    var body = document.querySelector("#workers tbody");
    var rows = (S.workers || []).map(function (w) {
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

  function renderResources() {
    var body = document.querySelector("#resources tbody");
    var rows = (S.resources || []).map(function (r) {
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

  // Capacity: slots live, slots desired and the forecast over the recorded hours, and the
  // forecast ahead of now (dashed). Plain SVG, no library.
  function fmtMinutes(s) { return s >= 3600 ? (s / 3600).toFixed(1) + " h" : Math.round(s / 60) + " min"; }
  function capacityChart(cap, nowTs, changes) {
    var W = 760, H = 220, L = 40, R = 34, T = 10, B = 24;
    var hist = cap.history || [];
    var ahead = (cap.ahead_values || []).map(function (v, i) { return [nowTs + i * cap.ahead_step_s, v]; });
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


  function renderCapacity() {
    var cap = S.capacity;
    if (!cap) return;
    setText("cap-slots", cap.slots);
    setText("cap-needed", cap.needed_now);
    setText("cap-forecast", cap.forecast);
    setText("cap-desired", cap.desired);
    setText("cap-warmup", fmtMinutes(cap.warmup_s));
    document.getElementById("capacity-chart").replaceChildren(capacityChart(cap, S.ts, S.policy_changes));
  }

  // --- Frames ---------------------------------------------------------------------------
  function merge(into, changed) {
    Object.keys(changed).forEach(function (k) {
      if (changed[k] === null) delete into[k]; else into[k] = changed[k];
    });
  }
  // A cell's history arrives once as runs (dashboard/picture.py): the oldest value in
  // seconds, then (step, count) pairs.
  function cellDecode(c) {
    var runs = c.history_runs || [], out = [];
    if (runs.length) {
      var v = runs[0];
      out.push(v);
      for (var i = 1; i < runs.length; i += 2) {
        for (var k = 0; k < runs[i + 1]; k++) { v += runs[i]; out.push(v); }
      }
    }
    delete c.history_runs;
    c.history = out;
    return c;
  }
  function picture(p) {
    S = p;
    Object.keys(S.grid.cells).forEach(function (key) { cellDecode(S.grid.cells[key]); });
    setText("generated-at", new Date(S.ts * 1000).toLocaleTimeString());
    renderPool(S.pool);
    renderQuarantine(S.quarantine);
    renderEngineMemory(S.engine_memory);
    renderDocuments();
    renderTotals(S.totals);
    renderGrid();
    renderRed();
    renderTenants();
    renderCapacity();
    renderWorkers();
    renderResources();
    renderDetail();
  }
  function delta(d) {
    S.ts = d.ts;
    setText("generated-at", new Date(S.ts * 1000).toLocaleTimeString());
    if (d.pool) { merge(S.pool, d.pool); renderPool(S.pool); }
    if (d.quarantine) { S.quarantine = S.quarantine || {}; merge(S.quarantine, d.quarantine); renderQuarantine(S.quarantine); }
    if (d.engine_memory) {
      S.engine_memory = S.engine_memory || {}; merge(S.engine_memory, d.engine_memory); renderEngineMemory(S.engine_memory);
    }
    ["top", "top_n", "red", "workers", "resources", "policy_changes", "documents"].forEach(function (k) {
      if (k in d) S[k] = d[k];
    });
    if ("documents" in d) renderDocuments();
    if (d.totals || "top_n" in d) { merge(S.totals, d.totals || {}); renderTotals(S.totals); }
    if (d.rows) {
      Object.keys(d.rows).forEach(function (slug) {
        if (S.rows[slug]) merge(S.rows[slug], d.rows[slug]); else S.rows[slug] = d.rows[slug];
      });
    }
    (d.gone || []).forEach(function (slug) { delete S.rows[slug]; });
    var g = S.grid, gd = d.grid || {};
    ["classes", "shards", "shards_total", "counts"].forEach(function (k) { if (k in gd) g[k] = gd[k]; });
    (gd.gone || []).forEach(function (key) { delete g.cells[key]; });
    var cells = gd.cells || {};
    Object.keys(g.cells).forEach(function (key) {  // this tick's point, as the server recorded it
      if (cells[key]) return;
      var c = g.cells[key];
      c.history.push(c.oldest_age_s || 0);
      if (c.history.length > HISTORY_LEN) c.history.shift();
    });
    Object.keys(cells).forEach(function (key) {
      var c = cells[key];
      if (c.history_runs) { g.cells[key] = cellDecode(c); return; }  // new to this page: whole, with its history
      merge(g.cells[key], c);
      g.cells[key].history.push(g.cells[key].oldest_age_s || 0);
      if (g.cells[key].history.length > HISTORY_LEN) g.cells[key].history.shift();
    });
    renderGrid();
    if ("red" in d) renderRed();
    if (d.rows || d.gone || "top" in d) renderTenants();
    if (d.capacity) merge(S.capacity, d.capacity);
    if (d.capacity || "policy_changes" in d) renderCapacity();
    if (d.dependencies) merge(S.dependencies, d.dependencies);
    if ("workers" in d) renderWorkers();
    if ("resources" in d) renderResources();
    openedRecord();
    renderDetail();
  }
  function rowsAdd(rows) {
    Object.keys(rows || {}).forEach(function (slug) { S.rows[slug] = rows[slug]; });
  }
  function handle(m) {
    if (m.t === "picture") {
      picture(m);
      if (stats.firstRenderAt === null) stats.firstRenderAt = performance.now();
      // A new connection knows nothing of this page's tenants: tell it again.
      if (pinned.length) send({ type: "pins", slugs: pinned });
      if (search.query) send({ type: "search", query: search.query });
      if (opened) send({ type: "open", slug: opened });
    } else if (!S) {
      return;
    } else if (m.t === "delta") {
      delta(m);
    } else if (m.t === "pins") {
      rowsAdd(m.rows);
      if (m.unknown.length) {  // deleted tenants: forget them here too
        pinned = pinned.filter(function (slug) { return m.unknown.indexOf(slug) < 0; });
        pinsSave();
      }
      renderTenants();
      renderDetail();
    } else if (m.t === "search") {
      rowsAdd(m.rows);
      searchShow(m);
    } else if (m.t === "detail") {
      if (m.row) S.rows[m.slug] = m.row;
      detailShow(m);
      renderTenants();
    } else if (m.t === "error") {
      setText("search-status", m.message);
    }
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
    socket.onmessage = function (ev) {
      var started = performance.now();
      handle(JSON.parse(ev.data));
      stats.frames += 1;
      stats.lastHandleMs = performance.now() - started;
      if (stats.lastHandleMs > stats.maxHandleMs) stats.maxHandleMs = stats.lastHandleMs;
    };
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

  document.getElementById("tenant-search").addEventListener("input", function () {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(searchSend, SEARCH_DELAY_MS);
  });
  document.getElementById("tenant-search-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    clearTimeout(searchTimer);
    searchSend();
  });
  document.getElementById("detail-close").addEventListener("click", function () {
    opened = null;
    send({ type: "open", slug: null });
    renderDetail();
  });
  document.getElementById("detail-pin").addEventListener("click", function () { if (opened) pinToggle(opened); });
  connect();
})();
