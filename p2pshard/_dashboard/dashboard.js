// The p2pshard dashboard: polls GET /dashboard/state about once a second and draws it as
// tables and inline SVG. No library and nothing from elsewhere; data is only ever written as
// text (textContent, attribute values), never parsed as HTML.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const TOKEN_KEY = "p2pshard-management-token";
  const POLL_MS = 1000;
  const RETRY_MS = 3000;
  const WINDOW_S = 300; // the charts' widest span: the sampler keeps five minutes
  const MIN_SPAN_S = 60; // and the narrowest, while there is less to show

  const byId = (id) => document.getElementById(id);

  function make(namespace, tag, attributes, children) {
    const node = namespace ? document.createElementNS(namespace, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, String(value));
    }
    for (const child of children || []) {
      node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
    }
    return node;
  }
  const html = (tag, attributes, ...children) => make(null, tag, attributes, children);
  const svg = (tag, attributes, ...children) => make(SVG, tag, attributes, children);

  // --- polling and the token ---------------------------------------------------------------

  function authorization() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    return token ? { Authorization: "Bearer " + token } : {};
  }

  function setStatus(kind, text) {
    const status = byId("status");
    status.className = "status " + kind;
    status.textContent = text;
  }

  function askForToken(reason) {
    byId("token-reason").textContent = reason;
    byId("token-form").hidden = false;
    byId("token").focus();
    setStatus("error", "waiting for the management token");
  }

  async function poll() {
    let delay = POLL_MS;
    try {
      const response = await fetch("/dashboard/state", { headers: authorization(), cache: "no-store" });
      const body = await response.json();
      if (response.status === 401) {
        const had = sessionStorage.getItem(TOKEN_KEY) !== null;
        sessionStorage.removeItem(TOKEN_KEY);
        askForToken(had ? "That token was refused: " + body.error : "This node asks for its management token to show the cluster.");
        return; // polling starts again when a token is given
      }
      if (!response.ok) throw new Error(body.error || "HTTP " + response.status);
      byId("token-form").hidden = true;
      render(body);
      setStatus("live", "live · updated " + clock(body.time));
    } catch (error) {
      setStatus("error", "cannot read the node's state (" + error.message + "); trying again");
      delay = RETRY_MS;
    }
    setTimeout(poll, delay);
  }

  byId("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, byId("token").value.trim());
    byId("token").value = "";
    byId("token-form").hidden = true;
    poll();
  });

  // --- drawing -----------------------------------------------------------------------------

  function clock(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function render(state) {
    const me = state.self;
    const leader = state.leader ? state.leader.name : "none";
    byId("node").textContent = `node ${me.name} at ${me.address} · leader ${leader}`;
    renderMembers(state);
    renderShards(state.entity_types);
    renderTypes(state.entity_types);
    const series = state.series;
    lineChart(byId("rate-chart"), series.ages, series.messages_per_second, {
      available: series.messages,
      unit: "/s",
      empty: "no data: this node counts no deliveries",
    });
    lineChart(byId("latency-chart"), series.ages, series.ask_latency_ms, {
      available: series.asks && series.latency,
      unit: " ms",
      empty: series.asks ? "no asks answered lately" : "no data: this node has no ask metrics",
    });
    renderEvents(state.events);
  }

  function renderMembers(state) {
    const same = (a, b) => a && b && a.address === b.address && a.uid === b.uid;
    const rows = state.members.map((m) => {
      const marks = [];
      if (same(m, state.leader)) marks.push(html("span", { class: "mark leader" }, "leader"));
      if (same(m, state.oldest)) marks.push(html("span", { class: "mark oldest" }, "oldest"));
      if (same(m, state.self)) marks.push(html("span", { class: "mark self" }, "this node"));
      return html(
        "tr",
        { class: m.reachable ? "" : "unreachable", "data-status": m.status },
        html("td", {}, m.name),
        html("td", {}, m.address),
        html("td", { class: "member-status " + m.status }, m.status),
        html("td", { class: m.reachable ? "yes" : "no" }, m.reachable ? "yes" : "unreachable"),
        html("td", {}, m.roles.join(", ") || "—"),
        html("td", {}, m.app_version || "—"),
        html("td", {}, m.up_number === null ? "—" : m.up_number),
        html("td", {}, ...marks),
      );
    });
    byId("members").tBodies[0].replaceChildren(...rows);
    const unreachable = state.unreachable.length ? `, ${state.unreachable.length} unreachable` : "";
    byId("member-count").textContent = `${state.members.length}${unreachable}`;
  }

  function renderShards(types) {
    if (!types.length) {
      byId("shards").replaceChildren(html("p", { class: "empty" }, "no entity type started on this node"));
      return;
    }
    const charts = types.map((type) => {
      const regions = [...type.regions].sort((a, b) => a.name.localeCompare(b.name));
      const most = Math.max(1, ...regions.map((r) => r.shard_count));
      const row = 22, label = 70, width = 360, height = Math.max(1, regions.length) * row;
      const chart = svg("svg", { viewBox: `0 0 ${label + width + 150} ${height}`, class: "bars", role: "img" });
      regions.forEach((r, i) => {
        const y = i * row;
        const bar = Math.max(r.shard_count ? 2 : 0, (r.shard_count / most) * width);
        chart.append(
          svg("text", { x: 0, y: y + 15, class: "bar-label" }, r.name),
          svg("rect", { x: label, y: y + 3, width: bar, height: row - 6, class: "bar", "data-node": r.name, "data-shards": r.shard_count }),
          svg("text", { x: label + bar + 6, y: y + 15, class: "bar-value" }, `${r.shard_count} shards · ${r.entity_count} entities`),
        );
      });
      const failed = type.failed.length ? ` (no answer from ${type.failed.map((n) => n.name).join(", ")})` : "";
      return html(
        "figure",
        { class: "shard-type", "data-type": type.type_name },
        html("figcaption", {}, type.type_name + (type.proxy ? " (a proxy here)" : "") + failed),
        regions.length ? chart : html("p", { class: "empty" }, type.error || "no region hosts a shard yet"),
      );
    });
    byId("shards").replaceChildren(...charts);
  }

  function renderTypes(types) {
    const rows = types.map((t) =>
      html("tr", {}, html("td", {}, t.type_name), html("td", {}, t.entities), html("td", {}, t.shards), html("td", {}, t.regions.length)),
    );
    byId("types").tBodies[0].replaceChildren(...rows);
  }

  function nice(value) {
    // The smallest 1, 2 or 5 times a power of ten at least value: the chart's top.
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  function format(value) {
    return value >= 100 ? value.toFixed(0) : value >= 10 ? value.toFixed(1) : value.toFixed(2);
  }

  function lineChart(container, ages, values, { available, unit, empty }) {
    const width = 480, height = 150, left = 44, right = 8, top = 26, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
    const known = values.filter((v) => v !== null);
    const latest = values.length ? values[values.length - 1] : null;
    const peak = Math.max(0, ...known);
    const most = peak > 0 ? nice(peak) : 1;
    // From the oldest point kept (one to five minutes ago) to now.
    const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, -Math.min(0, ...ages)));
    const since = span >= 120 ? `−${Math.round(span / 60)} min` : `−${Math.round(span)} s`;
    const x = (age) => left + ((age + span) / span) * plotW;
    const y = (value) => top + plotH - (value / most) * plotH;
    chart.append(
      svg("line", { x1: left, y1: top + plotH, x2: left + plotW, y2: top + plotH, class: "axis" }),
      svg("line", { x1: left, y1: top, x2: left + plotW, y2: top, class: "grid" }),
      svg("text", { x: left - 4, y: top + 4, class: "tick end" }, format(most)),
      svg("text", { x: left - 4, y: top + plotH + 4, class: "tick end" }, "0"),
      svg("text", { x: left, y: height - 3, class: "tick" }, since),
      svg("text", { x: left + plotW, y: height - 3, class: "tick end" }, "now"),
    );
    if (!available) {
      chart.append(svg("text", { x: left + plotW / 2, y: top + plotH / 2, class: "nodata middle" }, empty));
    } else {
      // A gap (no value) ends one line and a later value starts the next.
      let run = [];
      const flush = () => {
        if (run.length) chart.append(svg("polyline", { points: run.join(" "), class: "line" }));
        run = [];
      };
      ages.forEach((age, i) => {
        if (values[i] === null || age < -span) flush();
        else run.push(`${x(age).toFixed(1)},${y(values[i]).toFixed(1)}`);
      });
      flush();
    }
    const shown = available && latest !== null ? format(latest) + unit : "—";
    chart.append(svg("text", { x: width - right, y: 16, class: "latest end", "data-value": available && latest !== null ? latest : "" }, shown));
    container.replaceChildren(chart);
  }

  function renderEvents(events) {
    const items = [...events].reverse().map((e) =>
      html(
        "li",
        { class: "event " + e.kind, "data-kind": e.kind },
        html("time", {}, clock(e.time)),
        html("span", { class: "kind" }, e.kind),
        html("span", { class: "text" }, e.text),
      ),
    );
    if (!items.length) items.push(html("li", { class: "empty" }, "no events yet"));
    byId("events").replaceChildren(...items);
  }

  poll();
})();
