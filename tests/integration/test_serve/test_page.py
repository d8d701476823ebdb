"""The playground page in a real headless Chromium: type a prompt, watch the text stream, see the stats."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.test_serve.server import ServeProcess

pytestmark = pytest.mark.integration

PROMPT = "Name three primary colors."


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run scripts/ensure-chromium (make test does)")
    return path


def test_the_playground_streams_a_lossless_answer_and_shows_its_stats(
    server: ServeProcess, tmp_path: Path, client: object
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        # The system browser: Playwright's own browser builds are not installed.
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#prompt", PROMPT)
            page.select_option("#mode", "lossless")
            expect(page.locator("#drafter")).to_be_visible()
            page.fill("#max-tokens", "16")
            page.click("#send")
            expect(page.locator("#status")).to_have_text("done", timeout=120_000)
            page.screenshot(path=str(tmp_path / "playground.png"))
            text = page.locator("#output").inner_text()
            names = ("tps", "ttft", "tokens", "acceptance", "cached")
            stats = {name: page.locator(f"#stat-{name}").inner_text() for name in names}
        finally:
            browser.close()
    assert text.strip(), "no text streamed into the page"
    assert 1 <= int(stats["tokens"]) <= 16
    assert float(stats["acceptance"]) >= 1.0, f"acceptance length missing: {stats}"
    assert float(stats["tps"]) > 0 and stats["ttft"].endswith(" s")
    assert stats["cached"] == "0"
