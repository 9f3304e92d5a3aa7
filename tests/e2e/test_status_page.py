"""The status page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium, against the service and the partner simulator
as processes.

A person logs in (a wrong token is refused and sets no cookie), watches a run's numbers
move to done without reloading, and resolves an ambiguous operation through the form;
the ledger records who and why as it does for the CLI. Forged forms (no or a wrong CSRF
token, another origin, no origin at all) and a read-only viewer are refused, and nothing
the page loads comes from anywhere but the service, nor carries a token in its URL. The
screenshot the README shows (docs/status-page.png) is taken here, mid-run.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e.harness import E2E, Service

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# The README's picture is refreshed only when asked (CLEANUP_UPDATE_SCREENSHOT=1): a test
# run must not dirty the checkout it tests, and the picture should name its commit.
README_SCREENSHOT = ROOT / "docs" / "status-page.png"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 45.0

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # the skip below says how to install it
    webdriver = None  # type: ignore[assignment]


def _browser_missing() -> str | None:
    if webdriver is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install -y chromium chromium-driver: Debian's {package})"
    return None


# Every [data-field] of the current run at one instant, as the person sees it (none, and no
# chart, on the login page: a wait there that times out still says what the page showed).
FIELDS_JS = """
const out = {};
document.querySelectorAll('#current [data-field]').forEach(e => { out[e.dataset.field] = e.textContent; });
out.chart_points = Number(document.getElementById('chart')?.getAttribute('data-points') || 0);
return out;
"""


def number(text: str) -> int:
    return int(text.replace(",", ""))


class Browser:
    """The driver's blocking calls run in a thread, so the harness's readers of the
    service's stderr keep running while the browser waits."""

    def __init__(self, driver: WebDriver) -> None:
        self.driver = driver

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def get(self, url: str) -> None:
        await self.call(self.driver.get, url)

    async def until(self, condition: Callable[[WebDriver], Any], what: str,
                    within_s: float = WAIT_S) -> Any:
        def wait() -> Any:
            return WebDriverWait(self.driver, within_s, poll_frequency=0.1).until(
                condition, message=what)
        try:
            return await asyncio.to_thread(wait)
        except TimeoutException:
            raise AssertionError(f"not within {within_s}s: {what}; the page shows "
                                 f"{await self.fields()}") from None

    async def fields(self) -> dict[str, Any]:
        return dict(await self.call(self.driver.execute_script, FIELDS_JS))

    async def log_in(self, svc: Service, token: str) -> None:
        await self.get(f"{svc.url}/login")
        box = self.driver.find_element(By.ID, "token")
        box.clear()
        box.send_keys(token)
        page = self.driver.find_element(By.TAG_NAME, "html")
        await self.call(self.driver.find_element(By.CSS_SELECTOR, "#login button").click)
        # The post answers with a new page: until the old one has gone, anything found
        # is the form just submitted, and goes stale under a condition reading it.
        await self.until(expected_conditions.staleness_of(page), "the login form's answer")

    def console_errors(self) -> list[str]:
        """Errors the page's console showed: a script error, a refused CSP directive."""
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"
                # The wrong-token login answers 401 by design; the console notes it.
                and "status of 401" not in e["message"]]

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for since the last call (Chrome's network log)."""
        urls = []
        for entry in self.driver.get_log("performance"):
            message = orjson.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                urls.append(message["params"]["request"]["url"])
        return urls


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CLEANUP_REQUIRE_BROWSER") == "1":
            pytest.fail(f"the browser tests must run here: {missing}")
        pytest.skip(missing)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # The driver path is given, so Selenium never tries to download one.
    driver = await asyncio.to_thread(webdriver.Chrome, service=DriverService(CHROMEDRIVER),
                                     options=options)
    # The page as a 1280 x 900 screen shows it (the window's size includes its frame).
    await asyncio.to_thread(driver.execute_cdp_cmd, "Emulation.setDeviceMetricsOverride",
                            {"width": 1280, "height": 900, "deviceScaleFactor": 1,
                             "mobile": False})
    try:
        yield Browser(driver)
    finally:
        await asyncio.to_thread(driver.quit)


async def _login_cookie(e2e: E2E, svc: Service, token: str) -> tuple[str, str]:
    """Log in over plain HTTP as a browser would; the session cookie and its CSRF token."""
    async with e2e.http.post(f"{svc.url}/login", data={"token": token},
                             headers={"Origin": svc.url}, allow_redirects=False) as resp:
        assert resp.status == 303, await resp.text()
        cookie = resp.cookies["cleanup_status"].value
    async with e2e.http.get(f"{svc.url}/", headers={"Cookie": f"cleanup_status={cookie}"},
                            allow_redirects=False) as resp:
        assert resp.status == 200
        match = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
    assert match is not None
    return cookie, match.group(1)


async def test_log_in_and_watch_a_run_to_done(e2e: E2E, browser: Browser) -> None:
    viewer_token = "viewer-" + e2e.trigger_token[::-1]
    e2e.env["CLEANUP_STATUS_TOKEN"] = viewer_token
    # A partner slower than the configured ceiling: the limiter is cut by 429s and the
    # chart has something to show besides a flat line.
    sandbox = await e2e.sandbox("--recipients", 900, "--rate", 60)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 90.0},
                                "schedule": {"digest_cutoff_seconds": 3600.0}})
    await svc.start()

    # A wrong token: 401, the form again, and no cookie.
    wrong = "wrong-" + e2e.trigger_token
    async with e2e.http.post(f"{svc.url}/login", data={"token": wrong},
                             headers={"Origin": svc.url}, allow_redirects=False) as resp:
        assert resp.status == 401
        assert "Set-Cookie" not in resp.headers
        assert 'id="login"' in await resp.text()
    await browser.log_in(svc, wrong)
    await browser.until(lambda d: "Wrong token." in d.find_element(By.TAG_NAME, "main").text,
                        "the login page says the token is wrong")
    assert browser.driver.get_cookies() == []
    assert browser.driver.current_url == f"{svc.url}/login"

    await browser.log_in(svc, e2e.trigger_token)
    await browser.until(lambda d: d.find_element(By.ID, "role").text.lower() == "operator",
                        "logged in as an operator")
    [cookie] = browser.driver.get_cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == \
        ("cleanup_status", True, "Strict", "/"), cookie
    assert browser.driver.execute_script("return document.cookie") == ""  # HttpOnly
    # Set once: still there at the end only if the page never reloaded.
    browser.driver.execute_script("window.__sameDocument = true;")

    run_id = await svc.open_run()
    first = await browser.until(
        lambda d: (f := d.execute_script(FIELDS_JS))["run_id"] == run_id
        and number(f["deleted"]) > 0 and f,
        "the new run on the page with deletions counted")
    await browser.until(lambda d: number(d.execute_script(FIELDS_JS)["deleted"])
                        > number(first["deleted"]), "the deleted count rising")

    def mid_run(d: WebDriver) -> dict[str, Any] | bool:
        f = d.execute_script(FIELDS_JS)
        settled = number(f["deleted"]) + number(f["already_absent"])
        return f["state"] != "done" and settled >= 300 and f["chart_points"] >= 4 and f

    shown = await browser.until(mid_run, "a third of the run settled and the chart drawn")
    assert number(shown["unfinished"]) > 0, shown
    assert shown["rate"].endswith("/s"), shown
    assert "before the cutoff" in shown["verdict"], shown
    screenshot = (README_SCREENSHOT if os.environ.get("CLEANUP_UPDATE_SCREENSHOT") == "1"
                  else e2e.tmp_path / "status-page.png")
    assert await browser.call(browser.driver.save_screenshot, str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG")

    done = await browser.until(lambda d: (f := d.execute_script(FIELDS_JS))["state"] == "done"
                               and f, "the run done on the page")
    run = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, run, sandbox)
    assert number(done["discovered"]) == 900
    assert number(done["deleted"]) == run["counts"]["deleted"]
    assert number(done["already_absent"]) == run["counts"]["already_absent"]
    assert (done["unfinished"], done["failed"], done["ambiguous"]) == ("0", "0", "0")
    assert browser.driver.execute_script("return window.__sameDocument === true")

    assert browser.console_errors() == []
    urls = browser.requested_urls()
    assert any(u.endswith("/status/data") for u in urls), urls
    foreign = [u for u in urls if not u.startswith(f"{svc.url}/")]
    assert not foreign, f"assets from elsewhere: {foreign}"
    for token in (e2e.trigger_token, viewer_token, wrong):
        assert not [u for u in urls if token in u], "a token in a URL"
    for name, ctype in (("status.js", "text/javascript"), ("status.css", "text/css")):
        assert any(u == f"{svc.url}/static/{name}" for u in urls), urls
        async with e2e.http.get(f"{svc.url}/static/{name}") as resp:
            assert resp.status == 200
            assert resp.content_type == ctype
    async with e2e.http.get(f"{svc.url}/login") as resp:
        assert resp.headers["Content-Security-Policy"].startswith("default-src 'self'")


