"""HTML pieces the page is made of: elements, tables, a figure with its record link, and the link
itself (the record file relative to the report, a JSON pointer as its fragment: RFC 6901 in a URI
fragment, RFC 6901 section 6)."""

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import quote

from correctness.report_page.svg import Svg, escape


def tag(name: str, content: str = "", **attributes: object) -> str:
    """<name attributes>content</name>; an attribute `class_` is written `class`, `data_x` `data-x`,
    and one whose value is None is left out. `content` is HTML already."""
    written = "".join(f' {key.rstrip("_").replace("_", "-")}="{escape(value)}"'
                      for key, value in attributes.items() if value is not None)
    return f"<{name}{written}>{content}</{name}>"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], class_: str = "data") -> str:
    """A table; the header's cells are text (none where all are empty), the rows' cells HTML already."""
    head = tag("thead", tag("tr", "".join(tag("th", escape(cell)) for cell in header))) if any(header) else ""
    body = tag("tbody", "".join(tag("tr", "".join(tag("td", cell) for cell in row)) for row in rows))
    return tag("table", head + body, class_=class_)


def json_pointer(*tokens: object) -> str:
    """A JSON pointer to a field of a record: `/cases/3/candidate/tensors/0/slices`."""
    return "".join("/" + str(token).replace("~", "~0").replace("/", "~1") for token in tokens)


class RecordLink:
    """Links from a report to fields of one record file."""

    def __init__(self, record: Path, report: Path):
        relative = os.path.relpath(Path(record).resolve(), Path(report).resolve().parent)
        self.file = Path(relative).as_posix()

    def href(self, pointer: str) -> str:
        return quote(self.file) + "#" + quote(pointer, safe="/~-._")

    def anchor(self, pointer: str, text: str | None = None, class_: str = "pointer") -> str:
        """<a class="pointer">: the record field, its pointer shown as text (or `text`)."""
        return tag("a", escape(text if text is not None else f"{self.file}#{pointer}"), class_=class_,
                   href=self.href(pointer))


def figure(kind: str, svg: Svg, caption: str, source: str, after: str = "") -> str:
    """<figure class="chart" data-kind=KIND>: one inline SVG, its caption (HTML), and `source`, the
    link (<a class="pointer">) to what it draws; `after`: more HTML below the drawing (a table),
    above the caption (a figcaption is a figure's first or last child)."""
    source = tag("span", "drawn from: " + source, class_="source")
    return tag("figure", svg.render() + after + tag("figcaption", caption + " " + source), class_="chart",
               data_kind=kind)
