"""Chapter: OutRo on small vision-language models -- the paper's claims tested where the paper makes them.

The OutRo paper (arXiv 2603.14337) studies attention sinks in omni and vision-language models and proposes OutRo
(rotation of non-sink head outputs toward the sink value, and a one-time relaxation of the causal mask for the
sink rows). The text chapter (``chapters.outro``) can only use text models. This one runs on the vision-language
models the adaptation chapter produces (``chapters.vl_adaptation``: SmolLM2-135M-Instruct and Gemma 3 270M with a
frozen digit encoder and an MLP projector, trained on the 8x8 digits) and answers held-out digit questions under
each intervention:

1. OutRo, rotation alone and relaxation alone against no intervention, gamma chosen on validation questions
   (Tables 4, 5, 6 and B.6; App. B.5, Fig. B.2);
2. where the attention freed by rotation goes, image against text tokens (Fig. 7, Table B.4);
3. pruning image tokens by the sink query's attention, against random and mean-query pruning (Fig. 9, Table 9);
4. sink identification: removing the sink dimensions at the Phi_LLM sink or at Phi_VLM tokens (Table A.2), and
   rotating toward Phi_VLM tokens instead (Table B.7);
5. Zero-K: attention to the sink and accuracy (Figs. 4-5, Table 3);
6. the geometry of sink keys and values (Fig. 3);
7. what mask relaxation does to the sink's representation, and to accuracy (Fig. 6, Table 4).

Formulas: the book's methods page (book/methods.md), sections on Phi_LLM, Phi_VLM, Zero-K, OutRo and paired tests.
Accuracy comparisons are exact McNemar tests over the same questions at level ``ALPHA``; a claim the paper states as
an improvement holds only when the test says "improves". Every claim is gated: Phi_LLM must find a sink, and the
vision run must answer the held-out questions above chance (the adaptation chapter's rule); otherwise it is "not
comparable" and says why. Measurements run one model per worker process; the finding functions below are pure.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch

from ..core.claims import Finding, Rule, check, claim, slug
from ..core.profiles import Profiles, Settings, SettingsError
from ..measures.stats import HURTS, IMPROVES, mcnemar_exact

CHAPTER = "outro_multimodal"
PAPER = "OutRo paper"

PROFILES = Profiles({
    # quick: CI; the adaptation chapter's 6-step run does not learn the digits, so every claim is gated off
    "quick": dict(models=["smollm2-135m-instruct"], seed=0, n_test=12, n_val=4, gammas=[1.0],
                  prune_keep=[0.5], analysis_items=4, batch_size=16, workers=1, adaptation={}),
    # default: the book; test questions = the adaptation chapter's 100 held-out questions, one model per core
    "default": dict(models=["smollm2-135m-instruct", "gemma3-270m"], seed=0, n_test=100, n_val=30,
                    gammas=[0.5, 1.0, 2.0, 3.0, 4.0], prune_keep=[0.5], analysis_items=24, batch_size=16,
                    workers=2, adaptation={}),
    "gpu": dict(models=["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"], seed=0, n_test=300, n_val=100,
                gammas=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0], prune_keep=[0.5, 0.75, 0.25], analysis_items=64,
                batch_size=32, workers=1, adaptation={}),
})

# ---- constants and rules, each written once --------------------------------------------------------------------

ALPHA = 0.05              # ours: level of every paired test (the paper reports means, some with standard deviations)
TAU = 20.0                # Phi_VLM threshold (OutRo paper, Eq. 5)
TOP_SHARE = 0.01          # Table B.7: "top 1%" of the tokens under Phi_VLM
VALIDATION_SEED = 778     # ours: validation questions (the test questions use the adaptation chapter's seed)
LITTLE_EFFECT_PT = 2.0    # ours: Table A.2's largest overall drop when Phi_VLM tokens lose D_sink is 1.73 pt
NEARLY_IDENTICAL = 0.99   # ours: "nearly identical" representations (Fig. 6) as a cosine
CACHE_TOLERANCE = 1e-4    # ours: float32 rounding between one pass and prefill + cached decoding, relative

IMPROVES_RULE = Rule(f"the exact McNemar test over questions at alpha = {ALPHA:g} says 'improves' (alpha ours)",
                     lambda outcome: outcome == IMPROVES)
HURTS_RULE = Rule(f"the exact McNemar test over questions at alpha = {ALPHA:g} says 'hurts' (alpha ours)",
                  lambda outcome: outcome == HURTS)
COLLAPSES = Rule.true(f"accuracy at or below the chance level of the question mix, and the exact McNemar test at "
                      f"alpha = {ALPHA:g} says 'hurts' (alpha ours)")
LITTLE_EFFECT = Rule.true(f"the exact McNemar test at alpha = {ALPHA:g} does not say 'hurts', and accuracy falls by "
                          f"at most {LITTLE_EFFECT_PT:g} points (alpha and the {LITTLE_EFFECT_PT:g} points ours)")
GAMMA_VARIES = Rule.true("the rotation strength chosen on the validation questions differs between the models")
LOWERS_SINK_ATTENTION = Rule.true("mean change of the attention to the sink over the layers compared < 0, and a "
                                  "fall at more than half of those layers")
LESS_ATTENDED_GAINS = Rule.true("the modality attended less per token before rotation gains more attention mass")
SMALLER_NORM = Rule.true("the sink's norm is below the median norm of the other tokens at more than half of the "
                         "(layer, KV head) pairs with a sink")
STRUCTURED = Rule.true("the sink key's largest coordinate holds a larger share of its squared norm than the "
                       "other keys' largest coordinate (median), at more than half of the (layer, KV head) pairs")
ALIGNED = Rule.true("queries have a higher mean cosine with the sink key than with the other keys they see, at "
                    "more than half of the (layer, head) pairs")
IDENTICAL_RULE = Rule.at_least(NEARLY_IDENTICAL, "lowest mean cosine over the layers after relaxation")
CACHE_RULE = Rule.at_most(CACHE_TOLERANCE, "max |logit difference| / max |logit|")

SINK, IMAGE, TEXT = 0, 1, 2
GROUPS = ("sink", "image", "text")
PRUNE_METHODS = ("sink_query", "random", "mean_query")


# ---- measurements on a model (no verdicts) ----------------------------------------------------------------------

def example_batches(examples: list, batch_size: int) -> list[list[int]]:
    """Indices of ``examples`` in batches of one task and digit count (short answers generate together, and
    prompts of one length need no padding); within a group, the original order."""
    order = sorted(range(len(examples)), key=lambda i: (examples[i].task, len(examples[i].digits), i))
    batches, current = [], []
    for i in order:
        if current and (len(current) == batch_size or
                        (examples[current[0]].task, len(examples[current[0]].digits))
                        != (examples[i].task, len(examples[i].digits))):
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def first_real(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each left-padded sequence's first real token."""
    return mask.long().argmax(1)


