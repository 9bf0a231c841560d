"""SVG primitives for the report's figures: an element builder, a log scale, the palette, and the
way a figure's value is written on its mark. Every figure is inline SVG; nothing here draws a chart."""

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Okabe and Ito's colour-blind-safe palette (Color Universal Design), by name.
BLACK, ORANGE, SKY_BLUE, GREEN = "#000000", "#E69F00", "#56B4E9", "#009E73"
YELLOW, BLUE, VERMILLION, PURPLE = "#F0E442", "#0072B2", "#D55E00", "#CC79A7"
GREY, LIGHT_GREY = "#767676", "#E6E6E6"  # axes and grid lines; #767676 keeps 4.5:1 contrast on white

FONT = "font-family:system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif"


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def figure_value(value: float | None) -> str:
    """A figure as a mark's label: three significant digits; NaN or infinite (a record's null) as
    `non-finite`."""
    if value is None or not math.isfinite(value):
        return "non-finite"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e4:
        return f"{value:.3g}"
    return f"{value:.2e}"


def _number(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


@dataclass
class Svg:
    """An <svg> drawn element by element, in user units of one CSS pixel."""

    width: float
    height: float
    label: str  # what the figure shows, for a screen reader (aria-label)
    parts: list[str] = field(default_factory=list)

    def add(self, element: str) -> None:
        self.parts.append(element)

    @staticmethod
    def _attributes(attributes: dict[str, object]) -> str:
        return "".join(f' {name.rstrip("_").replace("_", "-")}="{escape(value)}"'
                       for name, value in attributes.items() if value is not None)

    def element(self, name: str, title: str | None = None, **attributes: object) -> None:
        """One element; `title`: the tooltip a browser shows over it (no script needed)."""
        inner = f"<title>{escape(title)}</title>" if title else ""
        self.add(f"<{name}{self._attributes(attributes)}>{inner}</{name}>" if inner
                 else f"<{name}{self._attributes(attributes)}/>")

    def rect(self, x: float, y: float, width: float, height: float, title: str | None = None, **attributes) -> None:
        self.element("rect", title, x=_number(x), y=_number(y), width=_number(max(width, 0.0)),
                     height=_number(max(height, 0.0)), **attributes)

    def circle(self, x: float, y: float, r: float, title: str | None = None, **attributes) -> None:
        self.element("circle", title, cx=_number(x), cy=_number(y), r=_number(r), **attributes)

    def line(self, x1: float, y1: float, x2: float, y2: float, **attributes) -> None:
        self.element("line", None, x1=_number(x1), y1=_number(y1), x2=_number(x2), y2=_number(y2), **attributes)

    def path(self, points: Sequence[tuple[float, float]], title: str | None = None, closed: bool = False,
             **attributes) -> None:
        """A polyline through `points` (a polygon where `closed`)."""
        if not points:
            return
        d = "M" + " L".join(f"{_number(x)} {_number(y)}" for x, y in points) + (" Z" if closed else "")
        self.element("path", title, d=d, **attributes)

    def text(self, x: float, y: float, text: object, size: float = 11, anchor: str = "start",
             **attributes) -> None:
        placed = {"x": _number(x), "y": _number(y), "font-size": _number(size), "text-anchor": anchor}
        self.add(f"<text{self._attributes({**placed, **attributes})}>{escape(text)}</text>")

    def render(self) -> str:
        width, height = _number(self.width), _number(self.height)
        return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"'
                f' aria-label="{escape(self.label)}" style="{FONT}">' + "".join(self.parts) + "</svg>")


@dataclass(frozen=True)
class LogScale:
    """Values from `low` to `high` (powers of ten) onto x from `left` to `right`."""

    low: float
    high: float
    left: float
    right: float

    @staticmethod
    def around(values: Sequence[float], left: float, right: float, must_show: float = 1.0,
               decades: int = 10) -> "LogScale":
        """A scale over the finite, positive values and `must_show` (the bound) with a decade either
        side of it, in whole decades: at most `decades` of them below the largest value, unless
        `must_show` needs more (smaller values are drawn at its low end, their labels say how small)."""
        shown = [value for value in values if value is not None and math.isfinite(value) and value > 0]
        top = math.ceil(math.log10(max(shown + [must_show * 10])))
        bottom = math.floor(math.log10(min(shown + [must_show / 10])))
        bottom = min(max(bottom, top - decades), math.floor(math.log10(must_show)) - 1)
        return LogScale(10.0 ** bottom, 10.0 ** top, left, right)

    def x(self, value: float) -> float:
        """Where a value lies; NaN or infinite at the right end, zero and below the range at the left."""
        if value is None or not math.isfinite(value):
            return self.right
        if value <= self.low:
            return self.left
        share = (math.log10(value) - math.log10(self.low)) / (math.log10(self.high) - math.log10(self.low))
        return self.left + min(share, 1.0) * (self.right - self.left)

    def ticks(self) -> list[float]:
        low, high = round(math.log10(self.low)), round(math.log10(self.high))
        step = max(1, math.ceil((high - low) / 8))
        return [10.0 ** power for power in range(low, high + 1, step)]


