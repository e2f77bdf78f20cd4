"""Execute every chapter notebook with papermill and build the Jupyter Book from the executed copies.

    python -m sinkbook.book build [--profile quick|default|gpu|gpu-local] [--only CHAPTER ...] [--device auto]

The chapters and their order come from ``sinkbook.chapters.CHAPTERS``; the book's ``_toc.yml`` (committed beside
``_config.yml``) is written from it by ``python -m sinkbook.book toc``, and a build stops when the two disagree.
The sources stay clean: each build stages the book (``_config.yml``, ``_toc.yml``, ``book/``) next to the executed
notebooks under ``_build/stage-<profile>/`` and builds the HTML from there into ``_build/html`` (default and
gpu profiles) or ``_build/<profile>/html`` (others). Results files go to ``results/`` for the default profile
and ``_build/<profile>/results/`` otherwise, so a quick test run never overwrites the book's numbers.

Each chapter runs in its own papermill process whose output goes to ``_build/logs/<profile>/<chapter>.log``;
the console shows one line per chapter (status, time). A chapter that fails is reported at the end with the
tail of its log and the path of its partly executed notebook; the other chapters still run and nothing they
computed is lost. In the executed copies every code cell is collapsed behind a toggle (``hide-input``) and
the parameters cells are hidden whole (``hide-cell``): a chapter page reads as prose, figures and verdicts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..chapters import CHAPTERS, chapter_names
from ..core.paths import REPO_ROOT, NotInCheckout, entry_lock, need_checkout
from ..core.profiles import PROFILE_NAMES
from ..runs.pool import die_with_parent
from .results import claim_id_clashes, claims_markdown, load_all_results, power_markdown, summary_figure
from .summary import summary_markdown

PROFILES = PROFILE_NAMES
# The prose pages around the chapters, in book order: (part caption, [page files]).
PAGES_BEFORE = ("The library", ["book/capture_points", "book/methods", "book/rerun"])
PAGES_AFTER = ("Back matter", ["book/results_schema", "book/references"])
# The layers whose docstrings make the API reference, one page each (book/api/<layer>.md includes the generated
# listing, so a new module appears without anyone adding it).
API_LAYERS = ("core", "measures", "interventions", "training")


def paths(profile: str) -> dict[str, Path]:
    base = REPO_ROOT / "_build"
    out = base if profile in ("default", "gpu") else base / profile
    return {
        "stage": base / f"stage-{profile}",
        "html_parent": out,
        "html": out / "html",
        "logs": base / "logs" / profile,
        "results": REPO_ROOT / "results" if profile in ("default", "gpu") else base / profile / "results",
    }


def toc_yaml() -> str:
    """The book's table of contents, from the chapter registry."""
    caption, pages = PAGES_BEFORE
    lines = ["format: jb-book", "root: book/intro", "parts:", f"  - caption: {caption}", "    chapters:"]
    lines += [f"      - file: {page}" for page in pages]
    lines += ["  - caption: Chapters", "    chapters:"]
    lines += [f"      - file: chapters/{c.name}" for c in CHAPTERS]
    lines += ["  - caption: API reference", "    chapters:"] + [f"      - file: book/api/{layer}" for layer in API_LAYERS]
    caption, pages = PAGES_AFTER
    lines += [f"  - caption: {caption}", "    chapters:"] + [f"      - file: {page}" for page in pages]
    return "\n".join(lines) + "\n"


def execute_chapter(chapter: str, profile: str, device: str, results_dir: Path, executed_dir: Path,
                    log_dir: Path, parameters: dict | None = None) -> tuple[bool, float, str]:
    """Run one notebook in a papermill process; returns (ok, seconds, tail of the log when it failed)."""
    source = REPO_ROOT / "notebooks" / f"{chapter}.ipynb"
    if not source.exists():
        return False, 0.0, f"notebook {source} is missing"
    executed_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    target = executed_dir / f"{chapter}.ipynb"
    params = {"profile": profile, "device": device, **(parameters or {})}
    command = [sys.executable, "-m", "sinkbook.book.papermill_ipc", str(source), str(target), "--cwd", str(REPO_ROOT),
               "-k", "python3", "--no-progress-bar", "--log-level", "ERROR", "-y", json.dumps(params)]
    env = {**os.environ, "SINKBOOK_RESULTS_DIR": str(results_dir), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    log = log_dir / f"{chapter}.log"
    with open(log, "w") as out:
        # papermill (and through the kernel's parent poller, the kernel and its workers) ends with the build
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                 preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        returncode = child.wait()
    seconds = time.perf_counter() - start
    if target.exists():
        present_for_reading(target)
    if returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-25:]
        return False, seconds, "\n".join(tail)
    return True, seconds, ""


