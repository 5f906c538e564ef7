"""The records of ``tpukit.setup()``: :class:`Request` (what was asked) and :class:`Runtime` (what
the runtime is, with its report as text, HTML and a dict). Plain frozen dataclasses; the
behaviour is in :mod:`tpukit.runtime`.
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass

from . import cache
from ._text import table_html, table_text


@dataclass(frozen=True)
class Request:
    """The settings a caller asked ``setup()`` for."""

    device: str = "auto"
    cpu_devices: int | None = None
    spmd: bool = False
    compile_cache: str | bool | None = None
    trace_compiles: bool = True


@dataclass(frozen=True)
class Runtime:
    """What the runtime is, as started by ``setup()``; see ``report()``."""

    platform: str
    device_type: str
    accelerator_type: str | None
    device: str
    device_count: int
    process_count: int
    world_size: int
    spmd: bool
    versions: dict
    compile_cache: str | None
    trace_file: str | None
    problems: tuple[str, ...] = ()
    tpu_signals: tuple[str, ...] = ()
    bf16: bool = False
    cache_note: str = ""
    target: str | None = None  # the TPU each graph is also compiled for (setup(target=...))
    trace_note: str = ""  # the report's words for trace_file (no machine's temp path in a saved notebook)
    compiler: str | None = None  # the TPU compiler that answers (setup(compiler=...)); None: the default

    def rows(self) -> list[tuple[str, str]]:
        """The report as (label, value) rows, shared by the text and HTML renderings."""
        v = self.versions
        vers = " · ".join(f"{k} {v[k]}" for k in ("python", "torch", "torch_xla", "libtpu") if v.get(k))
        return [
            ("platform", self.platform),
            ("device", f"{self.device} ({self.device_type}" + (f", {self.accelerator_type})" if self.accelerator_type else ")")),
            ("devices", f"{self.device_count} device(s), {self.process_count} process(es), world size {self.world_size}"),
            ("SPMD", "on" if self.spmd else "off"),
            ("multi-core", self.scale_note()),
            ("bfloat16", "supported" if self.bf16 else "not native (runs, but emulated)"),
            ("versions", vers),
            ("compile cache", (self.cache_note or self.compile_cache or "off")
             + (f" ({cache.stats()} so far)" if self.compile_cache else "")),
            ("compile tracing", self.trace_note or self.trace_file or "off (counts only, no causes)"),
        ] + ([("target TPU", f"{self.target}: each graph is also compiled for it by the TPU compiler, "
                             "ahead of time, off the training thread")] if self.target else []) \
          + ([("TPU compiler", f"{self.compiler}: it answers the target's compiles and tpukit.estimate")]
             if self.compiler else [])

    def scale_note(self) -> str:
        """What this many devices can and cannot do (a single chip, e.g. Colab's v5e-1, or several)."""
        if self.device_count == 1:
            more = ("tpukit.setup(cpu_devices=4) tries several virtual ones" if self.device_type == "CPU"
                    else "a v5e-8 (Kaggle's TPU) has 8 and splits each batch 8 ways")
            return f"one device: SPMD code runs unchanged over it, with no speed-up; {more}"
        how = "tpukit.mesh() + track(mesh=...) shard each batch" if self.spmd else "turn SPMD on to use them all"
        return f"{self.device_count} devices: {how} (the global batch must be a multiple of {self.device_count})"

    def report(self) -> str:
        """Multi-line plain-text report (what ``python -m tpukit doctor`` prints)."""
        lines = [table_text(self.rows(), title="tpukit runtime")]
        lines += [f"  problem: {p}" for p in self.problems] or ["  no problems found"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        flag = f", {len(self.problems)} problem(s)" if self.problems else ""
        return (f"Runtime({self.platform}: {self.device_count} x {self.device_type}"
                f"{' SPMD' if self.spmd else ''}, torch_xla {self.versions.get('torch_xla')}{flag})")

    def _repr_pretty_(self, p, cycle) -> None:  # IPython in a terminal shows the full report
        p.text(self.report())

    def _repr_html_(self) -> str:
        warn = "<span style='color:#b45309'>{}</span>"
        rows = [(f"<b>{html.escape(k)}</b>", html.escape(str(v))) for k, v in self.rows()]
        rows += [(warn.format("<b>problem</b>"), warn.format(html.escape(p))) for p in self.problems]
        return table_html(rows, title="tpukit runtime", css_class="tpukit-runtime", raw=True)

    def to_dict(self) -> dict:
        """JSON-ready dict of every field."""
        d = dataclasses.asdict(self)
        d["problems"] = list(self.problems)
        d["tpu_signals"] = list(self.tpu_signals)
        return d
