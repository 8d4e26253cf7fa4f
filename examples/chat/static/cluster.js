// The cluster page: reads /cluster.json about every second (the next read once the last is in).
// Each entity type gets a table with one row per node that hosts it: its shards, the entities
// (rooms) running there, and the entity count of each shard.
"use strict";
const $ = (id) => document.getElementById(id);
function cell(row, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; row.append(td); }
const TITLES = {Room: "Rooms per node", Gateway: "Gateways per node"};
function typeTable(s, name, t) {
  const h = document.createElement("h2"); h.textContent = TITLES[name] || name + " per node";
  const table = document.createElement("table"); table.dataset.type = name;
  table.innerHTML = "<thead><tr><th>node</th><th>shards</th><th>" + (name === "Room" ? "rooms" : "entities") +
    "</th><th>entities per shard</th></tr></thead>";
  const tb = document.createElement("tbody");
  for (const [node, shards] of Object.entries(t.nodes)) {
    const tr = document.createElement("tr"); tr.dataset.node = node;
    const ids = Object.keys(shards).sort((a, b) => a.localeCompare(b, undefined, {numeric: true}));
    const names = t.entities[node];
    cell(tr, node); cell(tr, String(ids.length));
    cell(tr, names === undefined ? "(its node did not say)" : names.join(", ") || "none", "entities");
    cell(tr, ids.map((id) => id + ": " + shards[id]).join("; ") || "none");
    tb.append(tr);
  }
  for (const node of t.failed) {
    const tr = document.createElement("tr"); tr.dataset.node = node;
    cell(tr, node); cell(tr, "no answer", "unreachable"); cell(tr, ""); cell(tr, ""); tb.append(tr);
  }
  table.append(tb);
  return [h, table];
}
async function refresh() {
  try {
    const r = await fetch("/cluster.json", {cache: "no-store"});
    if (!r.ok) throw new Error(String(r.status));
    const s = await r.json();
    $("error").hidden = true;
    $("node").textContent = s.node; $("leader").textContent = s.leader || "none"; $("oldest").textContent = s.oldest || "none";
    $("source").textContent = s.source === "management"
      ? "Read from this node's management endpoint (" + s.management + ")."
      : "Read from the node itself (it has no management endpoint).";
    const body = $("members"); body.replaceChildren();
    for (const m of s.members) {
      const tr = document.createElement("tr");
      cell(tr, m.name); cell(tr, m.address); cell(tr, m.status, m.status);
      cell(tr, m.reachable ? "yes" : "unreachable", m.reachable ? "" : "unreachable"); body.append(tr);
    }
    const types = $("types"); types.replaceChildren();
    for (const [name, t] of Object.entries(s.types)) types.append(...typeTable(s, name, t));
  } catch (e) {
    $("error").textContent = "This node does not answer; trying again every second…"; $("error").hidden = false;
  }
  setTimeout(refresh, 1000);
}
refresh();
