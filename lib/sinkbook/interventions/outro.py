"""OutRo: rotate non-sink head outputs toward the sink value, and let sink rows see the whole prompt.

The method (OutRo paper, Sec. 4, as the authors' implementation does it; formulas on the book's methods page,
book/methods.md):

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

Scoring a finished generation in one pass: ``prompt_length=P`` treats the first P positions of a longer
sequence as the prompt and the rest as decode tokens, so one forward pass over prompt + generated tokens gives
what the prefill and the cached decode steps gave: sinks are detected on the prompt only (the Phi_LLM median
too), relaxed rows and the head-mean control read the prompt's keys only, and the random-token control draws
from the prompt. Image tokens need nothing special: they are positions of the prompt like any other (the
model is called with ``inputs_embeds``), and padding, pruned positions included, comes from the attention mask.

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
from ..core.hooks import AttentionCall, intervene
from ..measures.criteria import phi_llm

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
    """What the last prefill found; the chapter reads it, decode steps reuse ``direction``."""
    sinks: dict = field(default_factory=dict)        # layer -> bool (B, T): cumulative sinks at that layer
    found: dict = field(default_factory=dict)        # layer -> bool (B, T): what the criterion flags there
    direction: dict = field(default_factory=dict)    # layer -> (B, H, d) rotation direction (v_bar for "sink")
    relaxed: dict = field(default_factory=dict)      # layer -> list per sequence of positions relaxed there
    gate_mean: dict = field(default_factory=dict)    # layer -> (B, H) mean gate over rotated prefill rows
    padding: torch.Tensor | None = None              # (B, T) 1 = real token, from the model call
    random_position: torch.Tensor | None = None      # (B,) the token used by direction="random_token"
    prompt_length: int = 0                           # positions of the prefill treated as the prompt
    decode_steps: int = 0
    rotated_decode_rows: int = 0


class OutRo:
    """OutRo on a loaded transformers model, active inside ``with``; ``state`` describes the last prefill.

    Parameters: ``gamma`` rotation strength; ``rotate`` / ``relax`` switch the two components; ``temperature``
    of the ReLU-tanh gate; ``direction`` one of DIRECTIONS; ``rotate_layers`` / ``relax_layers`` override
    the defaults (0..L-3 and multiples of max(1, L // 7)); ``sink_positions`` replaces Phi_LLM detection by
    fixed positions (indices into the padded prompt, sinks at every layer) so tests can use random models,
    which have no massive activations; ``detector(hidden, padding) -> bool (B, T)`` replaces Phi_LLM by any
    other criterion; ``seed`` drives the random-token control; ``prompt_length`` scores prompt + generated
    tokens in one pass as the prefill of the first ``prompt_length`` positions followed by cached decoding.
    """

    def __init__(self, model, gamma: float = 1.0, rotate: bool = True, relax: bool = True,
                 temperature: float = TEMPERATURE, direction: str = "sink",
                 rotate_layers: Sequence[int] | None = None, relax_layers: Sequence[int] | None = None,
                 sink_positions: Sequence[int] | None = None,
                 detector: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                 seed: int = 0, prompt_length: int | None = None):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
        if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and gamma >= 0):
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if sink_positions is not None and detector is not None:
            raise ValueError("give either sink_positions or detector, not both")
        if prompt_length is not None and (not isinstance(prompt_length, int) or prompt_length < 1):
            raise ValueError(f"prompt_length must be a positive number of positions, got {prompt_length!r}")
        self.prompt_length = prompt_length
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
        P = self.state.prompt_length
        if self.sink_positions is not None:
            found = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
            found[:, self.sink_positions] = True
            if padding is not None:
                found &= padding.bool()
        elif P < T:         # decode tokens are never sinks, and the criterion sees only the prompt
            found = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
            found[:, :P] = self.detector(hidden[:, :P], None if padding is None else padding[:, :P]).to(hidden.device)
        else:
            found = self.detector(hidden, padding).to(hidden.device)
        found[:, P:] = False
        self.state.found[layer] = found
        previous = self.state.sinks.get(layer - 1)
        self.state.sinks[layer] = found if previous is None else (previous | found)
        return hidden

    def _start_prefill(self, hidden: torch.Tensor) -> None:
        B, T = hidden.shape[:2]
        padding = getattr(self, "_call_padding", None)
        padding = padding[:, -T:].to(hidden.device) if padding is not None else None
        P = T if self.prompt_length is None else min(T, self.prompt_length)
        self.state = OutRoState(padding=padding, prompt_length=P)
        self._relaxed_so_far = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
        if self.direction_kind == "random_token":
            generator = torch.Generator().manual_seed(self.seed)
            valid = padding.bool().cpu().clone() if padding is not None else torch.ones(B, T, dtype=torch.bool)
            valid[:, P:] = False
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
        if self.state.prompt_length < T:      # what follows the prompt stands for decode tokens: unseen
            if key_valid is None:
                key_valid = torch.ones(B, S, dtype=torch.bool, device=out.device)
            key_valid = key_valid.clone()
            key_valid[:, offset + self.state.prompt_length:] = False
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


def detect_sinks(model, batch: dict) -> OutRoState:
    """Phi_LLM sinks of one prefill without changing anything: ``.sinks`` (cumulative) and ``.found``
    (per layer), each layer -> bool (B, T)."""
    with torch.no_grad(), OutRo(model, rotate=False, relax=False) as o:
        model(**batch)
    return o.state


def persistent_sinks(found: dict) -> torch.Tensor:
    """bool (B, T): positions Phi_LLM flags at at least half of the layers where it flags anything.

    Phi_LLM flags many tokens in a few early layers of Gemma 3 and one token elsewhere; the cumulative set
    then holds most of the prompt. The persistent set is the token(s) the criterion keeps finding."""
    layers = sorted(found)
    per_layer = torch.stack([found[l] for l in layers]).float()                  # (L, B, T)
    active = per_layer.flatten(2).any(-1).float().sum(0)                          # (B,) layers with any sink
    return (per_layer.sum(0) >= 0.5 * active[:, None].clamp_min(1)) & per_layer.any(0).bool()
