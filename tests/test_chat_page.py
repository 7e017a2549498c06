"""The chat page at `/` and `/chat`: the routes (Accept negotiation, HEAD, the API key, the static files) over
plain HTTP, then the page itself in headless Chromium (Debian's `chromium` + `chromium-driver`, which .ci/run
installs; skipped with the reason where they are missing) driven by Selenium, against `serve` on the demo model.
One server and one browser for the module; answers are kept to a few tokens."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import urllib.error
import urllib.request

import pytest

from helpers import start_serve

HTML = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"   # Chromium's


def get(url: str, accept: str | None = None, key: str | None = None, method: str = "GET"):
    headers = {}
    if accept:
        headers["Accept"] = accept
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def server():
    proc, base = start_serve(["--ctx", "2048"])
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


# ---- routes -----------------------------------------------------------------------------------------------------

def test_browsers_get_the_page_and_other_clients_the_json_index(server):
    status, headers, body = get(server + "/", HTML)
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b'id="messages"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]          # no inline or remote script
    for accept in (None, "*/*", "application/json", "application/json, text/html;q=0.5"):
        status, headers, body = get(server + "/", accept)
        index = json.loads(body)
        assert status == 200 and index["name"] == "ds4py" and index["status"] == "ok", accept
    assert index["model_id"] == "ds4py-demo" and index["backend"] == "ref" and index["context_length"] == 2048
    assert get(server + "/", method="HEAD")[0] == 200                          # clients probe it
    assert get(server + "/chat")[0] == 200 and b'id="composer"' in get(server + "/chat")[2]
    for name, kind in (("chat.js", "text/javascript"), ("markdown.js", "text/javascript"), ("chat.css", "text/css")):
        status, headers, _ = get(server + "/static/" + name)
        assert status == 200 and headers["Content-Type"].startswith(kind), name
    for bad in ("/static/..%2Fpage.py", "/static/.hidden.js", "/static/nothere.js", "/static/chat.html"):
        assert get(server + bad)[0] == 404, bad


@pytest.fixture(scope="module")
def key_server():
    proc, base = start_serve(["--ctx", "256"], env={"DS4PY_API_KEY": "page-key-1"})
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def test_behind_an_api_key_the_page_loads_and_the_api_does_not(key_server):
    base = key_server
    assert get(base + "/chat")[0] == 200 and get(base + "/", HTML)[0] == 200
    assert get(base + "/static/chat.js")[0] == 200
    assert get(base + "/")[0] == 401 and get(base + "/v1/models")[0] == 401      # the data needs the key
    assert get(base + "/", key="page-key-1")[0] == 200
    assert get(base + "/static/chat.js", key="wrong")[0] == 200


# ---- the page in a browser --------------------------------------------------------------------------------------

def _chromium() -> tuple[str, str] | str:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        return "headless Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does it as root)"
    return binary, driver


@pytest.fixture(scope="module")
def browser(server):
    found = _chromium()
    if isinstance(found, str):
        pytest.skip(found)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800",
              "--disable-extensions", "--no-first-run"):
        opts.add_argument(a)
    opts.binary_location = found[0]
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        d = webdriver.Chrome(service=Service(found[1]), options=opts)
    except Exception as e:   # a broken install: say so instead of failing every test
        pytest.skip(f"headless Chromium did not start: {str(e).splitlines()[0][:200]}")
    d.get(server + "/")
    yield d
    d.quit()


def wait(pred, timeout=30.0, what="condition"):
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def fresh(d, server, max_tokens=12, thinking="high"):
    """A clean page: no stored conversations, small answers, the given thinking mode."""
    d.get(server + "/chat")
    d.execute_script("localStorage.clear(); localStorage.setItem('ds4py.chat.settings', arguments[0]);",
                     json.dumps({"max_tokens": max_tokens, "thinking": thinking, "temperature": 1, "top_p": 1,
                                 "system": ""}))
    d.refresh()
    wait(lambda: d.find_element("id", "server-status").text == "ready", what="the header's status")


def send(d, text):
    from selenium.webdriver.common.keys import Keys

    box = d.find_element("id", "input")
    box.click()              # chromedriver types nowhere into a field that got its focus back from a closed dialog
    box.send_keys(text)
    box.send_keys(Keys.ENTER)                                   # Enter sends


def idle(d):
    return d.execute_script("return !window.ds4pyChat.state().running")


def severe(d):
    return [e for e in d.get_log("browser") if e["level"] == "SEVERE"]


def metric(server, name) -> float:
    text = get(server + "/metrics")[2].decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_page_loads_with_model_backend_and_context_and_no_console_error(browser, server):
    d = browser
    fresh(d, server)
    assert d.find_element("id", "model-name").text == "ds4py demo (tiny, random weights)"
    info = d.find_element("id", "model-info").text
    assert "ds4py-demo" in info and "backend ref" in info and "context 2,048 tokens" in info
    assert severe(d) == []


def test_a_message_streams_into_an_answer_with_its_stats(browser, server):
    from selenium.webdriver.common.keys import Keys

    d = browser
    fresh(d, server, max_tokens=16)
    box = d.find_element("id", "input")
    box.send_keys("first line")
    box.send_keys(Keys.SHIFT, Keys.ENTER)                      # Shift+Enter: a new line, not a send
    box.send_keys("second line")
    assert box.get_attribute("value") == "first line\nsecond line" and idle(d)
    box.send_keys(Keys.ENTER)
    # while it streams: the Stop button, and reasoning growing inside the open "Thinking" block
    wait(lambda: not idle(d) and d.find_element("id", "stop").is_displayed(), what="streaming")
    wait(lambda: idle(d), what="the end of the answer")
    msgs = d.find_elements("css selector", ".msg")
    assert [m.get_attribute("class") for m in msgs] == ["msg user", "msg assistant"]
    assert msgs[0].find_element("css selector", ".body").text == "first line\nsecond line"
    reasoning = d.execute_script("return document.querySelector('.msg.assistant .reasoning-text').textContent")
    assert reasoning.strip(), "the demo model thinks first: its reasoning is shown apart"
    stats = msgs[1].find_element("css selector", ".stats").text
    assert re.search(r"\b16 tokens\b", stats) and "first token" in stats and "tok/s" in stats, stats
    assert re.search(r"prompt \d+ \(\d+ cached\)", stats) and "stopped: max tokens" in stats, stats
    assert not d.find_element("id", "stop").is_displayed() and d.find_element("id", "send").is_displayed()
    # a second turn reuses the first turn's KV: the stats show cached prompt tokens
    send(d, "and again")
    wait(lambda: idle(d) and len(d.find_elements("css selector", ".msg")) == 4, what="the second answer")
    stats = d.find_elements("css selector", ".msg.assistant .stats")[-1].text
    assert int(re.search(r"\((\d+) cached\)", stats).group(1)) > 0, stats
    assert severe(d) == []


def test_stop_ends_a_long_answer_within_a_second_and_the_server_cancels(browser, server):
    from selenium.webdriver.common.keys import Keys

    d = browser
    fresh(d, server, max_tokens=1500)
    before = metric(server, "ds4py_cancelled_generations_total")
    send(d, "write a long story")
    wait(lambda: d.execute_script(
        "const r = document.querySelector('.msg.assistant .reasoning-text'); return r && r.textContent.length > 20"),
        what="the answer to start")
    t0 = time.monotonic()
    d.find_element("tag name", "body").send_keys(Keys.ESCAPE)    # Esc stops (as the Stop button does)
    wait(lambda: idle(d), timeout=1.0, what="Stop to end the answer")
    assert time.monotonic() - t0 < 1.0
    stats = d.find_element("css selector", ".msg.assistant .stats").text
    assert "stopped" in stats
    wait(lambda: metric(server, "ds4py_cancelled_generations_total") > before, timeout=5, what="the server's cancel")
    # the engine is free again at once: the next answer starts right away
    d.execute_script("window.ds4pyChat.settings().max_tokens = 4")
    send(d, "short")
    wait(lambda: idle(d) and len(d.find_elements("css selector", ".msg")) == 4, timeout=20, what="the next answer")
    assert severe(d) == []


def test_the_thinking_switch_changes_the_request(browser, server):
    d = browser
    prompts = {}
    for mode in ("off", "high", "max"):
        fresh(d, server, max_tokens=4)
        d.find_element("css selector", f'input[name="thinking"][value="{mode}"]').click()
        assert json.loads(d.execute_script("return localStorage.getItem('ds4py.chat.settings')"))["thinking"] == mode
        send(d, "hello")
        wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .stats"), what=f"the {mode} answer")
        has_reasoning = bool(d.find_elements("css selector", ".msg.assistant details.reasoning"))
        assert has_reasoning == (mode != "off"), mode       # off: the answer starts without reasoning
        stats = d.find_element("css selector", ".msg.assistant .stats").text
        prompts[mode] = int(re.search(r"prompt (\d+)", stats).group(1))
    assert prompts["max"] > prompts["high"]                # max: DeepSeek's Think Max instruction in the prompt
    assert severe(d) == []


def test_a_reload_keeps_the_conversations_and_regenerate_and_edit_work(browser, server):
    d = browser
    fresh(d, server, max_tokens=4)
    send(d, "remember me")
    wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .stats"), what="the answer")
    d.find_element("id", "new-chat").click()
    send(d, "a second chat")
    wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .stats"), what="the second answer")
    d.refresh()
    wait(lambda: d.find_element("id", "server-status").text == "ready", what="the reload")
    titles = [e.text for e in d.find_elements("css selector", "#conversations .title")]
    assert titles == ["a second chat", "remember me"]
    assert d.find_element("css selector", ".msg.user .body").text == "a second chat"
    d.find_elements("css selector", "#conversations .title")[1].click()
    assert d.find_element("css selector", ".msg.user .body").text == "remember me"
    d.find_element("css selector", ".msg.assistant .regenerate").click()
    wait(lambda: not idle(d), timeout=5, what="the regeneration to start")
    wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .stats"), what="the regenerated answer")
    assert len(d.find_elements("css selector", ".msg")) == 2            # the answer replaced, not appended
    d.find_element("css selector", ".msg.assistant .edit").click()
    assert d.find_element("id", "input").get_attribute("value") == "remember me"
    assert d.find_elements("css selector", ".msg") == []
    assert severe(d) == []


PAYLOAD = ('<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
           '<a href="javascript:window.pwned=3">x</a> **bold** [js](javascript:alert(1)) [ok](https://example.org)\n'
           '```html\n<b>in code</b>\n```')


def test_html_in_an_answer_is_shown_as_text(browser, server):
    d = browser
    fresh(d, server)
    # the renderer on a crafted string, as the page calls it for every answer
    out = d.execute_script("""
        const box = document.createElement('div');
        box.appendChild(window.ds4pyMarkdown.render(arguments[0]));
        return {tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()), text: box.textContent,
                hrefs: [...box.querySelectorAll('a')].map(a => a.getAttribute('href'))};""", PAYLOAD)
    assert not {"img", "script", "b"} & set(out["tags"]), out["tags"]
    assert {"strong", "pre", "code", "a"} <= set(out["tags"]) and out["hrefs"] == ["https://example.org"]
    assert "<img src=x onerror=" in out["text"] and "<script>" in out["text"] and "<b>in code</b>" in out["text"]
    # and in a stored answer, through the page's own rendering of a conversation
    conv = [{"id": "cx", "title": "html", "created": 1, "messages": [
        {"role": "user", "content": "<i>user html</i>"},
        {"role": "assistant", "content": PAYLOAD, "reasoning": "<img src=y onerror='window.pwned=4'>",
         "toolCalls": [{"name": "<b>tool</b>", "arguments": '{"html": "<script>x</script>"}'}]}]}]
    d.execute_script("localStorage.setItem('ds4py.chat.conversations', arguments[0]);"
                     "localStorage.setItem('ds4py.chat.current', 'cx');", json.dumps(conv))
    d.refresh()
    wait(lambda: d.find_elements("css selector", ".msg.assistant"), what="the stored conversation")
    box = d.find_element("id", "messages")
    assert d.execute_script("return arguments[0].querySelectorAll('img, script, b, i').length", box) == 0
    assert "<i>user html</i>" in box.text and "tool call: <b>tool</b>" in box.text
    assert d.find_element("css selector", ".tool-call pre").text.startswith("{\n")      # a tool call is a block
    assert d.execute_script("return window.pwned === undefined")
    assert severe(d) == []


def test_the_page_asks_for_the_key_and_sends_it(browser, key_server):
    d = browser
    d.get(key_server + "/chat")
    d.execute_script("localStorage.clear()")
    d.refresh()
    wait(lambda: d.find_element("id", "settings").get_attribute("open") is not None, what="the key prompt")
    assert "needs an API key" in d.find_element("id", "notice").text
    key = d.find_element("id", "set-api-key")
    assert d.switch_to.active_element == key
    key.send_keys("page-key-1")
    d.find_element("id", "settings-save").click()
    wait(lambda: d.find_element("id", "server-status").text == "ready", what="the header with the key")
    assert d.find_element("id", "notice").is_displayed() is False
    d.execute_script("window.ds4pyChat.settings().max_tokens = 3")
    send(d, "hi")
    wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .stats"), what="an answer with the key")
    d.execute_script("localStorage.clear()")          # the next tests use the other server
    d.get_log("browser")                              # and the 401 of the first look is expected, not theirs


@pytest.mark.parametrize("status, headers, body, says", [
    (401, {}, {"error": {"message": "missing or wrong API key"}}, "The API key is missing or wrong"),
    (429, {"Retry-After": "7"}, {"error": {"message": "the server is busy"}}, "busy (too many requests waiting); retry in 7 s"),
    (503, {"Retry-After": "5"}, {"error": {"message": "the model is still loading"}}, "The model is still loading"),
])
def test_errors_are_explained_in_one_sentence(browser, server, status, headers, body, says):
    """The server's answer is replaced in the page (fetch wrapped for this one POST): what the page makes of it."""
    d = browser
    fresh(d, server)
    d.execute_script("""
        const [status, headers, body] = arguments;
        const real = window.fetch;
        window.fetch = (url, opts) => (opts && opts.method === 'POST')
            ? Promise.resolve(new Response(JSON.stringify(body), {status, headers}))
            : real(url, opts);""", status, headers, body)
    send(d, "hi")
    wait(lambda: idle(d) and d.find_elements("css selector", ".msg.assistant .error"), what="the error")
    assert says in d.find_element("css selector", ".msg.assistant .error").text
    if status == 401:
        assert d.find_element("id", "settings").get_attribute("open") is not None
        d.find_element("id", "settings-save").click()