def tick_label(value: float) -> str:
    return f"{value:g}" if 1e-3 <= value <= 1e3 else f"1e{round(math.log10(value))}"


def draw_log_axis(svg: Svg, scale: LogScale, top: float, bottom: float, bound_label: str = "bound") -> None:
    """Decade grid lines with their labels above `top`, and the bound at 1 drawn bold, labelled."""
    for tick in scale.ticks():
        x = scale.x(tick)
        svg.line(x, top, x, bottom, stroke=LIGHT_GREY, stroke_width=1)
        svg.text(x, top - 4, tick_label(tick), size=10, anchor="middle", fill=GREY)
    bound = scale.x(1.0)
    svg.line(bound, top, bound, bottom, stroke=BLACK, stroke_width=2, class_="bound")
    svg.text(bound + 3, bottom + 12, f"{bound_label} = 1", size=10, fill=BLACK)


# A diverging ramp for err/bound on a log scale: ColorBrewer's sequential blues (colour-blind safe)
# from 1e-3 up to the bound, then orange to a dark vermillion from the bound to 100 x it.
_BELOW = ((0xF7, 0xFB, 0xFF), (0xC6, 0xDB, 0xEF), (0x6B, 0xAE, 0xD6), (0x21, 0x71, 0xB5), (0x08, 0x30, 0x6B))
_ABOVE = ((0xFD, 0xAE, 0x6B), (0xE6, 0x55, 0x0D), (0x7F, 0x27, 0x04))


def _along(stops: Sequence[tuple[int, int, int]], share: float) -> tuple[int, int, int]:
    """The colour `share` (0 to 1) of the way along the stops, mixed linearly between two."""
    place = min(max(share, 0.0), 1.0) * (len(stops) - 1)
    index = min(int(place), len(stops) - 2)
    (r1, g1, b1), (r2, g2, b2) = stops[index], stops[index + 1]
    part = place - index
    return round(r1 + (r2 - r1) * part), round(g1 + (g2 - g1) * part), round(b1 + (b2 - b1) * part)


def ratio_colour(value: float | None, low: float = 1e-3) -> tuple[str, str]:
    """The fill of a cell showing err/bound `value`, and the text colour that reads on it."""
    if value is None or not math.isfinite(value):
        return VERMILLION, "#FFFFFF"
    if value > 1.0:
        rgb = _along(_ABOVE, math.log10(value) / 2)
    else:
        rgb = _along(_BELOW, 1 - math.log10(max(value, low)) / math.log10(low))
    luminance = (0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]) / 255
    return "#%02X%02X%02X" % rgb, ("#000000" if luminance > 0.45 else "#FFFFFF")


@dataclass(frozen=True)
class LinearScale:
    """Values from `low` to `high` onto pixels from `start` to `end` (end < start for a y axis)."""

    low: float
    high: float
    start: float
    end: float

    def at(self, value: float) -> float:
        span = self.high - self.low or 1.0
        return self.start + (value - self.low) / span * (self.end - self.start)

    def ticks(self, count: int = 5) -> list[float]:
        """About `count` round values within the range."""
        span = self.high - self.low
        if span <= 0:
            return [self.low]
        raw = span / count
        magnitude = 10 ** math.floor(math.log10(raw))
        step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
        first = math.ceil(self.low / step) * step
        return [first + i * step for i in range(int((self.high - first) / step + 1e-9) + 1)]


def padded_range(values: Sequence[float], share: float = 0.05) -> tuple[float, float]:
    """The finite values' range, widened by `share` on each side (a flat curve gets room too)."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    pad = (high - low) * share or abs(high) * share or 1.0
    return low - pad, high + pad