def sink_query_attention(call, sinks: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """(B, S): attention of the sink query rows over every valid key, with no causal mask (the sink comes first,
    so under the mask it would see only itself), averaged over heads and over the sink rows of each sequence.

    ``sinks`` (B, T) bool, ``key_valid`` (B, S) bool. Scores use the layer's own scaling and soft-capping."""
    out = torch.zeros(key_valid.shape, dtype=torch.float32, device=key_valid.device)
    key = call.key.float().repeat_interleave(call.groups, dim=1)                          # (B, H, S, d)
    for b in range(sinks.shape[0]):
        rows = torch.nonzero(sinks[b]).flatten()
        if not len(rows):
            continue
        scores = torch.matmul(call.query[b, :, rows].float(), key[b].transpose(-1, -2)) * call.scaling
        if call.softcap:
            scores = torch.tanh(scores / call.softcap) * call.softcap
        scores = scores.masked_fill(~key_valid[b][None, None], float("-inf"))
        out[b] = torch.softmax(scores, dim=-1).mean(dim=(0, 1))
    return out


def mean_query_attention(call, rows: torch.Tensor) -> torch.Tensor:
    """(B, S): the layer's own (causal) attention, averaged over heads and over the query ``rows`` (B, T) bool."""
    pattern = call.probabilities().mean(1)                                                # (B, T, S)
    weights = rows.float().to(pattern.device)
    return (pattern * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp_min(1)


def prune_image_tokens(scores: torch.Tensor, image_mask: torch.Tensor, keep: float) -> torch.Tensor:
    """(B, T) bool: the image positions to prune. Each sequence keeps max(1, round(keep * n)) of its n image
    tokens, those of highest score (ties: the earlier position)."""
    pruned = torch.zeros_like(image_mask, dtype=torch.bool)
    for b in range(image_mask.shape[0]):
        positions = torch.nonzero(image_mask[b]).flatten()
        if not len(positions):
            continue
        n_keep = max(1, round(keep * len(positions)))
        ranked = positions[torch.argsort(-scores[b, positions].float().cpu(), stable=True).to(positions.device)]
        pruned[b, ranked[n_keep:]] = True
    return pruned


def remove_dimensions_edits(n_layers: int, positions: torch.Tensor, dims) -> dict:
    """``intervene`` edits that zero the dimensions ``dims`` of the residual stream at ``positions`` (B, T) bool
    on every decoder layer's input (OutRo paper, Table A.2). Other tokens and dimensions are untouched; decode
    steps (a different length) are left alone: the prompt's keys and values in the cache already carry the edit."""
    dims = torch.as_tensor(sorted(dims), dtype=torch.long)

    def edit(hidden, layer):
        if hidden.shape[1] != positions.shape[1] or not positions.any():
            return hidden
        chosen = torch.zeros(hidden.shape, dtype=torch.bool, device=hidden.device)
        rows = positions.to(hidden.device)
        chosen[..., dims.to(hidden.device)] = True
        return hidden.masked_fill(chosen & rows[..., None], 0.0)
    return {("resid_pre", layer): edit for layer in range(n_layers)}


def vlm_top_detector(dims, share: float | None = None, tau: float = TAU):
    """An OutRo detector (Table B.7): per layer, among the tokens Phi_VLM flags (ratio >= tau on ``dims``), the
    one of highest ratio (``share`` None) or the top ``share`` of the sequence's real tokens (at least one)."""
    from ..measures.criteria import rms_ratio

    def detect(hidden, padding):
        ratio = rms_ratio(hidden, dims).to(hidden.device)
        valid = padding.bool().to(hidden.device) if padding is not None else torch.ones_like(ratio, dtype=torch.bool)
        flagged = (ratio >= tau) & valid
        out = torch.zeros_like(flagged)
        for b in range(len(out)):
            candidates = torch.nonzero(flagged[b]).flatten()
            if not len(candidates):
                continue
            k = 1 if share is None else max(1, math.ceil(share * int(valid[b].sum())))
            out[b, candidates[ratio[b, candidates].topk(min(k, len(candidates))).indices]] = True
        return out
    return detect


class _Measure:
    """Everything one model is measured on, in one process: the prepared batches, then each measurement."""

    def __init__(self, vlm, loaded, fmt, s):
        from ..core.arch import arch_for, decoder_layers, text_config
        from ..interventions.outro import default_layers
        from ..training.probes import held_out_vision_examples
        self.vlm, self.loaded, self.fmt, self.s = vlm, loaded, fmt, s
        self.llm, self.tok = vlm.llm, loaded.tokenizer
        cfg = text_config(self.llm)
        self.L, self.H = cfg.num_hidden_layers, cfg.num_attention_heads
        self.Hkv = getattr(cfg, "num_key_value_heads", None) or self.H
        self.relax_layers = default_layers(self.L)[1]
        self.o_proj = [decoder_layers(self.llm)[l].get_submodule(arch_for(self.llm).o_proj).weight.detach().float()
                       for l in range(self.L)]
        self.device = next(self.llm.parameters()).device
        self.stop = [self.tok.eos_token_id]
        if not fmt.chat:          # a plain-format answer ends with a line break (training.vlm.PromptFormat)
            self.stop.append(self.tok("\n", add_special_tokens=False)["input_ids"][-1])
        # the question kinds the run was trained on, so the test questions are the adaptation chapter's own
        tasks = tuple(getattr(s, "tasks", None) or ()) or None
        kinds = {} if tasks is None else {"tasks": tasks}
        self.test = self._prepare(held_out_vision_examples(s.n_test, **kinds))
        self.val = self._prepare(held_out_vision_examples(s.n_val, seed=VALIDATION_SEED, **kinds))
        self.analysis = self._prepare(held_out_vision_examples(s.n_test, **kinds)[:s.analysis_items])
        self.seconds: dict[str, float] = {}

    # -- batches --

    def _prepare(self, examples) -> dict:
        """Batches of ``examples`` with their embeddings, the Phi_LLM sinks of one plain prefill and the
        dimensions that hold a massive entry there (for D_sink)."""
        from ..core.hooks import capture
        from ..interventions.outro import OutRo
        from ..measures.criteria import massive_dimensions
        from ..training.vlm import IMAGE_MARKER, encode_examples
        from .outro import persistent_sinks
        batches = []
        for index in example_batches(examples, self.s.batch_size):
            chosen = [examples[i] for i in index]
            enc = encode_examples(chosen, self.tok, self.fmt, "vision", answers=False, padding_side="left")
            mask = enc["attention_mask"].to(self.device)
            massive = set()
            with torch.no_grad():
                embeds = self.vlm.embed(enc["input_ids"].to(self.device), enc["image_mask"].to(self.device),
                                        enc.get("images"))
                with OutRo(self.llm, rotate=False, relax=False) as detection, \
                        capture(self.llm, points=("resid_pre",),
                                reducers={"resid_pre": lambda h, l: massive.update(massive_dimensions(h, mask))}):
                    self.llm(inputs_embeds=embeds, attention_mask=mask)
            found = {l: f.cpu() for l, f in detection.state.found.items()}
            sinks = persistent_sinks(found)
            has = sinks.any(1)
            stand_in = torch.zeros_like(sinks)
            stand_in[torch.arange(len(index)), first_real(enc["attention_mask"])] = True
            # the longest answer, end marker included, plus two tokens: a longer response is wrong anyway
            answer_tokens = max(len(self.tok(self.fmt.answer_text(self.tok, e.question, IMAGE_MARKER, e.answer),
                                             add_special_tokens=False)["input_ids"]) for e in chosen)
            batches.append({"index": index, "examples": chosen, "embeds": embeds, "mask": mask,
                            "image_mask": enc["image_mask"], "found": found, "has_sink": has,
                            "sinks": torch.where(has[:, None], sinks, stand_in), "max_new": answer_tokens + 2,
                            "massive_dims": massive})
        return {"examples": examples, "batches": batches}

    def first_sink_layer(self) -> int | None:
        layers = [l for part in (self.test, self.val) for b in part["batches"] for l, f in b["found"].items() if f.any()]
        return min(layers) if layers else None

    def sink_position(self, batch) -> torch.Tensor:
        """(B,) the first persistent sink of each sequence (its first real token when Phi_LLM finds none)."""
        return batch["sinks"].float().argmax(1)

    # -- generation --

    def hits(self, part: dict, context=None, mask=None) -> list[int]:
        """Exact-match outcome per question of ``part`` under ``context(batch)`` (a context manager factory) and
        with the attention mask ``mask(batch)`` (pruning), greedy decoding as the adaptation chapter scores it."""
        from ..training.probes import answer_matches
        out = [0] * len(part["examples"])
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        for batch in part["batches"]:
            attention_mask = batch["mask"] if mask is None else mask(batch)
            with torch.no_grad(), (context(batch) if context else contextlib.nullcontext()):
                new = self.llm.generate(inputs_embeds=batch["embeds"], attention_mask=attention_mask,
                                        max_new_tokens=batch["max_new"], do_sample=False, eos_token_id=self.stop,
                                        pad_token_id=pad)
            texts = self.tok.batch_decode(new, skip_special_tokens=True)
            for i, example, text in zip(batch["index"], batch["examples"], texts):
                out[i] = int(answer_matches(text if self.fmt.chat else text.split("\n", 1)[0], example.answer))
        return out

    def outro(self, **options):
        from ..interventions.outro import OutRo
        return lambda batch: OutRo(self.llm, **options)

    def timed(self, name, fn):
        start = time.perf_counter()
        out = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    # -- the measurements --

    def run(self) -> dict:
        from ..training.probes import chance_level
        s = self.s
        baseline = self.timed("generation", lambda: self.hits(self.test))
        chance = float(np.mean([chance_level(e.task, len(e.digits)) for e in self.test["examples"]]))
        by_task = {}
        for e, h in zip(self.test["examples"], baseline):
            by_task.setdefault(e.task, []).append(h)
        sink_items = float(torch.cat([b["has_sink"] for b in self.test["batches"]]).float().mean())
        val = {"baseline": self.timed("generation", lambda: self.hits(self.val))}
        for g in s.gammas:
            val[f"{g:g}"] = self.timed("generation", lambda: self.hits(self.val, self.outro(gamma=g)))
        gamma = select_gamma({g: val[f"{g:g}"] for g in s.gammas})
        test = {"baseline": baseline}

        def gen(name, context=None, mask=None):
            test[name] = self.timed("generation", lambda: self.hits(self.test, context, mask))
        gen("outro", self.outro(gamma=gamma))
        gen("rotate", self.outro(gamma=gamma, relax=False))
        gen("relax", self.outro(gamma=gamma, rotate=False))
        prune = self.timed("pruning", self.pruning_scores)
        for keep in s.prune_keep:
            for method in PRUNE_METHODS:
                gen(f"prune_{method}_{keep:g}", mask=self.pruned_mask(prune, method, keep))
        vlm = self.timed("phi_vlm", self.vlm_tokens)
        dims = vlm["sink_dims"]
        # without any Phi_LLM sink the first real token stands in, so the code runs (its claims are gated off)
        gen("remove_llm_sink", self.removal(lambda b: b["sinks"] & (b["has_sink"][:, None] | (not vlm["any_sink"])),
                                            dims))
        gen("remove_vlm_random", self.removal(lambda b: b["vlm_random"], dims))
        gen("remove_vlm_others", self.removal(lambda b: b["vlm_others"], dims))
        gen("rotate_vlm_top1", self.outro(gamma=gamma, relax=False, detector=vlm_top_detector(dims)))
        if vlm["top_percent_is_top1"]:
            test["rotate_vlm_top_percent"] = test["rotate_vlm_top1"]
        else:
            gen("rotate_vlm_top_percent", self.outro(gamma=gamma, relax=False,
                                                     detector=vlm_top_detector(dims, TOP_SHARE)))
        gen("zero_k", self.zero_k)
        analysis = self.timed("analysis", lambda: self.analyses(gamma))
        return {"spec": None, "seed": s.seed, "layers": self.L, "heads": self.H, "kv_heads": self.Hkv,
                "relax_layers": self.relax_layers, "record": self.loaded.record(),
                "sink": {"has_sink": sink_items > 0, "items_with_sink": sink_items,
                         "first_layer": self.first_sink_layer(),
                         "is_first_real": bool(all(torch.equal(b["sinks"][b["has_sink"]].float().argmax(1),
                                                               first_real(b["mask"][b["has_sink"]]).cpu())
                                                   for b in self.test["batches"]))},
                "vision": {"per_item": baseline, "accuracy": float(np.mean(baseline)), "chance": chance,
                           "by_task": {t: float(np.mean(h)) for t, h in by_task.items()}, "n": len(baseline)},
                "gamma": gamma, "val": val, "test": test,
                "prune": {k: v for k, v in prune.items() if k != "scores"},
                "vlm_criterion": {k: v for k, v in vlm.items() if k != "any_sink"}, **analysis,
                "seconds": self.seconds}

    # pruning (Fig. 9 / Table 9)
    def pruning_layer(self) -> int:
        """The layer where OutRo relaxes the sink (the first relaxation layer at or after the first layer with a
        sink), as the paper prunes at the layer where OutRo applies its sink enhancement."""
        first = self.first_sink_layer()
        if first is None:
            return self.relax_layers[min(1, len(self.relax_layers) - 1)]
        later = [l for l in self.relax_layers if l >= first]
        return later[0] if later else first

    def pruning_scores(self) -> dict:
        from ..core.hooks import intervene
        layer = self.pruning_layer()
        scores = []
        for n, batch in enumerate(self.test["batches"]):
            grabbed = {}

            def grab(call):
                grabbed["call"] = call
            with torch.no_grad(), intervene(self.llm, {("attn", layer): grab}):
                self.llm(inputs_embeds=batch["embeds"], attention_mask=batch["mask"])
            call, mask = grabbed["call"], batch["mask"].bool()
            image = batch["image_mask"].to(self.device)
            last_image = torch.where(image, torch.arange(image.shape[1], device=self.device), -1).amax(1)
            after = (torch.arange(image.shape[1], device=self.device)[None] > last_image[:, None]) & mask
            random = torch.rand(image.shape, generator=torch.Generator().manual_seed(self.s.seed * 1000 + n))
            scores.append({"sink_query": sink_query_attention(call, batch["sinks"].to(self.device), mask).cpu(),
                           "mean_query": mean_query_attention(call, after).cpu(), "random": random})
        image_tokens = float(np.mean([int(b["image_mask"][i].sum()) for b in self.test["batches"]
                                      for i in range(len(b["index"]))]))
        return {"layer": layer, "keep": list(self.s.prune_keep), "image_tokens": image_tokens, "scores": scores}

    def pruned_mask(self, prune: dict, method: str, keep: float):
        by_batch = {id(b): n for n, b in enumerate(self.test["batches"])}

        def mask(batch):
            scores = prune["scores"][by_batch[id(batch)]][method]
            pruned = prune_image_tokens(scores, batch["image_mask"], keep).to(self.device)
            return batch["mask"] * (~pruned).long()
        return mask

    # sink identification (Table A.2, Table B.7)
    def vlm_tokens(self) -> dict:
        """D_sink (every dimension with a Phi_LLM-massive entry at some layer on the test prompts; a fallback of
        two when none is massive), Phi_VLM tokens per sequence (flagged at any layer, the Phi_LLM sink excluded),
        and a random one of them per sequence."""
        from ..core.hooks import capture
        from ..measures.criteria import rms_ratio, sink_dimensions
        dims, fallback = set().union(*(b["massive_dims"] for b in self.test["batches"])), None
        massive = bool(dims)
        if not massive:
            first = self.test["batches"][0]
            with torch.no_grad(), capture(self.llm, points=("resid_pre",)) as cap:
                self.llm(inputs_embeds=first["embeds"], attention_mask=first["mask"])
            fallback = sink_dimensions({l: cap["resid_pre", l].cpu() for l in cap.layers}, first["mask"].cpu())
        dims = sorted(dims) if massive else fallback
        counts, any_vlm, one_token = [], [], True
        generator = torch.Generator().manual_seed(self.s.seed)
        for batch in self.test["batches"]:
            mask = batch["mask"]
            union = torch.zeros(mask.shape, dtype=torch.bool)

            def reduce(hidden, layer):
                union.__ior__(((rms_ratio(hidden, dims) >= TAU) & mask.bool()).cpu())
            with torch.no_grad(), capture(self.llm, points=("resid_pre",), reducers={"resid_pre": reduce}):
                self.llm(inputs_embeds=batch["embeds"], attention_mask=mask)
            others = union & ~(batch["sinks"] & batch["has_sink"][:, None])
            random = torch.zeros_like(others)
            for b in range(len(others)):
                candidates = torch.nonzero(others[b]).flatten()
                if len(candidates):
                    random[b, candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
            batch["vlm_others"], batch["vlm_random"] = others, random
            counts += others.sum(1).tolist()
            any_vlm += union.any(1).tolist()
            one_token &= all(math.ceil(TOP_SHARE * int(n)) <= 1 for n in mask.sum(1))
        return {"sink_dims": [int(d) for d in dims], "massive": massive, "tau": TAU,
                "vlm_tokens_per_item": float(np.mean(counts)), "items_with_other_vlm_tokens":
                float(np.mean([c > 0 for c in counts])), "items_with_vlm_tokens": float(np.mean(any_vlm)),
                "top_percent_is_top1": bool(one_token), "any_sink": bool(any(b["has_sink"].any()
                                                                             for b in self.test["batches"]))}

    def removal(self, positions, dims):
        from ..core.hooks import intervene
        return lambda batch: intervene(self.llm, remove_dimensions_edits(self.L, positions(batch), dims))

    # Zero-K (Table 3)
    def zero_k(self, batch):
        from ..core.hooks import intervene
        from ..interventions.zero_k import zero_k_edits
        return intervene(self.llm, zero_k_edits(range(self.L), self.sink_position(batch).to(self.device), top=1))

    # forward-pass analyses on the first questions
    def analyses(self, gamma: float) -> dict:
        from ..core.hooks import capture, intervene
        from ..interventions.outro import OutRo
        from ..interventions.zero_k import zero_k_edits
        from ..measures.criteria import attention_to_key
        per = {"base": [], "rotated": [], "zero_k": [], "counts": [], "geometry": [], "relaxation": [],
               "check": None}
        for n, batch in enumerate(self.analysis["batches"]):
            mask, sinks = batch["mask"], batch["sinks"].to(self.device)
            position = self.sink_position(batch).to(self.device)
            image = batch["image_mask"].to(self.device) & ~sinks
            groups = torch.full(mask.shape, TEXT, device=self.device)
            groups[image], groups[sinks] = IMAGE, SINK
            one_hot = torch.nn.functional.one_hot(groups, 3).float() * mask[..., None]
            last_image = torch.where(image, torch.arange(mask.shape[1], device=self.device), -1).amax(1)
            rows = ((torch.arange(mask.shape[1], device=self.device)[None] > last_image[:, None])
                    & mask.bool() & ~sinks).float()
            inputs = {"inputs_embeds": batch["embeds"], "attention_mask": mask}

            def attention(store):
                def reduce(pattern, layer):
                    mass = torch.einsum("bts,bsc->btc", pattern.float().mean(1), one_hot)
                    store.setdefault("groups", {})[layer] = ((mass * rows[..., None]).sum(1)
                                                             / rows.sum(1, keepdim=True).clamp_min(1)).cpu()
                    store.setdefault("to_sink", {})[layer] = attention_to_key(pattern, mask, position).mean(1).cpu()
                return reduce
            base, rotated, zeroed = {}, {}, {}
            with torch.no_grad(), capture(self.llm, points=("pattern", "q", "k", "v", "resid_post"),
                                          reducers={"pattern": attention(base)}) as cap:
                self.llm(**inputs)
            with torch.no_grad(), OutRo(self.llm, gamma=gamma, relax=False), \
                    capture(self.llm, points=("pattern",), reducers={"pattern": attention(rotated)}):
                self.llm(**inputs)
            with torch.no_grad(), intervene(self.llm, zero_k_edits(range(self.L), position, top=1)), \
                    capture(self.llm, points=("pattern",), reducers={"pattern": attention(zeroed)}):
                self.llm(**inputs)
            with torch.no_grad(), OutRo(self.llm, gamma=gamma, rotate=False) as relaxed, \
                    capture(self.llm, points=("resid_post",)) as relaxed_cap:
                self.llm(**inputs)
            per["base"].append(base)
            per["rotated"].append(rotated)
            per["zero_k"].append(zeroed)
            per["counts"].append(torch.stack([(groups == g).logical_and(mask.bool()).sum(1) for g in range(3)], 1).cpu())
            per["geometry"].append(self.geometry(cap, batch, position))
            per["relaxation"].append(self.relaxation(cap, relaxed_cap, relaxed.state, position))
            if n == 0:
                per["check"] = self.cached_equals_full(batch, gamma)
        return summarise_analyses(per, self.L)

    def geometry(self, cap, batch, position) -> dict:
        """Per layer, question and KV head (keys, values) or head (queries): the sink against the other real
        tokens. Returns tensors (L, B, heads), the written sink values (L, B, D) and their cross-head cosine."""
        mask, position = batch["mask"].bool().cpu(), position.cpu()
        B, T = mask.shape
        rows, t = torch.arange(B), torch.arange(T)
        others = mask.clone()
        others[rows, position] = False
        visible = (t[None, :] <= t[:, None])[None] & others[:, None, :]                     # (B, T, S)
        query_rows = (others & (t[None] > position[:, None])).float()[:, None]               # (B, 1, T)
        groups = self.H // self.Hkv
        out = {k: [] for k in ("key_ratio", "value_ratio", "key_top_sink", "key_top_other", "cos_sink",
                               "cos_other", "value_heads_cos", "value_direction")}

        def median_of_others(x):                                                              # (B, Hkv, S)
            return torch.stack([x[b][:, others[b]].median(dim=-1).values for b in range(B)])
        for l in range(self.L):
            k, v, q = (cap[p, l].float().cpu() for p in ("k", "v", "q"))
            k_norm, v_norm = k.norm(dim=-1), v.norm(dim=-1)
            out["key_ratio"].append(k_norm[rows, :, position] / median_of_others(k_norm).clamp_min(1e-12))
            out["value_ratio"].append(v_norm[rows, :, position] / median_of_others(v_norm).clamp_min(1e-12))
            top = k.pow(2).amax(-1) / k.pow(2).sum(-1).clamp_min(1e-12)                     # (B, Hkv, S)
            out["key_top_sink"].append(top[rows, :, position])
            out["key_top_other"].append(median_of_others(top))
            cos = torch.matmul(torch.nn.functional.normalize(q, dim=-1),
                               torch.nn.functional.normalize(k, dim=-1).repeat_interleave(groups, 1).transpose(-1, -2))
            sink_cos = cos[rows, :, :, position]                                              # (B, H, T)
            other_cos = (cos * visible[:, None]).sum(-1) / visible[:, None].sum(-1).clamp_min(1)
            count = query_rows.sum(-1).clamp_min(1)
            out["cos_sink"].append((sink_cos * query_rows).sum(-1) / count)
            out["cos_other"].append((other_cos * query_rows).sum(-1) / count)
            # the sink value as each head writes it into the residual stream: W_O^h v_sink (D,)
            v_sink = v[rows, :, position].repeat_interleave(groups, dim=1)                    # (B, H, d)
            written = torch.einsum("dhe,bhe->bhd", self.o_proj[l].cpu().view(-1, self.H, v.shape[-1]), v_sink)
            unit = torch.nn.functional.normalize(written, dim=-1)
            pair = torch.matmul(unit, unit.transpose(-1, -2))                                 # (B, H, H)
            out["value_heads_cos"].append(pair[:, ~torch.eye(self.H, dtype=torch.bool)].mean(1))
            out["value_direction"].append(written.sum(1))
        return {k: torch.stack(v) for k, v in out.items()}

    def relaxation(self, plain_cap, relaxed_cap, state, position) -> dict:
        """Per layer: cosine and relative distance between the sink's residual stream with and without
        relaxation (the caller keeps the layers at or after the one where each sink was relaxed)."""
        position = position.cpu()
        rows = torch.arange(len(position))
        relaxed_at = torch.full((len(position),), -1)
        for layer in sorted(state.relaxed):
            for b, positions in enumerate(state.relaxed[layer]):
                if relaxed_at[b] < 0 and int(position[b]) in positions:
                    relaxed_at[b] = layer
        cos, dist = [], []
        for l in range(self.L):
            a = plain_cap["resid_post", l].float().cpu()[rows, position]
            r = relaxed_cap["resid_post", l].float().cpu()[rows, position]
            cos.append(torch.nn.functional.cosine_similarity(a, r, dim=-1).cpu())
            dist.append(((r - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)).cpu())
        return {"relaxed_at": relaxed_at, "cosine": torch.stack(cos), "distance": torch.stack(dist)}

    def cached_equals_full(self, batch, gamma: float, n_new: int = 4) -> dict:
        """Prefill + cached decoding under OutRo against one pass over prompt + answer under OutRo."""
        from ..interventions.outro import OutRo
        embeds, mask = batch["embeds"], batch["mask"]
        with torch.no_grad():
            with OutRo(self.llm, gamma=gamma) as active:
                out = self.llm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=n_new,
                                        min_new_tokens=n_new, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True, pad_token_id=self.stop[0])
            generated = out.sequences[:, -n_new:]
            full = torch.cat([embeds, self.llm.get_input_embeddings()(generated)], dim=1)
            full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
            with OutRo(self.llm, gamma=gamma, prompt_length=embeds.shape[1]):
                logits = self.llm(inputs_embeds=full, attention_mask=full_mask).logits[:, embeds.shape[1] - 1:-1]
        cached = torch.stack(out.logits, dim=1).float()
        return {"max_abs_diff": float((cached - logits.float()).abs().max()),
                "max_abs_logit": float(logits.abs().max()), "rotated_decode_rows": active.state.rotated_decode_rows}


def summarise_analyses(per: dict, n_layers: int) -> dict:
    """Per-batch analysis tensors to per-layer lists, means over the analysed questions."""
    def by_layer(stores, key):                                                                # (L, N, ...)
        return torch.stack([torch.cat([s[key][l] for s in stores]) for l in range(n_layers)])
    geometry = {k: torch.cat([g[k] for g in per["geometry"]], dim=1) for k in per["geometry"][0]}
    unit = torch.nn.functional.normalize(geometry.pop("value_direction"), dim=-1)             # (L, N, D)
    relaxed_at = torch.cat([r["relaxed_at"] for r in per["relaxation"]])
    after = (torch.arange(n_layers)[:, None] >= relaxed_at[None, :]) & (relaxed_at[None, :] >= 0)

    def mean_after(key):
        x = torch.cat([r[key] for r in per["relaxation"]], dim=1)                               # (L, N)
        return [float(x[l][after[l]].mean()) if after[l].any() else float("nan") for l in range(n_layers)]
    return {
        "attention": {"base": by_layer(per["base"], "groups").mean(1).tolist(),
                      "rotated": by_layer(per["rotated"], "groups").mean(1).tolist(),
                      "counts": torch.cat(per["counts"]).float().mean(0).tolist(),
                      "items": int(sum(len(c) for c in per["counts"]))},
        "zero_k": {"before": by_layer(per["base"], "to_sink").mean(1).tolist(),
                   "after": by_layer(per["zero_k"], "to_sink").mean(1).tolist()},
        "geometry": {**{k: v.mean(1).tolist() for k, v in geometry.items()},
                     "value_layers_cos": (unit[1:] * unit[:-1]).sum(-1).mean(1).tolist()},
        "relaxation": {"relaxed_at": relaxed_at.tolist(), "cosine": mean_after("cosine"),
                       "distance": mean_after("distance")},
        "check": per["check"],
    }


def select_gamma(accuracy: dict) -> float:
    """The rotation strength of highest validation accuracy (ties: the smaller gamma)."""
    return min(sorted(accuracy), key=lambda g: -float(np.mean(accuracy[g])))


def measure_model(job: dict) -> dict:
    """One adapted model, every measurement of the chapter (a worker process runs this)."""
    from ..training.vlm import load_vlm
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    vlm, loaded, fmt = load_vlm(job["directory"], device=job["device"])
    out = _Measure(vlm, loaded, fmt, SimpleNamespace(**job["settings"])).run()
    out.update({"spec": job["spec"], "directory": job["directory"], "chat": fmt.chat})
    out["seconds"]["total"] = time.perf_counter() - start
    return out


def measure_models(jobs: list[dict], workers: int) -> list[dict]:
    if workers <= 1 or len(jobs) <= 1:
        return [measure_model(job) for job in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(measure_model, [{**job, "threads": 1} for job in jobs]))


# ---- finding functions: measurements in, table / figures / claims out ------------------------------------------
# ``measured[spec]`` is what ``measure_model`` returned for the adapted ``spec``.

def _gate(spec: str, m: dict) -> tuple[bool, str]:
    """The precondition of every claim: a Phi_LLM sink, a vision run that learned the digits (the adaptation
    chapter's rule, on our test questions) and enough questions for the exact test to be able to decide."""
    from .outro import min_pairs_to_decide
    from .vl_adaptation import vision_learned
    if not m["sink"]["has_sink"]:
        return False, (f"Phi_LLM finds no sink in the adapted {spec} on these prompts, so OutRo has nothing to "
                       f"rotate toward and there is no sink to prune by, remove or zero")
    ok, text, _ = vision_learned({(spec, "vision", m.get("seed", 0)): {"vision": m["vision"]}}, spec)
    if not ok:
        return False, f"the adapted {spec} does not answer the held-out questions above chance ({text or 'no test'})"
    if m["vision"]["n"] < min_pairs_to_decide(ALPHA):
        return False, f"{m['vision']['n']} test questions; the exact McNemar test needs at least " \
                      f"{min_pairs_to_decide(ALPHA)} to reach alpha = {ALPHA:g}"
    return True, ""


def _both(first: tuple[bool, str], second: tuple[bool, str]) -> tuple[bool, str]:
    return first if not first[0] else second


def _paired(m: dict, first: str, second: str):
    """Exact McNemar of setting ``second`` against ``first`` on the test questions ('improves': second better)."""
    return mcnemar_exact(m["test"][first], m["test"][second], ALPHA)


def _describe(test) -> str:
    d = test.detail
    return (f"{d['rate_first']:.3f} -> {d['rate_second']:.3f} ({100 * test.effect:+.1f} pt; {d['only_first']} lost, "
            f"{d['only_second']} gained, p = {test.p_value:.3g}; {test.n} questions)")


def _accuracy(m: dict, name: str) -> float:
    return float(np.mean(m["test"][name]))


def models_finding(measured: dict[str, dict], adaptation: dict[str, dict] | None = None) -> Finding:
    """The adapted models: sinks, baseline accuracy against chance (the gate of every claim), and the check that
    OutRo's cached decoding on image prompts equals one pass over prompt and answer. ``adaptation[spec]``: the
    adaptation chapter's evaluation of the same run ({"accuracy", "n"}), shown for comparison."""
    rows, claims, notes = {}, [], []
    for spec, m in measured.items():
        ok, why = _gate(spec, m)
        v, sink = m["vision"], m["sink"]
        rows[spec] = {"layers": m["layers"], "first layer with a Phi_LLM sink": sink["first_layer"]
                      if sink["first_layer"] is not None else "none",
                      "sink = first real token": sink["is_first_real"] if sink["has_sink"] else "-",
                      "test questions": v["n"], "accuracy": round(v["accuracy"], 3), "chance": round(v["chance"], 3),
                      "claims tested": ok}
        seen = (adaptation or {}).get(spec)
        also = (f" (the adaptation chapter's evaluation of this run: {seen['accuracy']:.3f} on {seen['n']} questions)"
                if seen else "")
        notes.append(f"{spec}: held-out accuracy {v['accuracy']:.3f} against chance {v['chance']:.3f}{also}; by task "
                     + ", ".join(f"{t} {a:.2f}" for t, a in v["by_task"].items()) + "."
                     + ("" if ok else f" Claims are not tested: {why}."))
        c = m["check"]
        relative = c["max_abs_diff"] / max(c["max_abs_logit"], 1e-12)
        claims.append(check(f"vlm_outro_cache_{slug(spec)}",
                            f"{spec}: prefill and cached decoding under OutRo on image prompts give the logits of one "
                            f"pass over prompt and answer ({c['rotated_decode_rows']} decode rows rotated)",
                            f"{relative:.2g}", CACHE_RULE, expected=f"<= {CACHE_TOLERANCE:g}", value=relative))
    return Finding("The adapted models", claims=claims, table=pd.DataFrame(rows).T if rows else None, notes=notes)


def rotation_strength_finding(measured: dict[str, dict]) -> Finding:
    """App. B.5 / Fig. B.2: validation accuracy of OutRo at each gamma; the gamma chosen per model."""
    import plotly.graph_objects as go
    table, notes, fig, usable = {}, [], go.Figure(), {}
    for spec, m in measured.items():
        gammas = sorted(float(g) for g in m["val"] if g != "baseline")
        accuracy = {g: float(np.mean(m["val"][f"{g:g}"])) for g in gammas}
        base = float(np.mean(m["val"]["baseline"]))
        table[spec] = {"no OutRo": base, **{f"gamma {g:g}": a for g, a in accuracy.items()}}
        fig.add_trace(go.Scatter(x=gammas, y=[a - base for a in accuracy.values()], mode="lines+markers", name=spec))
        flat = len(set(accuracy.values())) == 1
        notes.append(f"{spec}: gamma {m['gamma']:g} has the highest accuracy on {len(m['val']['baseline'])} validation "
                     f"questions ({accuracy.get(m['gamma'], float('nan')):.3f}, against {base:.3f} without OutRo)"
                     + ("; every gamma scores the same, so the choice is the smallest." if flat else "."))
        ok, _ = _gate(spec, m)
        if ok and not flat:
            usable[spec] = m["gamma"]
    fig.add_hline(y=0, line_dash="dot")
    fig.update_layout(height=340, title="Validation accuracy with OutRo against no OutRo, by rotation strength",
                      xaxis_title="gamma", yaxis_title="accuracy - no OutRo")
    claims = [claim("vlm_gamma_varies_across_models", "measured", f"{PAPER}, App. B.5, Fig. B.2",
                    "the best rotation strength differs between models",
                    "3.0 (Qwen2.5-Omni), 0.5 (Qwen3-VL, video-SALMONN2+), 1.5 (VideoLLaMA3)",
                    ", ".join(f"{spec}: {m['gamma']:g}" for spec, m in measured.items()), GAMMA_VARIES,
                    value=len(set(usable.values())) > 1,
                    precondition=(len(usable) >= 2, "needs two models whose claims are tested and whose validation "
                                                    "accuracy depends on gamma"))]
    return Finding("Rotation strength on validation questions", claims=claims,
                   table=pd.DataFrame(table) if table else None, figures=[fig], notes=notes)


def accuracy_finding(measured: dict[str, dict]) -> Finding:
    """Tables 5, 6 and B.6: test accuracy without intervention, with OutRo, and with rotation alone (relaxation
    alone is claimed with the relaxation analysis), at the gamma chosen on validation questions."""
    table, claims, notes = {}, [], []
    names = {"baseline": "no intervention", "outro": "OutRo", "rotate": "rotation alone", "relax": "relaxation alone"}
    for spec, m in measured.items():
        gate = _gate(spec, m)
        table[spec] = {label: _accuracy(m, name) for name, label in names.items()}
        tests = {name: _paired(m, "baseline", name) for name in ("outro", "rotate", "relax")}
        notes.append(f"{spec}, gamma {m['gamma']:g}: OutRo {_describe(tests['outro'])}; rotation alone "
                     f"{_describe(tests['rotate'])}; relaxation alone {_describe(tests['relax'])}.")
        claims.append(claim(f"vlm_outro_accuracy_{slug(spec)}", "measured", f"{PAPER}, Tables 6 and B.6",
                            f"OutRo (rotation and relaxation) improves accuracy on held-out visual questions: {spec}",
                            "+0.11 to +1.47 pt on 8 of 9 VLM benchmarks, one -0.15 (Table B.6)",
                            _describe(tests["outro"]), IMPROVES_RULE, value=tests["outro"].outcome, precondition=gate))
        claims.append(claim(f"vlm_rotation_accuracy_{slug(spec)}", "measured", f"{PAPER}, Table 5 and Table B.7",
                            f"rotation alone improves accuracy on held-out visual questions: {spec}",
                            "consistent gains; +0.39 to +0.88 pt on Qwen2.5-Omni 3B (Table B.7)",
                            _describe(tests["rotate"]), IMPROVES_RULE, value=tests["rotate"].outcome,
                            precondition=gate))
    return Finding("OutRo on the test questions", claims=claims, table=pd.DataFrame(table) if table else None,
                   notes=notes)


def _after_first_sink(m: dict) -> list[int]:
    first = m["sink"]["first_layer"]
    return [] if first is None else list(range(first + 1, m["layers"]))


def redistribution_finding(measured: dict[str, dict]) -> Finding:
    """Fig. 7 / Table B.4: attention of the question's rows to the sink, the image and the text tokens, per layer,
    with and without rotation (the layers after the first one with a sink)."""
    from plotly.subplots import make_subplots
    rows, claims, notes = {}, [], []
    specs = list(measured)
    fig = make_subplots(rows=1, cols=max(1, len(specs)), subplot_titles=specs)
    for i, (spec, m) in enumerate(measured.items(), start=1):
        layers = _after_first_sink(m)
        gate = _both(_gate(spec, m), (bool(layers), "no layer follows the first layer with a sink"))
        base, rotated = np.asarray(m["attention"]["base"]), np.asarray(m["attention"]["rotated"])
        counts = np.maximum(np.asarray(m["attention"]["counts"]), 1e-12)
        fig.add_scatter(y=base[:, SINK], name="no rotation", line=dict(color="#4c78a8"), showlegend=i == 1,
                        row=1, col=i)
        fig.add_scatter(y=rotated[:, SINK], name=f"rotation (gamma {m['gamma']:g})", line=dict(color="#e45756"),
                        showlegend=i == 1, row=1, col=i)
        fell, less, gained, delta, share_down = False, "-", "-", np.full(3, np.nan), float("nan")
        if layers:
            per_token = (base[layers] / counts).mean(0)
            delta = (rotated[layers] - base[layers]).mean(0)
            share_down = float((rotated[layers, SINK] < base[layers, SINK]).mean())
            fell = bool(delta[SINK] < 0 and share_down > 0.5)
            less = GROUPS[IMAGE] if per_token[IMAGE] < per_token[TEXT] else GROUPS[TEXT]
            gained = GROUPS[IMAGE] if delta[IMAGE] > delta[TEXT] else GROUPS[TEXT]
            rows[spec] = {"attention to an image token": per_token[IMAGE], "attention to a text token": per_token[TEXT],
                          "change: sink": delta[SINK], "change: image": delta[IMAGE], "change: text": delta[TEXT]}
            notes.append(f"{spec}, layers {layers[0]}..{layers[-1]}: rotation changes the attention to the sink by "
                         f"{delta[SINK]:+.4f} (lower at {share_down:.0%} of the layers); per token the {less} tokens got "
                         f"less attention before, and the larger gain goes to the {gained} tokens.")
        claims.append(claim(f"vlm_rotation_lowers_sink_attention_{slug(spec)}", "measured", f"{PAPER}, Fig. 7, Table B.4",
                            f"rotation lowers the attention paid to the sink: {spec}", "-0.0095 to -0.0234 (Table B.4)",
                            round(float(delta[SINK]), 5), LOWERS_SINK_ATTENTION, value=fell, precondition=gate))
        claims.append(claim(f"vlm_freed_attention_to_less_attended_{slug(spec)}", "measured", f"{PAPER}, Table B.4",
                            f"the freed attention goes mostly to the modality attended less per token (image or "
                            f"text): {spec}", "video +0.0127 vs audio +0.0022 when video got less per token "
                                              "(Qwen2.5-Omni); audio gains more in VideoLLaMA2",
                            f"less attended: {less}; change image {delta[IMAGE]:+.4f}, text {delta[TEXT]:+.4f}",
                            LESS_ATTENDED_GAINS, value=less == gained, precondition=gate))
    fig.update_yaxes(title_text="attention to the sink", row=1, col=1)
    fig.update_layout(height=340, title="Attention of the question's rows to the sink, per layer (Fig. 7)")
    return Finding("Where the freed attention goes", claims=claims, table=pd.DataFrame(rows).T if rows else None,
                   figures=[fig], notes=notes)


def pruning_finding(measured: dict[str, dict]) -> Finding:
    """Fig. 9 / Table 9: keep a share of the image tokens, chosen by the sink query's attention at the layer where
    OutRo relaxes the sink, by a random draw, or by the mean attention of the question's rows."""
    import plotly.graph_objects as go
    table, claims, notes, fig = {}, [], [], go.Figure()
    for spec, m in measured.items():
        keeps = m["prune"]["keep"]
        key = lambda method, keep: f"prune_{method}_{keep:g}"
        table[spec] = {"all image tokens": _accuracy(m, "baseline"),
                       **{f"{method}, keep {keep:g}": _accuracy(m, key(method, keep))
                          for keep in keeps for method in PRUNE_METHODS}}
        for method in PRUNE_METHODS:
            fig.add_scatter(x=[1.0, *keeps], y=[_accuracy(m, "baseline")] + [_accuracy(m, key(method, k)) for k in keeps],
                            mode="lines+markers", name=f"{spec}: {method.replace('_', ' ')}")
        keep = keeps[0]
        gate = _gate(spec, m)
        sink = _paired(m, "baseline", key("sink_query", keep))
        random = _paired(m, "baseline", key("random", keep))
        versus = _paired(m, key("mean_query", keep), key("sink_query", keep))
        notes.append(f"{spec}: scores at layer {m['prune']['layer']} (the sink's relaxation layer), "
                     f"{m['prune']['image_tokens']:.1f} image tokens per question; keeping {keep:g} of them by the sink "
                     f"query {_describe(sink)}; at random {_describe(random)}.")
        source = f"{PAPER}, Sec. 5.3, Fig. 9, Table 9"
        claims.append(claim(f"vlm_sink_query_pruning_{slug(spec)}", "measured", source,
                            f"pruning image tokens by the sink query's attention improves accuracy (keep {keep:g}): "
                            f"{spec}", "improves at the relaxation layer (AVHBench)", _describe(sink), IMPROVES_RULE,
                            value=sink.outcome, precondition=gate))
        claims.append(claim(f"vlm_random_pruning_hurts_{slug(spec)}", "measured", source,
                            f"pruning image tokens at random lowers accuracy (keep {keep:g}): {spec}",
                            "random pruning degrades performance", _describe(random), HURTS_RULE,
                            value=random.outcome, precondition=gate))
        claims.append(claim(f"vlm_sink_query_beats_mean_query_{slug(spec)}", "measured",
                            "ours (a control for the paper's Sec. 5.3)",
                            f"the sink query picks better image tokens than the question's mean attention (keep "
                            f"{keep:g}): {spec}", "not tested in the paper", _describe(versus), IMPROVES_RULE,
                            value=versus.outcome, precondition=gate, origin="ours"))
    fig.update_layout(height=340, title="Accuracy against the share of image tokens kept",
                      xaxis_title="share of image tokens kept", yaxis_title="accuracy")
    return Finding("Pruning image tokens by the sink query", claims=claims,
                   table=pd.DataFrame(table) if table else None, figures=[fig], notes=notes)


def identification_finding(measured: dict[str, dict]) -> Finding:
    """Table A.2 (D_sink removed at the Phi_LLM sink, at one random Phi_VLM token, at every other Phi_VLM token)
    and Table B.7 (rotation alone toward the Phi_LLM sinks against the top 1 / top 1% Phi_VLM tokens)."""
    names = {"baseline": "no intervention", "remove_llm_sink": "D_sink removed: Phi_LLM sink",
             "remove_vlm_random": "D_sink removed: one Phi_VLM token", "remove_vlm_others":
             "D_sink removed: all other Phi_VLM tokens", "rotate": "rotation toward Phi_LLM sinks",
             "rotate_vlm_top1": "rotation toward Phi_VLM top 1", "rotate_vlm_top_percent":
             "rotation toward Phi_VLM top 1%"}
    table, claims, notes = {}, [], []
    for spec, m in measured.items():
        vlm, gate = m["vlm_criterion"], _gate(spec, m)
        massive = (vlm["massive"], "no dimension holds a massive entry, so D_sink is only a fallback of the "
                                   "two most outlying dimensions")
        others = (vlm["items_with_other_vlm_tokens"] > 0, f"Phi_VLM (tau {vlm['tau']:g}) flags no token besides the "
                                                          f"Phi_LLM sink")
        flagged = (vlm["items_with_vlm_tokens"] > 0, f"Phi_VLM (tau {vlm['tau']:g}) flags no token")
        table[spec] = {label: _accuracy(m, name) for name, label in names.items()}
        notes.append(f"{spec}: D_sink = {vlm['sink_dims']}{'' if vlm['massive'] else ' (fallback)'}; Phi_VLM flags "
                     f"{vlm['vlm_tokens_per_item']:.1f} tokens per question besides the Phi_LLM sink (at any layer).")
        removed = _paired(m, "baseline", "remove_llm_sink")
        acc, chance = _accuracy(m, "remove_llm_sink"), m["vision"]["chance"]
        claims.append(claim(f"vlm_remove_llm_sink_collapses_{slug(spec)}", "measured", f"{PAPER}, App. A.2, Table A.2",
                            f"removing the sink dimensions at the Phi_LLM sink collapses accuracy: {spec}",
                            "71.60 -> 0.00 (AVHBench)", f"{_describe(removed)}; chance {chance:.3f}", COLLAPSES,
                            value=acc <= chance and removed.outcome == HURTS, precondition=_both(gate, massive)))
        for name, what, paper in (("remove_vlm_random", "one random Phi_VLM token", "71.60 -> 69.87"),
                                  ("remove_vlm_others", "every Phi_VLM token but the Phi_LLM sink", "71.60 -> 71.06")):
            test = _paired(m, "baseline", name)
            claims.append(claim(f"vlm_{name}_little_effect_{slug(spec)}", "measured", f"{PAPER}, App. A.2, Table A.2",
                                f"removing the sink dimensions at {what} barely changes accuracy: {spec}",
                                f"{paper} (AVHBench)", _describe(test), LITTLE_EFFECT,
                                value=test.outcome != HURTS and 100 * test.effect >= -LITTLE_EFFECT_PT,
                                precondition=_both(_both(gate, massive), others)))
        top1 = _paired(m, "rotate_vlm_top1", "rotate")
        claims.append(claim(f"vlm_rotation_llm_beats_vlm_top1_{slug(spec)}", "measured", f"{PAPER}, App. B.6, Table B.7",
                            f"rotation toward the Phi_LLM sinks beats rotation toward the top Phi_VLM token: {spec}",
                            "better in 8 of 8 settings, e.g. AVHBench 64.78 vs 61.90 (Qwen2.5-Omni 3B)",
                            _describe(top1), IMPROVES_RULE, value=top1.outcome,
                            precondition=_both(_both(gate, massive), flagged)))
        percent = _paired(m, "rotate_vlm_top_percent", "rotate")
        same = (not vlm["top_percent_is_top1"], "every prompt has at most 100 tokens, so its top 1% is one token: the "
                                                "same setting as the top Phi_VLM token, claimed above")
        claims.append(claim(f"vlm_rotation_llm_beats_vlm_top_percent_{slug(spec)}", "measured",
                            f"{PAPER}, App. B.6, Table B.7",
                            f"rotation toward the Phi_LLM sinks beats rotation toward the top 1% of Phi_VLM tokens: "
                            f"{spec}", "better in 8 of 8 settings, e.g. AVHBench 64.78 vs 60.97 (Qwen2.5-Omni 3B)",
                            _describe(percent), IMPROVES_RULE, value=percent.outcome,
                            precondition=_both(_both(_both(gate, massive), flagged), same)))
    return Finding("Which tokens are the sink", claims=claims, table=pd.DataFrame(table) if table else None,
                   notes=notes)


def zero_k_finding(measured: dict[str, dict]) -> Finding:
    """Figs. 4-5 and Table 3: the top-1 dimension of the sink key zeroed at every layer and head."""
    from plotly.subplots import make_subplots
    specs = list(measured)
    fig = make_subplots(rows=1, cols=max(1, len(specs)), subplot_titles=specs)
    rows, claims, notes = {}, [], []
    for i, (spec, m) in enumerate(measured.items(), start=1):
        before, after = np.asarray(m["zero_k"]["before"]), np.asarray(m["zero_k"]["after"])
        fig.add_scatter(y=before, name="baseline", line=dict(color="#4c78a8"), showlegend=i == 1, row=1, col=i)
        fig.add_scatter(y=after, name="Zero-K top 1", line=dict(color="#e45756"), showlegend=i == 1, row=1, col=i)
        change, share_down = float((after - before).mean()), float((after < before).mean())
        test, gate = _paired(m, "baseline", "zero_k"), _gate(spec, m)
        rows[spec] = {"attention to the sink": float(before.mean()), "with Zero-K": float(after.mean()),
                      "layers where it falls": share_down, "accuracy": _accuracy(m, "baseline"),
                      "accuracy with Zero-K": _accuracy(m, "zero_k")}
        notes.append(f"{spec}: Zero-K changes the mean attention to the sink by {change:+.4f} over all layers (lower at "
                     f"{share_down:.0%} of them); accuracy {_describe(test)}.")
        claims.append(claim(f"vlm_zero_k_lowers_sink_attention_{slug(spec)}", "measured", f"{PAPER}, Sec. 3 (Q3), Figs. 4-5",
                            f"zeroing the sink key's top dimension lowers the attention to the sink across layers: {spec}",
                            "substantially lower at every layer", round(change, 5), LOWERS_SINK_ATTENTION,
                            value=change < 0 and share_down > 0.5, precondition=gate))
        claims.append(claim(f"vlm_zero_k_accuracy_{slug(spec)}", "measured", f"{PAPER}, Sec. 3 (Q3), Table 3",
                            f"zeroing the sink key's top dimension lowers accuracy: {spec}",
                            "consistent degradation (Table 3)", _describe(test), HURTS_RULE, value=test.outcome,
                            precondition=gate))
    fig.update_yaxes(title_text="attention to the sink", row=1, col=1)
    fig.update_layout(height=340, title="Mean attention to the sink key, per layer (Fig. 4)")
    return Finding("Zero-K", claims=claims, table=pd.DataFrame(rows).T if rows else None, figures=[fig], notes=notes)


def geometry_finding(measured: dict[str, dict]) -> Finding:
    """Fig. 3: sink key and value norms against the other tokens', the sink key's top coordinate, the cosine of
    queries with the sink key, and (ours) how aligned the sink value is across heads and layers once written into
    the residual stream, at the layers with a sink."""
    from plotly.subplots import make_subplots
    specs = list(measured)
    fig = make_subplots(rows=1, cols=max(1, len(specs)), subplot_titles=specs)
    table, claims, notes = {}, [], []
    for i, (spec, m) in enumerate(measured.items(), start=1):
        g = {k: np.asarray(v) for k, v in m["geometry"].items()}
        first = m["sink"]["first_layer"]
        layers = list(range(first, m["layers"])) if first is not None else []
        gate = _both(_gate(spec, m), (bool(layers), "no layer has a sink"))
        fig.add_scatter(y=np.median(g["key_ratio"], 1), name="key", line=dict(color="#4c78a8"), showlegend=i == 1,
                        row=1, col=i)
        fig.add_scatter(y=np.median(g["value_ratio"], 1), name="value", line=dict(color="#e45756"), showlegend=i == 1,
                        row=1, col=i)
        pick = (lambda x: x[layers]) if layers else (lambda x: x)
        key, value = pick(g["key_ratio"]), pick(g["value_ratio"])
        top_sink, top_other = pick(g["key_top_sink"]), pick(g["key_top_other"])
        cos_sink, cos_other = pick(g["cos_sink"]), pick(g["cos_other"])
        shares = {"key": float((key < 1).mean()), "value": float((value < 1).mean()),
                  "top": float((top_sink > top_other).mean()), "cos": float((cos_sink > cos_other).mean())}
        heads_cos = float(pick(g["value_heads_cos"]).mean())
        layer_pairs = [l - 1 for l in layers if l >= 1] if layers else list(range(len(g["value_layers_cos"])))
        layers_cos = float(np.mean([g["value_layers_cos"][p] for p in layer_pairs])) if layer_pairs else float("nan")
        table[spec] = {"sink key norm / others' median": float(np.median(key)),
                       "sink value norm / others' median": float(np.median(value)),
                       "top-coordinate share, sink key": float(np.median(top_sink)),
                       "top-coordinate share, other keys": float(np.median(top_other)),
                       "cos(query, sink key)": float(cos_sink.mean()), "cos(query, other keys)": float(cos_other.mean()),
                       "sink value across heads (cos)": heads_cos, "sink value across layers (cos)": layers_cos}
        notes.append(f"{spec}, layers {layers[0] if layers else 0}..{m['layers'] - 1}: the sink key is shorter than the "
                     f"median other key at {shares['key']:.0%} of the (layer, KV head) pairs and the sink value at "
                     f"{shares['value']:.0%}; written into the residual stream (W_O v), the sink values of different "
                     f"heads have mean cosine {heads_cos:.2f} and those of consecutive layers {layers_cos:.2f} (ours, "
                     f"no claim).")
        source = f"{PAPER}, Sec. 3 (Q3), Fig. 3"
        for what, name, rule, statement, paper in (
                ("key", "vlm_sink_key_norm_smaller", SMALLER_NORM, "sink keys have smaller norms than other keys",
                 "smaller (Fig. 3a)"),
                ("value", "vlm_sink_value_norm_smaller", SMALLER_NORM, "sink values have smaller norms than other values",
                 "smaller (Fig. 3a)"),
                ("top", "vlm_sink_key_structured", STRUCTURED, "the sink key is structured, not uniformly small: a "
                 "few coordinates carry it", "structured (Fig. 3b)"),
                ("cos", "vlm_sink_key_aligned", ALIGNED, "queries are aligned with the sink key", "high cosine "
                 "(Figs. 3c, 3d)")):
            claims.append(claim(f"{name}_{slug(spec)}", "measured", source, f"{statement}: {spec}", paper,
                                f"{shares[what]:.0%} of the pairs", rule, value=shares[what] > 0.5, precondition=gate))
    fig.add_hline(y=1, line_dash="dot")
    fig.update_yaxes(title_text="sink norm / others' median", type="log", row=1, col=1)
    fig.update_layout(height=340, title="Sink key and value norms against the other tokens', median over heads (Fig. 3a)")
    frame = pd.DataFrame(table) if table else None
    return Finding("The sink's keys and values", claims=claims, table=frame, figures=[fig], notes=notes)


def relaxation_finding(measured: dict[str, dict]) -> Finding:
    """Fig. 6 and Table 4: how far relaxation moves the sink's residual stream, and accuracy with relaxation alone."""
    import plotly.graph_objects as go
    table, claims, notes, fig = {}, [], [], go.Figure()
    for spec, m in measured.items():
        r = m["relaxation"]
        cosine = np.asarray(r["cosine"], dtype=float)
        measured_layers = np.isfinite(cosine)
        relaxed = [x for x in r["relaxed_at"] if x >= 0]
        gate = _both(_gate(spec, m), (bool(measured_layers.any()), "no sink was relaxed"))
        lowest = float(cosine[measured_layers].min()) if measured_layers.any() else float("nan")
        farthest = float(np.nanmax(np.asarray(r["distance"], dtype=float))) if measured_layers.any() else float("nan")
        fig.add_scatter(y=cosine, mode="lines+markers", name=spec)
        test = _paired(m, "baseline", "relax")
        table[spec] = {"relaxed at layer": min(relaxed) if relaxed else "-", "lowest cosine": lowest,
                       "largest relative distance": farthest, "accuracy": _accuracy(m, "baseline"),
                       "accuracy, relaxation alone": _accuracy(m, "relax")}
        notes.append(f"{spec}: the relaxed sink's residual stream keeps a cosine of at least {lowest:.5f} with the "
                     f"original (relative distance at most {farthest:.3g}); accuracy with relaxation alone "
                     f"{_describe(test)}.")
        claims.append(claim(f"vlm_relaxed_sink_nearly_identical_{slug(spec)}", "measured",
                            f"{PAPER}, Sec. 3 (Q3), Fig. 6 (the cosine threshold is ours)",
                            f"with the causal mask relaxed, the sink's representation stays nearly identical: {spec}",
                            "nearly identical to the original", round(lowest, 5), IDENTICAL_RULE, precondition=gate))
        claims.append(claim(f"vlm_relaxation_accuracy_{slug(spec)}", "measured", f"{PAPER}, Sec. 3 (Q3), Table 4",
                            f"relaxation alone improves accuracy on held-out visual questions: {spec}",
                            "consistent gains (Table 4)", _describe(test), IMPROVES_RULE, value=test.outcome,
                            precondition=gate))
    fig.update_layout(height=320, title="Cosine of the sink's residual stream with and without relaxation",
                      xaxis_title="layer", yaxis_title="cosine")
    return Finding("Mask relaxation", claims=claims, table=pd.DataFrame(table).T if table else None, figures=[fig],
                   notes=notes)


# ---- the chapter ---------------------------------------------------------------------------------------------------

class OutRoMultimodal:
    """Obtains the adapted models through the adaptation chapter's jobs (cached), measures each model once (in worker
    processes), then returns one finding per notebook section; ``claims`` holds them all."""

    FINDINGS = ("models", "rotation_strength", "accuracy", "redistribution", "pruning", "identification", "zero_k",
                "geometry", "relaxation")

    def __init__(self, settings: Settings):
        from .vl_adaptation import PROFILES as VL
        s = self.settings = settings
        if not s.models:
            raise SettingsError("models is empty; give at least one model spec")
        if s.n_test < 1 or s.n_val < 1 or s.batch_size < 1 or s.workers < 1:
            raise SettingsError("n_test, n_val, batch_size and workers must be at least 1")
        if not 1 <= s.analysis_items <= s.n_test:
            raise SettingsError(f"analysis_items must lie in 1..n_test ({s.n_test})")
        if not s.gammas or any(g <= 0 for g in s.gammas):
            raise SettingsError(f"gammas must be rotation strengths > 0, got {s.gammas!r}")
        if not s.prune_keep or any(not 0 < k <= 1 for k in s.prune_keep):
            raise SettingsError(f"prune_keep must be shares in (0, 1], got {s.prune_keep!r}")
        self.vl = VL.resolve(s.profile, device=s.device, models=list(s.models), **s.adaptation).replace(seeds=[s.seed])
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}
        self._findings: dict[str, Finding] = {}
        self._measured: dict[str, dict] | None = None
        self.adaptation: dict[str, dict] = {}

    def jobs(self) -> list[dict]:
        """The adaptation chapter's vision runs of these models (seed ``seed``), as its own jobs."""
        from ..core.models import resolve_device
        from .vl_adaptation import adapt_configs, eval_spec, probe_spec
        device = resolve_device(self.settings.device)
        return [{"kind": "run", "config": cfg.record(), "eval": eval_spec(self.vl), "probe": probe_spec(self.vl),
                 "device": device} for cfg in adapt_configs(self.vl) if cfg.modality == "vision"]

    def measured(self) -> dict[str, dict]:
        if self._measured is None:
            import json

            from ..core.models import resolve_device
            from .vl_adaptation import run_jobs
            start = time.perf_counter()
            device = resolve_device(self.settings.device)
            jobs = self.jobs()
            paths = run_jobs(jobs, self.vl.workers if device == "cpu" else 1)
            runs = {}
            for job, path in zip(jobs, paths):
                doc = json.loads(Path(path).read_text())
                runs[job["config"]["model"]] = doc["directory"]
                if doc.get("vision"):
                    self.adaptation[job["config"]["model"]] = {"accuracy": doc["vision"]["accuracy"],
                                                               "n": len(doc["vision"]["per_item"])}
            self.timings["adaptation runs"] = time.perf_counter() - start
            start = time.perf_counter()
            settings = {k: v for k, v in self.settings.values.items() if k != "adaptation"}
            settings["tasks"] = list(self.vl.tasks)
            ours = [{"spec": spec, "directory": runs[spec], "device": device, "settings": settings}
                    for spec in self.settings.models]
            results = measure_models(ours, self.settings.workers if device == "cpu" else 1)
            self._measured = {job["spec"]: m for job, m in zip(ours, results)}
            self.timings["measurements"] = time.perf_counter() - start
        return self._measured

    def _once(self, name: str, build) -> Finding:
        if name not in self._findings:
            measured = self.measured()
            start = time.perf_counter()
            self._findings[name] = build(measured)
            self.timings[name] = time.perf_counter() - start
        return self._findings[name]

    def models(self) -> Finding:
        return self._once("models", lambda m: models_finding(m, self.adaptation))

    def rotation_strength(self) -> Finding:
        return self._once("rotation_strength", rotation_strength_finding)

    def accuracy(self) -> Finding:
        return self._once("accuracy", accuracy_finding)

    def redistribution(self) -> Finding:
        return self._once("redistribution", redistribution_finding)

    def pruning(self) -> Finding:
        return self._once("pruning", pruning_finding)

    def identification(self) -> Finding:
        return self._once("identification", identification_finding)

    def zero_k(self) -> Finding:
        return self._once("zero_k", zero_k_finding)

    def geometry(self) -> Finding:
        return self._once("geometry", geometry_finding)

    def relaxation(self) -> Finding:
        return self._once("relaxation", relaxation_finding)

    @property
    def claims(self) -> list:
        return [c for name in self.FINDINGS if name in self._findings for c in self._findings[name].claims]

    def results(self) -> dict:
        for name in self.FINDINGS:                    # a claim never goes missing because a cell was skipped
            getattr(self, name)()
        extra = {spec: {"directory": m["directory"], "gamma": m["gamma"], "sink": m["sink"],
                        "vision": {k: v for k, v in m["vision"].items() if k != "per_item"},
                        "accuracy": {name: float(np.mean(hits)) for name, hits in m["test"].items()},
                        "validation": {name: float(np.mean(hits)) for name, hits in m["val"].items()},
                        "outcomes": m["test"], "prune": m["prune"], "vlm_criterion": m["vlm_criterion"],
                        "attention": m["attention"], "zero_k": m["zero_k"], "relaxation": m["relaxation"],
                        "check": m["check"], "seconds": m["seconds"]}
                 for spec, m in self.measured().items()}
        return dict(chapter=CHAPTER, parameters=self.settings.as_dict(), claims=self.claims,
                    models=[m["record"] for m in self.measured().values()],
                    extra={"models": extra, "adaptation": self.adaptation,
                           "timings": {**self.timings, "total_s": time.perf_counter() - self.started}})


# ---- decoding overhead with image tokens in the prompt (scripts/bench_outro.py --vlm) -------------------------------

def benchmark_vlm_decoding(vlm, loaded, fmt, settings: dict, new_tokens: int = 32, repeats: int = 3,
                           batch_size: int = 1, digits: int = 4, seed: int = 0) -> list[dict]:
    """``measures.decoding.benchmark_decoding`` for an adapted vision-language model: the prompt is a held-out
    question about a row of ``digits`` digit images (4 image tokens each), given as ``inputs_embeds``; every
    setting (``{name: factory of a context manager}``, the first the reference) runs interleaved in each repeat.
    One row per (setting, repeat), with the decode-step latency per token, the prefill time and peak memory."""
    from ..measures.decoding import time_settings
    from ..training.digits import load_digit_splits, make_examples
    from ..training.vlm import encode_examples
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (the first token comes from the prefill)")
    _, held_out = load_digit_splits()
    examples = make_examples(held_out, batch_size, seed=seed, tasks=("row",), row_lengths=(digits,))
    device = str(next(vlm.llm.parameters()).device)
    batch = encode_examples(examples, loaded.tokenizer, fmt, "vision", answers=False, padding_side="left")
    with torch.no_grad():
        embeds = vlm.embed(batch["input_ids"].to(device), batch["image_mask"].to(device), batch["images"])
    mask = batch["attention_mask"].to(device)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else loaded.tokenizer.eos_token_id

    inputs = {"inputs_embeds": embeds, "attention_mask": mask}
    return time_settings(vlm.llm, inputs, settings, new_tokens, repeats, pad, device,
                         {"prompt_tokens": int(embeds.shape[1]), "image_tokens": int(batch["image_mask"].sum(1).max()),
                          "batch_size": batch_size})
