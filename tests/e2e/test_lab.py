"""End to end: JupyterLab in headless Chromium, driven by Playwright.

Starts JupyterLab from the project's environment on a free 127.0.0.1 port with a
token, opens a small notebook, runs ``%load_ext tpukit``, ``%tpu``, an ``%%xla``
cell and a short training loop with the live dashboard, and checks the page's
DOM: the header names the device, the step counter grows while the cell is still
running, a deliberate recompilation shows up as an alert naming the graph (cell
and line) and the input that changed, the first graphs are shown as new graphs
(not alarms), and when the loop ends the cell holds one thing: the static report
(where the time goes, the tables, the timeline image) in place of the live
widget. Screenshots of the live
dashboard and the report go to build/e2e/ (so a test run leaves the checkout
clean), or to $TPUKIT_SCREENSHOTS: ``make screenshots`` sets it to docs/images to
refresh the README's images on purpose. On failure the page is saved to
build/e2e/failure.png. Run with ``make test-e2e`` (installs Debian's chromium).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "e2e"
IMAGES = ROOT / os.environ.get("TPUKIT_SCREENSHOTS", str(BUILD))  # relative to the checkout, or absolute
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]
LOOP_LINE = 9  # line of the `for` statement in the training cell below

CELLS = [
    "%load_ext tpukit",
    "%tpu",
    "%%xla\nimport torch\nx = torch.arange(6, dtype=torch.float32, device='xla')\ny = (x * 2).sum()",
    # The training cell: 24 slow steps, the batch shrinks at step 13 (a deliberate recompilation).
    # The sleep keeps the loop running long enough to watch the dashboard update.
    "import time, torch, tpukit\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to('xla')\n"
    "opt = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
    "data = [(torch.randn(16 if i < 12 else 12, 8), torch.randint(0, 2, (16 if i < 12 else 12,))) for i in range(24)]\n"
    "def slow(batches):\n"
    "    for b in batches:\n"
    "        time.sleep(0.6); yield b\n"
    "for x, y in tpukit.track(slow(data), total=len(data), dashboard=True, progress=False):\n"
    "    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
    "    loss.backward(); opt.step(); opt.zero_grad()\n"
    "    tpukit.log(loss=loss)\n",
]


# JupyterLab's own settings for the test server: no "news?" toast over the screenshots.
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                {"fetchNews": "false", "checkForUpdates": False}}


def _notebook() -> dict:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
              "source": src} for i, src in enumerate(CELLS)]
    return {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a folder with the test notebook; stopped whatever happens."""
    (tmp_path / "e2e.ipynb").write_text(json.dumps(_notebook()))
    settings = tmp_path.parent / (tmp_path.name + "-settings")
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    # A user's environment: the widget front end, not the text fallback CI/nbval get.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NBVAL", "TPUKIT_DASHBOARD")}
    env.update(PJRT_DEVICE="CPU", JUPYTER_PLATFORM_DIRS="1")
    jupyter = Path(sys.executable).with_name("jupyter")
    with serve([str(jupyter), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
                f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
                f"--LabApp.user_settings_dir={settings}",
                "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=False"],
               env, port, token, "JupyterLab") as server:
        yield server


@contextlib.contextmanager
def serve(argv: list[str], env: dict, port: int, token: str, name: str):
    """Start a Jupyter server, wait until it answers, yield (base URL, token); stop it whatever happens."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name} did not start:\n" + (proc.stdout.read() if proc.stdout else ""))
                time.sleep(0.5)
        yield base, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _steps(text: str) -> int | None:
    m = re.search(r"^steps\s+(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _text(locator) -> str:
    """The element's text, or "" when it is gone (the live widget is replaced when the loop ends)."""
    from playwright.sync_api import Error

    try:
        return locator.inner_text(timeout=1000)
    except Error:  # a timeout (TimeoutError is a subclass) or a detached node
        return ""


