"""``sinkbook adapt`` (vision-language or text-only adaptation of a model) and ``sinkbook evaluate`` (the
text-capability suite on a model or an adapted directory)."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

MODEL_HELP = "built-in name, tiny-<family>, local dir, .gguf file or hub id"


LOCK = ".sinkbook-adapt.lock"


@contextlib.contextmanager
def _only_writer(out: Path):
    """Hold ``out`` for this process while it trains: a second ``sinkbook adapt --out`` to the same folder is refused
    at once instead of training into it too. An ``flock``, so it goes with the process however that ended."""
    import fcntl
    with open(out / LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ValueError(f"{out} is being written by another `sinkbook adapt` ({holder}); wait for it to finish "
                             f"or choose another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            (out / LOCK).unlink(missing_ok=True)        # a finished or failed run leaves no lock file behind


def _check_empty_of_runs(out: Path) -> None:
    if (out / "run.json").exists():
        raise ValueError(f"{out} already holds an adapted model; choose another --out or delete that folder first")
    if (out / "model").exists():
        raise ValueError(f"{out} holds an unfinished run (model/ but no run.json, which is written last); delete that "
                         f"folder or choose another --out")


def _writable_directory(path: str) -> Path:
    """The output directory, created now, so that a bad --out fails before minutes of training."""
    out = Path(path).expanduser()
    _check_empty_of_runs(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".sinkbook-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write to --out {str(out)!r} ({err.strerror or err}); choose a writable folder") from None
    return out


def _metrics_line(name: str, row: dict) -> str:
    keys = [("S", "S"), ("strong_fraction", "strong"), ("pos0_mass", "pos-0 mass"), ("margin_G_minus_B", "G - B"),
            ("heldout_loss", "held-out loss"), ("arithmetic_strict", "arithmetic strict"),
            ("vision_accuracy", "image accuracy")]
    return f"{name:<7}" + "  ".join(f"{label} {row[k]:.3f}" for k, label in keys if k in row)


def cmd_adapt(args) -> int:
    from ..core.models import load_model
    from ..training.adapt import AdaptConfig, adapt
    from ..training.probes import AdaptationProbe
    cfg = AdaptConfig(args.model, modality=args.modality, steps=args.steps, lr=args.lr, seed=args.seed,
                      stage1_steps=args.stage1_steps, batch_size=args.batch_size, probe_every=args.steps,
                      precision=args.precision)
    out = _writable_directory(args.out)
    with _only_writer(out):
        _check_empty_of_runs(out)            # again, now that no other process can be writing it
        try:
            reference = load_model(args.model, device=args.device)
        except Exception:
            if {p.name for p in out.iterdir()} <= {LOCK}:    # leave no empty folder behind a failed start
                (out / LOCK).unlink(missing_ok=True)
                out.rmdir()
            raise
        probe = AdaptationProbe(reference, arithmetic=args.probe_items, vision=args.probe_items, heldout_windows=2,
                                precision=args.precision)
        run = adapt(cfg, probe=probe, device=args.device, use_cache=False, progress=not args.json, out=out)
    if int(os.environ.get("RANK", "0")) != 0:      # under torchrun, one process reports
        return 0
    before, after = run.probes[0], run.probes[-1]
    summary = {"config": cfg.record(), "before": before, "after": after, "train_seconds": run.seconds,
               "directory": str(out / "model")}
    if args.json:
        print(json.dumps(summary, indent=1, default=float))
        return 0
    print(f"adapted {args.model} ({args.modality}) in {run.seconds:.0f} s -> {out / 'model'}")
    print(_metrics_line("before", before))
    print(_metrics_line("after", after))
    print(f"load it with load_model({str(out / 'model')!r}) (language model) or "
          f"sinkbook.training.vlm.load_vlm (with the vision parts)")
    return 0


def cmd_evaluate(args) -> int:
    from ..core.models import in_unfinished_run, load_model, model_directory
    from ..measures.textsuite import headroom, run_suite
    directory = model_directory(args.model) if Path(args.model).expanduser().is_dir() else None
    adapted = directory is not None and (directory / "sinkbook_vision.pt").exists()
    if adapted:                  # a damaged vision file is reported now, not after minutes of text tasks
        from ..training.vlm import read_vision_file
        read_vision_file(directory)
    elif directory is not None and ((directory / "sinkbook_adaptation.json").exists() or in_unfinished_run(directory)
                                    or (directory.parent / "run.json").exists()):
        print(f"sinkbook: note: {directory} comes from `sinkbook adapt` but holds no sinkbook_vision.pt (a save cut "
              f"short?); only the text tasks are run", file=sys.stderr)
    loaded = load_model(args.model, device=args.device)
    results = run_suite(loaded, arithmetic=args.arithmetic, knowledge=args.knowledge, ifeval=args.ifeval,
                        ifeval_tokens=args.ifeval_tokens)
    rows = {name: {"kind": r.kind, "score": r.score, "floor": r.chance, "items": r.n, "headroom": headroom(r),
                   "seconds": r.seconds} for name, r in results.items()}
    if adapted:
        from ..training.probes import held_out_vision_examples, vision_scores
        from ..training.vlm import load_vlm
        vlm, vl_loaded, fmt = load_vlm(directory, device=args.device)
        logging.getLogger(__name__).info("image tasks, %d held-out questions ...", args.vision)
        scores = vision_scores(vlm, vl_loaded.tokenizer, held_out_vision_examples(args.vision), fmt)
        rows["image_tasks"] = {"kind": "vision", "score": scores["accuracy"], "floor": scores["chance"],
                               "items": len(scores["per_item"]), "headroom": None, "seconds": float("nan")}
    if args.json:
        print(json.dumps({"model": args.model, "tasks": rows}, indent=1, default=float))
        return 0
    print(f"{'task':<22}{'kind':<11}{'score':>7}{'floor':>7}{'items':>7}  headroom")
    for name, r in rows.items():
        print(f"{name:<22}{r['kind']:<11}{r['score']:>7.3f}{r['floor']:>7.3f}{r['items']:>7}  {'-' if r['headroom'] is None else 'yes' if r['headroom'] else 'no'}")
    return 0


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def register_cli(subparsers) -> None:
    a = subparsers.add_parser("adapt", help="adapt a model into a small vision-language model (or the text-only "
                                            "counterpart) on the digit tasks; prints sink and text metrics before/after")
    a.add_argument("model", help=MODEL_HELP)
    a.add_argument("--modality", choices=("vision", "text"), default="vision")
    a.add_argument("--steps", type=_positive, required=True, help="stage-2 steps (projector + language model)")
    a.add_argument("--lr", type=float, default=1e-4, help="stage-2 peak learning rate (default 1e-4)")
    a.add_argument("--stage1-steps", type=_count, default=30, help="projector-only steps before (vision only)")
    a.add_argument("--batch-size", type=_positive, default=8)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: autocast over float32 weights (faster where the CPU has AVX512-BF16; scripts/bench_dtype.py)")
    a.add_argument("--probe-items", type=_positive, default=24, help="arithmetic / image questions in the probes")
    a.add_argument("--out", required=True, help="folder for the adapted model (created; must not hold one already)")
    a.add_argument("--json", action="store_true", help="print JSON instead of the progress bar and summary")
    a.add_argument("--device", default="auto")
    a.set_defaults(func=cmd_adapt)

    e = subparsers.add_parser("evaluate", help="the text-capability suite on a model or an adapted directory")
    e.add_argument("model", help=MODEL_HELP + ", or a folder written by `sinkbook adapt`")
    e.add_argument("--arithmetic", type=_count, default=60, help="arithmetic items (0 skips)")
    e.add_argument("--knowledge", type=_count, default=100, help="multiple-choice knowledge items (0 skips)")
    e.add_argument("--ifeval", type=_count, default=115, help="IFEval-style prompts (0 skips)")
    e.add_argument("--ifeval-tokens", type=_positive, default=64)
    e.add_argument("--vision", type=_positive, default=100, help="held-out image questions (adapted folders)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--device", default="auto")
    e.set_defaults(func=cmd_evaluate)


if __name__ == "__main__":
    from .cli import main
    sys.exit(main())