RESULTS_LINK_TAG = "sinkbook-results-link"


def results_link_markdown(chapter: str) -> str:
    """The line under a chapter's claims: its results file and its executed notebook, as the built book serves them
    (a chapter page is chapters/<name>.html; the files are results/<name>.json and _sources/chapters/<name>.ipynb)."""
    return (f'The numbers behind these verdicts: <a class="{RESULTS_LINK_TAG}" href="../results/{chapter}.json">'
            f'results/{chapter}.json</a> (its fields: {{ref}}`the results files <results-schema>`), and this chapter '
            f'executed, outputs included: <a href="../_sources/chapters/{chapter}.ipynb" download>{chapter}.ipynb</a>.')


def present_for_reading(notebook: Path) -> None:
    """Collapse code behind toggles in an executed notebook: hide-input everywhere, parameters cells hidden; under
    the cell that shows the claims (or at the end), a line linking the chapter's results file."""
    import nbformat
    nb = nbformat.read(str(notebook), as_version=4)
    nb.cells = [c for c in nb.cells if RESULTS_LINK_TAG not in c.metadata.get("tags", [])]   # once per notebook
    shows_claims = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "show_claims(" in c.source]
    link = nbformat.v4.new_markdown_cell(results_link_markdown(notebook.stem), metadata={"tags": [RESULTS_LINK_TAG]})
    nb.cells.insert(shows_claims[-1] + 1 if shows_claims else len(nb.cells), link)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        tags = list(cell.metadata.get("tags", []))
        wanted = "hide-cell" if ("parameters" in tags or "injected-parameters" in tags) else "hide-input"
        if wanted not in tags:
            tags.append(wanted)
        cell.metadata["tags"] = tags
    nbformat.write(nb, str(notebook))


TOC = REPO_ROOT / "_toc.yml"


def check_toc() -> None:
    """The committed ``_toc.yml`` must be the one the chapter registry gives; it says how to fix it if not."""
    if not TOC.exists() or TOC.read_text() != toc_yaml():
        raise SystemExit(f"{TOC.name} does not match the chapter registry (sinkbook.chapters.CHAPTERS); "
                         f"write it with: python -m sinkbook.book toc")


def stage_book(stage: Path) -> None:
    shutil.copy2(REPO_ROOT / "_config.yml", stage / "_config.yml")
    shutil.copy2(TOC, stage / "_toc.yml")
    if (stage / "book").exists():
        shutil.rmtree(stage / "book")
    shutil.copytree(REPO_ROOT / "book", stage / "book", symlinks=False)


def write_generated(stage: Path, results_dir: Path, profile: str, timings: dict) -> None:
    generated = stage / "book" / "_generated"
    generated.mkdir(parents=True, exist_ok=True)
    results = load_all_results(results_dir)
    figure = None
    if results:
        summary_figure(results, generated / "claims_summary.svg", order=chapter_names())
        figure = "claims_summary.svg"
    (generated / "claims.md").write_text(claims_markdown(results, order=chapter_names(), figure=figure,
                                                          results_href="../results/"))
    (generated / "findings.md").write_text(summary_markdown(results))
    (generated / "power.md").write_text(power_markdown(results, order=chapter_names()))
    publish_results(stage, results_dir)
    set_footer(stage, profile)
    lines = ["| chapter | executed in | status |", "|---|---|---|"]
    for chapter, (ok, seconds, _) in timings.items():
        lines.append(f"| {chapter} | {seconds:.0f} s | {'ok' if ok else '**failed**'} |")
    (generated / "build.md").write_text(f"Profile `{profile}`.\n\n" + "\n".join(lines) + "\n")
    (generated / "capture_points.md").write_text(_capture_points_table())
    (generated / "architectures.md").write_text(_architectures_table())
    for layer in API_LAYERS:
        (generated / f"api_{layer}.md").write_text(api_listing(layer))


