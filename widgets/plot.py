"""PNG rendering of the step timeline with matplotlib's Agg backend (no pyplot state).

Each step is one stacked bar of where its wall time went: compile, waiting for
input, host tracing, and waiting for the device (see
:class:`~tpukit.widgets.view.Timeline`); the logged scalars are drawn below.
:class:`TimelinePlot` builds its figure once and then only swaps data. Axis
limits are rounded up to "nice" values, so the frame (axes, ticks, labels: the
expensive text) changes rarely; it is drawn once, cached as pixels, and each
refresh restores it and draws the data artists on top (blitting). Bars are one
compound path per layer, long histories are binned. A refresh of a 1000-step
history costs a few milliseconds plus the PNG encoding.
"""

from __future__ import annotations

import io
import math

import numpy as np

from tpukit._text import plural

from .view import Timeline

LAYERS = (("compile", "#f97316"), ("input", "#a855f7"), ("tracing", "#9ca3af"), ("device wait", "#2563eb"))
MAX_BARS = 300
MAX_CURVES = 6
CLIP_RATIO = 4.0  # clip the y axis when compile steps are this much taller than steady ones
TINY = 8
_NICE = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceil(x: float) -> float:
    """The smallest 'nice' number (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten) >= x."""
    if x <= 0 or not math.isfinite(x):
        return 1.0
    p = 10.0 ** math.floor(math.log10(x))
    for m in _NICE:
        if m * p >= x * (1 - 1e-12):
            return m * p
    return 10 * p  # pragma: no cover


def nice_range(lo: float, hi: float) -> tuple[float, float]:
    """(lo, hi) widened to multiples of a nice step, so small changes keep the same limits."""
    span = hi - lo
    if span <= 0:
        span = abs(hi) or 1.0
    step = nice_ceil(span / 4)
    return math.floor(lo / step) * step - step * 0.25, math.ceil(hi / step) * step + step * 0.25


