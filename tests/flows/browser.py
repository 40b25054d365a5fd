"""A headless Chromium driven over the DevTools protocol, for tests that look at the Prefect UI.

Only what those tests need: open a page, wait for something on it, click like a person (a real
mouse press and release at an element's centre: Radix-style buttons act on ``pointerdown``, which
a scripted ``element.click()`` never sends), read text and take a screenshot. The client is the
``websockets`` package Prefect already depends on, so the tests need no browser-automation library.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect


def chromium_binary() -> str | None:
    """The Chromium on this machine (Debian's ``chromium`` package), if any."""
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


class Chromium:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, binary: str, *, width: int, height: int) -> None:
        self._profile = tempfile.TemporaryDirectory(
            prefix="chromium-profile-", ignore_cleanup_errors=True
        )  # its helpers may still write
        self._process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = self._devtools_url()
        self._socket = connect(url, max_size=64 * 2**20, open_timeout=30)
        self._ids = itertools.count(1)
        target = self._send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self._send("Page.enable", session=True)

    def _devtools_url(self) -> str:
        assert self._process.stderr is not None
        for line in self._process.stderr:
            if match := re.search(r"DevTools listening on (ws://\S+)", line):
                return match.group(1)
        raise RuntimeError(f"chromium exited ({self._process.wait()}) before opening its DevTools port")

    def _send(self, method: str, *, session: bool = False, **params: Any) -> dict:
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._socket.send(json.dumps(message))
        while True:
            reply = json.loads(self._socket.recv(timeout=60))
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self._send(
            "Runtime.evaluate", session=True, expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self._send("Page.navigate", session=True, url=url)

    def wait_for(self, expression: str, *, timeout: float = 180, what: str = "") -> Any:
        """Poll a JavaScript expression until it is truthy; its value. An expression that throws is not there yet:
        while a page loads (after a form is sent, say) ``document.body`` is null for a moment. The default wait is
        long: in CI the browser step shares 2 cores with three other steps, and the Prefect and MLflow UIs (React
        apps) take tens of seconds to render there; a page that shows costs no more for it."""
        deadline, error = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                if value := self.evaluate(expression):
                    return value
            except RuntimeError as thrown:
                error = thrown
            time.sleep(0.25)
        raise TimeoutError(f"the page never showed {what or expression}" + (f" (last: {error})" if error else ""))

    def click(self, expression: str) -> None:
        """Press and release the mouse on the element ``expression`` evaluates to (scrolled into view)."""
        box = self.evaluate(
            f"(() => {{ const e = {expression}; e.scrollIntoView({{block: 'center'}});"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = box
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self._send(
                "Input.dispatchMouseEvent",
                session=True,
                type=kind,
                x=x,
                y=y,
                button="none" if kind == "mouseMoved" else "left",
                buttons=0 if kind == "mouseReleased" else 1 if kind == "mousePressed" else 0,
                clickCount=0 if kind == "mouseMoved" else 1,
            )

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the viewport, written to ``path``; its bytes."""
        png = base64.b64decode(self._send("Page.captureScreenshot", session=True, format="png")["data"])
        path.write_bytes(png)
        return png

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self._socket.close()
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._profile.cleanup()
