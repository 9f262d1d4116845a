"""The playground page in a real browser (Debian's headless Chromium through selenium and chromedriver) against a real
tritonserver and gateway: an image uploaded, every skill run, the drawn overlay checked against the answer, a
screenshot of each kept as a test artifact (TEST_ARTIFACTS, else the test's temporary folder)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GATEWAY_KEY, TINY, _free_port

pytest.importorskip("selenium")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

IMAGE = TINY / "images" / "small.png"
pytestmark = pytest.mark.xdist_group("playground")  # (one browser for the module, on one worker)


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are not installed (README's set-up installs them)")
        pytest.skip("chromium and chromium-driver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    b = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    yield b
    b.quit()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("TEST_ARTIFACTS") or tmp_path_factory.mktemp("artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wait(browser, condition, timeout: float = 60, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(lambda b: condition(b), message=what)


def _css(browser, selector: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def _open(browser, url: str) -> None:
    browser.get(url + "/playground")
    _wait(browser, lambda b: _css(b, "#status")[0].text == "server ready", what="the page says the server is ready")
    key = _css(browser, "#key")[0]
    key.clear()
    key.send_keys(GATEWAY_KEY)
    _css(browser, "#file")[0].send_keys(str(IMAGE))
    _wait(browser, lambda b: _css(b, "#stage")[0].is_displayed(), what="the image is shown")


def _run(browser, skill: str, text: str | None = None) -> tuple[dict | None, str]:
    """Runs a skill from the form: (the result JSON the page shows, or None after an error; the answer's text)."""

    Select(_css(browser, "#skill")[0]).select_by_value(skill)
    if text is not None:
        field = _css(browser, "#text")[0]
        field.clear()
        field.send_keys(text)
    for field, value in (("#maxTokens", "6"), ("#maxObjects", "3")):
        if _css(browser, field)[0].is_displayed():  # (each skill shows its own fields)
            _css(browser, field)[0].clear()
            _css(browser, field)[0].send_keys(value)
    _css(browser, "#run")[0].click()
    _wait(browser, lambda b: b.execute_script(
        "return !document.getElementById('run').disabled && (document.getElementById('result').textContent !== '' "
        "|| document.getElementById('answer').classList.contains('error'))"), what=f"{skill} answered")
    text = browser.execute_script("return document.getElementById('answer').textContent")  # (as set: \r kept)
    if "error" in _css(browser, "#answer")[0].get_attribute("class"):
        return None, text
    return json.loads(browser.execute_script("return document.getElementById('result').textContent")), text


def test_every_skill_runs_from_the_page_and_is_drawn_on_the_image(browser, gateway, artifacts):
    _open(browser, gateway.url)

    result, answer = _run(browser, "caption")
    assert result["caption"] and answer == result["caption"]  # (streamed into the page, then the final body's)
    metrics = browser.execute_script("return [...document.querySelectorAll('#metrics td:first-child')]"
                                     ".map(td => td.textContent)")
    assert {"ttft_ms", "output_tokens", "client_total_ms", "client_first_chunk_ms"} <= set(metrics)

    result, answer = _run(browser, "query", "What is in this image?")
    assert answer == result["answer"]
    assert "curl " in _css(browser, "#curl")[0].text and "model.query(image" in _css(browser, "#python")[0].text

    result, answer = _run(browser, "detect", "face")
    assert len(_css(browser, "#overlay rect.box")) == len(result["objects"]) > 0
    assert not _css(browser, "#length")[0].is_displayed()  # (a field of another skill)
    browser.save_screenshot(str(artifacts / "playground-detect.png"))

    result, answer = _run(browser, "point", "face")
    assert len(_css(browser, "#overlay ellipse.point")) == len(result["points"]) > 0
    assert not _css(browser, "#overlay rect.box")  # (the last answer's drawing went)
    browser.save_screenshot(str(artifacts / "playground-point.png"))

    result, answer = _run(browser, "chat", "Hello?")
    assert result is not None and "usage" in result

    Select(_css(browser, "#skill")[0]).select_by_value("gaze")  # the eye: a click on the image
    image = _css(browser, "#overlay")[0]
    ActionChains(browser).move_to_element_with_offset(image, image.size["width"] // 4, 0).click().perform()
    eye = [float(v) for v in _css(browser, "#eye")[0].get_attribute("value").split(",")]
    assert abs(eye[0] - 0.75) < 0.02 and abs(eye[1] - 0.5) < 0.02
    result, answer = _run(browser, "gaze")
    assert result["gaze"] is not None and answer.startswith("looking at")
    line = _css(browser, "#overlay line.gaze")[0]
    assert abs(float(line.get_attribute("x1")) - eye[0]) < 1e-3
    assert abs(float(line.get_attribute("x2")) - result["gaze"]["x"]) < 1e-9
    browser.save_screenshot(str(artifacts / "playground-gaze.png"))

    result, answer = _run(browser, "segment", "face")  # Moondream 3's skill: this server says so, clearly
    assert result is None and answer.startswith("400: ") and "Moondream 3" in answer
    browser.save_screenshot(str(artifacts / "playground-segment-refused.png"))


def test_the_page_says_when_the_server_is_not_ready_and_keeps_to_its_own_origin(browser, tmp_path):
    """A gateway whose tritonserver is gone: the page loads (no CDN, served by the gateway) and says so."""
    port = _free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "kestrel_backend.gateway", "--port", str(port), "--triton",
                                f"127.0.0.1:{_free_port()}", "--refresh-s", "0.5"],
                               stdout=open(tmp_path / "gateway.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        import urllib.request

        for _ in range(100):
            try:
                with urllib.request.urlopen(url + "/playground/") as r:
                    policy = r.headers["Content-Security-Policy"]
                    break
            except OSError:
                time.sleep(0.1)
        assert "default-src 'none'" in policy and "script-src 'self'" in policy
        browser.get_log("browser")  # (what the last test's page logged)
        browser.get(url + "/playground")
        _wait(browser, lambda b: _css(b, "#status")[0].text.startswith("server not ready"), what="not ready shown")
        assert "no tritonserver replica is ready" in _css(browser, "#status")[0].text
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "/readyz" not in e["message"]]
        assert not errors, errors  # (nothing the page needs comes from elsewhere, nothing the policy refused)
    finally:
        gateway.terminate()
        gateway.wait(30)
