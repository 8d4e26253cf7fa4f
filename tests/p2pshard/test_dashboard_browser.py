"""The dashboard in a real headless Chromium, on a three-node cluster under a workload of tells.

Debian's ``/usr/bin/chromium`` driven by the PyPI ``playwright`` package's sync API, as the chat
example's browser test does (its command line and its check for the browser are reused). The
three nodes run in this process, on the simulated network, in a thread of their own running
trio (:class:`LiveCluster`); their management endpoints are real HTTP servers on 127.0.0.1, and
the browser loads the page from node 1's. A bounded workload of tells (and a few asks) runs
from every node while the test reads the page.

The screenshot goes to the test's ``tmp_path`` (printed), and also to the directory named by
``DASHBOARD_SCREENSHOTS`` when it is set. (Not ``P2PSHARD_*``: node processes refuse unknown
``P2PSHARD_*`` variables, and a test run may start some.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from playwright.sync_api import BrowserContext, Page, sync_playwright

from p2pshard import ManagementSettings
from tests.examples.test_chat_browser import CHROMIUM, CHROMIUM_ARGS
from tests.p2pshard.test_cli_status import Touch
from tests.p2pshard.test_management import BOUND, TOKEN, cluster, registered

SCREENSHOTS = os.environ.get("DASHBOARD_SCREENSHOTS", "")
LIFETIME = 90.0
"""Seconds the cluster runs at most, whatever the test does."""
MAX_MESSAGES = 30_000
"""Tells the workload sends at most."""
ENTITIES = 60
LINE_POINTS = 6
"""Points of the rate chart the screenshot waits for."""

# Predicates are functions, not expressions: playwright evaluates an expression with eval, which
# the page's Content-Security-Policy forbids (as it should).
THREE_UP = "() => document.querySelectorAll('#members tbody tr[data-status=\"UP\"]').length === 3"
# The rate chart as the page draws it: the latest value and every plotted point.
READ_RATE = """() => {
    const latest = document.querySelector('#rate-chart text.latest');
    const lines = [...document.querySelectorAll('#rate-chart polyline')];
    return {
        latest: latest ? latest.dataset.value : null,
        points: lines.map(line => line.getAttribute('points')).join(' '),
    };
}"""


class LiveCluster:
    """Three managed nodes and a workload, run by ``trio.run`` in a thread.

    Node 2's endpoint asks for the token on read routes. Start with :meth:`start`; the cluster
    stops on :meth:`stop`, after ``LIFETIME`` seconds, or when the workload has sent
    ``MAX_MESSAGES``, whichever comes first.
    """

    def __init__(self) -> None:
        self.urls: dict[int, str] = {}
        self.sent = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopped: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=self._run, name="live-cluster", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(BOUND * 3):
            raise AssertionError("the three nodes did not start in time")
        if self._error is not None:
            raise AssertionError(f"the cluster failed to start: {self._error!r}")

    def stop(self) -> None:
        if self._token is not None and self._stopped is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):  # it had stopped by itself
                trio.from_thread.run_sync(self._stopped.set, trio_token=self._token)
        self._thread.join(BOUND)
        assert not self._thread.is_alive(), "the cluster's thread did not end"
        if self._error is not None:
            raise AssertionError(f"the cluster failed: {self._error!r}")

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start() or stop(), in the test's thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._stopped = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        protected = ManagementSettings(enabled=True, port=0, token=TOKEN, read_token_required=True)
        async with cluster(seed=21, settings={2: protected}) as sim:
            await sim.start_up([1, 2, 3], bound=BOUND)
            await registered(sim, [1, 2, 3])
            self.urls = {i: f"http://{sim.nodes[i].management_address}/" for i in (1, 2, 3)}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._workload, sim)
                self._ready.set()
                with trio.move_on_after(LIFETIME):
                    await self._stopped.wait()
                nursery.cancel_scope.cancel()

    async def _workload(self, sim: Any) -> None:
        """Tells from every node to ``ENTITIES`` entities, an ask now and then; bounded."""
        for n in range(MAX_MESSAGES):
            region = sim.regions[1 + n % 3]
            entity = region.entity_ref(f"e{n % ENTITIES}")
            if n % 25 == 0:
                await entity.ask(Touch(), timeout=10)
            else:
                await entity.tell(Touch())
            self.sent += 1
            await trio.sleep(0.004)


@pytest.fixture
def live() -> Iterator[LiveCluster]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: this test drives Debian's Chromium. scripts/test.sh installs"
            " it; by hand: apt-get install --no-install-recommends chromium",
            pytrace=False,
        )
    running = LiveCluster()
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "chromium-profile",
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 900},
        )
        try:
            context.set_default_timeout(20_000)
            yield context
        finally:
            context.close()


def _rate(page: Page) -> dict[str, Any]:
    result: dict[str, Any] = page.evaluate(READ_RATE)
    return result


def test_the_dashboard_shows_three_members_their_shards_and_a_moving_rate(
    live: LiveCluster, browser: BrowserContext, tmp_path: Path
) -> None:
    shots: list[Path] = []
    try:
        page = browser.new_page()
        page.goto(live.urls[1])
        page.wait_for_function(THREE_UP)
        names = page.eval_on_selector_all(
            "#members tbody tr td:first-child", "cells => cells.map(c => c.textContent)"
        )
        assert sorted(names) == ["n1", "n2", "n3"]
        marks = page.inner_text("#members tbody")
        for mark in ("leader", "oldest", "this node"):
            assert mark in marks, marks
        # a bar for each node that hosts Counter shards: all three, under this workload
        page.wait_for_function(
            "() => [...document.querySelectorAll('#shards rect.bar')]"
            ".filter(bar => Number(bar.dataset.shards) > 0).length === 3"
        )
        bars = page.eval_on_selector_all(
            "#shards rect.bar", "bars => bars.map(b => [b.dataset.node, Number(b.dataset.shards)])"
        )
        assert sorted(node for node, _ in bars) == ["n1", "n2", "n3"]
        assert page.inner_text("#types tbody").startswith("Counter")

        # The messages-per-second chart moves: a nonzero latest value, then other points.
        page.wait_for_function(f"() => Number(({READ_RATE})().latest) > 0")
        first = _rate(page)
        assert first["points"], first
        page.wait_for_function(
            f"""before => {{
                const now = ({READ_RATE})();
                return Number(now.latest) > 0 && now.points !== before;
            }}""",
            arg=first["points"],
        )
        second = _rate(page)
        assert float(second["latest"]) > 0
        assert second["points"] != first["points"]
        # Node 1 asks now and then: the latency chart draws a line of real values.
        page.wait_for_function(
            "() => [...document.querySelectorAll('#latency-chart polyline')]"
            ".some(line => (line.getAttribute('points') || '').trim().length > 0)"
        )
        assert "no data" not in page.inner_text("#latency-chart")
        timeline = page.inner_text("#events")
        for name in ("n2", "n3"):
            assert f"{name} (10.0.0.1:" in timeline, timeline
        # a few more seconds of line for the screenshot to show
        page.wait_for_function(f"() => ({READ_RATE})().points.split(' ').length >= {LINE_POINTS}")
        path = tmp_path / "dashboard-node-1.png"
        page.screenshot(path=path, full_page=True)
        shots.append(path)

        # Node 2 asks for its token: the page asks once, keeps it for the tab, then shows all.
        guarded = browser.new_page()
        guarded.goto(live.urls[2])
        guarded.wait_for_selector("#token-form:not([hidden])")
        assert guarded.locator("#members tbody tr").count() == 0
        guarded.fill("#token", TOKEN)
        guarded.click("#token-form button")
        guarded.wait_for_function(THREE_UP)
        assert guarded.evaluate("sessionStorage.getItem('p2pshard-management-token')") == TOKEN
        assert guarded.is_hidden("#token-form")
        path = tmp_path / "dashboard-node-2.png"
        guarded.screenshot(path=path, full_page=True)
        shots.append(path)
        print(f"rate chart: {first['latest']}/s then {second['latest']}/s; {live.sent} sent")
    finally:
        if SCREENSHOTS:
            Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
            for path in shots:
                shutil.copy(path, Path(SCREENSHOTS) / path.name)
        for path in shots:
            print(f"screenshot: {path}")
