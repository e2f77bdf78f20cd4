"""The shape of the project: layers import only downwards, chapters import no chapter and no module takes part in an
import circle, one chapter registry and protocol, one run-cache key and one process pool, notebooks a reader can
run whose parameters are exactly their chapter's settings."""
from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from sinkbook.chapters import CHAPTERS, chapter_names
from sinkbook.core.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "lib" / "sinkbook"
LAYERS = {"core": 0, "measures": 1, "interventions": 2, "training": 3, "runs": 4, "figures": 5, "chapters": 6,
          "book": 7}
CHAPTER_HELPERS = {"__init__", "base"}          # the registry and the protocol: every chapter module may import them
MAX_CELL_LINES = 20


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "sinkbook" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _module_name(path: Path) -> str:
    name = "sinkbook." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every sinkbook import in a file (function-level ones too), relative ones
    resolved; ``from package import name`` is reported as ``package.name``."""
    module = "sinkbook." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]   # resolved to the deepest module by _resolved
            out += [(n, node.lineno) for n in names if n.startswith("sinkbook")]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("sinkbook")]
    return out


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if len(rel) == 1:
            assert rel[0] == "__init__.py", f"{path}: modules live in a layer subpackage ({', '.join(LAYERS)})"
        else:
            assert rel[0] in LAYERS, f"{path}: {rel[0]} is not a layer ({', '.join(LAYERS)})"


def test_layers_import_only_downwards():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if len(rel) == 1:
            continue
        own = LAYERS[rel[0]]
        for target, line in _imports(path):
            layer = _layer_of(target)
            if layer is not None and layer > own:
                violations.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {target} (layer {layer} > {own})")
    assert not violations, "lower layers import higher ones:\n" + "\n".join(violations)


def test_the_layering_test_catches_an_upward_import(tmp_path, monkeypatch):
    fake = PACKAGE / "core" / "_upward_probe.py"
    fake.write_text("from ..book.results import write_results\n")
    try:
        with pytest.raises(AssertionError, match="_upward_probe"):
            test_layers_import_only_downwards()
    finally:
        fake.unlink()


def _resolved(target: str) -> str | None:
    """The module file an imported name lives in: ``sinkbook.chapters.base.finding`` -> ``sinkbook.chapters.base``."""
    parts = target.split(".")
    while parts:
        candidate = PACKAGE.parent.joinpath(*parts)
        if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return None


def _graph() -> dict[str, set[str]]:
    """module -> the sinkbook modules it imports (any depth in the file)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        own = _module_name(path)
        graph[own] = {m for target, _ in _imports(path) if (m := _resolved(target)) and m != own}
    return graph


def test_no_chapter_imports_another_chapter():
    chapter_modules = {f"sinkbook.chapters.{p.stem}" for p in (PACKAGE / "chapters").glob("*.py")
                       if p.stem not in CHAPTER_HELPERS}
    graph = _graph()
    crossing = [f"{m} imports {t}" for m in sorted(chapter_modules) for t in sorted(graph[m]) if t in chapter_modules]
    assert not crossing, crossing
    assert chapter_modules == {f"sinkbook.chapters.{name}" for name in chapter_names()}, \
        "every chapter module is a registered chapter (shared code belongs in a lower layer)"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, one representative path each (depth-first search over the module graph)."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle_anywhere():
    # a package's __init__ that only documents the layer is not an edge of a circle
    graph = {m: {t for t in targets if not (m.startswith(t + ".") and t.count(".") == 1)}
             for m, targets in _graph().items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_circle_test_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_one_run_cache_key_and_one_process_pool():
    hashing = [str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py")
               if "hashlib.sha256(" in p.read_text() and p.name != "paths.py"]
    pools = [str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py")
             if "ProcessPoolExecutor" in p.read_text() and p.name != "pool.py"]
    cache_roots = [str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py")
                   if "def cache_root" in p.read_text() and p.name != "paths.py"]
    assert not hashing and not pools and not cache_roots, (hashing, pools, cache_roots)


def test_scripts_use_the_library_below_the_chapters():
    hits = [f"{p.name}: {line.strip()}" for p in (REPO_ROOT / "scripts").glob("*.py")
            for line in p.read_text().splitlines() if re.search(r"sinkbook\.chapters", line)]
    assert not hits, hits


def test_registry_matches_the_notebooks_and_modules():
    from sinkbook.chapters.base import Chapter
    on_disk = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(chapter_names()) == on_disk
    for chapter in CHAPTERS:
        module = importlib.import_module(f"sinkbook.chapters.{chapter.name}")
        assert set(module.PROFILES.names) >= {"quick", "default", "gpu"}, chapter.name
        classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Chapter)
                   and c is not Chapter and c.__module__ == module.__name__]
        assert len(classes) == 1 and classes[0].__name__.endswith("Chapter"), chapter.name
        assert module.NAME == classes[0].NAME == chapter.name and classes[0].PROFILES is module.PROFILES
        assert classes[0].FINDINGS, f"{chapter.name} has no finding"


