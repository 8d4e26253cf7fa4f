// The cluster page: polls /cluster.json every second.
"use strict";
const $ = (id) => document.getElementById(id);
function cell(row, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; row.append(td); }
async function refresh() {
  try {
    const r = await fetch("/cluster.json", {cache: "no-store"});
    const s = await r.json();
    $("error").hidden = true;
    $("node").textContent = s.node; $("leader").textContent = s.leader || "none"; $("oldest").textContent = s.oldest || "none";
    const body = $("members"); body.replaceChildren();
    for (const m of s.members) {
      const tr = document.createElement("tr");
      cell(tr, m.name); cell(tr, m.address); cell(tr, m.status, m.status);
      cell(tr, m.reachable ? "yes" : "unreachable", m.reachable ? "" : "unreachable"); body.append(tr);
    }
    const types = $("types"); types.replaceChildren();
    for (const [name, t] of Object.entries(s.types)) {
      const h = document.createElement("h2"); h.textContent = name + " shards per node"; types.append(h);
      const table = document.createElement("table");
      table.innerHTML = "<thead><tr><th>node</th><th>shards</th><th>entities per shard</th></tr></thead>";
      const tb = document.createElement("tbody");
      for (const [node, shards] of Object.entries(t.nodes)) {
        const tr = document.createElement("tr"); const ids = Object.keys(shards).sort();
        cell(tr, node); cell(tr, String(ids.length));
        cell(tr, ids.map((id) => id + ": " + shards[id] + (node === s.node && t.local_entities[id] ? " (" + t.local_entities[id].join(", ") + ")" : "")).join("; ") || "none");
        tb.append(tr);
      }
      for (const node of t.failed) { const tr = document.createElement("tr"); cell(tr, node); cell(tr, "no answer", "unreachable"); cell(tr, ""); tb.append(tr); }
      table.append(tb); types.append(table);
    }
  } catch (e) { $("error").textContent = "this node does not answer: " + e; $("error").hidden = false; }
}
refresh(); setInterval(refresh, 1000);
