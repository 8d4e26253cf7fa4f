"""The chat page end to end in a real headless Chromium: two users, three nodes, kill -9.

Debian's ``/usr/bin/chromium`` (``scripts/test.sh`` installs it when missing), driven by the
PyPI ``playwright`` package's sync API; the browsers playwright can download are not used. The
three nodes are real processes (:class:`ChatCluster`), so the test itself is plain sync code.

Screenshots of the chat pages (before the kill, while posts are pending, after) and of the
``/cluster`` page go to the test's ``tmp_path`` (printed), and also to the directory named by
``CHAT_SCREENSHOTS`` when it is set.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import BrowserContext, Page, sync_playwright

from examples.chat.cluster import ChatCluster
from tests._support.chat import room_home, running_chat

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOM = "browsers"
# Not P2PSHARD_*: node processes inherit the environment and refuse unknown P2PSHARD_* variables.
SCREENSHOTS = os.environ.get("CHAT_SCREENSHOTS", "")

# Every message in the DOM: seq and id of a delivered one (absent while pending), user, text,
# and the state shown beside a post not acknowledged yet ("sending…", "not sent — retry").
READ_MESSAGES = """els => els.map(li => ({
    seq: li.dataset.seq ? Number(li.dataset.seq) : null,
    id: li.dataset.id || null,
    user: li.querySelector('.user').textContent,
    text: li.childNodes[1] ? li.childNodes[1].textContent : '',
    pending: li.classList.contains('pending'),
    failed: li.classList.contains('failed'),
    state: li.querySelector('.state') ? li.querySelector('.state').textContent : null,
}))"""
# Every text the page ever shows in its banners and status line, recorded as it changes.
RECORD_BANNERS = """
window.__shown = [];
document.addEventListener("DOMContentLoaded", () => {
  const record = () => {
    for (const id of ["banner", "error", "status"]) {
      const e = document.getElementById(id);
      if (e && !e.hidden && e.textContent && !window.__shown.includes(e.textContent))
        window.__shown.push(e.textContent);
    }
  };
  new MutationObserver(record).observe(document.body, {
    subtree: true, childList: true, characterData: true, attributes: true,
    attributeFilter: ["hidden"],
  });
  record();
});
"""
# What must never reach a person: exception and class names, tracebacks.
PROGRAMMER_WORDS = re.compile(r"Error|Exception|Traceback|\b[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+\b")
RECONNECTING = "The connection to the chat was lost; reconnecting…"
BANNER_SHOWN = "!document.getElementById('banner').hidden"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ChatCluster]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: this test drives Debian's Chromium. scripts/test.sh installs"
            " it; by hand: apt-get install --no-install-recommends chromium",
            pytrace=False,
        )
    with running_chat(tmp_path / "chat") as chat:
        yield chat


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "chromium-profile",
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1000, "height": 640},
        )
        try:
            context.set_default_timeout(20_000)
            context.add_init_script(RECORD_BANNERS)
            yield context
        finally:
            context.close()


def _messages(page: Page) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = page.eval_on_selector_all("#messages li", READ_MESSAGES)
    return result


def _join(page: Page, url: str, user: str) -> None:
    page.goto(url)
    page.wait_for_function("document.getElementById('status').textContent.startsWith('connected')")
    page.fill("#user", user)
    page.fill("#room", ROOM)
    page.click("#join button")
    page.wait_for_function("!document.getElementById('text').disabled")


def _post(page: Page, text: str) -> None:
    page.fill("#text", text)
    page.press("#text", "Enter")


def _wait_delivered(page: Page, texts: list[str], timeout: float) -> None:
    """Until every text is a delivered (numbered) message and nothing is pending."""
    deadline = time.monotonic() + timeout
    while True:
        shown = _messages(page)
        delivered = {m["text"] for m in shown if m["seq"] is not None}
        if set(texts) <= delivered and not any(m["pending"] for m in shown):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not all of {texts} delivered within {timeout:g} s: {shown}")
        time.sleep(0.2)


def _status(page: Page) -> str:
    return page.inner_text("#status")


def _shown(page: Page) -> list[str]:
    """Every banner and status text the page has shown."""
    result: list[str] = page.evaluate("window.__shown")
    return result


def _room_on_row(node: str) -> str:
    """A page function: whether the /cluster page names the room on ``node``'s row."""
    row = f"#types table[data-type=Room] tr[data-node={node}] .entities"
    return f"(document.querySelector('{row}')?.textContent || '').split(', ').includes('{ROOM}')"


