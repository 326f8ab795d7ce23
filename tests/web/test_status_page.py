"""The manager's status page in a real browser, on a real mesh.

A manager on the real broker serves the page on a free port and reads queue depths from the
management API; two sample agents run in their own pools (``calc`` and ``echo``); a producer
publishes calc's descriptor and holds one admission. Headless Chromium loads the page and the
test reads it as an operator would: both agents Ready, with their task queues linked into the
RabbitMQ UI. While the page watches, the producer is admitted (and releases) nine more times
and refused three times: the counters, the charts and the refusals' reason codes must follow.
Then the echo agent is drained through the manager: within a few polls it must leave Ready on
the page while calc stays Ready. Last, the manager's HTTP server goes away and the page must
say so instead of showing stale data as if it were current.

Full-page screenshots of the live page and of the page after the drain go to
``MESH_SCREENSHOT_DIR`` (else the test's tmp dir); their paths are printed even without ``-s``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import pytest
from integration.test_admission import settings_for
from integration.test_grant_enforcement import CALC, CALC_REQUIREMENTS
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.support.ui import WebDriverWait

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.wire import CapabilityRange

if TYPE_CHECKING:
    from conftest import BrokerEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.browser]

T = TypeVar("T")

CALC_AGENT = "calc-1"
ECHO_AGENT = "echo-1"

# Read the page in one script call: rows are rebuilt every poll, so element handles go stale.
AGENTS_JS = """
return Array.from(document.querySelectorAll('#agents tbody tr[data-agent-id]'), (row) => ({
  id: row.dataset.agentId,
  state: row.dataset.state,
  badge: row.querySelector('.badge').textContent,
  queue_url: row.querySelector('a') ? row.querySelector('a').href : null,
}));
"""
REFUSALS_JS = """
return Array.from(document.querySelectorAll('#refusals tbody tr[data-reason]'),
                  (row) => ({reason: row.dataset.reason, text: row.textContent}));
"""
POOLS_JS = """
return Object.fromEntries(Array.from(document.querySelectorAll('#pools tbody tr[data-pool-id]'),
                                     (row) => [row.dataset.poolId, row.dataset.epoch]));
"""
QUEUES_JS = """
return Object.fromEntries(Array.from(document.querySelectorAll('#queues tbody tr[data-queue]'),
                                     (row) => [row.dataset.queue, row.querySelector('a').href]));
