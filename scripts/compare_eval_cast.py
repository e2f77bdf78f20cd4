"""One adapted run's whole evaluation (``runs.adaptation.evaluate``, the default profile's spec) in bfloat16, with
frozen weights cast at every step (as before 8a488e7) and cast once per context, in the order given: the CPU
seconds of each and every value that differs between them (the per-task timings always do).

    .venv/bin/python scripts/compare_eval_cast.py <run directory> <IFEval prompts> [once-first]

For the README: the seed-0 default vision runs of Gemma 3 (IFEval 0) and SmolLM2 (IFEval 115), one thread.
"""
import sys
import time

import torch

from sinkbook.core.models import load_model
from sinkbook.runs import adaptation
from sinkbook.training.adapt import load_run


def differences(x, y, path=""):
    if isinstance(x, dict):
        for k in x:
            yield from differences(x[k], y.get(k) if isinstance(y, dict) else None, f"{path}/{k}")
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            yield from differences(u, v, f"{path}[{i}]")
    elif x != y:
        yield path, x, y


def main() -> None:
    torch.set_num_threads(1)
    directory, ifeval = sys.argv[1], int(sys.argv[2])
    run = load_run(directory, device="cpu")
    spec = {**adaptation.eval_spec(adaptation.recipe("default")), "ifeval": ifeval}
    reference = load_model(run.config.model, device="cpu")
    once = adaptation.autocast
    ways = [("per_step_cast", lambda p, d="cpu", m=None: once(p, d)), ("cast_once", once)]
    if sys.argv[3:] == ["once-first"]:
        ways.reverse()
    out = {}
    for name, context in ways:
        adaptation.autocast = context
        start = time.process_time()
        out[name] = adaptation.evaluate(run.loaded, run.vlm, run.fmt, spec, reference=reference, modality="vision",
                                        tasks=run.config.tasks)
        print(name, round(time.process_time() - start, 1), "CPU s", flush=True)
    adaptation.autocast = once
    a, b = out["per_step_cast"], out["cast_once"]
    for key in ("tasks", "heldout_loss", "vision"):
        for path, x, y in differences(a[key], b[key], key):
            print("differs:", path, str(x)[:60], str(y)[:60])


if __name__ == "__main__":
    main()
