"""Headless Chromium driven over the DevTools protocol: load a page, wait until its text shows what
a test expects (pages that fill themselves over a websocket, like a marimo app, are not done when
they load), then read the text and take a screenshot."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import websocket  # websocket-client

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DEEP_TEXT = """(() => { const out = []; const skip = new Set(['SCRIPT', 'STYLE', 'TEMPLATE', 'NOSCRIPT']);
  const walk = (n) => { if (n.nodeType === 3) out.push(n.textContent);
    if (n.nodeType === 1 && skip.has(n.tagName)) return;
    if (n.shadowRoot) walk(n.shadowRoot); n.childNodes.forEach(walk); };
  if (document.body) walk(document.body); return out.join(' '); })()"""
DEEP_COUNT = """(() => { let count = 0;
  const walk = (n) => { if (n.querySelectorAll) count += n.querySelectorAll(SELECTOR).length;
    n.querySelectorAll && n.querySelectorAll('*').forEach((e) => { if (e.shadowRoot) walk(e.shadowRoot); }); };
  walk(document); return count; })()"""
DEEP_STYLES = """(() => { const out = [];
  const walk = (n) => { if (n.querySelectorAll) n.querySelectorAll(SELECTOR).forEach((e) => out.push(getComputedStyle(e)[PROP]));
    n.querySelectorAll && n.querySelectorAll('*').forEach((e) => { if (e.shadowRoot) walk(e.shadowRoot); }); };
  walk(document); return out; })()"""


class Page:
    def __init__(self, ws: websocket.WebSocket) -> None:
        self.ws, self._id = ws, 0

    def call(self, method: str, **params: object) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def text(self) -> str:
        """The page's rendered text (not its scripts), with that of its web components' shadow roots
        (where marimo draws its tables and charts)."""
        return str(self.evaluate(DEEP_TEXT) or "")

    def count(self, selector: str) -> int:
        """Elements matching `selector`, in the document and every shadow root."""
        return int(self.evaluate(DEEP_COUNT.replace("SELECTOR", json.dumps(selector))) or 0)

    def styles(self, selector: str, prop: str) -> list[str]:
        """The computed `prop` (e.g. "backgroundColor") of every element matching `selector`, in the
        document and every shadow root."""
        script = DEEP_STYLES.replace("SELECTOR", json.dumps(selector)).replace("PROP", json.dumps(prop))
        return [str(v) for v in (self.evaluate(script) or [])]

    def wait_for(self, ready: Callable[[str], bool], timeout: float = 120.0) -> str:
        """The page's text (`text`) once `ready(text)` holds; TimeoutError with the last text otherwise."""
        deadline, text = time.time() + timeout, ""
        while time.time() < deadline:
            text = self.text()
            if ready(text):
                return text
            time.sleep(1.0)
        raise TimeoutError(f"the page did not get ready in {timeout:.0f} s; its text:\n{text[:2000]}")

    def screenshot(self, out: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        out.write_bytes(base64.b64decode(data))


@contextmanager
def open_page(url: str, profile: Path, width: int = 1400, height: int = 1000) -> Iterator[Page]:
    assert CHROMIUM, "chromium is not installed"
    port = _free_port()
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", f"--window-size={width},{height}",
                             f"--remote-debugging-port={port}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, target = time.time() + 30, None
        while target is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as answer:
                    target = next(t for t in json.load(answer) if t["type"] == "page")
            except (OSError, StopIteration):
                if time.time() > deadline:
                    raise
                time.sleep(0.3)
        ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        try:
            page = Page(ws)
            page.call("Page.enable")
            page.call("Page.navigate", url=url)
            yield page
        finally:
            ws.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
