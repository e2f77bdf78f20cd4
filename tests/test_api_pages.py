"""The API reference: one page per library layer, generated from the modules that are there (a new module appears
without anyone listing it), reachable from the table of contents and the capture-points page, with docstrings
that reStructuredText reads as they were written."""
from __future__ import annotations

import importlib

import pytest

from sinkbook.book.build import API_LAYERS, api_listing, toc_yaml
from sinkbook.book.sphinx_docstrings import as_rest
from sinkbook.core.paths import REPO_ROOT


@pytest.mark.parametrize("layer", API_LAYERS)
def test_each_layer_page_documents_every_module_of_the_layer(layer):
    on_disk = sorted(f"sinkbook.{layer}.{p.stem}" for p in (REPO_ROOT / "lib" / "sinkbook" / layer).glob("*.py")
                     if p.stem != "__init__")
    listing = api_listing(layer)
    documented = sorted(line.split("::")[1].strip() for line in listing.splitlines()
                        if line.startswith(".. automodule::"))
    assert documented == on_disk
    for name in documented:          # autodoc imports each one; a module that fails to import would show nothing
        importlib.import_module(name)
    assert f"file: book/api/{layer}" in toc_yaml()
    assert f"_generated/api_{layer}.md" in (REPO_ROOT / "book" / "api" / f"{layer}.md").read_text()
    assert f"<api-{layer}>" in (REPO_ROOT / "book" / "capture_points.md").read_text()


def test_docstrings_become_valid_rest():
    text = ["The norm |x| of each head, per point:", "- ``a``: one thing", "  continued;", "- ``b``: another."]
    fixed = as_rest(text)
    assert fixed[1] == "" and "\\|x\\|" in fixed[0]
    assert not _problems(fixed)
    assert len(list(_doctree(fixed).findall(lambda n: n.tagname == "list_item"))) == 2
    assert _problems(text), "unfixed, the same text is what made the API pages show errors"


def _doctree(lines):
    from docutils.core import publish_doctree
    return publish_doctree("\n".join(lines), settings_overrides={"report_level": 5, "warning_stream": False})


def _problems(lines) -> list:
    from docutils.utils import Reporter
    return [m for m in _doctree(lines).findall(lambda n: n.tagname == "system_message")
            if m["level"] >= Reporter.WARNING_LEVEL]
