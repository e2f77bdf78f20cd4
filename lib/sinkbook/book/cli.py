"""The ``sinkbook`` command: ``info``, ``capture``, ``strength``, ``explore`` (and the adaptation commands).

Every user error (unknown model, missing file, bad parameter, unsupported architecture) ends in one line
``sinkbook: error: ...`` that says what to do, and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time

# Only torch-free modules at the top: `sinkbook --help` and usage errors answer in a fraction of a second, and
# torch (seconds to import) is loaded by the command that needs it. ModelNotAvailable is caught in main().
from ..core.profiles import SettingsError, check_device

# core.arch.UnsupportedArchitecture is a ValueError; naming it here would import torch (core.arch needs it).
USER_ERRORS = (SettingsError, ValueError, FileNotFoundError)
WINDOW_HELP_DEFAULT = 10        # measures.strength.DEFAULT_WINDOW, written out so the parser needs no torch (tested)
# The packages of pyproject.toml's extras, by import name: a command that needs one says which extra to install
# (the library alone installs only the core dependencies).
EXTRA_OF = {"accelerate": "train", "peft": "train", "sklearn": "train", "tqdm": "train",
            "lm_eval": "eval", "langdetect": "eval", "immutabledict": "eval", "nltk": "eval",
            "matplotlib": "book", "seaborn": "book", "plotly": "book", "ipywidgets": "book", "IPython": "book",
            "nbformat": "book", "papermill": "book", "psutil": "book"}
MODEL_HELP = "built-in name, tiny-<family>, local dir, .gguf file or hub id"


def cmd_info(args) -> int:
    from ..core.models import architecture_info, load_model
    info = architecture_info(load_model(args.model, device=args.device))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_capture(args) -> int:
    _check_writable_file(args.out, ".npz")            # before torch is imported: a bad --out answers at once
    import numpy as np
    import torch

    from ..core.hooks import capture
    from ..core.models import check_input_fits, encode, load_model
    loaded = load_model(args.model, device=args.device)
    batch = encode(loaded.tokenizer, args.prompt, chat=args.chat, device=loaded.device)
    check_input_fits(loaded, batch["attention_mask"])
    start = time.perf_counter()
    with torch.no_grad(), capture(loaded.model, points=("pattern",), layers=[args.layer], stop_early=True) as cap:
        loaded.model(**batch)
    layer = cap.layers[0]
    pattern = cap["pattern", layer][0].cpu().numpy()            # (heads, T, T)
    tokens = loaded.tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    np.savez_compressed(args.out, attention=pattern, tokens=np.array(tokens), layer=layer,
                        model=args.model, prompt=args.prompt, chat=bool(args.chat))
    print(f"wrote {args.out}: layer {layer}, attention {pattern.shape} (heads, query, key), "
          f"{len(tokens)} tokens, {time.perf_counter() - start:.2f} s")
    return 0


def _check_writable_file(name: str, suffix: str) -> None:
    """Refuse an output path that cannot be written, before a model is loaded: a wrong suffix, a directory, a
    missing folder, a folder that refuses a new file (tried with a probe file, which root's permissions cannot fake)."""
    import os
    from pathlib import Path
    path = Path(name).expanduser()
    if path.suffix != suffix:
        raise ValueError(f"--out must name a {suffix} file, got {name!r}")
    if path.is_dir():
        raise ValueError(f"--out {name!r} is a directory; name a file in it, e.g. {str(path / ('attention' + suffix))!r}")
    if not path.parent.is_dir():
        raise ValueError(f"--out {name!r}: the folder {str(path.parent)!r} does not exist; create it first")
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write --out {name!r} ({err.strerror or err}); choose a writable folder") from None


def cmd_strength(args) -> int:
    from ..core.prompts import load_prompts_file, prompt_texts      # torch-free: bad input answers at once
    prompts = load_prompts_file(args.prompts_file) if args.prompts_file else prompt_texts()
    if args.n is not None:
        if args.n < 1:
            raise ValueError(f"--n must be at least 1, got {args.n}")
        prompts = prompts[:args.n]
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    from ..core.arch import n_layers
    from ..core.models import load_model
    from ..measures.strength import DEFAULT_WINDOW, STRONG_SINK_G, sink_strength
    if args.window is None:
        args.window = DEFAULT_WINDOW
    start = time.perf_counter()
    loaded = load_model(args.model, device=args.device)
    window = min(args.window, n_layers(loaded.model))
    result = sink_strength(loaded, prompts, chat=args.chat, window=window)
    out = result.summary(window)
    out["load_seconds"] = round(loaded.load_seconds, 3)
    out["total_seconds"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    q = out["quantiles"]
    note = f" (the model has only {window} layers)" if window < args.window else ""
    print(f"model            {args.model}")
    print(f"prompts          {out['n_prompts']} ({'chat template' if out['chat'] else 'raw text'})")
    print(f"window           last {window} layers{note}, {out['n_gaps']} (layer, head, query) gaps")
    print(f"Sink Strength S  {out['S']:.3f}   (mean G {out['mean_G']:.3f})")
    print("G quantiles      " + "  ".join(f"{k} {v:.2f}" for k, v in q.items()))
    if "learned_sink_share" in out:
        print(f"learned sink     {out['learned_sink_share']:.3f} of the attention goes to the learned sink logits "
              f"(no key); S with it counted as a key {out['S_with_learned_sink']:.3f}")
    print(f"strong sinks     {100 * out['strong_fraction']:.1f}% of gaps have G > {STRONG_SINK_G:g}")
    print(f"time             {out['seconds']:.2f} s for S, {out['load_seconds']:.2f} s loading, "
          f"{out['total_seconds']:.2f} s in all")
    if not math.isfinite(out["S"]):
        raise ValueError("S is not finite; the prompts may be too short")
    return 0


def cmd_explore(args) -> int:
    from ..core.models import load_model
    from ..measures.attention_maps import explorer_data
    from .explorer import explorer_page
    if not args.out.endswith((".html", ".htm")):
        raise ValueError(f"--out must name an .html file, got {args.out!r}")
    loaded = load_model(args.model, device=args.device)
    data = explorer_data(loaded, args.prompt, chat=args.chat, max_tokens=args.max_tokens)
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(explorer_page([data], f"Attention per head: {args.model}"))
    print(f"wrote {args.out}: {data['layers']} layers x {data['heads']} heads, {len(args.prompt)} prompt(s); "
          "it opens offline in a browser")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors in the command's one-line form (argparse prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"sinkbook: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="sinkbook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="architecture facts of a model")
    info.add_argument("model", help=MODEL_HELP)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--device", default="auto")
    info.set_defaults(func=cmd_info)

    cap = sub.add_parser("capture", help="write one layer's per-head attention probabilities to .npz")
    cap.add_argument("model", help=MODEL_HELP)
    cap.add_argument("--layer", type=int, required=True, help="layer index (negative counts from the end)")
    cap.add_argument("--prompt", required=True)
    cap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                     help="wrap the prompt in the tokenizer's chat template")
    cap.add_argument("--out", required=True, help="output .npz (arrays: attention, tokens)")
    cap.add_argument("--device", default="auto")
    cap.set_defaults(func=cmd_capture)

    cmd = sub.add_parser("strength", help="Sink Strength S of a model (pre-adaptation screen, VL paper Sec. 3.2)",
                         description="Median attention-logit gap G of the per-head favourite key over the last K layers.")
    cmd.add_argument("model", help=MODEL_HELP)
    cmd.add_argument("--prompts-file", help="plain-text file, one prompt per line (default: the 15 calibration prompts)")
    cmd.add_argument("--n", type=int, default=None, help="use only the first N prompts")
    cmd.add_argument("--window", type=int, default=None, help=f"last K layers (default {WINDOW_HELP_DEFAULT})")
    cmd.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap prompts in the chat template (default: when the tokenizer has one)")
    cmd.add_argument("--json", action="store_true", help="print JSON")
    cmd.add_argument("--device", default="auto")
    cmd.set_defaults(func=cmd_strength)

    explore = sub.add_parser("explore", help="write the per-head attention explorer for a model and prompts to "
                             "one HTML page that works offline")
    explore.add_argument("model", help=MODEL_HELP)
    explore.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    explore.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                         help="wrap prompts in the chat template (default: when the tokenizer has one)")
    explore.add_argument("--max-tokens", type=int, default=64, help="cut longer prompts (the page grows with T^2)")
    explore.add_argument("--out", required=True, help="output .html file")
    explore.add_argument("--device", default="auto")
    explore.set_defaults(func=cmd_explore)

    for register in _more_commands():
        register(sub)
    return parser


