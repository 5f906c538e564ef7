"""The live widget view: plain ipywidgets (HTML, Image, VBox, Layout), 7.x and 8.x alike.

Imported only when a dashboard runs in widget mode. It only holds widgets and
sets their values; what to show is decided in ``ui_widgets.py`` and ``render.py``.
"""

from __future__ import annotations

import ipywidgets as widgets

PARTS = ("header", "now", "verdict", "counters", "alerts", "graphs", "tpu", "fallbacks")
REPR = "tpukit dashboard (live widgets; replaced by its report when the tracked loop ends)"


class DashboardBox(widgets.VBox):
    """The dashboard's container. Its text repr stands in where widgets cannot render
    (GitHub, nbval's text comparison), like tqdm's notebook bar."""

    def __repr__(self) -> str:
        return REPR


class LiveView:
    """The widgets of one dashboard, updated in place (no clear_output, no flicker)."""

    def __init__(self, plot: bool = True):
        self.html = {name: widgets.HTML(value="") for name in PARTS}
        # Hidden until the first PNG: an empty Image shows a broken-image icon (Colab).
        self.image = widgets.Image(format="png", layout=widgets.Layout(display="none")) if plot else None
        h = self.html
        children = [h["header"], h["now"], h["verdict"], h["counters"]]
        if self.image is not None:
            children.append(self.image)
        children += [h["alerts"], h["graphs"], h["tpu"], h["fallbacks"]]
        self.box = DashboardBox(children, layout=widgets.Layout(border="1px solid #e5e7eb", padding="4px 8px"))
        # Stable CSS classes (ipywidgets 7 and 8) so the page can be styled and tested.
        self.box.add_class("tpukit-dashboard")
        for name, w in self.html.items():
            w.add_class(f"tpukit-{name}")

    def update(self, parts: dict, png: bytes | None = None) -> None:
        """Set the HTML parts that changed and, if given, the timeline image."""
        for name, value in parts.items():
            w = self.html[name]
            if w.value != value:
                w.value = value
        if png is not None and self.image is not None:
            self.image.value = png
            if self.image.layout.display == "none":
                self.image.layout.display = None

    @property
    def png(self) -> bytes | None:
        """The timeline PNG shown now (None before the first)."""
        img = self.image
        return bytes(img.value) if img is not None and img.value else None

    def values(self) -> dict:
        """Current HTML values by part name (what the front end shows)."""
        return {name: w.value for name, w in self.html.items()}

    def close(self) -> None:
        """Close the widget models (after the view was replaced by the report); values stay readable."""
        for w in [self.box, *self.html.values(), *([self.image] if self.image is not None else [])]:
            w.layout.close()
            w.close()
