"""The OutRo text-model measurements: sinks, attention, head outputs, losses and generations, computed once.

``OutRoTextRuns`` holds the models of one chapter run and computes each measurement on first use, keyed by its
arguments (the same pass is never run twice). Every number is plain: arrays, tables and dicts the chapter's
finding functions read. Formulas: the book's methods page (sections on Phi_LLM, OutRo and paired tests).
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pandas as pd
import torch

from ..core.hooks import attention_implementation, capture, intervene
from ..core.models import architecture_info, encode, load_model
from ..core.profiles import SettingsError
from ..core.prompts import calibration_prompts, pool_prompts
from ..interventions.outro import OutRo, default_layers, detect_sinks, outro, persistent_sinks
from ..measures.decoding import benchmark_decoding, overhead_ratios
from ..measures.ifeval import generate_responses, grade
from ..measures.regression import pearson
from ..training.corpus import heldout_text_windows


N_PROMPTS = len(calibration_prompts()) + len(pool_prompts())           # 115
SINK, DELIMITER, CONTENT = 0, 1, 2
CATEGORY_NAMES = ("sink", "delimiter", "content")

# IFEval settings: OutRo options per name (None: no intervention). "rotate*" use the rotation alone, as the
# paper's direction controls do (Table B.9).
CONTROLS = ("rotate", "rotate_random_token", "rotate_head_mean")


def ifeval_options(name: str, gamma: float) -> dict | None:
    """OutRo options of an IFEval setting name: baseline, outro, relax, rotate, rotate_<direction>,
    outro_gamma_<g>."""
    if name == "baseline":
        return None
    if name == "outro":
        return dict(gamma=gamma)
    if name == "relax":
        return dict(gamma=gamma, rotate=False)
    if name == "rotate":
        return dict(gamma=gamma, relax=False)
    if name.startswith("rotate_"):
        return dict(gamma=gamma, relax=False, direction=name.removeprefix("rotate_"), seed=0)
    if name.startswith("outro_gamma_"):
        return dict(gamma=float(name.removeprefix("outro_gamma_")))
    raise SettingsError(f"unknown IFEval setting {name!r}; use relax, rotate, rotate_random_token, "
                        f"rotate_head_mean or outro_gamma_<g>")


def token_categories(tokenizer, input_ids: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """(B, T) int: SINK for ``sinks``, DELIMITER for special tokens and tokens with no letter or digit
    (punctuation, spaces, newlines: the usual secondary sinks), CONTENT otherwise. The text analog of the
    paper's modality groups in Table B.4."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = torch.full(input_ids.shape, CONTENT, dtype=torch.long)
    for b in range(input_ids.shape[0]):
        for t, token in enumerate(input_ids[b].tolist()):
            text = tokenizer.decode([token])
            if token in special or not any(ch.isalnum() for ch in text):
                out[b, t] = DELIMITER
    out[sinks.cpu()] = SINK
    return out


# ---- measurements on a model (no verdicts) -----------------------------------------------------------------

def attention_to_categories(model, batch: dict, categories: torch.Tensor, n_categories: int,
                            query_rows: torch.Tensor, outro_options: dict | None = None) -> torch.Tensor:
    """(L, B, C): attention mass that the ``query_rows`` (B, T) bool send to each key category, averaged over
    heads and those rows; ``categories`` (B, T) int in [0, C). With ``outro_options`` OutRo is active."""
    device = batch["input_ids"].device
    one_hot = torch.nn.functional.one_hot(categories.long(), n_categories).float().to(device)   # (B, T, C)
    rows = query_rows.float().to(device)

    def reduce(pattern, layer):
        mass = torch.einsum("bhts,bsc->btc", pattern.float(), one_hot) / pattern.shape[1]   # mean over heads
        return (mass * rows[..., None]).sum(1) / rows.sum(1, keepdim=True).clamp_min(1)

    context = OutRo(model, **outro_options) if outro_options is not None else contextlib.nullcontext()
    with torch.no_grad(), context, capture(model, points=("pattern",), reducers={"pattern": reduce}) as cap:
        model(**batch)
    return cap.stacked("pattern").cpu()


