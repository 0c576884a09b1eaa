"""``report.html``: a page of figures (PNG files in ``figures/`` beside it) followed by the
run's Markdown report rendered to HTML.  Figures are written first, each atomically, then
the page; PNGs in ``figures/`` that the new page does not reference are removed."""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path

from statelab.paths import atomic_path, slug

FIGURES = "figures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #1a202c; line-height: 1.45; }
h1 { font-size: 1.6em; border-bottom: 2px solid #2b6cb0; padding-bottom: .2em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #cbd5e0; }
figure { margin: 1.2em 0; }
figure img { max-width: 100%; border: 1px solid #e2e8f0; }
figcaption { font-size: .9em; color: #4a5568; }
table { border-collapse: collapse; font-size: .82em; margin: .6em 0; display: block; overflow-x: auto; }
th, td { border: 1px solid #cbd5e0; padding: .2em .45em; text-align: left; }
th { background: #edf2f7; }
code { background: #edf2f7; padding: 0 .2em; font-size: .9em; }
.meta { color: #4a5568; font-size: .9em; }
"""


def markdown_html(md: str) -> str:
    """Markdown (CommonMark + tables) to HTML; raw HTML in the input is escaped."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(md)


@dataclass
class Figure:
    name: str  # file name in figures/
    png: bytes
    caption: str


@dataclass
class Page:
    title: str
    intro: str = ""  # one paragraph of plain text
    figures: list[Figure] = field(default_factory=list)
    markdown: str = ""  # the run's Markdown report, rendered below the figures

    def add(self, name: str, png: bytes, caption: str) -> None:
        if not png.startswith(PNG_MAGIC):
            raise ValueError(f"figure {name!r} is not a PNG")
        self.figures.append(Figure(slug(name, "figure", "-") + ".png", png, caption))

    def render(self) -> str:
        title, md = self.title, self.markdown
        first, _, rest = md.lstrip().partition("\n")
        if first.startswith("# "):  # the report's own title heads the page, above the figures
            title, md = first[2:].strip(), rest
        parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                 f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
                 f"<h1>{html.escape(title)}</h1>"]
        if self.intro:
            parts.append(f'<p class="meta">{html.escape(self.intro)}</p>')
        if self.figures:
            parts.append("<h2>Figures</h2>")
        for f in self.figures:
            src = html.escape(f"{FIGURES}/{f.name}", quote=True)
            parts.append(f'<figure><img src="{src}" alt="{html.escape(f.caption, quote=True)}">'
                         f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")
        if md.strip():
            parts.append('<div class="report">' + markdown_html(md) + "</div>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"

    def write(self, folder) -> Path:
        """Write figures/*.png, then report.html; returns the page's path."""
        folder = Path(folder)
        fig_dir = folder / FIGURES
        fig_dir.mkdir(parents=True, exist_ok=True)
        names = {f.name for f in self.figures}
        if len(names) != len(self.figures):
            raise ValueError("two figures of one page share a file name")
        for f in self.figures:
            write_file(fig_dir / f.name, f.png)
        for old in fig_dir.glob("*.png"):
            if old.name not in names:
                old.unlink()
        return write_file(folder / "report.html", self.render().encode())


def write_file(path: Path, data: bytes) -> Path:
    """Atomically, with the mode of an ordinary new file (a page is meant to be read by others)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def referenced_images(page_html: str) -> list[str]:
    """The ``src`` of every ``<img>`` of a page (as written, HTML-unescaped)."""
    return [html.unescape(m) for m in re.findall(r'<img\b[^>]*\bsrc="([^"]*)"', page_html)]
