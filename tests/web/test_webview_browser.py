"""End to end: a trainer and a real vLLM node, the live page in headless Chromium.

The page must draw rollout throughput from the node's accepted work and show the node as healthy,
fed only by its event stream (no reload). Debian's chromium is driven by Playwright's Python package
(`executable_path`, no browser download). The screenshot is saved under the test's tmp dir and
copied to $SWARM_TEST_OUTPUT (default runs/test-output/) so CI can keep it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, wait_json

CHROMIUM = os.environ.get("SWARM_CHROMIUM", "/usr/bin/chromium")


def _playwright():
    if os.environ.get("SWARM_SKIP_BROWSER") == "1":
        pytest.skip("SWARM_SKIP_BROWSER=1")
    # Missing tools fail the test rather than skip it: `make test` installs both.
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: apt-get install -y chromium (make test does)"
    from playwright.sync_api import sync_playwright

    return sync_playwright


@pytest.mark.slow
def test_live_page_draws_throughput_and_a_healthy_node(tmp_path, procs):
    sync_playwright = _playwright()
    zport, hport, wport, tport = free_port(), free_port(), free_port(), free_port()
    trainer = procs.start(
        "trainer", "train", "--run-dir", str(tmp_path / "run"), "--port", str(zport), "--http-port", str(hport),
        "--web-port", str(wport), "--max-steps", "200",
        "--set", f"server.tracker_port={tport}", "--set", "server.heartbeat_s=0.5",
        "--set", "train.prompts_per_step=4", "--set", "train.inflight_groups=8", "--set", "train.eval_every=2",
        "--set", "guard.release_unpaired=true",
    )
    web = f"http://127.0.0.1:{wport}"
    wait_json(f"{web}/api/summary", timeout=240, proc=trainer)
    procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(tmp_path / "node"),
                "--name", "n0", "--status-port", str(free_port()))

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(web + "/")
        # Everything below arrives over the event stream: the page is never reloaded.
        page.wait_for_function("document.getElementById('live').textContent === 'live'", timeout=30_000)
        page.wait_for_selector("#throughput canvas", timeout=30_000)
        page.wait_for_function("+document.getElementById('throughput').dataset.points >= 3", timeout=360_000)
        page.wait_for_selector("#nodes tr[data-state='healthy']", timeout=30_000)
        page.wait_for_function("+document.getElementById('learning').dataset.points >= 2", timeout=120_000)
        row = page.inner_text("#nodes tr[data-state='healthy']")
        assert "n0" in row and "healthy" in row
        assert page.get_attribute("#throughput", "data-unit") == "tokens/s"  # the y axis's unit
        assert "n0" in page.inner_text("#throughput")  # the node has its series (legend)
        assert "held-out accuracy" in page.inner_text("#learning")
        assert "no relay tree yet" not in page.inner_text("#tree")  # the node is a peer of the relay tree
        # The run releases unpaired nodes unchecked (a lab setting): the page says so while it is on.
        assert "release_unpaired is on" in page.inner_text("#banner-release-unpaired")
        shot = tmp_path / "webview.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert not errors, errors
    out = Path(os.environ.get("SWARM_TEST_OUTPUT", ROOT / "runs" / "test-output"))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, out / "webview.png")
    print(f"screenshot: {shot} (copy: {out / 'webview.png'})")

    # The same figures as JSON and Prometheus on the web port, and in the terminal.
    view = wait_json(f"{web}/api/view", lambda v: v["overview"]["nodes"] and v["overview"]["tokens_generated"] > 0)
    assert view["overview"]["nodes"][0]["state"] == "healthy" and view["throughput"]["t"]
    with urllib.request.urlopen(f"{web}/metrics", timeout=5) as r:
        assert b'swarm_node_tokens_per_second{node="n0"}' in r.read()
    st = subprocess.run([sys.executable, "-m", "swarm.cli", "status", "--trainer", f"127.0.0.1:{wport}"],
                        capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert st.returncode == 0, st.stderr
    assert any(line.startswith("n0 ") and "healthy" in line for line in st.stdout.splitlines()), st.stdout