class TimelinePlot:
    """A reusable figure: stacked per-step bars (compile/input/tracing/device wait) over scalar curves."""

    def __init__(self, width: float = 8.0, height: float = 3.4, dpi: int = 80, stable_limits: bool = True):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import PathPatch
        from matplotlib.path import Path
        from matplotlib.ticker import MaxNLocator

        self._Path = Path
        self._round = nice_ceil if stable_limits else (lambda v: v)
        self.fig = fig = Figure(figsize=(width, height), dpi=dpi)
        self.canvas = FigureCanvasAgg(fig)
        self.ax_t, self.ax_s = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        fig.subplots_adjust(left=0.09, right=0.98, top=0.9, bottom=0.12, hspace=0.1)
        self.layers = []
        empty = Path(np.zeros((1, 2)))
        for name, colour in LAYERS:
            patch = PathPatch(empty, facecolor=colour, edgecolor="none", label=name)
            self.ax_t.add_patch(patch)
            self.layers.append(patch)
            # Coloured words instead of a legend (a legend redraws boxes and handles).
        prev = None
        for name, colour in LAYERS:  # each word right after the previous one, whatever the font
            where = {"xy": (0.0, 1.02), "xycoords": "axes fraction"} if prev is None else \
                {"xy": (1.0, 0.0), "xycoords": prev, "xytext": (8, 0), "textcoords": "offset points"}
            prev = self.ax_t.annotate(name, **where, fontsize=TINY, color=colour, va="bottom",
                                      fontweight="bold")
        (self.clip_marks,) = self.ax_t.plot([], [], linestyle="none", marker="^", color="#b91c1c", markersize=5)
        self.clip_text = self.ax_t.annotate("", xy=(1.0, 0.0), xycoords=prev, xytext=(12, 0),
                                            textcoords="offset points", fontsize=TINY, color="#b91c1c",
                                            va="bottom")
        self.title = self.ax_t.text(1.0, 1.02, "", transform=self.ax_t.transAxes, fontsize=TINY, ha="right",
                                    va="bottom")
        self.ax_t.set_ylabel("seconds", fontsize=TINY)
        self.ax_s.set_xlabel("step", fontsize=TINY)
        self.empty = self.ax_s.text(0.5, 0.5, "no scalars: tpukit.log(loss=loss) draws curves here",
                                    transform=self.ax_s.transAxes, ha="center", va="center", fontsize=TINY,
                                    color="#6b7280")
        for ax in (self.ax_t, self.ax_s):
            ax.tick_params(labelsize=TINY)
            ax.yaxis.set_major_locator(MaxNLocator(3))
        self.ax_s.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        self.lines: dict = {}
        self._names: tuple = ()
        self._name_texts: list = []
        self._sticky: dict = {}  # last y limits, kept while the data still fits them well
        self._frame_key = None
        self._frame = None
        self.frames_drawn = 0  # how often the full frame had to be redrawn

    # ------------------------------------------------------------ public
    def render(self, tl: Timeline, title: str = "") -> bytes:
        """Swap the data in and return the figure as PNG bytes."""
        key = self.draw(tl, title)
        dynamic = self._dynamic()
        if key != self._frame_key or self._frame is None:
            for a in dynamic:
                a.set_visible(False)
            self.canvas.draw()
            self._frame = self.canvas.copy_from_bbox(self.fig.bbox)
            self._frame_key = key
            self.frames_drawn += 1
            for a in dynamic:
                a.set_visible(True)
        else:
            self.canvas.restore_region(self._frame)
        renderer = self.canvas.get_renderer()
        for a in dynamic:
            if a.get_visible():
                a.draw(renderer)
        return self._png()

    def draw(self, tl: Timeline, title: str = "") -> tuple:
        """Swap the data into the artists; return the frame key (the limits and labels)."""
        x = np.asarray(tl.steps, dtype=float)
        cols = [np.asarray(c, dtype=float) for c in (tl.compile, tl.input, tl.tracing, tl.device)]
        k = 1
        if len(x) > MAX_BARS:
            # Powers of two: the bin size (and the cached frame's title) changes rarely.
            k = 2 ** math.ceil(math.log2(len(x) / MAX_BARS))
            x, cols = _bin(x, k), [_bin(c, k) for c in cols]
        self.title.set_text(title + (f"  (bars: mean of {k} steps)" if k > 1 else ""))
        n = len(x)
        xlim = ylim = (0.0, 1.0)
        self.clip_marks.set_data([], [])
        self.clip_text.set_text("")
        if n:
            gap = float(np.median(np.diff(x))) if n > 1 else 1.0
            half = 0.4 * (gap if gap > 0 else 1.0)
            bottom = np.zeros(n)
            for patch, col in zip(self.layers, cols):
                top = bottom + col
                patch.set_path(self._bars(x, half, bottom, top))
                bottom = top
            total = bottom
            ymax = float(total.max()) or 1e-3
            steady = total[cols[0] <= 0]
            ref = float(np.quantile(steady, 0.95)) if steady.size else 0.0
            if ref > 0 and ymax > CLIP_RATIO * ref:
                top_y = nice_ceil(2.0 * ref)
                clipped = total > top_y
                self.clip_marks.set_data(x[clipped], np.full(int(clipped.sum()), top_y * 0.96))
                self.clip_text.set_text(f"▲ {plural(int(clipped.sum()), 'bar' if k > 1 else 'step')} clipped (up to {ymax:.2f} s)")
            else:
                top_y = nice_ceil(ymax * 1.1)
            prev = self._sticky.get("t")
            if prev is not None and prev / 2.5 <= top_y <= prev:
                top_y = prev  # hysteresis: noisy step times must not redraw the frame every time
            self._sticky["t"] = top_y
            ylim = (0.0, top_y)
            right = self._round(float(x[-1]) + 2 * half)
            if tl.x_end is not None:  # never past the loop's last step
                right = min(right, max(float(tl.x_end), float(x[-1])) + 2 * half)
            xlim = (float(x[0]) - 2 * half, right)
        else:
            for patch in self.layers:
                patch.set_path(self._Path(np.zeros((1, 2))))
        self.ax_t.set_ylim(*ylim)
        self.ax_t.set_xlim(*xlim)
        # Texts are part of the cached frame: drawing glyphs is the costly part of a refresh.
        return (xlim, ylim, self.title.get_text(), self.clip_text.get_text(), self._draw_scalars(tl))

    # ------------------------------------------------------------ internals
    def _bars(self, x, half, bottom, top):
        """One compound path of n rectangles (one draw call instead of n)."""
        n = len(x)
        v = np.empty((n, 5, 2))
        v[:, 0, 0] = v[:, 1, 0] = v[:, 4, 0] = x - half
        v[:, 2, 0] = v[:, 3, 0] = x + half
        v[:, 0, 1] = v[:, 3, 1] = v[:, 4, 1] = bottom
        v[:, 1, 1] = v[:, 2, 1] = top
        P = self._Path
        codes = np.tile(np.array([P.MOVETO, P.LINETO, P.LINETO, P.LINETO, P.CLOSEPOLY], dtype=P.code_type), n)
        return P(v.reshape(-1, 2), codes)

    def _draw_scalars(self, tl: Timeline) -> tuple:
        names = tuple(list(tl.scalars)[:MAX_CURVES])
        lo, hi = np.inf, -np.inf
        for name in names:
            xs, ys = tl.scalars[name]
            line = self.lines.get(name)
            if line is None:
                (line,) = self.ax_s.plot([], [], linewidth=1.2, label=name)
                self.lines[name] = line
            y = np.asarray(ys, dtype=float)
            line.set_data(np.asarray(xs, dtype=float), y)
            finite = y[np.isfinite(y)]
            if finite.size:
                lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
        self.empty.set_visible(not names)
        if names != self._names:
            self._set_names(names)
        ylim = nice_range(lo, hi) if np.isfinite(lo) else (0.0, 1.0)
        prev = self._sticky.get("s")
        if prev is not None and prev[0] <= ylim[0] and ylim[1] <= prev[1] and \
                ylim[1] - ylim[0] >= 0.4 * (prev[1] - prev[0]):
            ylim = prev
        self._sticky["s"] = ylim
        self.ax_s.set_ylim(*ylim)
        return names, ylim

    def _set_names(self, names: tuple) -> None:
        """Curve names, each in its line's colour, as one row of text (cheaper than a legend)."""
        for t in self._name_texts:
            t.remove()
        self._name_texts, x = [], 0.99
        for name in reversed(names):
            t = self.ax_s.text(x, 0.95, name, transform=self.ax_s.transAxes, fontsize=TINY, ha="right",
                               va="top", color=self.lines[name].get_color(), fontweight="bold")
            self._name_texts.append(t)
            x -= 0.012 * (len(name) + 2)
        self._names = names

    def _dynamic(self) -> list:
        return [*self.layers, self.clip_marks, *self.lines.values()]

    def _png(self) -> bytes:
        from PIL import Image  # a matplotlib dependency

        w, h = self.canvas.get_width_height()
        img = Image.frombuffer("RGBA", (w, h), bytes(self.canvas.buffer_rgba()), "raw", "RGBA", 0, 1)
        buf = io.BytesIO()
        img.save(buf, format="png", compress_level=1)
        return buf.getvalue()


def _bin(a: np.ndarray, k: int) -> np.ndarray:
    """Means of consecutive groups of ``k`` values (the last group may be shorter)."""
    starts = np.arange(0, len(a), k)
    sums = np.add.reduceat(a, starts)
    counts = np.diff(np.append(starts, len(a)))
    return sums / counts


def report_png(tl: Timeline, title: str = "") -> bytes:
    """A larger, fresh figure of the whole history, for the static report."""
    return TimelinePlot(width=9.0, height=4.2, dpi=100, stable_limits=False).render(tl, title)
