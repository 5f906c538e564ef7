"""End to end on the classic front end: Notebook 6.5.7 + ipywidgets 7.7.1 in headless Chromium.

Colab's widget front end is the classic one (ipywidgets 7, widgetsnbextension 3),
so this is the closest to Colab that runs here. It runs in ``.venv-colab`` (Colab's
pinned stack, IPython 7.34 + ipykernel 6) with ``make test-e2e-classic``; in an
environment without classic Notebook 6 (``.venv``, JupyterLab only) it is skipped,
unless ``TPUKIT_E2E_CLASSIC=1`` (set by the make target) makes that a failure.

The same notebook and checks as ``test_lab.py`` (its CELLS are imported from there):
``jupyter notebook`` on a free 127.0.0.1 port with a token, Cell > Run All from the
menu, then in the page: ``%tpu`` renders its HTML table, ``%%xla`` prints what the
cell cost, the live dashboard's widgets appear (header naming the device), its step
counter grows while the cell is still running, no broken-image icon is ever shown
and the timeline plot appears live, the deliberate recompilation is an alert naming
the graph as ``cell [4] line 9`` and the input that changed, and when the loop ends
the cell holds one thing: the static report in place of the live widget. Throughout,
no JavaScript error (uncaught page errors, console errors, widget-render errors in
the DOM) may come from the kit; the few unrelated ones the classic page logs on its
own are listed in IGNORED_CONSOLE and ignored. Screenshots go to
dashboard_classic_live.png / dashboard_classic_report.png in build/e2e/ or
$TPUKIT_SCREENSHOTS; on failure the page goes to build/e2e/failure_classic.png.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time

import pytest
from test_lab import (
    BUILD,
    CELLS,
    CHROMIUM,
    CHROMIUM_ARGS,
    IMAGES,
    LOOP_LINE,
    _free_port,
    _notebook,
    serve,
    _steps,
    _text,
)

# Console errors the classic page logs by itself, unrelated to tpukit: (pattern on the
# message, pattern on the source URL). Anything else logged as an error fails the test.
IGNORED_CONSOLE = [
    (r"Failed to load resource", r"/favicon\.ico"),                 # no favicon at the server root
    (r"Failed to load resource", r"/kernelspecs/[^/]+/logo-"),     # kernelspecs without a logo image
]
# What ipywidgets 7 writes into the page when a widget cannot be shown.
WIDGET_FAILURES = ("Error displaying widget", "Failed to display Jupyter Widget", "Error rendering")
# Images in the live dashboard that are shown but empty or broken (the icon Colab showed before the first
# plot). An image whose next PNG is still loading is neither: each refresh points the <img> at a new blob:
# URL, and for the few milliseconds Chromium takes to decode it the element reports complete=false and
# naturalWidth=0 while it keeps its size and the previous plot. Sampled at that moment, a healthy image
# looked broken (the flaky failure); so each shown image is judged once it has finished loading (a newer
# refresh may start another load: wait again, up to 2 s, after which a load still running counts as broken).
BROKEN_IMAGES_JS = """async () => {
    const shown = () => Array.from(document.querySelectorAll('.tpukit-dashboard img'))
        .filter(img => img.offsetParent !== null);
    const deadline = Date.now() + 2000;
    while (shown().some(img => !img.complete) && Date.now() < deadline)
        await new Promise(done => setTimeout(done, 20));
    return shown().filter(img => !(img.complete && img.naturalWidth > 0))
        .map(img => (img.complete ? 'broken: ' : 'never loaded: ') + (img.getAttribute('src') || '').slice(0, 40));
}"""
LIVE_PLOT_JS = """() => Array.from(document.querySelectorAll('.tpukit-dashboard img'))
    .some(img => img.offsetParent !== null && img.complete && img.naturalWidth > 0)"""


def _classic_notebook() -> str | None:
    """Why classic Notebook 6 cannot run in this environment, or None when it can."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        v = version("notebook")
    except PackageNotFoundError:
        return "the classic Notebook is not installed here"
    if int(v.split(".")[0]) >= 7:
        return f"notebook {v} is Notebook 7 (a JupyterLab front end), not the classic one"
    for pkg in ("ipywidgets", "widgetsnbextension"):
        try:
            version(pkg)
        except PackageNotFoundError:
            return f"{pkg} is not installed here"
    return None


