"""A small W3C WebDriver client (httpx) for Debian's chromedriver + Chromium.

Enough for tests/web/test_web.py: open a page, find elements by CSS selector,
read text and attributes, click, type, run a script, take a screenshot. No
Selenium: its dependencies (trio among them) would change what other
modules import (httpcore picks trio up when it is installed).
"""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from balancer.devtools.embedded import free_port

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


class WebDriverError(Exception):
    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error


class Element:
    def __init__(self, browser: Browser, element_id: str) -> None:
        self.browser, self.id = browser, element_id

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        return self.browser.call(method, f"/element/{self.id}{path}", body)

    @property
    def text(self) -> str:
        return self._call("GET", "/text")

    def attribute(self, name: str) -> str | None:
        return self._call("GET", f"/attribute/{name}")

    def click(self) -> None:
        self._call("POST", "/click", {})

    def send_keys(self, text: str) -> None:
        self._call("POST", "/value", {"text": text})

    def find(self, css: str) -> Element:
        return Element(self.browser, self._call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def find_all(self, css: str) -> list[Element]:
        found = self._call("POST", "/elements", {"using": "css selector", "value": css})
        return [Element(self.browser, e[ELEMENT]) for e in found]


class Browser:
    """chromedriver on a free port, one Chromium session with ``args``; :meth:`quit` ends both."""

    def __init__(self, chromium: str, chromedriver: str, args: list[str], log: Path) -> None:
        port = free_port()
        self.shots = log.parent / "shots"  # where tests/web/test_web.py's screenshots go (beside the log)
        self._log = log.open("wb")
        self.driver = subprocess.Popen([chromedriver, f"--port={port}"], stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.http.get("/status").json()["value"]["ready"]:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.driver.poll() is not None:
                self.quit()
                raise RuntimeError(f"chromedriver did not start; see {log}")
            time.sleep(0.1)
        caps = {"browserName": "chrome", "goog:chromeOptions": {"binary": chromium, "args": args}}
        try:
            reply = self.http.post("/session", json={"capabilities": {"alwaysMatch": caps}}).json()["value"]
            if "sessionId" not in reply:
                raise WebDriverError(reply.get("error", "?"), reply.get("message", ""))
        except BaseException:
            self.quit()
            raise
        self.session = reply["sessionId"]

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        answer = self.http.request(method, f"/session/{self.session}{path}", json=body)
        value = answer.json()["value"]
        if answer.status_code >= 400:
            raise WebDriverError(value.get("error", "?"), value.get("message", "").splitlines()[0])
        return value

    def get(self, url: str) -> None:
        self.call("POST", "/url", {"url": url})

    @property
    def title(self) -> str:
        return self.call("GET", "/title")

    @property
    def page_source(self) -> str:
        return self.call("GET", "/source")

    def execute(self, script: str, *args: Any) -> Any:
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def find(self, css: str) -> Element:
        return Element(self, self.call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def rows(self, css: str, *cells: str) -> list[list[str | None]]:
        """For each element at ``css``, each of ``cells``: the text of the element a CSS selector
        finds in it (``""``: its own text), or with ``@name`` its attribute. Read in one script: a
        page whose live poll replaces its rows (balancer web's) cannot replace them between two
        reads, as it could between finding a row and reading its text ("stale element reference")."""
        script = ("const [css, cells] = arguments; return Array.from(document.querySelectorAll(css)).map(row =>"
                  " cells.map(c => c.startsWith('@') ? row.getAttribute(c.slice(1))"
                  " : (c === '' ? row : row.querySelector(c)).innerText.trim()))")
        return self.execute(script, css, list(cells))

    def find_all(self, css: str) -> list[Element]:
        return [Element(self, e[ELEMENT]) for e in self.call("POST", "/elements", {"using": "css selector", "value": css})]

    def wait_find(self, css: str, timeout: float = 30.0) -> Element:
        """:meth:`find`, retried until the element is there (the page a click led to may still be loading)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.find(css)
            except WebDriverError as exc:
                if exc.error != "no such element" or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def text_of(self, css: str, timeout: float = 30.0) -> str:
        """The text of the element at ``css`` once it is there (:meth:`wait_find`), read again when
        the page was replaced between finding the element and reading it (a form's redirect landing
        mid-read, a live page's poll)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.wait_find(css, max(0.0, deadline - time.monotonic())).text
            except WebDriverError as exc:
                if exc.error != "stale element reference" or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def set_window_size(self, width: int, height: int) -> None:
        self.call("POST", "/window/rect", {"width": width, "height": height})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("GET", "/screenshot")))

    def quit(self) -> None:
        try:
            if getattr(self, "session", None):
                self.http.delete(f"/session/{self.session}")
        except httpx.HTTPError:
            pass
        finally:
            self.http.close()
            self.driver.terminate()
            try:
                self.driver.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.driver.kill()
                self.driver.wait()
            self._log.close()