def head_alignment(model, batch: dict, sinks_by_layer: dict) -> dict:
    """Per layer with sinks: sink score and cos(head output, v_bar) of every head at every non-sink row.

    Returns {layer: {"sink_score": (B, H, T), "cosine": (B, H, T), "rows": (B, T) bool}} where sink_score is
    the attention mass a row puts on the layer's (cumulative) sink positions and v_bar the mean sink value
    of the row's KV head; rows are the real, non-sink positions."""
    padding = batch.get("attention_mask")
    layers = [l for l, s in sorted(sinks_by_layer.items()) if s.any()]
    if not layers:
        return {}
    with torch.no_grad(), capture(model, points=("pattern", "v", "z"), layers=layers) as cap:
        model(**batch)
    out = {}
    for layer in layers:
        sinks = sinks_by_layer[layer]
        pattern, value, z = cap["pattern", layer], cap["v", layer].float(), cap["z", layer].float()
        groups = pattern.shape[1] // value.shape[1]
        score = (pattern * sinks[:, None, None, :].float()).sum(-1)                            # (B, H, T)
        weights = sinks.float() / sinks.float().sum(1, keepdim=True).clamp_min(1)
        v_bar = torch.einsum("bs,bhsd->bhd", weights, value).repeat_interleave(groups, dim=1)  # (B, H, d)
        cosine = torch.nn.functional.cosine_similarity(z.transpose(1, 2), v_bar[:, :, None], dim=-1)
        rows = ~sinks
        if padding is not None:
            rows &= padding.bool()
        out[layer] = {"sink_score": score.cpu(), "cosine": cosine.cpu(), "rows": rows.cpu()}
    return out


def alignment_points(per_layer: dict) -> tuple[list[float], pd.DataFrame]:
    """(Pearson r per layer over all (head, query) points, one row per (layer, head) with mean sink score and
    mean cosine over the non-sink rows)."""
    r_layers, points = [], []
    for layer, a in per_layer.items():
        rows_mask = a["rows"][:, None, :].expand_as(a["sink_score"])
        r_layers.append(pearson(a["sink_score"][rows_mask].numpy(), a["cosine"][rows_mask].numpy()))
        score = (a["sink_score"] * rows_mask).sum((0, 2)) / rows_mask.sum((0, 2))
        cosine = (a["cosine"] * rows_mask).sum((0, 2)) / rows_mask.sum((0, 2))
        points += [(layer, h, score[h].item(), cosine[h].item()) for h in range(len(score))]
    return r_layers, pd.DataFrame(points, columns=["layer", "head", "sink_score", "cosine"])


def window_losses(model, input_ids: torch.Tensor, options: dict | None = None, ablate: tuple | None = None,
                  skip_first: int = 1, chunk: int = 4) -> tuple[np.ndarray, bool]:
    """(mean next-token loss in nats of each window of ``input_ids`` (B, T), no padding; whether OutRo rotated
    anything). OutRo is active with ``options``; ``ablate=(layer, head)`` zeroes that head's output before
    o_proj. The first ``skip_first`` predicted tokens are left out (their context is only the sink).
    Sequences go through ``chunk`` at a time (Gemma's 262k-token vocabulary makes large logits).

    Mask relaxation is never scored this way: the relaxed sink row reads the whole sequence, so later positions
    would see the future through the sink."""
    if options is not None and options.get("relax", True):
        raise ValueError("a teacher-forced loss cannot score mask relaxation; pass relax=False")
    edits = {}
    if ablate is not None:
        layer, head = ablate

        def zero_head(z, _layer):
            z = z.clone()
            z[:, :, head] = 0
            return z
        edits[("z", layer)] = zero_head
    losses, rotated = [], False
    for start in range(0, input_ids.shape[0], chunk):
        ids = input_ids[start:start + chunk]
        active = OutRo(model, **options) if options is not None else None
        with torch.no_grad(), (active or contextlib.nullcontext()), intervene(model, edits):
            logits = model(input_ids=ids).logits[:, skip_first:-1]
        token_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                       ids[:, skip_first + 1:].flatten(), reduction="none")
        losses += token_loss.view(ids.shape[0], -1).double().mean(1).tolist()
        rotated |= bool(active is not None and active.state.direction)
        del logits
    return np.array(losses), rotated


def later_heldout_windows(tokenizer, n_windows: int, length: int) -> torch.Tensor:
    """The test windows of the rotation-strength claim: cut from the stretch of held-out text after the one the
    sweep windows come from, so the two sets never overlap."""
    return heldout_text_windows(tokenizer, n_windows, length, part=1)[0]


def benchmark_settings(model, gamma: float) -> dict:
    """The three settings Table 7 compares, as context factories for ``measures.decoding.benchmark_decoding``:
    plain SDPA, OutRo on SDPA (which yields the OutRo object, so rows report how many decode rows it rotated)
    and eager attention."""
    @contextlib.contextmanager
    def with_outro():
        with attention_implementation(model, "sdpa"), OutRo(model, gamma=gamma) as active:
            yield active
    return {"sdpa": lambda: attention_implementation(model, "sdpa"), "outro": with_outro,
            "eager": lambda: attention_implementation(model, "eager")}


