"""The gateway's chat page at ``/``: served as HTML, and driven in a real headless browser.

The browser test starts ``quanta serve --openai-port`` on the tiny random-weight model, opens
the page in the system's Chromium through Playwright (its own browser download is never
needed), asks a question and reads the streamed answer with its TTFT and tokens/s. It skips,
saying why, where Playwright or a Chromium binary is missing (Debian: ``apt-get install
chromium``). ``QUANTA_CHAT_SCREENSHOTS`` names a folder to keep a screenshot of the page as
each browser test leaves it (``<test name>.png``), to look at how it reads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from quanta.frontends.openai.app import GatewaySettings, create_app

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """A Chromium binary: ``QUANTA_CHROMIUM`` if set, else the first on PATH."""
    named = os.environ.get("QUANTA_CHROMIUM")
    if named:
        return named
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def test_the_page_is_served_at_the_root(tmp_path):
    app = create_app(GatewaySettings(triton_grpc_url="127.0.0.1:1", state_dir=tmp_path))
    response = TestClient(app).get("/")  # NOTE: no lifespan, so nothing connects to Triton
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    for element in ('id="model"', 'id="tenant"', 'id="priority"', 'id="prompt"', 'id="stop"'):
        assert element in page, element
    assert "v1/chat/completions" in page and "getReader()" in page
    assert "<script src" not in page  # self-contained: works with no network


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    executable = find_chromium()
    if executable is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from serving import start_serve, stop_serve

    serve = start_serve(tmp_path_factory.mktemp("serve"))
    try:
        yield serve
    finally:
        code, out = stop_serve(serve)
    assert code == 0, out


@pytest.fixture
def page(browser, live, request):
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.goto(live.openai_url.removesuffix("/v1") + "/")
    yield opened
    shots = os.environ.get("QUANTA_CHAT_SCREENSHOTS")
    if shots:
        opened.screenshot(path=str(Path(shots) / f"{request.node.name}.png"), full_page=True)
    context.close()
    assert not errors, errors  # no uncaught script error on the way


def ask(page, question: str) -> None:
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def answer(page, number: int, timeout_ms: float = 60_000):
    """The ``number``-th assistant message (1 first) and its statistics line, once that is
    shown (the answer is over)."""
    message = page.locator(".msg.assistant").nth(number - 1)
    stats = message.locator(".stats")
    stats.wait_for(timeout=timeout_ms)
    return message, stats


def ready(page) -> None:
    """Wait until the page has listed the models and found the model ready."""
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")


@pytest.mark.slow
@pytest.mark.live
def test_a_streamed_answer_with_its_ttft_and_tokens_per_second(page, live):
    from serving import scrape, wait_for

    ready(page)
    assert page.locator("#model option").all_inner_texts() == ["quanta"]
    page.fill("#tenant", "alice")
    page.select_option("#priority", "offline")
    page.fill("#max-tokens", "24")
    ask(page, "What is paged attention?")
    message, stats = answer(page, 1)
    assert message.locator(".text").inner_text().strip()
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert float(stats.get_attribute("data-tokens-per-s")) > 0
    assert stats.get_attribute("data-finish") in ("length", "stop")
    assert "tenant alice" in stats.inner_text() and "class offline" in stats.inner_text()
    assert page.evaluate("messages.map((m) => m.role)") == ["user", "assistant"]
    offline = 'quanta_generation_tokens_total{priority_class="offline",tenant="alice"}'
    wait_for(lambda: scrape(live.metrics_url).get(offline, 0) >= 1, what="alice's offline tokens")

    ask(page, "And why does it help?")  # the conversation goes on with the history
    answer(page, 2)
    assert page.evaluate("messages.length") == 4


@pytest.mark.slow
@pytest.mark.live
def test_an_error_is_shown_and_the_question_left_out(page):
    ready(page)
    page.fill("#max-tokens", "600")  # more than the tiny model's context
    ask(page, "Hello")
    message, stats = answer(page, 1)
    assert "maximum length" in message.locator(".error").inner_text()
    assert "finish error" in stats.inner_text()
    assert page.evaluate("messages.length") == 0
    assert page.locator("#send").is_enabled()


STOP_AT_FIRST_TEXT = """
new MutationObserver((_, observer) => {
  const text = document.querySelector(".msg.assistant .text");
  if (text && text.textContent) {
    window.stoppedWhileRunning = !document.getElementById("stop").disabled;
    document.getElementById("stop").click();
    observer.disconnect();
  }
}).observe(document.getElementById("log"), { childList: true, subtree: true, characterData: true });
"""


@pytest.mark.slow
@pytest.mark.live
def test_stop_ends_the_answer(page):
    ready(page)
    page.fill("#max-tokens", "300")
    # NOTE: greedy, the tiny model writes all 300 tokens (at the page's default temperature it
    # may sample its end of text within a few dozen, before a Stop on a busy machine lands)
    page.fill("#temperature", "0")
    # NOTE: Stop is pressed from inside the page as the first text shows: the tiny model
    # writes hundreds of tokens a second, faster than a round trip from the test could press it
    page.evaluate(STOP_AT_FIRST_TEXT)
    ask(page, "Tell me a long story")
    _, stats = answer(page, 1)
    assert page.evaluate("window.stoppedWhileRunning") is True  # text showed mid-answer
    assert "finish stopped" in stats.inner_text()
    assert page.evaluate("messages.map((m) => m.role)") == ["user", "assistant"]