def test_two_browser_users_survive_kill_of_the_room_node(
    cluster: ChatCluster, browser: BrowserContext, tmp_path: Path
) -> None:
    shots: list[Path] = []

    def shot(page: Page, name: str) -> None:
        path = tmp_path / f"{name}.png"
        page.bring_to_front()  # a background tab paints late
        page.screenshot(path=path, full_page=True)
        shots.append(path)

    try:
        alice, bob, watch = browser.new_page(), browser.new_page(), browser.new_page()
        _join(alice, cluster.url(1), "alice")
        deadline = time.monotonic() + 10
        while (home := room_home(cluster, ROOM)) is None:
            assert time.monotonic() < deadline, "the room did not start"
            time.sleep(0.2)
        # one page on the room's node (it must reconnect), the other elsewhere (it must not)
        bob_node = 2 if home == 1 else home
        _join(bob, cluster.url(bob_node), "bob")
        assert _status(alice) == "connected to node-1"
        assert _status(bob) == f"connected to node-{bob_node}"
        assert alice.is_hidden("#banner")
        assert bob.is_hidden("#banner")
        refused = browser.new_page()  # a post the room refuses: "not sent", and a retry button
        _join(refused, cluster.url(bob_node), "carol")
        _post(refused, "x" * 5000)
        refused.wait_for_selector("#messages li.failed button.retry")
        assert [m["state"] for m in _messages(refused)] == ["not sent — retry"]
        assert refused.inner_text("#error").startswith("Your message was not sent: message too")
        refused.click("#messages li.failed button.retry")  # refused again: not sent again
        refused.wait_for_selector("#messages li.failed button.retry")
        banners = {"carol": _shown(refused)}
        refused.close()
        posted: list[str] = []
        for n in range(3):
            for who, page in (("alice", alice), ("bob", bob)):
                posted.append(f"{who} says {n}")
                _post(page, posted[-1])
                _wait_delivered(page, posted, 10)
        for page in (alice, bob):  # each sees the other's messages, live, across nodes
            _wait_delivered(page, posted, 10)
        assert [m["text"] for m in _messages(alice)] == posted
        watch.goto(cluster.url(home) + "cluster")
        watch.wait_for_function(_room_on_row(f"node-{home}"))
        shot(alice, "chat-alice-before")
        shot(bob, "chat-bob-before")
        shot(watch, f"cluster-node-{home}-before")

        cluster.kill(home)
        killed = time.monotonic()
        on_killed, on_killed_user, other, other_user = (
            (alice, "alice", bob, "bob") if home == 1 else (bob, "bob", alice, "alice")
        )
        on_killed.wait_for_function(
            "!document.getElementById('status').textContent.startsWith('connected')"
            f" && document.getElementById('text').disabled && {BANNER_SHOWN}",
            timeout=5000,
        )
        assert on_killed.inner_text("#banner") == RECONNECTING
        # The other page is still connected: what it posts while the room is down stays pending
        # (grey, "sending…") and is sent again until acknowledged. (The disconnected page takes
        # no input.)
        posted.append(f"{other_user} during the failover")
        _post(other, posted[-1])
        other.wait_for_function("document.querySelector('#messages li.pending') !== null")
        shot(other, f"chat-{other_user}-pending")
        shot(on_killed, f"chat-{on_killed_user}-disconnected")
        waiting = [(m["text"], m["state"]) for m in _messages(other) if m["pending"]]
        assert waiting == [(posted[-1], "sending…")]
        assert time.monotonic() - killed < 5, "the room came back too soon to see a pending post"

        _wait_delivered(other, posted, 45)
        assert [m for m in _messages(other) if m["state"] is not None] == []
        on_killed.wait_for_function(f"!({BANNER_SHOWN})", timeout=15_000)  # reconnected
        # the page on the killed node has reconnected to another node and joined again by itself
        posted.append(f"{on_killed_user} is back")
        _post(on_killed, posted[-1])
        for page in (alice, bob):
            _wait_delivered(page, posted, 15)
        recovered = time.monotonic() - killed
        status = _status(on_killed)
        assert status.startswith("connected to node-"), status
        assert status != f"connected to node-{home}", status
        for n in range(3, 5):
            for who, page in (("alice", alice), ("bob", bob)):
                posted.append(f"{who} says {n}")
                _post(page, posted[-1])
                _wait_delivered(page, posted, 15)
        for page in (alice, bob):
            _wait_delivered(page, posted, 10)

        views = {name: _messages(page) for name, page in (("alice", alice), ("bob", bob))}
        for name, shown in views.items():
            seqs = [m["seq"] for m in shown]
            assert seqs == list(range(1, len(posted) + 1)), (name, shown)
            assert sorted(m["text"] for m in shown) == sorted(posted), (name, shown)
            assert len({m["id"] for m in shown}) == len(posted), (name, shown)
            assert all(m["user"] == m["text"].split()[0] for m in shown), (name, shown)
        assert views["alice"] == views["bob"]
        # the order of each user's own posts is kept
        for who in ("alice", "bob"):
            assert [m["text"] for m in views["alice"] if m["user"] == who] == [
                t for t in posted if t.startswith(who)
            ]

        deadline = time.monotonic() + 20  # a loaded machine: /cluster.json may miss a round
        while (new_home := room_home(cluster, ROOM)) is None:
            assert time.monotonic() < deadline, "no running node says it has the room"
            time.sleep(0.2)
        assert new_home != home
        banners["watch, killed node"] = _shown(watch)
        watch.goto(cluster.url(new_home) + "cluster")
        watch.wait_for_function(
            f"{_room_on_row(f'node-{new_home}')} &&"
            " (document.getElementById('members').textContent.includes('unreachable')"
            f" || !document.getElementById('members').textContent.includes('node-{home}'))"
        )
        banners |= {"alice": _shown(alice), "bob": _shown(bob), "watch": _shown(watch)}
        print(f"banners and status lines shown: {banners}")
        assert RECONNECTING in banners[on_killed_user], banners
        for name, texts in banners.items():
            for text in texts:
                assert not PROGRAMMER_WORDS.search(text), f"{name}'s page showed {text!r}"
        shot(alice, "chat-alice-after")
        shot(bob, "chat-bob-after")
        shot(watch, f"cluster-node-{new_home}-after")
        print(
            f"room {ROOM} was on node-{home}, now on node-{new_home}; every post delivered"
            f" {recovered:.1f} s after kill -9; {len(posted)} messages, none lost or doubled"
        )
    finally:
        if SCREENSHOTS:
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            for path in shots:
                shutil.copy(path, Path(SCREENSHOTS) / path.name)
        for path in shots:
            print(f"screenshot: {path}")
