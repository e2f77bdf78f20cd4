"""The ``sinkbook`` command: ``sinkbook info MODEL``, ``sinkbook capture MODEL ...`` and chapter tools."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .arch import UnsupportedArchitecture
from .models import ModelNotAvailable

USER_ERRORS = (ModelNotAvailable, UnsupportedArchitecture, ValueError, FileNotFoundError)


def cmd_info(args) -> int:
    from .models import architecture_info, load_model
    info = architecture_info(load_model(args.model, device=args.device))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_capture(args) -> int:
    import numpy as np
    import torch

    from .hooks import capture
    from .models import encode, load_model
    if not args.out.endswith(".npz"):
        raise ValueError(f"--out must name a .npz file, got {args.out!r}")
    loaded = load_model(args.model, device=args.device)
    batch = encode(loaded.tokenizer, args.prompt, chat=args.chat, device=loaded.device)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkbook", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="architecture facts of a model")
    info.add_argument("model", help="built-in name, tiny-<family>, local dir, .gguf file or hub id")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--device", default="auto")
    info.set_defaults(func=cmd_info)

    cap = sub.add_parser("capture", help="write one layer's per-head attention probabilities to .npz")
    cap.add_argument("model")
    cap.add_argument("--layer", type=int, required=True, help="layer index (negative counts from the end)")
    cap.add_argument("--prompt", required=True)
    cap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                     help="wrap the prompt in the tokenizer's chat template")
    cap.add_argument("--out", required=True, help="output .npz (arrays: attention, tokens)")
    cap.add_argument("--device", default="auto")
    cap.set_defaults(func=cmd_capture)

    for register in _chapter_commands():
        register(sub)
    return parser


def _chapter_commands():
    """Subcommands contributed by chapter modules (each exposes ``register_cli(subparsers)``)."""
    import importlib
    out = []
    for name in ("strength",):
        try:
            module = importlib.import_module(f"sinkbook.{name}")
        except ImportError:
            continue
        if hasattr(module, "register_cli"):
            out.append(module.register_cli)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"sinkbook: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
