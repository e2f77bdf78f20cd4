"""Layer 4, chapters: one module per chapter of the book, each a set of finding functions.

``CHAPTERS`` is the one list of chapters, in book order: the build executes exactly these notebooks and
writes the book's table of contents from it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    name: str          # module sinkbook.chapters.<name>, notebook notebooks/<name>.ipynb, results/<name>.json
    title: str         # the title in the table of contents (the notebook's first heading)


CHAPTERS = (
    Chapter("sink_criteria", "Which tokens are sinks, and how strong is the sink?"),
    Chapter("theorems", "The theorems, checked numerically"),
    Chapter("predictor", "Sink Strength as a predictor"),
    Chapter("vl_adaptation", "Vision-language adaptation at small scale"),
    Chapter("vl_protection", "Protecting text capability during adaptation"),
    Chapter("outro", "OutRo: rotating head outputs toward the sink value"),
    Chapter("outro_multimodal", "OutRo on small vision-language models"),
    Chapter("gradient_sinks", "Gradient sinks and V-scale"),
)


def chapter_names() -> list[str]:
    return [c.name for c in CHAPTERS]
