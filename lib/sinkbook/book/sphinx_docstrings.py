"""A Sphinx extension for the API reference pages. The library's docstrings are plain text with ``literals``: they
write norms as ``|x|``, which reStructuredText reads as substitutions, and start a list right under its
introducing line, which it reads as a broken indentation. Both are fixed here, on the way into autodoc, so the
docstrings stay as they read in the source."""
from __future__ import annotations


def as_rest(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        starts_list = line.startswith("- ")
        previous = out[-1] if out else ""
        if starts_list and previous.strip() and not previous.startswith(("- ", " ")):
            out.append("")                     # reST wants a blank line before a list
        out.append(line.replace("|", "\\|"))
    return out


def _process(app, what, name, obj, options, lines: list[str]) -> None:
    lines[:] = as_rest(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process)
    return {"parallel_read_safe": True}