def _more_commands():
    """Commands whose code lives in other modules of this layer (``register_cli(subparsers)``)."""
    import importlib
    out = []
    for name in ("adapt_cli",):
        try:
            module = importlib.import_module(f"sinkbook.book.{name}")
        except ModuleNotFoundError:
            continue
        out.append(module.register_cli)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with _progress_lines():
        return _run(args)


def _run(args) -> int:
    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device)           # "gpu0" is refused here, not by torch after the model has loaded
        return args.func(args)
    except USER_ERRORS as err:
        return _user_error(err)
    except RuntimeError as err:
        from ..core.models import ModelNotAvailable      # imported already by whatever raised it
        if isinstance(err, ModelNotAvailable):
            return _user_error(err)
        raise
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        if package not in EXTRA_OF:
            raise
        print(f"sinkbook: error: `sinkbook {args.command}` needs {package}, which comes with an extra: "
              f"pip install 'sinkbook[{EXTRA_OF[package]}]'", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _progress_lines():
    """While a command runs, show the library's progress lines (``logging`` under "sinkbook": model loading, the
    encoder training, the text suite's tasks) on stderr when it is a terminal. Piped or captured stderr keeps only
    results and the one-line errors, which scripts and tests read."""
    if not sys.stderr.isatty():
        yield
        return
    logger, handler = logging.getLogger("sinkbook"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("sinkbook: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _user_error(err: Exception) -> int:
    print(f"sinkbook: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
