"""The multimodal OutRo measurements: every intervention and analysis on one adapted vision-language model.

One job per model and seed (``measure_model``): that seed's vision run of the adaptation chapter is loaded
(``training.vlm.load_vlm``),
its held-out digit questions are answered under no intervention, OutRo, rotation alone and relaxation alone (the
rotation strength chosen on validation questions), image-token pruning by three scores, removing the sink
dimensions at the Phi_LLM sink or at Phi_VLM tokens, rotating toward Phi_VLM tokens and Zero-K; forward-pass
analyses on the first questions record where attention goes, the geometry of sink keys and values and what mask
relaxation does to the sink. The run's seed also seeds its random choices (random pruning, the random Phi_VLM
token). The test and validation questions do not depend on the seed, so the runs of one model answer the same
questions. The record is plain numbers and lists; the chapter's findings read it.
"""
from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace

import numpy as np
import torch

from ..core.arch import arch_for, decoder_layers, text_config
from ..core.hooks import capture, intervene
from ..interventions.outro import OutRo, default_layers, persistent_sinks
from ..interventions.zero_k import zero_k_edits
from ..measures.criteria import attention_to_key, massive_dimensions, rms_ratio, sink_dimensions
from ..measures.decoding import time_settings
from ..training.digits import load_digit_splits, make_examples
from ..training.probes import answer_matches, chance_level, held_out_vision_examples
from ..training.vlm import IMAGE_MARKER, encode_examples, load_vlm
from .adaptation import adaptation_jobs, run_adaptation_jobs
from .pool import run_jobs


TAU = 20.0                # Phi_VLM threshold (OutRo paper, Eq. 5)
TOP_SHARE = 0.01          # Table B.7: "top 1%" of the tokens under Phi_VLM
VALIDATION_SEED = 778     # ours: validation questions (the test questions use the adaptation chapter's seed)
SINK, IMAGE, TEXT = 0, 1, 2
GROUPS = ("sink", "image", "text")
PRUNE_METHODS = ("sink_query", "random", "mean_query")


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
        return lambda batch: OutRo(self.llm, **options)

    def timed(self, name, fn):
        start = time.perf_counter()
        out = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    # -- the measurements --

    def run(self) -> dict:
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
        return lambda batch: intervene(self.llm, remove_dimensions_edits(self.L, positions(batch), dims))

    # Zero-K (Table 3)
    def zero_k(self, batch):
        return intervene(self.llm, zero_k_edits(range(self.L), self.sink_position(batch).to(self.device), top=1))

    # forward-pass analyses on the first questions
    def analyses(self, gamma: float) -> dict:
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
    """One adapted model (one seed's run), every measurement of the chapter (a worker process runs this)."""
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    vlm, loaded, fmt = load_vlm(job["directory"], device=job["device"])
    out = _Measure(vlm, loaded, fmt, SimpleNamespace(**job["settings"], seed=job["seed"])).run()
    out.update({"spec": job["spec"], "directory": job["directory"], "chat": fmt.chat})
    out["seconds"]["total"] = time.perf_counter() - start
    return out


def measure_models(jobs: list[dict], workers: int) -> list[dict]:
    """Every job's record, one worker process (one thread) per job when ``workers`` > 1."""
    if workers <= 1 or len(jobs) <= 1:
        return [measure_model(job) for job in jobs]
    return run_jobs(measure_model, [{**job, "threads": 1} for job in jobs], workers)


def measure_adapted(recipe, models: list, seeds: list, settings: dict, workers: int,
                    device: str) -> tuple[dict, dict, dict]:
    """The vision runs of ``models`` and ``seeds`` under the adaptation ``recipe`` (trained where missing, else
    read from the cache), each measured once, one job per (model, seed): (accuracy of each run as the adaptation
    evaluated it, ``{spec: {seed: ...}}``; ``measure_model``'s record as ``{spec: {seed: record}}``; seconds of the
    two stages)."""
    start = time.perf_counter()
    listed = [j for j in adaptation_jobs(recipe) if j.get("config", {}).get("modality") == "vision"]
    docs = run_adaptation_jobs(listed, workers, device)
    runs = {(j["config"]["model"], j["config"]["seed"]): d for j, d in zip(listed, docs)}
    adaptation = {}
    for (model, seed), d in runs.items():
        if d.get("vision"):
            adaptation.setdefault(model, {})[seed] = {"accuracy": d["vision"]["accuracy"],
                                                      "n": len(d["vision"]["per_item"])}
    seconds = {"adaptation runs": round(time.perf_counter() - start, 1)}
    start = time.perf_counter()
    jobs = [{"spec": spec, "seed": seed, "directory": runs[(spec, seed)]["directory"], "device": device,
             "settings": settings} for spec in models for seed in seeds]
    results = measure_models(jobs, workers if device == "cpu" else 1)
    seconds["measurements"] = round(time.perf_counter() - start, 1)
    measured = {}
    for job, m in zip(jobs, results):
        measured.setdefault(job["spec"], {})[job["seed"]] = m
    return adaptation, measured, seconds


# ---- decoding overhead with image tokens in the prompt (scripts/bench_outro.py --vlm) -------------------------------

def benchmark_vlm_decoding(vlm, loaded, fmt, settings: dict, new_tokens: int = 32, repeats: int = 3,
                           batch_size: int = 1, digits: int = 4, seed: int = 0) -> list[dict]:
    """``measures.decoding.benchmark_decoding`` for an adapted vision-language model: the prompt is a held-out
    question about a row of ``digits`` digit images (4 image tokens each), given as ``inputs_embeds``; every
    setting (``{name: factory of a context manager}``, the first the reference) runs interleaved in each repeat.
    One row per (setting, repeat), with the decode-step latency per token, the prefill time and peak memory."""
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