def publish_results(stage: Path, results_dir: Path) -> None:
    """Serve the results files with the book, at results/<chapter>.json (Sphinx copies html_extra_path as it is)."""
    served = stage / "book" / "_generated" / "extra" / "results"
    if served.exists():
        shutil.rmtree(served)
    served.mkdir(parents=True)
    for path in sorted(results_dir.glob("*.json")):
        shutil.copy2(path, served / path.name)


def set_footer(stage: Path, profile: str) -> None:
    """The staged _config.yml gets a footer with the version and the commit the book was built from."""
    import yaml
    from importlib import metadata

    from .results import git_commit
    commit = git_commit()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True).stdout.strip()
    try:
        version = metadata.version("sinkbook")
    except metadata.PackageNotFoundError:
        version = "unknown"
    built = f"commit <code>{commit[:12]}</code>" + (" with uncommitted changes" if dirty else "")
    config_path = stage / "_config.yml"
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("html", {})["extra_footer"] = (
        f'<p class="sinkbook-build">sinkbook {version}, built from {built}, profile <code>{profile}</code>. '
        f'Code MIT, text and figures CC BY 4.0; the papers\' tables remain their authors\'.</p>')
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))


def api_listing(layer: str) -> str:
    """The API page body of one layer: a summary table of its modules, then each module's documented members
    (Sphinx autodoc reads the docstrings when the book is built)."""
    import importlib
    import pkgutil
    package = importlib.import_module(f"sinkbook.{layer}")
    modules = [m.name for m in pkgutil.iter_modules(package.__path__, f"{package.__name__}.")]
    lines = ["```{eval-rst}", ".. autosummary::", ""] + [f"   {name}" for name in modules] + ["```", ""]
    for name in modules:
        lines += [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", "   :members:", "```", ""]
    return "\n".join(lines)


def _capture_points_table() -> str:
    from ..core.hooks import CAPTURE_POINTS
    rows = ["| name | shape | what it is |", "|---|---|---|"]
    for name, doc in CAPTURE_POINTS.items():
        shape, _, what = doc.partition(") ")
        rows.append(f"| `{name}` | {shape}) | {what} |")
    return "\n".join(rows) + "\n"


def _architectures_table() -> str:
    from dataclasses import fields

    from ..core.arch import ARCHITECTURES
    names = [f.name for f in fields(next(iter(ARCHITECTURES.values())))]
    rows = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for spec in ARCHITECTURES.values():
        rows.append("| " + " | ".join(f"`{getattr(spec, n)}`" for n in names) + " |")
    return "\n".join(rows) + "\n"


def _stop_children(signum, _frame):
    """Ctrl-C or SIGTERM of the build: end every process it started (papermill, kernels, workers), then exit."""
    import psutil
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    print(f"[sinkbook] build stopped by signal {signum}; cached runs that finished are kept", file=sys.stderr)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def one_build_at_a_time(profile: str):
    """Two builds of one profile in one checkout would share staging, logs and executed notebooks, and the default
    and gpu profiles share the book's HTML and results/: a second build that would write the same book waits for
    the first (and then reads what it cached)."""
    with entry_lock(paths(profile)["html"], f"a build of {paths(profile)['html']}"):
        yield


def build(profile: str = "default", only: list[str] | None = None, device: str = "auto") -> int:
    signal.signal(signal.SIGTERM, _stop_children)
    signal.signal(signal.SIGINT, _stop_children)
    with one_build_at_a_time(profile):
        return _build(profile, only, device)


def _build(profile: str, only: list[str] | None, device: str) -> int:
    if profile not in PROFILES:
        raise SystemExit(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    unknown = set(only or []) - set(chapter_names())
    if unknown:
        raise SystemExit(f"unknown chapter(s) {sorted(unknown)}; chapters: {', '.join(chapter_names())}")
    check_toc()                     # before an hour of chapters, not after
    where = paths(profile)
    stage = where["stage"]
    stage.mkdir(parents=True, exist_ok=True)
    executed_dir = stage / "chapters"
    timings = {}
    for chapter in chapter_names():
        if only and chapter not in only:
            continue
        print(f"[sinkbook] {chapter}: running (log {where['logs'] / (chapter + '.log')})", flush=True)
        ok, seconds, error = execute_chapter(chapter, profile, device, where["results"], executed_dir, where["logs"])
        timings[chapter] = (ok, seconds, error)
        print(f"[sinkbook] {chapter}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
    for chapter in chapter_names():  # a chapter not executed this time keeps its last executed copy, if any
        if not (executed_dir / f"{chapter}.ipynb").exists():
            print(f"[sinkbook] {chapter}: no executed notebook; the book will show a placeholder", flush=True)
            _placeholder(executed_dir / f"{chapter}.ipynb", chapter)
    check_claim_ids(where["results"])
    stage_book(stage)
    write_generated(stage, where["results"], profile, timings)
    start = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).with_name("jupyter-book")), "build", str(stage), "--path-output",
                           str(where["html_parent"]), "--builder", "html"], capture_output=True, text=True)
    (where["logs"] / "jupyter-book.log").write_text(proc.stdout + proc.stderr)
    book_ok = proc.returncode == 0 and (where["html_parent"] / "_build" / "html" / "index.html").exists()
    if book_ok:
        if where["html"].exists():
            shutil.rmtree(where["html"])
        shutil.move(str(where["html_parent"] / "_build" / "html"), str(where["html"]))
        shutil.rmtree(where["html_parent"] / "_build", ignore_errors=True)
    else:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
    print(f"[sinkbook] jupyter-book build: {'ok' if book_ok else 'FAILED'} in {time.perf_counter() - start:.0f} s;"
          f" open {where['html'] / 'index.html'}", flush=True)
    failed = [c for c, (ok, _, _) in timings.items() if not ok]
    for chapter in failed:
        print(f"[sinkbook] chapter {chapter} failed; its partly executed notebook: "
              f"{executed_dir / (chapter + '.ipynb')}; end of its log:\n{timings[chapter][2]}", file=sys.stderr)
    return 0 if book_ok and not failed else 1


def check_claim_ids(results_dir: Path) -> None:
    """Stop the build, in one line, when a claim id appears in two results files: a number is claimed once and other
    chapters refer to it. Nothing is deleted: the results files and executed notebooks stay for the next build."""
    clashes = claim_id_clashes(load_all_results(results_dir))
    if clashes:
        raise SystemExit("[sinkbook] build refused: claim id(s) in more than one results file: "
                         + "; ".join(f"{cid} ({', '.join(chapters)})" for cid, chapters in clashes.items())
                         + f"; claim each once, in one chapter (results files in {results_dir})")


def _placeholder(path: Path, chapter: str) -> None:
    import nbformat
    title = next(c.title for c in CHAPTERS if c.name == chapter)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(
        f"# {title}\n\nThis chapter has not been executed in this build. "
        f"Run `python -m sinkbook.book build --only {chapter}` to execute it.")]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sinkbook.book", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="execute the notebooks and build the HTML book")
    b.add_argument("--profile", default="default", choices=PROFILES)
    b.add_argument("--only", nargs="*", help="execute only these chapters (others keep their last executed copy)")
    b.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    sub.add_parser("toc", help=f"write {TOC.name} from the chapter registry")
    args = parser.parse_args(argv)
    try:
        need_checkout("building the book")
    except NotInCheckout as err:
        raise SystemExit(f"python -m sinkbook.book: {err}") from None
    if args.command == "toc":
        TOC.write_text(toc_yaml())
        print(f"wrote {TOC}")
        return 0
    return build(args.profile, args.only, args.device)


if __name__ == "__main__":
    sys.exit(main())