async def test_resolve_through_the_form_and_forgeries_refused(e2e: E2E, browser: Browser,
                                                             ) -> None:
    viewer_token = "viewer-" + e2e.trigger_token[::-1]
    e2e.env["CLEANUP_STATUS_TOKEN"] = viewer_token
    # As tests/e2e/test_ambiguous.py: a partner that acts and then hangs, no idempotency
    # keys and no probe, so the hung operations stay ambiguous for a person to decide.
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 400, "--no-idempotency",
                                "--fault-timeout-after-act", 0.05, "--hang-seconds", 3)
    svc = e2e.service(sandbox, {"partner": {"idempotency_keys": False,
                                            "request_timeout_seconds": 1.0,
                                            "probe_path": ""}})
    await svc.start()
    run_id = await svc.open_run()
    await svc.wait_done(run_id)
    ambiguous = [op["id"] for op in await svc.operations(run_id, state="ambiguous")]
    assert len(ambiguous) >= 3, f"the simulator hung too few requests: {ambiguous}"
    by_browser, by_form, by_viewer = ambiguous[:3]

    await browser.log_in(svc, e2e.trigger_token)
    await browser.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr[data-operation]"))
                        == len(ambiguous), "every ambiguous operation listed")
    form = browser.driver.find_element(By.CSS_SELECTOR, f'form[data-operation="{by_browser}"]')
    Select(form.find_element(By.NAME, "outcome")).select_by_value("deleted")
    form.find_element(By.NAME, "by").send_keys("Ada Lovelace")
    form.find_element(By.NAME, "reason").send_keys("the partner's log shows the DELETE ran")
    await browser.call(form.find_element(By.CSS_SELECTOR, "button").click)
    flash = await browser.until(
        lambda d: (e := d.find_elements(By.CSS_SELECTOR, ".flash.ok")) and e[0].text,
        "the resolution confirmed on the page")
    assert f"Operation {by_browser} resolved as deleted by Ada Lovelace" in flash
    assert not browser.driver.find_elements(By.CSS_SELECTOR, f'tr[data-operation="{by_browser}"]')
    # The name is offered again in the next form.
    assert browser.driver.find_element(
        By.CSS_SELECTOR, f'form[data-operation="{by_form}"] input[name=by]'
    ).get_attribute("value") == "Ada Lovelace"

    op = await svc.operation(by_browser)
    assert op["state"] == "deleted", op
    assert op["reason"] == "resolved by operator Ada Lovelace: the partner's log shows the DELETE ran"
    last = op["attempts_log"][-1]
    assert (last["kind"], last["outcome"], last["detail"]) == \
        ("operator", "deleted", "operator Ada Lovelace: the partner's log shows the DELETE ran"), last
    assert not [u for u in browser.requested_urls() if e2e.trigger_token in u]

    # Forgeries, with a real operator session: each refused, nothing recorded.
    cookie, csrf = await _login_cookie(e2e, svc, e2e.trigger_token)
    path = f"{svc.url}/status/operations/{by_form}/resolve"
    fields = {"outcome": "failed", "by": "Mallory", "reason": "forged"}

    async def post(form: dict[str, str], headers: dict[str, str]) -> int:
        async with e2e.http.post(path, data=form, headers=headers,
                                 allow_redirects=False) as resp:
            return resp.status

    session = {"Cookie": f"cleanup_status={cookie}"}
    same = {**session, "Origin": svc.url}
    forgeries = [
        ("no CSRF token", fields, same, 403),
        ("a wrong CSRF token", {**fields, "csrf": csrf[:-2] + "xx"}, same, 403),
        ("another origin", {**fields, "csrf": csrf}, {**session, "Origin": "http://evil.example"}, 403),
        ("a cross-site referer, no origin", {**fields, "csrf": csrf},
         {**session, "Referer": "http://evil.example/page"}, 403),
        ("neither origin nor referer", {**fields, "csrf": csrf}, session, 403),
        ("no session", {**fields, "csrf": csrf}, {"Origin": svc.url}, 401),
    ]
    for what, form_fields, headers, expected in forgeries:
        assert await post(form_fields, headers) == expected, what
    assert (await svc.operation(by_form))["state"] == "ambiguous"
    # The same form, genuine: accepted, so the refusals above were for what they lacked.
    assert await post({**fields, "csrf": csrf, "by": "Grace Hopper", "reason": "checked"},
                      same) == 303
    op = await svc.operation(by_form)
    assert (op["state"], op["reason"]) == ("failed", "resolved by operator Grace Hopper: checked")

    # A viewer sees the operations but gets no form, and a resolve from them is refused.
    cookie, csrf = await _login_cookie(e2e, svc, viewer_token)
    viewer = {"Cookie": f"cleanup_status={cookie}"}
    async with e2e.http.get(f"{svc.url}/", headers=viewer) as resp:
        page = await resp.text()
    assert 'id="role">viewer<' in page
    assert f'data-operation="{by_viewer}"' in page
    assert 'class="resolve"' not in page
    async with e2e.http.post(f"{svc.url}/status/operations/{by_viewer}/resolve",
                             data={**fields, "csrf": csrf}, headers={**viewer, "Origin": svc.url},
                             allow_redirects=False) as resp:
        assert resp.status == 403
    assert (await svc.operation(by_viewer))["state"] == "ambiguous"
    async with e2e.http.get(f"{svc.url}/status/data", headers=viewer) as resp:
        assert resp.status == 200
        assert (await resp.json())["role"] == "viewer"
