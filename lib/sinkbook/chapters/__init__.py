"""Layer 5, chapters: one module per chapter of the book, each its profiles, rules and finding functions over the
one protocol of ``chapters.base``; no chapter module imports another.

``CHAPTERS`` is the one list of chapters, in book order: the build executes exactly these notebooks and writes
the book's table of contents (``_toc.yml``) from it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChapterEntry:
    name: str          # module sinkbook.chapters.<name>, notebook notebooks/<name>.ipynb, results/<name>.json
    title: str         # the title in the table of contents (the notebook's first heading)


CHAPTERS = (
    ChapterEntry("sink_criteria", "Which tokens are sinks, and how strong is the sink?"),
    ChapterEntry("theorems", "The VL paper's theorems, checked numerically"),
    ChapterEntry("predictor", "Sink Strength as a predictor"),
    ChapterEntry("vl_margins", "Margins, trajectories and the paper's other tables"),
    ChapterEntry("vl_adaptation", "Vision-language adaptation at small scale"),
    ChapterEntry("vl_protection", "Protecting text capability during adaptation"),
    ChapterEntry("outro", "OutRo: rotating head outputs toward the sink value"),
    ChapterEntry("outro_multimodal", "OutRo on small vision-language models"),
    ChapterEntry("gradient_theorems", "The gradient-sinks paper's theorems, checked numerically"),
    ChapterEntry("gradient_sinks", "Gradient sinks and V-scale"),
    ChapterEntry("gradient_sinks_with_sink", "Gradient sinks where there is a sink"),
)


def chapter_names() -> list[str]:
    return [c.name for c in CHAPTERS]
