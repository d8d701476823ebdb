"""The playground page in a real headless Chromium: type a prompt, watch the text stream, see the stats."""

from __future__ import annotations

import contextlib
import http.server
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.test_serve.server import ServeProcess

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.integration

PROMPT = "Name three primary colors."
# The page's parts that depend on the mode, and the ones each mode shows.
MODE_PARTS = ("#mode-note", "#output-note", "#drafter", "#draft-length")
VISIBLE_PARTS = {
    "plain": set(),
    "lossy": {"#mode-note", "#output-note", "#drafter"},
    "lossless": {"#drafter", "#draft-length"},
}
# Chromium asks for /favicon.ico once the page has loaded, on no event the page can wait for.
FAVICON_WAIT_MS = 2_000
# Response headers a proxy must not relay: they describe the hop, not the response.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run scripts/ensure-chromium (make test does)")
    return path


@contextlib.contextmanager
def browser_page(*args: str) -> Iterator[Page]:
    """A fresh page in the system Chromium (Playwright's own browser builds are not installed)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox", *args])
        try:
            yield browser.new_page()
        finally:
            browser.close()


@contextlib.contextmanager
def recording_proxy(target: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """An HTTP proxy on loopback that forwards GETs and records `(status, url)` of those sent to `target`.

    Chromium fetches /favicon.ico itself, outside the page's network events that Playwright reports,
    so only a proxy in front of the server sees every response the browser gets."""
    responses: list[tuple[int, str]] = []
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    class Forward(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                with direct.open(self.path, timeout=30) as upstream:
                    status, headers, body = upstream.status, upstream.headers, upstream.read()
            except urllib.error.HTTPError as error:
                status, headers, body = error.code, error.headers, error.read()
            if self.path.startswith(target):
                responses.append((status, self.path))
            self.send_response(status)
            for name, value in headers.items():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", responses
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


def visible_parts(page: Page) -> set[str]:
    return {part for part in MODE_PARTS if page.locator(part).is_visible()}


def send(page: Page, mode: str, max_tokens: int) -> None:
    from playwright.sync_api import expect

    page.fill("#prompt", PROMPT)
    page.select_option("#mode", mode)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#send")
    expect(page.locator("#status")).to_have_text("done", timeout=120_000)


def test_the_playground_streams_a_lossless_answer_and_shows_its_stats(
    server: ServeProcess, tmp_path: Path, client: object
) -> None:
    from playwright.sync_api import expect

    with browser_page() as page:
        page.goto(server.url + "/")
        page.select_option("#mode", "lossless")
        expect(page.locator("#drafter")).to_be_visible()
        send(page, "lossless", max_tokens=16)
        page.screenshot(path=str(tmp_path / "playground.png"))
        text = page.locator("#output").inner_text()
        names = ("tps", "ttft", "tokens", "acceptance", "cached")
        stats = {name: page.locator(f"#stat-{name}").inner_text() for name in names}
    assert text.strip(), "no text streamed into the page"
    assert 1 <= int(stats["tokens"]) <= 16
    assert float(stats["acceptance"]) >= 1.0, f"acceptance length missing: {stats}"
    assert float(stats["tps"]) > 0 and stats["ttft"].endswith(" s")
    assert stats["cached"] == "0"


def test_switching_the_mode_shows_the_lossy_notes_and_the_draft_fields_only_where_they_apply(
    server: ServeProcess,
) -> None:
    # Every switch between two modes, in both directions.
    switches = ("plain", "lossy", "lossless", "plain", "lossless", "lossy", "plain")
    with browser_page() as page:
        page.goto(server.url + "/")
        seen = []
        for mode in switches:
            page.select_option("#mode", mode)
            seen.append((mode, visible_parts(page)))
        note = page.locator("#mode-note").text_content() or ""
    for step, (mode, parts) in enumerate(seen):
        assert parts == VISIBLE_PARTS[mode], f"switch {step} to {mode}: shows {sorted(parts)}"
    assert "expected to differ" in note and "Lossless mode" in note, f"the lossy note says: {note!r}"


def test_the_lossy_output_note_follows_the_answer_not_the_mode_selected_after_it(server: ServeProcess) -> None:
    from playwright.sync_api import expect

    note = "#output-note"
    with browser_page() as page:
        page.goto(server.url + "/")
        send(page, "lossy", max_tokens=4)
        page.select_option("#mode", "plain")
        expect(page.locator(note)).to_be_visible()  # the text shown is still the lossy answer
        expect(page.locator("#mode-note")).to_be_hidden()
        send(page, "plain", max_tokens=4)
        expect(page.locator(note)).to_be_hidden()


def test_loading_the_page_gets_no_404(server: ServeProcess) -> None:
    # Chromium sends loopback requests past a proxy unless told not to.
    with recording_proxy(server.url) as (proxy, responses), \
            browser_page(f"--proxy-server={proxy}", "--proxy-bypass-list=<-loopback>") as page:
        page.goto(server.url + "/")
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(FAVICON_WAIT_MS)
    assert (200, server.url + "/") in responses, f"the proxy recorded no page load: {responses}"
    assert not [url for status, url in responses if status == 404], f"404 on page load: {responses}"