"""


class StatusPage:
    """The status page in a browser. Every method blocks: call them through ``asyncio.to_thread``
    (the manager serving the page runs on the test's event loop)."""

    def __init__(self, driver: webdriver.Chrome, url: str) -> None:
        self.driver = driver
        self.url = url

    def script(self, source: str) -> Any:
        return self.driver.execute_script(source)

    def wait_for(
        self, what: str, probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 15
    ) -> T:
        """Poll ``probe()`` until ``done`` accepts it; fail naming ``what`` and the last value."""
        seen: list[T] = []

        def check(_: object) -> bool:
            seen[:] = [probe()]
            return done(seen[0])

        try:
            WebDriverWait(self.driver, timeout_s, poll_frequency=0.2).until(check)
        except TimeoutException:
            raise AssertionError(
                f"the page never showed {what} in {timeout_s} s; last seen: {seen!r}"
            ) from None
        return seen[0]

    def open(self) -> None:
        self.driver.get(self.url)
        self.wait_for("its first poll", self.status, lambda status: status == "ok")

    def status(self) -> str:
        return str(self.script("return document.body.dataset.status"))

    def text(self, element_id: str) -> str:
        return str(self.script(f"return document.getElementById('{element_id}').textContent"))

    def agents(self) -> dict[str, dict[str, Any]]:
        return {row["id"]: row for row in self.script(AGENTS_JS)}

    def banner(self) -> str | None:
        """The unreachable banner's text while it is shown, else None."""
        return self.script(  # type: ignore[no-any-return]
            "const b = document.getElementById('unreachable');"
            "return b.hidden || b.offsetParent === null ? null : b.textContent;"
        )

    def chart(self, element_id: str) -> dict[str, str]:
        return self.script(  # type: ignore[no-any-return]
            f"return Object.assign({{}}, document.getElementById('{element_id}').dataset)"
        )

    def screenshot(self, path: Path) -> Path:
        """The whole page, however long (Chromium's DevTools protocol, beyond the viewport)."""
        size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def management_url(broker: BrokerEndpoint) -> str:
    """The management API's address with the AMQP URL's credentials, as the manager wants it."""
    amqp, api = urlsplit(broker.amqp_url), urlsplit(broker.management_url)
    user, password = amqp.username or "guest", amqp.password or "guest"
    return urlunsplit(api._replace(netloc=f"{user}:{password}@{api.netloc}"))


def sample_runtime(key: str, agent_id: str, amqp_url: str, namespace: str) -> AgentRuntime:
    agent = SAMPLES[key](agent_id, heartbeat_interval_s=5.0)
    return AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(line, file=sys.stdout, flush=True)


async def traffic(producer: MeshClient, rounds: int, refuse_every: int) -> tuple[int, list[str]]:
    """Admit-and-release calc tasks, one every 0.25 s, with a capability nobody offers every
    ``refuse_every`` rounds: the admitted count and the refusals' reason codes."""
    nobody_offers = CALC_REQUIREMENTS.model_copy(
        update={"capability": CapabilityRange(name="image.generate", version_spec=">=1")}
    )
    admitted, reasons = 0, []
    for n in range(1, rounds + 1):
        decision = await producer.admit(
            nobody_offers if n % refuse_every == 0 else CALC_REQUIREMENTS
        )
        if decision.grant is not None:
            admitted += 1
            assert (await producer.release_admission(decision.grant)).released
        else:
            assert decision.reason is not None, decision
            reasons.append(decision.reason.value)
        await asyncio.sleep(0.25)
    return admitted, reasons


async def test_the_status_page_shows_the_live_mesh_and_follows_a_drain(
    chrome: webdriver.Chrome,
    broker: BrokerEndpoint,
    amqp_url: str,
    namespace: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.monotonic()
    settings = settings_for(
        amqp_url,
        namespace,
        tmp_path,
        http_port=0,
        http_host="127.0.0.1",
        management_url=management_url(broker),
        queue_poll_interval_s=1.0,
    )
    shots = Path(os.environ.get("MESH_SCREENSHOT_DIR") or tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        manager = ManagerService(settings)
        await manager.start()
        stack.push_async_callback(manager.stop)
        assert manager.observer.web is not None
        for key, agent_id in (("calc", CALC_AGENT), ("echo", ECHO_AGENT)):
            runtime = sample_runtime(key, agent_id, amqp_url, namespace)
            await runtime.start()
            stack.push_async_callback(runtime.stop)
        producer = await MeshClient.connect(amqp_url, namespace=namespace, name="producer")
        stack.push_async_callback(producer.close)
        assert (await producer.publish_descriptor(CALC)).type == "mesh.descriptor-accepted.v1"
        held = await producer.admit(CALC_REQUIREMENTS)  # kept: the reservations table shows it
        assert held.outcome == "admitted"

        page = StatusPage(chrome, manager.observer.web.url)
        await asyncio.to_thread(page.open)
        assert await asyncio.to_thread(page.text, "manager-id") == settings.manager_id
        assert await asyncio.to_thread(page.text, "namespace") == namespace
        agents = await asyncio.to_thread(
            page.wait_for,
            "both agents Ready",
            page.agents,
            lambda rows: (
                {a: r["state"] for a, r in rows.items()}
                == {CALC_AGENT: "Ready", ECHO_AGENT: "Ready"}
            ),
        )
        for agent_id, row in agents.items():
            assert row["badge"] == "Ready"  # said in words, not only in colour
            assert row["queue_url"].startswith(broker.management_url)
            assert row["queue_url"].endswith(f"/{namespace}.agent.{agent_id}.tasks")
        assert await asyncio.to_thread(page.script, POOLS_JS) == {
            "calc": str(CALC.descriptor_epoch),
            "echo": "",  # no descriptor published for echo's pool
        }

        admitted, reasons = await traffic(producer, rounds=12, refuse_every=4)
        assert (admitted, len(reasons)) == (9, 3)
        total = str(admitted + 1)
        await asyncio.to_thread(
            page.wait_for,
            f"{total} admissions",
            lambda: page.text("sum-admitted"),
            lambda text: text == total,
        )
        refusals = await asyncio.to_thread(
            page.wait_for, "three refusals", lambda: page.script(REFUSALS_JS), lambda r: len(r) == 3
        )
        assert [r["reason"] for r in refusals] == reasons
        assert all(r["reason"] in r["text"] for r in refusals)
        admissions = await asyncio.to_thread(page.chart, "chart-admissions")
        assert int(admissions["points"]) >= 2 and float(admissions["peak"]) > 0, admissions
        assert float((await asyncio.to_thread(page.chart, "chart-refusals"))["peak"]) > 0
        calc_tasks = f"{namespace}.agent.{CALC_AGENT}.tasks"
        queues = await asyncio.to_thread(
            page.wait_for,
            "the task queues from the management API",
            lambda: page.script(QUEUES_JS),
            lambda rows: calc_tasks in rows,
        )
        assert queues[calc_tasks] == agents[CALC_AGENT]["queue_url"]
        live = await asyncio.to_thread(page.screenshot, shots / "status-page.png")
        report(capsys, f"\nstatus page screenshot (live mesh): {live}")

        drain = await producer.drain(ECHO_AGENT, reason="status page test")
        assert drain.type == "mesh.drain-accepted.v1", drain
        agents = await asyncio.to_thread(
            page.wait_for,
            f"{ECHO_AGENT} leave Ready after its drain",
            page.agents,
            lambda rows: ECHO_AGENT not in rows or rows[ECHO_AGENT]["state"] != "Ready",
        )
        assert agents[CALC_AGENT]["state"] == "Ready"
        if ECHO_AGENT in agents:
            assert agents[ECHO_AGENT]["state"] in ("Draining", "Terminated")
        drained = await asyncio.to_thread(page.screenshot, shots / "status-page-drained.png")
        report(capsys, f"status page screenshot (after the drain): {drained}")

        await manager.observer.web.close()  # the page stays open; its manager goes away
        banner = await asyncio.to_thread(
            page.wait_for, "the unreachable banner", page.banner, lambda text: text is not None
        )
        assert banner is not None and "Manager unreachable" in banner
        assert await asyncio.to_thread(page.status) == "unreachable"
    report(capsys, f"status page test took {time.monotonic() - started:.1f} s")
