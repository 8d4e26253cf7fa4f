// The chat page: one WebSocket to this node; on close, a "reconnecting" banner and a reconnect to
// another node of the list the server sent (with a growing, jittered delay), then join again and
// reload the history. Posts carry a client id and show "sending…" until acknowledged; pending
// posts are sent again after a reconnect (the room drops duplicates). A post the room refuses, or
// that could not be delivered after many tries, shows "not sent" and a retry button.
// Every text shown to people is written here in plain words: the server's error texts are shown
// only for input the person can fix (a bad name, a message too long).
"use strict";
const $ = (id) => document.getElementById(id);
let nodes = [location.origin + "/"];
let nodeIndex = 0;
let ws = null;
let joined = null;          // {room, user} we want to be in
let lastSeq = 0;
const pending = new Map();  // client id -> {text, tries, failed}, until acknowledged
let attempts = 0;           // reconnects since the last successful one
const MAX_TRIES = 15;       // "try again" answers for one post before it shows "not sent"
const ROOM_UNREACHABLE = "The room could not be reached; trying again…";
const RECONNECTING = "The connection to the chat was lost; reconnecting…";

function showError(text) { const e = $("error"); e.textContent = text; e.hidden = !text; }
function showBanner(text) { const b = $("banner"); b.textContent = text; b.hidden = !text; }
function setStatus(text) { $("status").textContent = text; }
function wsUrl(base) { const u = new URL(base); u.protocol = u.protocol === "https:" ? "wss:" : "ws:"; u.pathname = "/ws"; return u.href; }
function send(frame) { if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame)); }
function sendPost(id) { const p = pending.get(id); if (p) send({type: "post", id, text: p.text}); }

function renderMembers(members) {
  const ul = $("members"); ul.replaceChildren();
  for (const m of members) { const li = document.createElement("li"); li.textContent = m; ul.append(li); }
}
function messageItem(user, text) {
  const li = document.createElement("li");
  const who = document.createElement("span"); who.className = "user"; who.textContent = user;
  li.append(who, document.createTextNode(text)); return li;
}
// Our posts not yet acknowledged, after the room's messages: grey with "sending…" until the ack
// (or the message itself) comes; "not sent" with a retry button once given up.
function renderPending() {
  const ul = $("messages");
  for (const li of ul.querySelectorAll("li.pending, li.failed")) li.remove();
  for (const [id, p] of pending) {
    const li = messageItem(joined ? joined.user : "", p.text); li.dataset.id = id;
    const state = document.createElement("span"); state.className = "state";
    if (p.failed) {
      li.className = "failed"; state.textContent = "not sent — ";
      const retry = document.createElement("button"); retry.type = "button"; retry.className = "retry";
      retry.textContent = "retry";
      retry.onclick = () => { p.failed = false; p.tries = 0; renderPending(); sendPost(id); };
      state.append(retry);
    } else {
      li.className = "pending"; state.textContent = "sending…";
    }
    li.append(state); ul.append(li);
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

// An error frame: "try again" ones are retried (a room moving after a failure), the others are
// about something the person sent, which the server's text names.
function onError(f) {
  const p = f.id ? pending.get(f.id) : undefined;
  if (f.retry && p) {
    p.tries += 1;
    if (p.tries >= MAX_TRIES) { p.failed = true; renderPending(); showError("A message could not be sent; press retry to try again."); return; }
    showError(ROOM_UNREACHABLE); setTimeout(() => sendPost(f.id), 1000);
  } else if (f.retry && joined) {
    showError(ROOM_UNREACHABLE); setTimeout(() => send({type: "join", ...joined}), 1000);
  } else if (f.retry) {
    showError("The room could not be reached; please try again.");
  } else {
    if (p) { p.failed = true; renderPending(); }
    showError(f.id ? "Your message was not sent: " + f.error : "That did not work: " + f.error);
  }
}

function connect() {
  const base = nodes[nodeIndex % nodes.length];
  setStatus("connecting…");
  ws = new WebSocket(wsUrl(base));
  ws.onopen = () => { attempts = 0; showBanner(""); setStatus("connected to " + base); if (joined) send({type: "join", ...joined}); };
  ws.onmessage = (event) => {
    let f; try { f = JSON.parse(event.data); } catch { return; }
    switch (f.type) {
      case "hello": if (f.nodes && f.nodes.length) { nodes = f.nodes; nodeIndex = Math.max(0, nodes.indexOf(base)); }
        setStatus("connected to " + f.node); break;
      case "joined": showError(""); renderHistory(f.history); renderMembers(f.members); setJoined(true);
        for (const [id, p] of pending) if (!p.failed) sendPost(id);
        break;
      case "history": renderHistory(f.history); renderMembers(f.members); break;
      case "message": renderMessage(f.message); break;
      case "members": renderMembers(f.members); break;
      case "ack": pending.delete(f.id); showError(""); renderPending();
        if (f.seq > lastSeq) send({type: "history"}); break;
      case "left": joined = null; setJoined(false); renderMembers([]); break;
      case "error": onError(f); break;
    }
  };
  ws.onclose = () => {
    showBanner(RECONNECTING); setStatus("reconnecting…"); setJoined(false);
    nodeIndex += 1; attempts += 1;
    // 0.25 s, 0.5 s, 1 s ... up to 5 s, each somewhere in its upper half: pages that lost the
    // same node do not all come back at the same instant.
    const delay = Math.min(5000, 125 * 2 ** Math.min(attempts, 6));
    setTimeout(connect, delay * (0.5 + Math.random() / 2));
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
  pending.set(id, {text, tries: 0, failed: false}); renderPending(); sendPost(id); $("text").value = "";
};
connect();