def test_dashboard_and_magics_in_jupyterlab(lab):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed: run `make test-e2e`, which installs it")
    base, token = lab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        try:
            page.goto(f"{base}/lab/tree/e2e.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session", timeout=120_000)
            # Not awaited: the command's promise resolves only when every cell has run.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

            # %tpu renders the runtime report as an HTML table.
            report = page.locator("table.tpukit-runtime").first
            report.wait_for(timeout=180_000)
            assert "CPU" in report.inner_text() and "torch_xla" in report.inner_text()

            # %%xla prints what the cell cost.
            xla_out = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea-output")
            xla_out.first.wait_for(timeout=120_000)
            page.wait_for_function("() => document.querySelectorAll('.jp-Cell')[2].innerText.includes('%%xla:')",
                                   timeout=120_000)
            assert re.search(r"%%xla: \d+ compiles? ", page.locator(".jp-Cell").nth(2).inner_text())

            # The live dashboard: header with the device, a growing step counter.
            dash = page.locator(".tpukit-dashboard").first
            dash.wait_for(timeout=180_000)
            header = dash.locator(".tpukit-header")
            page.wait_for_function("() => (document.querySelector('.tpukit-dashboard .tpukit-header') || {}).innerText"
                                   "?.includes('CPU')", timeout=60_000)
            assert "1 × CPU" in header.inner_text()
            counters = dash.locator(".tpukit-counters")
            prompt = page.locator(".jp-Cell").nth(3).locator(".jp-InputPrompt")
            seen_while_running = []
            live_alerts = live_graphs = ""
            live_shot = False
            deadline = time.time() + 300
            while time.time() < deadline:
                running = "*" in prompt.inner_text()
                steps = _steps(_text(counters))
                if not running:
                    break
                if steps is not None:
                    seen_while_running.append(steps)
                    if steps >= 16 and not live_shot:  # after the recompilation, loop still running
                        live_alerts, live_graphs = _text(dash.locator(".tpukit-alerts")), _text(dash.locator(".tpukit-graphs"))
                        if f"cell [4] line {LOOP_LINE}" in live_alerts:
                            IMAGES.mkdir(parents=True, exist_ok=True)
                            dash.screenshot(path=str(IMAGES / "dashboard_live.png"))
                            live_shot = True
                page.wait_for_timeout(300)
            # The counter grew while the cell was still running (live updates, not a final render).
            assert len(set(seen_while_running)) >= 2 and max(seen_while_running) > min(seen_while_running), \
                seen_while_running
            assert live_shot, ("the loop ended before the dashboard could be photographed live with its alert",
                               live_alerts)

            # The deliberate recompilation is the one alarm: it names the graph (cell and line) and the
            # input that changed; the first graphs (AdamW's state, the steady step) are not alarms.
            assert "1 recompilation" in live_alerts and f"step graph at cell [4] line {LOOP_LINE}" in live_alerts
            assert "(16, 8) -> (12, 8)" in live_alerts and "Bucket or pad" in live_alerts, live_alerts
            assert "2 new graphs (not alarms)" in live_graphs and "first graph here" in live_graphs, live_graphs

            # After the loop the cell holds one thing: the static report, in place of the live widget.
            page.wait_for_function(
                "() => document.querySelectorAll('.jp-Cell')[3].querySelector('.jp-InputPrompt').innerText.includes('[4]')",
                timeout=300_000)
            cell = page.locator(".jp-Cell").nth(3)
            final = cell.locator(".tpukit-report").first
            final.wait_for(timeout=60_000)
            assert cell.locator(".tpukit-dashboard").count() == 0 and cell.locator(".tpukit-report").count() == 1
            report_img = final.locator("img")
            assert (report_img.first.get_attribute("src") or "").startswith("data:image/png")
            text = final.inner_text()
            assert _steps(text) == 24 and "1 recompilation" in text and "(16, 8) -> (12, 8)" in text, text
            assert "where the time goes" in text and "-bound over" in text, text
            assert re.search(r"warm-up\s+settled after step 13", text), text
            cell.locator(".jp-OutputArea").screenshot(path=str(IMAGES / "dashboard_report.png"))
        except Exception:
            BUILD.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(BUILD / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