@pytest.fixture
def classic(tmp_path):
    """A classic Notebook server on 127.0.0.1 serving the test notebook, with the widget nbextension on."""
    why = _classic_notebook()
    if why:
        msg = f"{why}: run `make test-e2e-classic` (it uses .venv-colab, Colab's stack)"
        if os.environ.get("TPUKIT_E2E_CLASSIC") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    root = tmp_path / "nb"
    root.mkdir()
    (root / "e2e.ipynb").write_text(json.dumps(_notebook()))
    port, token = _free_port(), secrets.token_hex(16)
    # A user's environment: the widget front end, not the text fallback CI/nbval get. The
    # user's own Jupyter config stays out (the widget nbextension is enabled in sys-prefix).
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NBVAL", "TPUKIT_DASHBOARD")}
    env.update(PJRT_DEVICE="CPU", JUPYTER_PLATFORM_DIRS="1", JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    enabled = subprocess.run([jupyter, "nbextension", "list"], env=env, capture_output=True, text=True, check=False)
    if not re.search(r"jupyter-js-widgets/extension\W+enabled", enabled.stdout + enabled.stderr):
        subprocess.run([jupyter, "nbextension", "enable", "--py", "widgetsnbextension", "--sys-prefix"],
                       env=env, check=True, capture_output=True)
    with serve([jupyter, "notebook", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
                f"--NotebookApp.token={token}", f"--notebook-dir={root}", "--NotebookApp.open_browser=False"],
               env, port, token, "Notebook") as server:
        yield server


class _Errors:
    """JavaScript errors seen by the page: uncaught exceptions and console errors, minus IGNORED_CONSOLE."""

    def __init__(self, page):
        self.errors: list[str] = []
        self.ignored: list[str] = []
        self.log: list[str] = []  # every console message, printed when the test fails
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", self._console)

    def _console(self, msg) -> None:
        self.log.append(f"{msg.type}: {msg.text[:300]}")
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        line = f"console.error: {msg.text} ({url})"
        if any(re.search(m, msg.text) and re.search(u, url) for m, u in IGNORED_CONSOLE):
            self.ignored.append(line)
        else:
            self.errors.append(line)


def test_dashboard_and_magics_in_classic_notebook(classic):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed: run `make test-e2e-classic`, which installs it")
    base, token = classic
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        js = _Errors(page)
        try:
            page.goto(f"{base}/notebooks/e2e.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector("#notebook-container .code_cell", timeout=120_000)
            # The kernel is connected and the widget nbextension has attached its manager to it.
            page.wait_for_function("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel"
                                   " && Jupyter.notebook.kernel.is_connected()"
                                   " && Jupyter.notebook.kernel.widget_manager !== undefined", timeout=120_000)
            cells = page.locator("#notebook-container .code_cell")
            assert cells.count() == len(CELLS)
            # Cell > Run All, as a user would.
            page.click("#menus a.dropdown-toggle:text-is('Cell')")
            page.click("#run_all_cells > a")

            # %tpu renders the runtime report as an HTML table.
            report = page.locator("table.tpukit-runtime").first
            report.wait_for(timeout=180_000)
            assert "CPU" in report.inner_text() and "torch_xla" in report.inner_text()

            # %%xla prints what the cell cost.
            page.wait_for_function("() => document.querySelectorAll('#notebook-container .code_cell')[2]"
                                   ".querySelector('.output_area')?.innerText.includes('%%xla:')", timeout=120_000)
            assert re.search(r"%%xla: \d+ compiles? ", cells.nth(2).locator(".output").inner_text())

            # The live dashboard: its widget DOM appears, the header names the device, the counter grows.
            dash = cells.nth(3).locator(".tpukit-dashboard").first
            dash.wait_for(timeout=180_000)
            page.wait_for_function("() => (document.querySelector('.tpukit-dashboard .tpukit-header') || {}).innerText"
                                   "?.includes('CPU')", timeout=60_000)
            assert "1 × CPU" in dash.locator(".tpukit-header").inner_text()
            counters = dash.locator(".tpukit-counters")
            prompt = cells.nth(3).locator(".input_prompt")
            seen_while_running: list[int] = []
            broken: list[str] = []
            live_alerts = live_graphs = ""
            live_plot = live_shot = False
            deadline = time.time() + 300
            while time.time() < deadline:
                running = "*" in _text(prompt)
                steps = _steps(_text(counters))
                broken += page.evaluate(BROKEN_IMAGES_JS)
                if not running:
                    break
                if steps is not None:
                    seen_while_running.append(steps)
                    live_plot = live_plot or page.evaluate(LIVE_PLOT_JS)
                    if steps >= 16 and live_plot and not live_shot:  # after the recompilation, loop still running
                        live_alerts, live_graphs = _text(dash.locator(".tpukit-alerts")), _text(dash.locator(".tpukit-graphs"))
                        if f"cell [4] line {LOOP_LINE}" in live_alerts:
                            IMAGES.mkdir(parents=True, exist_ok=True)
                            dash.screenshot(path=str(IMAGES / "dashboard_classic_live.png"))
                            live_shot = True
                page.wait_for_timeout(300)
            # The counter grew while the cell was still running (live updates, not a final render).
            assert len(set(seen_while_running)) >= 2 and max(seen_while_running) > min(seen_while_running), \
                seen_while_running
            # The empty timeline image is hidden until the first plot: never a broken-image icon.
            assert not broken, ("broken or empty images shown in the live dashboard", broken[:5])
            assert live_plot, "the live timeline plot never appeared while the loop ran"
            assert live_shot, ("the loop ended before the dashboard could be photographed live with its alert",
                               live_alerts)

            # The deliberate recompilation is the one alarm, named by cell and line with the input that
            # changed; the first graphs (AdamW's state, the steady step) are not alarms.
            assert "1 recompilation" in live_alerts and "1 recompilations" not in live_alerts, live_alerts
            assert f"step graph at cell [4] line {LOOP_LINE}" in live_alerts, live_alerts
            assert "(16, 8) -> (12, 8)" in live_alerts and "Bucket or pad" in live_alerts, live_alerts
            assert "2 new graphs (not alarms)" in live_graphs and "first graph here" in live_graphs, live_graphs

            # After the loop the cell holds one thing: the static report, in place of the live widget.
            page.wait_for_function("() => document.querySelectorAll('#notebook-container .code_cell')[3]"
                                   ".querySelector('.input_prompt').innerText.includes('[4]')", timeout=300_000)
            cell = cells.nth(3)
            final = cell.locator(".tpukit-report").first
            try:  # the report takes the live widget's place before the cell ends
                final.wait_for(timeout=30_000)
            except sync_api.TimeoutError:
                held = page.evaluate("() => JSON.stringify(Jupyter.notebook.get_cell(3).output_area.outputs)")
                pytest.fail("the cell ended without the report in place of the live widget (the update_display_data"
                            f" needs the widget's display_data to carry its display_id); the cell holds: {held[:1500]}")
            assert cell.locator(".tpukit-dashboard").count() == 0 and cell.locator(".tpukit-report").count() == 1
            assert cell.locator(".output_area").count() == 1, cell.locator(".output").inner_text()
            assert (final.locator("img").first.get_attribute("src") or "").startswith("data:image/png")
            text = final.inner_text()
            assert _steps(text) == 24 and "1 recompilation" in text and "1 recompilations" not in text, text
            assert "(16, 8) -> (12, 8)" in text and f"cell [4] line {LOOP_LINE}" in text, text
            assert "where the time goes" in text and "-bound over" in text, text
            assert re.search(r"warm-up\s+settled after step 13", text), text
            page.wait_for_function("() => Array.from(document.querySelectorAll('.tpukit-report img'))"
                                   ".every(img => img.complete && img.naturalWidth > 0)", timeout=10_000)
            cell.locator(".output_subarea").first.screenshot(path=str(IMAGES / "dashboard_classic_report.png"))

            # Nothing failed on the way: no traceback or kit warning in any cell, no widget that could
            # not be shown, no JavaScript error.
            outputs = page.locator("#notebook-container .output").all_inner_texts()
            assert page.locator("#notebook-container .output_error").count() == 0, outputs
            stderr = page.locator("#notebook-container .output_stderr").all_inner_texts()
            assert not [s for s in stderr if "tpukit" in s.lower()], stderr
            assert not [o for o in outputs if any(f in o for f in WIDGET_FAILURES)], outputs
            page.wait_for_timeout(500)  # let late console messages arrive
            assert not js.errors, js.errors
            print("ignored console errors (unrelated to tpukit):", js.ignored or "none")
        except Exception:
            BUILD.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(BUILD / "failure_classic.png"), full_page=True)
            print("JavaScript errors:", js.errors, "ignored:", js.ignored)
            print("console:", *js.log[-60:], sep="\n  ")
            try:  # what the notebook model holds for the training cell (the DOM may differ)
                print("cell 4 outputs:", page.evaluate("() => JSON.stringify(Jupyter.notebook.get_cell(3)"
                                                       ".output_area.outputs).slice(0, 4000)"))
            except sync_api.Error as exc:  # the page may be gone
                print("cell 4 outputs unavailable:", exc)
            raise
        finally:
            browser.close()