def test_toc_is_written_from_the_registry_and_committed():
    from sinkbook.book.build import toc_yaml
    toc = toc_yaml()
    assert re.findall(r"file: chapters/(\w+)", toc) == chapter_names()
    committed = REPO_ROOT / "_toc.yml"
    assert committed.exists() and committed.read_text() == toc, \
        "_toc.yml and the chapter registry disagree: run python -m sinkbook.book toc"


def _notebook(name):
    return json.loads((REPO_ROOT / "notebooks" / f"{name}.ipynb").read_text())


@pytest.mark.parametrize("name", chapter_names())
def test_notebook_structure(name):
    nb = _notebook(name)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and "parameters" in code[0].get("metadata", {}).get("tags", []), "first code cell tagged parameters"
    params = "".join(code[0]["source"])
    assigned = [t.id for node in ast.parse(params).body if isinstance(node, ast.Assign) for t in node.targets]
    module = importlib.import_module(f"sinkbook.chapters.{name}")
    assert sorted(assigned) == sorted({"profile", "device", *module.PROFILES.keys}), \
        "the parameters cell names exactly the profile's settings, plus profile and device"
    assert ".from_notebook(globals())" in "".join(code[1]["source"]), "the second cell resolves the parameters"
    for cell in code[1:]:
        assert not cell.get("outputs") and not cell.get("execution_count"), "source notebooks carry no outputs"
        lines = len("".join(cell["source"]).splitlines())
        assert lines <= MAX_CELL_LINES, f"a code cell of {lines} lines: analysis belongs in sinkbook.chapters.{name}"
    assert not code[0].get("outputs") and not code[0].get("execution_count")
    source = "\n".join("".join(c["source"]) for c in code)
    assert "write_results(" in source, "the notebook writes its results file"
    assert nb["cells"][0]["cell_type"] == "markdown" or nb["cells"][1]["cell_type"] == "markdown"


@pytest.mark.parametrize("name", chapter_names())
def test_papermill_reads_the_parameters_cell(name, caplog):
    import logging

    from papermill.inspection import inspect_notebook
    with caplog.at_level(logging.WARNING, logger="papermill"):
        params = inspect_notebook(str(REPO_ROOT / "notebooks" / f"{name}.ipynb"))
    assert {"profile", "device"} <= set(params)
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]


def test_no_tracker_words_in_what_readers_see():
    pattern = re.compile(r"\bissue\s*#?\d|\bissue tracker\b|\bthe issue\b", re.IGNORECASE)
    places = [*(REPO_ROOT / "notebooks").glob("*.ipynb"), *(REPO_ROOT / "book").glob("*.md"),
              *PACKAGE.rglob("*.py"), *(REPO_ROOT / "scripts").glob("*.py"),
              *(REPO_ROOT / "measurements").rglob("*.md"), REPO_ROOT / "README.md"]
    hits = [f"{p.relative_to(REPO_ROOT)}: {m.group(0)!r}" for p in places for m in pattern.finditer(p.read_text())]
    assert not hits, hits


def test_docstrings_cite_the_book_not_files_outside_the_repository():
    hits = [str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py") if "shared/notes" in p.read_text()]
    assert not hits, hits
