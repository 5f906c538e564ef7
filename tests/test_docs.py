"""The documentation: what it links and names exists, the README stays a front page, and its Python runs.

Pages: README.md, docs/*.md, bench/README.md. External links are not fetched (no network).
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

from conftest import run_python

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]

# The README is a front page: short, with a newcomer's path (install, the first example, its dashboard) on
# its first screen. The limits are line numbers in README.md.
README_MAX_LINES = 260
INSTALL_HEADING, INSTALL_BY = "## Install", 30
TEN_LINES_HEADING, TEN_LINES_BY = "## The ten lines", 60
FIRST_EXAMPLE_ENDS_BY = 80  # the ten lines' code block closed, and the dashboard's screenshot shown
# README code blocks tagged ```python no-run are not run here; each must say why in its first line
# ("# not run ..."). More than this many means untested examples: raise it only on purpose.
MAX_NOT_RUN = 1
# What the README's blocks run with: the test suite's environment (XLA:CPU, offline, text dashboard).
ENV = {"PJRT_DEVICE": "CPU", "TPUKIT_PROFILE": "ci", "TPUKIT_DASHBOARD": "text", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target), ![alt](target)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"[\w.\-/*]+")
API_NAME = re.compile(r"\btpukit(?:\.[A-Za-z_]\w*)+")


def _top_level() -> set[str]:
    """The repository's top-level entries (tracked ones: build/, .venv/ are not the repository's)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        names = {line.split("/")[0] for line in out.stdout.splitlines() if line}
        if names:
            return names
    except (OSError, subprocess.SubprocessError):
        pass
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name != "build"} | {".ci"}


TOP = _top_level()


