// The chat page: one WebSocket to this node; on close, reconnect to another node of the list the
// server sent, join again and reload the history. Posts carry a client id and stay pending until
// acknowledged; pending posts are sent again after a reconnect (the room drops duplicates).
"use strict";
const $ = (id) => document.getElementById(id);
let nodes = [location.origin + "/"];
let nodeIndex = 0;
let ws = null;
let joined = null;          // {room, user} we want to be in
let lastSeq = 0;
const pending = new Map();  // client id -> text, until acknowledged
let attempts = 0;

function showError(text) { const e = $("error"); e.textContent = text; e.hidden = !text; }
function setStatus(text) { $("status").textContent = text; }
function wsUrl(base) { const u = new URL(base); u.protocol = u.protocol === "https:" ? "wss:" : "ws:"; u.pathname = "/ws"; return u.href; }
function send(frame) { if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame)); }

function renderMembers(members) {
  const ul = $("members"); ul.replaceChildren();
  for (const m of members) { const li = document.createElement("li"); li.textContent = m; ul.append(li); }
}
function messageItem(user, text) {
  const li = document.createElement("li");
  const who = document.createElement("span"); who.className = "user"; who.textContent = user;
  li.append(who, document.createTextNode(text)); return li;
}
// Our posts not yet acknowledged: grey, after the room's messages, until the ack (or the message).
function renderPending() {
  const ul = $("messages");
  for (const li of ul.querySelectorAll("li.pending")) li.remove();
  for (const [id, text] of pending) {
    const li = messageItem(joined ? joined.user : "", text); li.className = "pending"; li.dataset.id = id;
    ul.append(li);
  }
  ul.scrollTop = ul.scrollHeight;
}
function renderMessage(m) {
  if (m.seq <= lastSeq) return;
  if (m.seq > lastSeq + 1 && lastSeq > 0) { send({type: "history"}); return; } // a gap: reload
  lastSeq = m.seq;
  // our own post, in the journal: no longer pending even if its ack was lost with a connection
  if (joined && m.user === joined.user) pending.delete(m.id);
  const li = messageItem(m.user, m.text); li.dataset.seq = m.seq; li.dataset.id = m.id;
  $("messages").append(li); renderPending();
}
function renderHistory(history) {
  $("messages").replaceChildren(); lastSeq = 0;
  for (const m of history) { lastSeq = m.seq - 1; renderMessage(m); }
  renderPending();
}
function setJoined(on) {
  $("text").disabled = $("send").disabled = !on; $("leave").disabled = !on;
}

function connect() {
  const base = nodes[nodeIndex % nodes.length];
  setStatus("connecting to " + base + " …");
  ws = new WebSocket(wsUrl(base));
  ws.onopen = () => { attempts = 0; setStatus("connected to " + base); if (joined) send({type: "join", ...joined}); };
  ws.onmessage = (event) => {
    let f; try { f = JSON.parse(event.data); } catch { return; }
    switch (f.type) {
      case "hello": if (f.nodes && f.nodes.length) { nodes = f.nodes; nodeIndex = Math.max(0, nodes.indexOf(base)); }
        setStatus("connected to " + f.node); break;
      case "joined": showError(""); renderHistory(f.history); renderMembers(f.members); setJoined(true);
        for (const [id, text] of pending) send({type: "post", id, text}); break;
      case "history": renderHistory(f.history); renderMembers(f.members); break;
      case "message": renderMessage(f.message); break;
      case "members": renderMembers(f.members); break;
      case "ack": pending.delete(f.id); showError(""); renderPending();
        if (f.seq > lastSeq) send({type: "history"}); break;
      case "left": joined = null; setJoined(false); renderMembers([]); break;
      case "error": showError(f.error);
        if (f.retry && f.id && pending.has(f.id)) setTimeout(() => send({type: "post", id: f.id, text: pending.get(f.id)}), 1000);
        else if (f.retry && joined) setTimeout(() => send({type: "join", ...joined}), 1000);
        else if (f.id) { pending.delete(f.id); renderPending(); }
        break;
    }
  };
  ws.onclose = () => {
    setStatus("disconnected; reconnecting …"); setJoined(false);
    nodeIndex += 1; attempts += 1;
    setTimeout(connect, Math.min(5000, 200 * attempts));
  };
}

$("join").onsubmit = (e) => {
  e.preventDefault();
  joined = {room: $("room").value.trim(), user: $("user").value.trim()};
  send({type: "join", ...joined});
};
$("leave").onclick = () => send({type: "leave"});
$("post").onsubmit = (e) => {
  e.preventDefault();
  const text = $("text").value; if (!text) return;
  const id = Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 10);
  pending.set(id, text); renderPending(); send({type: "post", id, text}); $("text").value = "";
};
connect();
