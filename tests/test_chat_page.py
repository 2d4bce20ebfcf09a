"""The chat page (`GET /`, serve/web/chat.html) in a real browser: headless Debian Chromium driven by
selenium against the session's `chat_server` (tests/conftest.py).

The browser types the API key, sends messages with Enter, watches the answer stream in, shows
reasoning folded and a tool call (forced by a one-choice structured output that a fetch wrapper
the test installs adds to the page's request, so the page itself carries no test code), and presses Stop,
after which the server's /metrics must show the engine request gone and not counted as finished.
`DSV4_UPDATE_DOCS_SCREENSHOT=1` also writes the screenshot to docs/chat_page.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from conftest import CHAT_SERVER_FLAGS, CHAT_SERVER_NAME, REPO  # tests/ is on sys.path

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PAGE = REPO / "serve" / "web" / "chat.html"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
WAIT_S = 30  # generous upper bound for any one wait; a passing run waits far less


# ---- without a browser ---------------------------------------------------------------------------------
def test_page_is_one_self_contained_file():
    """No outside assets: no external script, stylesheet, font or image, and API calls on this origin only."""
    html = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(|https?://", html, re.IGNORECASE)
    assert set(re.findall(r"fetch\(\s*\"([^\"]+)\"", html)) == {"/v1/models", "/v1/chat/completions"}


def test_no_web_ui_removes_the_page():
    """The app as the server builds it, in this process (the page route needs no engine): `/` is the
    page, open without the API key; with --no-web-ui it is a 404."""
    import asyncio

    from serve.app import build_app
    from serve.args import parse_args
    from serve.state import ServingState

    async def get_root(*flags: str) -> httpx.Response:
        state = ServingState(parse_args(["ckpt", *CHAT_SERVER_FLAGS, "--api-key", "k", *flags]),
                             served_model_names=(CHAT_SERVER_NAME,))
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return await http.get("/")

    page = asyncio.run(get_root())
    assert page.status_code == 200 and page.text == PAGE.read_text(encoding="utf-8")
    assert page.headers["content-type"].startswith("text/html")
    gone = asyncio.run(get_root("--no-web-ui"))
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "no route /"


# ---- in Chromium ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} is missing: install Debian's chromium and chromium-driver "
                    "(.ci/run does when it can)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # This machine's network is closed: every background connection Chromium would try is off.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1100,760",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(browser, chat_server):
    """The page loaded from the server, the API key typed in, the model shown."""
    from selenium.webdriver.common.keys import Keys

    browser.get(chat_server["base"] + "/")
    _wait(browser, lambda: "API key" in _text(browser, "status"))  # 401 from /v1/models: asks for the key
    assert _text(browser, "model-name") == "(not loaded)"
    browser.find_element("id", "api-key").send_keys(chat_server["key"], Keys.TAB)  # "change" loads the model
    _wait(browser, lambda: _text(browser, "model-name") == chat_server["name"])
    return browser


def _wait(driver, condition, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda _: condition())


def _text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def _metric(server: dict, name: str) -> float:
    """The sum of a metric's samples (over its labels) in the server's /metrics."""
    text = httpx.get(server["base"] + "/metrics", timeout=10).text
    values = [float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def _last_assistant(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def _set_options(driver, *, thinking: bool, max_tokens: int, ignore_eos: bool, tools: str = "") -> None:
    from selenium.webdriver.common.keys import Keys

    advanced = driver.find_element("css selector", "#settings details")
    if not advanced.get_attribute("open"):
        advanced.find_element("tag name", "summary").click()
    for element_id, wanted in (("thinking", thinking), ("ignore-eos", ignore_eos)):
        box = driver.find_element("id", element_id)
        if box.is_selected() != wanted:
            box.click()
    field = driver.find_element("id", "max-tokens")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(max_tokens))
    tools_field = driver.find_element("id", "tools")
    tools_field.clear()
    if tools:
        tools_field.send_keys(tools)


def _send(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    driver.find_element("id", "prompt").send_keys(text, Keys.ENTER)  # Enter sends


def _idle(driver) -> bool:
    return driver.find_element("tag name", "body").get_attribute("data-state") == "idle"


def test_model_name_kv_layout_and_key_persistence(page, chat_server):
    models = httpx.get(chat_server["base"] + "/v1/models", timeout=10,
                       headers={"Authorization": f"Bearer {chat_server['key']}"}).json()["data"][0]
    kv = models["dsv4"]
    layout = _text(page, "kv-layout")
    assert layout.startswith(f"{kv['kv_cache_dtype']} on {kv['attention_backend']}"), layout  # float32 on xla
    assert f"{kv['block_size']}-token blocks" in layout and f"{kv['num_seq_slots']} sequences" in layout
    assert page.find_element("id", "kv-layout").get_attribute("title") == kv["summary"]
    assert _text(page, "max-model-len") == f"{models['max_model_len']} tokens"
    # The key is kept in localStorage: a reload loads the model without typing it again.
    page.refresh()
    _wait(page, lambda: _text(page, "model-name") == chat_server["name"])
    assert page.execute_script("return localStorage.getItem('dsv4-jax.api-key')") == chat_server["key"]


def test_answer_streams_in_and_usage_is_shown(page):
    _set_options(page, thinking=False, max_tokens=48, ignore_eos=True)
    # Every length the answer's text takes on, as the browser renders it.
    page.execute_script("""
        window.seenLengths = [];
        new MutationObserver(() => {
            const bubbles = document.querySelectorAll('.message.assistant .content');
            if (bubbles.length) window.seenLengths.push(bubbles[bubbles.length - 1].textContent.length);
        }).observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});
    """)
    _send(page, "Hello")
    _wait(page, lambda: _idle(page))
    answer = _last_assistant(page)
    meta = answer.find_element("css selector", ".meta").text
    assert "finish: length" in meta and "48 completion tokens" in meta, meta
    assert answer.find_elements("css selector", "details.reasoning") == []  # thinking off: no reasoning
    lengths = page.execute_script("return window.seenLengths")
    final = len(answer.find_element("css selector", ".content").get_attribute("textContent"))
    assert final > 0 and lengths[-1] == final
    assert len(set(lengths) - {0, final}) >= 3, lengths  # it grew in steps, not all at once


def test_reasoning_is_folded_and_tool_calls_are_shown(page, tmp_path):
    """A one-choice structured output (the server's constraints bind the reasoning too) forces the
    answer; a fetch wrapper installed here adds it to the page's request and records what the page
    sent."""
    from dsv4_jax.chat import THINK_END, render_tool_calls

    arguments = json.dumps({"city": "Paris"})
    forced = ("Check the weather." + THINK_END + "Let me look.\n\n"
              + render_tool_calls([{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]))
    page.execute_script("""
        const forced = arguments[0], pageFetch = window.pageFetch = window.fetch;
        window.fetch = (url, init) => {
            if (url === '/v1/chat/completions') {
                window.sentBody = JSON.parse(init.body);
                const constraint = {structured_outputs: {choice: [forced]}};
                init = {...init, body: JSON.stringify({...window.sentBody, ...constraint})};
            }
            return pageFetch(url, init);
        };
    """, forced)
    try:
        page.find_element("id", "new-chat").click()
        _set_options(page, thinking=True, max_tokens=100, ignore_eos=False, tools=json.dumps(TOOLS))
        _send(page, "Weather in Paris?")
        _wait(page, lambda: _idle(page))
        sent = page.execute_script("return window.sentBody")
        assert sent["chat_template_kwargs"] == {"thinking": True} and sent["tools"] == TOOLS
        assert sent["max_tokens"] == 100 and sent["stream"] is True and "ignore_eos" not in sent
        assert [m["role"] for m in sent["messages"]] == ["user"]  # New chat dropped the earlier turns
        answer = _last_assistant(page)
        reasoning = answer.find_element("css selector", "details.reasoning")
        assert reasoning.get_attribute("open") is None  # folded
        reasoning_text = reasoning.find_element("css selector", ".reasoning-text").get_attribute("textContent")
        assert reasoning_text == "Check the weather."
        assert answer.find_element("css selector", ".content").text == "Let me look."
        (call,) = answer.find_elements("css selector", ".tool-call")
        assert call.find_element("css selector", ".tool-name").text == "get_weather(…)"
        assert json.loads(call.find_element("css selector", ".tool-arguments").text) == {"city": "Paris"}
        assert "finish: tool_calls" in answer.find_element("css selector", ".meta").text

        reasoning.find_element("tag name", "summary").click()  # unfolded for the screenshot, settings folded
        page.find_element("css selector", "#settings details summary").click()
        shot = tmp_path / "chat_page.png"
        assert page.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("DSV4_UPDATE_DOCS_SCREENSHOT") == "1":
            shutil.copyfile(shot, REPO / "docs" / "chat_page.png")
    finally:  # the next tests send what the page sends, even after a failure here
        page.execute_script("window.fetch = window.pageFetch")


def test_stop_aborts_the_engine_request(page, chat_server):
    page.find_element("id", "new-chat").click()
    _set_options(page, thinking=False, max_tokens=480, ignore_eos=True)
    finished_before = _metric(chat_server, "vllm:request_success_total")
    _send(page, "Tell me a long story")
    _wait(page, lambda: len(_last_assistant(page).find_element("css selector", ".content").text) > 0)
    assert _metric(chat_server, "vllm:num_requests_running") == 1
    page.find_element("id", "stop").click()
    _wait(page, lambda: _idle(page))
    answer = _last_assistant(page)
    assert answer.find_element("css selector", ".meta").text == "stopped"
    text = answer.find_element("css selector", ".content").get_attribute("textContent")
    # A generous bound (a loaded CI machine may stall for seconds): a Stop that did not abort is
    # caught below, by the finished count, since the request would have run to its end.
    deadline = time.monotonic() + WAIT_S
    while _metric(chat_server, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, f"the engine request still runs {WAIT_S} s after Stop"
        time.sleep(0.05)
    time.sleep(0.5)  # a request that ran to its end is counted a moment after the gauges drop
    assert _metric(chat_server, "vllm:request_success_total") == finished_before  # aborted, not finished
    time.sleep(0.2)
    assert answer.find_element("css selector", ".content").get_attribute("textContent") == text  # no more text
    assert page.find_element("id", "send").is_enabled() and not page.find_element("id", "stop").is_enabled()