def split(page: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str, list[str], int]]]:
    """The page's prose lines (number, text) and its fenced blocks (first line number, info string,
    code lines, closing line number)."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if block is None and fence:
            block = (number, fence.group(2).strip(), [], fence.group(1))
        elif block is not None and fence and fence.group(1).startswith(block[3]) and not fence.group(2).strip():
            blocks.append((block[0], block[1], block[2], number))
            block = None
        elif block is not None:
            block[2].append(line)
        else:
            prose.append((number, line))
    assert block is None, f"{page.name}: the code block opened at line {block[0]} is never closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in split(page)[0]:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def repo_path(token: str) -> str | None:
    """``token`` when it reads as a path in this repository (its first part a top-level entry), else None."""
    token = token.strip()
    if not PATHLIKE.fullmatch(token) or token.split("/")[0] not in TOP:
        return None
    return token


def exists(relative: str) -> bool:
    if "*" in relative:
        return any(ROOT.glob(relative))
    return (ROOT / relative).exists()


def page_problems(page: Path) -> list[str]:
    problems = []
    prose, _ = split(page)
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    for number, line in prose:
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z+.-]*:", target):  # http(s), mailto: not fetched
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{where}:{number}: link to {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{where}:{number}: link to {target}: no heading #{anchor} in {file.name}")
        for span in CODE_SPAN.findall(line):
            path = repo_path(span)
            if path is not None and not exists(path):
                problems.append(f"{where}:{number}: `{span}` names a repository path that does not exist")
    return problems


def test_pages_are_there():
    assert README.exists() and len(PAGES) > 3, PAGES
    for name in ("dashboard", "estimates", "multicore", "checkpoints", "development", "migrating", "architecture"):
        assert (ROOT / "docs" / f"{name}.md").exists(), f"docs/{name}.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(page):
    problems = page_problems(page)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_is_missing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title: `x`\n\n[a](nowhere.md) [b](#a-title-x) [c](#no-such) [d](https://example.com/x)\n"
                    "`tpukit/no_such_module.py` `tpukit/tpu/estimate.py` `bench/results/*.json` `bench/none/*.json`\n"
                    "`build/e2e/` `tpukit.hf` `~/.cache/tpukit/tpu`\n"
                    "```\n`tests/_in_a_code_block.py` [e](nowhere_either.md)\n```\n", encoding="utf-8")
    problems = page_problems(page)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "link to nowhere.md: no such file",
        "link to #no-such: no heading #no-such in page.md",
        "`tpukit/no_such_module.py` names a repository path that does not exist",
        "`bench/none/*.json` names a repository path that does not exist",
    ], problems


def _api_names(page: Path) -> set[str]:
    return set(API_NAME.findall(page.read_text(encoding="utf-8")))


def resolve(name: str) -> object:
    """The object ``tpukit.a.b`` names, importing submodules (``tpukit.hf``) as needed."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if i == len(parts) - 1 and part in getattr(obj, "__all__", ()):
            return obj  # exported; maybe built on first use
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[: i + 1]))
            except ModuleNotFoundError:
                pass
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tpukit_names_are_real(page):
    """Every ``tpukit.x.y`` a page names exists (the blocks not run included)."""
    missing = []
    for name in sorted(_api_names(page)):
        try:
            resolve(name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    assert not missing, f"{page.relative_to(ROOT)} names what tpukit does not have:\n" + "\n".join(missing)


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"

    def heading(text: str) -> int:
        found = [n for n, line in enumerate(lines, start=1) if line.strip() == text]
        assert found, f"README.md has no heading {text!r}"
        return found[0]

    install, ten = heading(INSTALL_HEADING), heading(TEN_LINES_HEADING)
    assert install <= INSTALL_BY, f"{INSTALL_HEADING!r} is at line {install}, past line {INSTALL_BY}"
    assert ten <= TEN_LINES_BY, f"{TEN_LINES_HEADING!r} is at line {ten}, past line {TEN_LINES_BY}"
    _, blocks = split(README)
    first = next(b for b in blocks if b[0] > ten)
    assert first[1] == "python" and any("tpukit.track(" in line for line in first[2]), first
    assert first[3] <= FIRST_EXAMPLE_ENDS_BY, f"the ten lines end at line {first[3]}, past {FIRST_EXAMPLE_ENDS_BY}"
    image = next((n for n, line in enumerate(lines, start=1) if line.startswith("![") and "dashboard" in line), None)
    assert image is not None and image <= FIRST_EXAMPLE_ENDS_BY, f"the dashboard's screenshot is at line {image}"


def readme_python() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """README's ```python blocks: those to run and those tagged no-run, as (line, code)."""
    run, not_run = [], []
    for start, info, code, _ in split(README)[1]:
        words = info.split()
        if not words or words[0] != "python":
            continue
        (not_run if "no-run" in words[1:] else run).append((start, "\n".join(code) + "\n"))
    return run, not_run


def test_blocks_not_run_say_why():
    run, not_run = readme_python()
    assert len(not_run) <= MAX_NOT_RUN, f"{len(not_run)} README blocks are not run (at most {MAX_NOT_RUN}): " \
                                        f"lines {[line for line, _ in not_run]}"
    for line, code in not_run:
        assert code.lstrip().startswith("# not run"), \
            f"README.md:{line}: a no-run block must say why in its first line ('# not run ...: reason')"
    assert any("tpukit.track(" in code for _, code in run), "the ten lines are not among the blocks run"
    assert any("tpukit.hf.Callback()" in code for _, code in run), "the Trainer's two lines are not run"


DRIVER = """
import os, time
os.chdir({cwd!r})
namespace = {{"__name__": "__main__"}}
for line, code in {blocks!r}:
    print(f"=== README.md:{{line}} starts", flush=True)
    start = time.perf_counter()
    exec(compile(code, f"README.md block at line {{line}}", "exec"), namespace)
    print(f"=== README.md:{{line}} ran in {{time.perf_counter() - start:.1f}} s", flush=True)
"""


@pytest.mark.subprocess
def test_readme_python_runs(tmp_path):
    """The README's Python blocks, in order, in one fresh interpreter on XLA:CPU, in an empty folder."""
    run, _ = readme_python()
    assert len(run) >= 2
    proc = run_python(DRIVER.format(cwd=str(tmp_path), blocks=run), env=ENV, timeout=600,
                      drop=("TPUKIT_CPU_DEVICES", "TPUKIT_TARGET"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"a README block failed:\n{out[-6000:]}"
    for line, _ in run:
        assert f"=== README.md:{line} ran in" in proc.stdout, out[-3000:]


MAGICS_PAGE = ROOT / "docs" / "magics.md"
MAGIC_NAME = re.compile(r"%%?(\w+)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def magics_table(page: Path = MAGICS_PAGE) -> list[tuple[int, set[str], set[str], set[str]]]:
    """The rows of the page's magics table: (line, the magics its first column names, the options its first
    column shows, the options the whole row names)."""
    rows = []
    for number, line in split(page)[0]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 2 or not cells[0].startswith("`%"):
            continue
        rows.append((number, set(MAGIC_NAME.findall(cells[0])), set(OPTION.findall(cells[0])),
                     set(OPTION.findall(line))))
    return rows


def test_the_magics_table_shows_each_magic_with_its_real_options():
    """docs/magics.md's table against the magics' own argument parsers: every magic has a row, the row names
    every option the magic takes (issue 44: %%xla --target was missing) and its usage shows no option the magic
    lacks."""
    pytest.importorskip("IPython")
    from tpukit import magics

    cls = magics._magics_class()
    options = {name: {s for a in getattr(cls, method).parser._actions for s in a.option_strings if s.startswith("--")}
               for table in cls.magics.values() for name, method in table.items()}
    rows = magics_table()
    assert rows, f"{MAGICS_PAGE.name} has no table of magics"
    problems = [f"%{name} has no row in {MAGICS_PAGE.name}'s table"
                for name in sorted(set(options) - set().union(*(names for _, names, _, _ in rows)))]
    for number, names, usage, named in rows:
        real = set().union(*(options.get(n, set()) for n in names))
        problems += [f"{MAGICS_PAGE.name}:{number}: %{n} is not a magic of tpukit" for n in sorted(names - set(options))]
        problems += [f"{MAGICS_PAGE.name}:{number}: the row does not name {o} of %{n}"
                     for n in sorted(names) for o in sorted(options.get(n, set()) - named)]
        problems += [f"{MAGICS_PAGE.name}:{number}: {o} is no option of {', '.join('%' + n for n in sorted(names))}"
                     for o in sorted(usage - real)]
    assert not problems, "\n".join(problems)