class OutRoTextRuns:
    """The measurements of one run of the OutRo chapter on text models; ``s`` holds its settings (device,
    analysis_prompts, n_windows, window_length, gamma, gammas, max_new_tokens, batch_size)."""

    def __init__(self, s):
        self.settings = s
        self.records = calibration_prompts() + pool_prompts()
        self._loaded, self._batches, self._states = {}, {}, {}
        self._heads, self._windows, self._losses, self._generations = {}, {}, {}, {}
        self.windows_source = ""

    def loaded(self, spec: str):
        if spec not in self._loaded:
            self._loaded[spec] = load_model(spec, device=self.settings.device)
        return self._loaded[spec]

    def batch(self, spec: str) -> dict:
        if spec not in self._batches:
            lm = self.loaded(spec)
            prompts = [r["prompt"] for r in self.records[:self.settings.analysis_prompts]]
            self._batches[spec] = encode(lm.tokenizer, prompts, device=lm.device)  # chat template when it has one
        return self._batches[spec]

    def state(self, spec: str):
        """Phi_LLM sinks of the analysis prompts (OutRo's own detection, nothing changed)."""
        if spec not in self._states:
            self._states[spec] = detect_sinks(self.loaded(spec).model, self.batch(spec))
        return self._states[spec]

    def first_sink(self, spec: str) -> int | None:
        state = self.state(spec)
        return next((l for l in sorted(state.sinks) if state.sinks[l].any()), None)

    def windows(self, spec: str, part: str) -> torch.Tensor:
        """"sweep": the held-out windows of the ablation, sweep and controls; "test": later, disjoint windows."""
        if (spec, part) not in self._windows:
            s, lm = self.settings, self.loaded(spec)
            if part == "sweep":
                ids, self.windows_source = heldout_text_windows(lm.tokenizer, s.n_windows, s.window_length)
            else:
                ids = later_heldout_windows(lm.tokenizer, s.n_windows, s.window_length)
            self._windows[spec, part] = ids.to(lm.device)
        return self._windows[spec, part]

    def losses(self, spec: str, part: str, options: dict | None = None, ablate: tuple | None = None):
        key = (spec, part, tuple(sorted((options or {}).items())), ablate)
        if key not in self._losses:
            self._losses[key] = window_losses(self.loaded(spec).model, self.windows(spec, part), options, ablate)
        return self._losses[key]

    def generations(self, spec: str, name: str, n_prompts: int) -> dict:
        """Greedy responses under one IFEval setting, graded: {"passes", "summary", "responses", "seconds"}."""
        if (spec, name, n_prompts) not in self._generations:
            s, lm = self.settings, self.loaded(spec)
            records = self.records[:n_prompts]
            options = ifeval_options(name, s.gamma)
            start = time.perf_counter()
            responses = generate_responses(lm, records, s.max_new_tokens, batch_size=s.batch_size,
                                           context=(lambda: outro(lm.model, **options)) if options else None)
            grades = grade(records, responses)
            self._generations[spec, name, n_prompts] = {
                "passes": grades.prompt_passes, "summary": grades.summary(), "responses": responses,
                "seconds": time.perf_counter() - start}
        return self._generations[spec, name, n_prompts]

    def sink_facts(self, spec: str) -> dict:
        lm, batch, state = self.loaded(spec), self.batch(spec), self.state(spec)
        info = architecture_info(lm)
        L = info["layers"]
        mask = batch["attention_mask"]
        real = mask.sum(1).float().cpu()
        flagged = torch.stack([state.found[l] for l in range(L)]).float().cpu()          # (L, B, T)
        share_flagged = (flagged.sum(-1) / real).mean(1)
        share_cumulative = torch.stack([state.sinks[l] for l in range(L)]).float().cpu().sum(-1).div(real).mean(1)
        persistent = persistent_sinks(state.found).cpu()
        first_real = mask.float().argmax(1).cpu()
        has_sink = self.first_sink(spec) is not None
        # Without a Phi_LLM sink OutRo rotates nothing; a sink fixed at the last (always real) position still
        # exercises the rotation step, so the identity check tests something on every model.
        fixed = {} if has_sink else {"sink_positions": [batch["input_ids"].shape[1] - 1]}
        with torch.no_grad():
            plain = lm.model(**batch).logits
            with outro(lm.model, gamma=0.0, relax=False, **fixed) as o:
                same = lm.model(**batch).logits
        return {"layers": L, "heads": info["heads"], "kv_heads": info["kv_heads"],
                "share_flagged": share_flagged.tolist(), "share_cumulative": share_cumulative.tolist(),
                "first_sink": self.first_sink(spec),
                "persistent_is_first_real": bool(all(torch.nonzero(persistent[b]).flatten().tolist()
                                                     == [first_real[b].item()] for b in range(len(real)))),
                "relax_layers": default_layers(L)[1], "identical": bool(torch.equal(plain, same)),
                "rotation_ran": bool(o.state.direction), "check_sinks": "Phi_LLM" if has_sink else "fixed position"}

    def attention_by_category(self, spec: str) -> dict | None:
        first = self.first_sink(spec)
        if first is None:
            return None
        lm, batch, state = self.loaded(spec), self.batch(spec), self.state(spec)
        persistent = persistent_sinks(state.found).cpu()
        categories = token_categories(lm.tokenizer, batch["input_ids"].cpu(), persistent)
        queries = batch["attention_mask"].bool().cpu() & ~persistent
        base = attention_to_categories(lm.model, batch, categories, 3, queries)
        rotated = attention_to_categories(lm.model, batch, categories, 3, queries,
                                          outro_options=dict(gamma=self.settings.gamma, rotate=True, relax=False))
        counts = torch.stack([(categories == c).float().sum(1) for c in range(3)], 1)
        return {"base": base.numpy(), "rotated": rotated.numpy(), "counts": counts.numpy(), "first_sink": first}

    def head_points(self, spec: str) -> dict | None:
        if spec not in self._heads:
            per_layer = head_alignment(self.loaded(spec).model, self.batch(spec), self.state(spec).sinks)
            if per_layer:
                r_layers, heads = alignment_points(per_layer)
                self._heads[spec] = {"r_per_layer": r_layers, "heads": heads}
            else:
                self._heads[spec] = None
        return self._heads[spec]

    def sweep(self, spec: str) -> dict:
        s = self.settings
        sweep, rotated = {}, False
        for g in sorted(set(s.gammas) | {s.gamma}):
            sweep[g], acted = self.losses(spec, "sweep", dict(gamma=g, relax=False))
            rotated |= acted
        return {"baseline": self.losses(spec, "sweep")[0], "sweep": sweep, "rotated": rotated}

    def head_ablation(self, spec: str, n_heads: int) -> dict:
        """Sweep-window loss with each of the ``n_heads`` heads of highest sink score zeroed, against none zeroed;
        per-window losses too, so the chapter can pair the windows."""
        windows = [float(x) for x in self.losses(spec, "sweep")[0]]
        base = float(np.mean(windows))
        rows = []
        points = self.head_points(spec)
        if points is not None:
            top = points["heads"].sort_values("sink_score", ascending=False).head(n_heads)
            for h in top.itertuples():
                ablated = [float(x) for x in self.losses(spec, "sweep", ablate=(int(h.layer), int(h.head)))[0]]
                rows.append({"head": f"L{int(h.layer)}H{int(h.head)}", "sink_score": h.sink_score,
                             "delta": float(np.mean(ablated)) - base, "windows": ablated})
        return {"baseline_loss": base, "baseline_windows": windows, "rows": rows}

    def direction_losses(self, spec: str, gamma: float) -> dict:
        """Sweep-window losses rotating toward the sink value (from the sweep), a random token's value, the head mean."""
        sweep = self.sweep(spec)
        m = {"sink": sweep["sweep"][gamma], "rotated": sweep["rotated"]}
        for kind in ("random_token", "head_mean"):
            m[kind] = self.losses(spec, "sweep", dict(gamma=gamma, relax=False, direction=kind, seed=0))[0]
        return m

    def overhead(self) -> dict:
        """Per model: decode-latency ratios of OutRo and eager attention against plain SDPA, and OutRo's state."""
        s, measured = self.settings, {}
        prompt_tokens, new_tokens, repeats = s.bench
        for spec in s.models:
            lm = self.loaded(spec)
            ratios = overhead_ratios(benchmark_decoding(lm, benchmark_settings(lm.model, s.gamma), prompt_tokens,
                                                         new_tokens, repeats))
            with torch.no_grad(), outro(lm.model, gamma=s.gamma) as o:
                lm.model(**encode(lm.tokenizer, ["a short prompt to size the state"], device=lm.device))
            state_bytes = sum(t.numel() * t.element_size() for t in o.state.direction.values())
            measured[spec] = {"ratios": ratios, "state_kib": state_bytes / 1024}
        return measured
