"""Capturing every layer's attention pattern: sinkbook against its peers, as ratios against a plain SDPA forward.

    .venv/bin/python scripts/bench_peers.py [--model smollm2-135m-instruct] [--repeats 3]

One torch thread. Over the 15 calibration prompts (one forward per prompt, chat template), each repeat times,
interleaved so that drift in the machine's load hits all alike:

- ``plain``: the model's own SDPA forward, nothing captured (the reference, ratio 1);
- ``sinkbook``: the same SDPA forward inside ``capture(model, points=("pattern",))`` (all layers);
- ``eager``: transformers' eager attention with ``output_attentions=True``;
- ``nnsight``: nnsight tracing a copy of the model on eager attention, saving every layer's attention weights
  (``self_attn.output[1]``); skipped (with the reason) when nnsight is not importable;
- ``transformer_lens``: run only when TransformerLens is installed and loads the model without the hub.

Every method keeps all layers' (1, H, T, T) patterns of a prompt until the next prompt. Before timing, the
patterns of each method are checked against eager's on every prompt and layer (max |difference| printed, must
be <= 1e-5). Reported: median CPU seconds (one thread: the work done, whatever else shares the machine) and
median wall seconds over the repeats, each with its ratio of medians to ``plain``.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # everything here is local; never wait on the hub

import torch

from sinkbook.core.hooks import attention_implementation, capture
from sinkbook.core.models import encode, load_model
from sinkbook.core.prompts import calibration_prompts

TOLERANCE = 1e-5


def run_plain(model, batch):
    model(**batch)
    return None


def run_sinkbook(model, batch):
    with capture(model, points=("pattern",)) as cap:
        model(**batch)
    return [cap["pattern", layer] for layer in cap.layers]


def run_eager(model, batch):
    return list(model(**batch, output_attentions=True).attentions)


def nnsight_runner():
    """(runner, None), or (None, why not)."""
    if importlib.util.find_spec("nnsight") is None:
        return None, "nnsight is not installed (pip install 'sinkbook[bench]')"
    try:
        import nnsight
        from nnsight import NNsight
    except Exception as err:   # an installed nnsight that does not import with this torch/transformers
        return None, f"nnsight does not import: {type(err).__name__}: {err}"
    wrapped = {}

    def run(model, batch):
        if id(model) not in wrapped:
            wrapped[id(model)] = NNsight(model)
        traced = wrapped[id(model)]
        with traced.trace(**batch):
            # what is saved must be bound inside the trace; a container saved once collects every layer's weights
            weights = nnsight.save(list())
            for layer in traced.model.layers:
                weights.append(layer.self_attn.output[1])
        return list(weights)
    return run, None


def transformer_lens_runner(loaded):
    """(runner, None), or (None, why not): TransformerLens only when installed and loading the model offline."""
    if importlib.util.find_spec("transformer_lens") is None:
        return None, "TransformerLens is not installed in this environment (not a dependency of sinkbook)"
    try:
        from transformer_lens import HookedTransformer
        hooked = HookedTransformer.from_pretrained_no_processing(
            "HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=copy.deepcopy(loaded.model), tokenizer=loaded.tokenizer,
            device="cpu", dtype=torch.float32)
    except Exception as err:
        return None, f"TransformerLens did not load the model offline: {type(err).__name__}: {str(err)[:160]}"
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(hooked.cfg.n_layers)]

    def run(model, batch):
        _, cache = hooked.run_with_cache(batch["input_ids"], names_filter=lambda n: n in names)
        return [cache[n] for n in names]
    return run, None


def timed(fn, model, batches) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one pass over the batches. With one thread the CPU time is the work done;
    on a machine shared with other jobs the wall clock also counts the time this process was not scheduled."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for batch in batches:
            fn(model, batch)
    return time.process_time() - cpu, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, device="cpu")
    model = loaded.model
    eager_copy = copy.deepcopy(model)          # peers wrap their own copy, so their hooks never touch the others
    eager_copy.set_attn_implementation("eager")
    prompts = [p["prompt"] for p in calibration_prompts()]
    batches = [encode(loaded.tokenizer, p) for p in prompts]
    lengths = [b["input_ids"].shape[1] for b in batches]
    print(f"{args.model}: torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(prompts)} prompts "
          f"(chat template), {min(lengths)}-{max(lengths)} tokens; median of {args.repeats} repeats, interleaved")

    # name -> (runner, model it runs, context it runs in)
    methods = {"plain": (run_plain, model, lambda: attention_implementation(model, "sdpa")),
               "sinkbook": (run_sinkbook, model, lambda: attention_implementation(model, "sdpa")),
               "eager": (run_eager, model, lambda: attention_implementation(model, "eager"))}
    skipped = {}
    run_nn, why = nnsight_runner()
    if run_nn:
        methods["nnsight"] = (run_nn, eager_copy, lambda: torch.no_grad())
    else:
        skipped["nnsight"] = why
    run_tl, why = transformer_lens_runner(loaded)
    if run_tl:
        methods["transformer_lens"] = (run_tl, None, lambda: torch.no_grad())
    else:
        skipped["transformer_lens"] = why

    # correctness (also the warm-up): every captured pattern against eager's, every prompt and layer
    worst = {name: 0.0 for name in methods if name not in ("plain", "eager")}
    with torch.no_grad():
        for batch in batches:
            with attention_implementation(model, "eager"):
                reference = run_eager(model, batch)
            for name in worst:
                fn, on, context = methods[name]
                with context():
                    got = fn(on, batch)
                assert len(got) == len(reference), f"{name}: {len(got)} layers captured, eager has {len(reference)}"
                for a, b in zip(got, reference):
                    assert a.shape == b.shape, f"{name}: pattern shape {tuple(a.shape)} vs eager {tuple(b.shape)}"
                    worst[name] = max(worst[name], float((a.float() - b.float()).abs().max()))
        timed(run_plain, model, batches[:2])
    for name, diff in worst.items():
        print(f"max |pattern - eager| {name:<17} {diff:.2e}  (every prompt and layer)")
        assert diff <= TOLERANCE, f"{name}'s patterns differ from eager's by {diff:.2e} > {TOLERANCE:g}"

    cpu = {name: [] for name in methods}
    wall = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (fn, on, context) in methods.items():
            with context():
                c, w = timed(fn, on, batches)
            cpu[name].append(c)
            wall[name].append(w)
    plain_cpu, plain_wall = statistics.median(cpu["plain"]), statistics.median(wall["plain"])
    print(f"{'method':<18}{'CPU s':>8}{'ratio':>8}{'wall s':>9}{'ratio':>8}   per-repeat CPU ratios")
    for name in methods:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        ratios = " ".join(f"{v / p:.2f}" for v, p in zip(cpu[name], cpu["plain"]))
        print(f"{name:<18}{c:>8.2f}{c / plain_cpu:>8.2f}{w:>9.2f}{w / plain_wall:>8.2f}   {ratios}")
    for name, why in skipped.items():
        print(f"{name:<18}{'skipped':>10}   {why}")


if __name__ == "__main__":
    main()
