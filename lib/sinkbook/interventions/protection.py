r"""Head-selective sink protection during adaptation (the VL paper's Limitations candidate, derived from Theorem 1).

The paper's Limitations propose: *freeze the layers below the first sink layer and project the sink-head
W_q, W_k updates away from the sink direction*, which should slow how fast VL training closes the margin
G_base - B_gap. This module implements both halves and measures what they need on calibration prompts.

## Which layers and heads

- **Sink position** s: the first real token of each prompt (the BOS or the chat template's first token), the
  position every criterion of ``sinkbook.measures.criteria`` tests. (The paper's per-head p_sink is the argmax
  key; on the models of this book it is the first token for the heads that matter.)
- **First sink layer** l0, rule ``"phi_llm"``: the first layer whose input (``resid_pre``) Phi_LLM flags at the
  first token in at least half of the calibration prompts (massive activation: max_d |h_s[d]| >=
  max(100, 1000 median |h|)). Rule ``"head_fraction"``: the first layer where the gradient-sinks criterion
  Sink^eps (the fraction of heads whose mean attention alpha^h to the first token over the first T_eps queries
  exceeds eps = 0.3), averaged over the prompts, is at least one half. Rule ``"auto"`` (default): Phi_LLM, and
  the head fraction where Phi_LLM flags no layer. No layer passing either rule means the model has no sink to
  protect: nothing is frozen or projected (``SinkProtection.active`` is False and ``reason`` says why).
- **Sink heads**: at every layer l >= l0, the heads with mean alpha^h > eps (the same per-head vote).
- **Frozen**: every parameter of the decoder layers l < l0, and the pre-attention norm gain of every protected
  layer. With the input embeddings frozen too (stage 2 of ``training.adapt`` freezes them), the sink token's
  residual stream entering layer l0 cannot change: under the causal mask the first token only ever attends to
  itself, so its hidden state is a function of token 0 and of the frozen layers alone. The projections read
  that stream through the layer's input RMSNorm, whose gain multiplies xi_s coordinate by coordinate; left
  trainable it would move the sink key of every head of the layer (a tiny Llama's protected sink key moved by
  2% of its norm in three AdamW steps at lr 1e-2, against 2e-7 with the gain frozen), so it is frozen with
  the layer's QK-norm gains (approximation 5).

## What moves the sink logit (Theorem 1, Eq. 8)

One layer, one sink head h with key/value head g, a query at position t > s. With xi_t, xi_s the inputs of the
projections (after the input norm), q_t = W_q^h xi_t + b_q, k_s = W_k^g xi_s + b_k (pre-norm, pre-RoPE),
the sink logit is

    l_s(t) = c < R_t N_q(q_t), R_s N_k(k_s) >,          c = 1/sqrt(d_h) (the model's scaling),

with R_t the RoPE rotation at position t and N the per-head QK-RMSNorm (identity in families without it).
An update (dW_q, dW_k) acts on it in two ways.

**Key side.** The sink key depends on W_k only through k_s = W_k xi_s (+ b_k). Write xi~_s = [xi_s; 1] and
W~_k = [W_k | b_k] when the projection has a bias. Then

    dW~_k <- dW~_k (I - u u^T),      u = xi~_s / ||xi~_s||,

makes dW~_k xi~_s = 0, so k_s, and with it N_k(k_s) and R_s N_k(k_s), is **exactly** unchanged, for every query
and every norm or RoPE, while dW_k x for any input x orthogonal to u passes unchanged: other tokens' keys move
as before except for their component along the sink input.

**Query side.** With k_s pinned, l_s(t) changes only through dq_t = dW_q^h xi_t. Without QK-norm this is exactly
linear:  dl_s(t) = c < R_t dq_t, R_s k_s > = < w(t), dW_q^h xi_t >,  w(t) = c R_t^T R_s k_s = c R_{s-t} k_s,
the post-RoPE key of the sink as the query at t sees it, taken back into the query's pre-RoPE frame. With
QK-norm it holds to first order with w(t) = d l_s(t) / d q_t = J_{N_q}(q_t)^T c R_t^T R_s N_k(k_s); the module
computes w(t) by autograd through the model's own norm, RoPE and scaling, so one code path covers every family.
dl_s(t) vanishes for every input xi_t exactly when w(t)^T dW_q^h = 0, i.e.

    dW_q^h <- (I - w w^T) dW_q^h,    w = w(t) / ||w(t)||    (the bias b_q^h is projected the same way).

**Where the approximation enters.** A single w per head would be exact without RoPE (w(t) is then parallel to
k_s for every t, or to J^T k_s, which still varies with q_t under QK-norm). RoPE rotates each 2-D frequency
pair i of w(t) by (t - s) theta_i: low-frequency pairs barely move over a context, high-frequency ones sweep
around. We therefore stack w(t) over the calibration prompts and all query positions t > s that see s (the query
at s sees only itself: its softmax is 1 whatever the logit) and project away the top-``rank`` right singular
directions U_h (``rank=1``: the "one direction per head" of the Limitations; ``energy=0.9``: as many as needed for
90% of sum_t ||w(t)||^2). ``q_energy`` reports the captured share per head; the rest of the sink-logit
sensitivity leaks. Further approximations, all stated where they are made:

1. xi_s is exact at l0 (frozen layers below, frozen embeddings, frozen input-norm gain). At l > l0 the layers
   l0..l-1 train (their MLP, V, O), so the sink input drifts from the calibrated u; ``refresh(model)``
   recomputes every direction on the current model (e.g. from a ``training.loop.Every`` callback).
2. Prompts whose first tokens differ give several sink inputs: u becomes an orthonormal basis of their span
   (numerical rank at relative tolerance ``k_rtol``); with one BOS token the span is one direction.
3. GQA: the rows of W_k for key/value head g are shared by the H/H_kv query heads of its group, so pinning the
   sink key of a sink head pins it for the whole group.
4. Layerwise QK-norm (OLMo 2): one RMS over all heads couples them. The query directions are then computed over
   the layer's whole q_proj output (H d_h coordinates, so the projection also acts on the other heads' rows, the
   first-order effect of the shared RMS), and the key projection is applied to every row of k_proj, which keeps
   the sink token's whole pre-norm key, and so its shared RMS, fixed.
5. The pre-attention norm gain and the QK-norm gains gamma_q, gamma_k (shared by the heads of a layer) are
   frozen in protected layers (Assumption 1 of the theorem holds the inputs and norms fixed); that freezes them
   for the non-sink heads, and the pre-attention gain for V, of those layers too (``freeze_norms=False`` leaves
   them trainable, and the key-side pinning is then no longer exact).
6. The query inputs xi_t still drift with the layers below (Assumption 1 holds them fixed; nothing here does).
7. Adaptive optimisers: projecting a gradient does not project an Adam update (the division by sqrt(v) is
   elementwise), so the projection is applied to the *parameter change* after every optimizer step
   (``optimizer.register_step_post_hook``), exact for any optimizer; the rows are restored to
   W_before + P(W_after - W_before). With ``project_grads=True`` the gradients are also projected before the
   step, so the optimizer's moments see the protected gradient (gradient clipping in ``fit`` still sees the raw
   one).

**What it buys in the bound.** In Eq. (8) both terms that carry the sink input, (R_q dW_q xi_q)^T R_s W_k xi_s
and (R_q W_q xi_q)^T R_s dW_k xi_s, vanish (the first up to the uncaptured RoPE energy), so delta_s = 0 and
B_gap = sup_p |delta_p| <= eps d_h^{-1/2} ||xi_q|| (||W_q||_op + ||W_k||_op) sup_{p != s} ||xi_p||: the factor
||xi_{p_sink}||, the one a massive activation inflates, is gone from Eq. (4), while the head stays free to
change how it attends among the other keys.

## Use

    prot = calibrate_protection(model, encode(tokenizer, prompt_texts(), device=...))
    prot.attach(model, optimizer)        # freezes layers < l0, registers the optimizer step hooks
    ...train...
    prot.detach()                        # removes the hooks, restores requires_grad flags
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from ..core.arch import arch_for, decoder_layers, get_module, head_dim, text_config
from ..core.hooks import capture, intervene
from ..measures.criteria import first_real_position, head_fraction_sink, phi_llm

EPS = 0.3            # head vote threshold of the gradient-sinks criterion
T_EPS = 64
MIN_FRACTION = 0.5   # share of prompts (Phi_LLM) or of heads (head fraction) for a layer to count as a sink layer
RULES = ("auto", "phi_llm", "head_fraction")


# ---- which layers and heads ---------------------------------------------------------------------------------

@dataclass
class SinkCensus:
    """Per-layer sink statistics on calibration prompts (first real token as the sink position)."""
    phi_first: torch.Tensor      # (L,) share of prompts whose first token Phi_LLM flags at the layer input
    alpha: torch.Tensor          # (L, H) mean over prompts of alpha^h (attention to the first token)
    sink_eps: torch.Tensor       # (L,) mean over prompts of Sink^eps (share of heads with alpha^h > eps)
    eps: float = EPS

    def table(self):
        import pandas as pd
        return pd.DataFrame({"layer": range(len(self.phi_first)), "phi_llm_first_token": self.phi_first.tolist(),
                             "sink_eps": self.sink_eps.tolist(),
                             "sink_heads": [[h for h in range(self.alpha.shape[1]) if self.alpha[layer, h] > self.eps]
                                            for layer in range(len(self.phi_first))]})


def sink_census(model, batch: dict, eps: float = EPS, t_eps: int = T_EPS) -> SinkCensus:
    """One forward pass: Phi_LLM at the first token of every layer input, alpha^h and Sink^eps per layer."""
    mask = batch.get("attention_mask")
    phi, alpha, frac = {}, {}, {}

    def reduce_pattern(pattern, layer):
        f, a = head_fraction_sink(pattern, mask, eps=eps, t_eps=t_eps)
        frac[layer], alpha[layer] = f.mean().item(), a.mean(0).cpu()
        return None

    def reduce_resid(hidden, layer):
        flags = phi_llm(hidden, mask)
        first = first_real_position(mask, hidden.shape[0], hidden.device)
        phi[layer] = flags[torch.arange(hidden.shape[0]), first].float().mean().item()
        return None

    with torch.no_grad(), capture(model, points=("resid_pre", "pattern"),
                                  reducers={"pattern": reduce_pattern, "resid_pre": reduce_resid}):
        model(**batch, use_cache=False)
    layers = sorted(phi)
    return SinkCensus(torch.tensor([phi[x] for x in layers]), torch.stack([alpha[x] for x in layers]),
                      torch.tensor([frac[x] for x in layers]), eps)


def first_sink_layer(phi_first, sink_eps, rule: str = "auto", min_fraction: float = MIN_FRACTION):
    """(layer or None, rule that found it) from per-layer statistics; see the module docstring for the rules."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if rule in ("auto", "phi_llm"):
        hits = [i for i, v in enumerate(phi_first) if float(v) >= min_fraction]
        if hits:
            return hits[0], "phi_llm"
        if rule == "phi_llm":
            return None, "phi_llm"
    hits = [i for i, v in enumerate(sink_eps) if float(v) >= min_fraction]
    return (hits[0] if hits else None), "head_fraction"


def sink_heads(alpha: torch.Tensor, first_layer: int | None, eps: float = EPS) -> dict[int, tuple[int, ...]]:
    """{layer: heads with mean alpha^h > eps} for the layers from ``first_layer`` on (layers without one left out)."""
    if first_layer is None:
        return {}
    out = {}
    for layer in range(first_layer, alpha.shape[0]):
        heads = tuple(int(h) for h in torch.nonzero(alpha[layer] > eps).flatten())
        if heads:
            out[layer] = heads
    return out


# ---- the directions -----------------------------------------------------------------------------------------

def _kv_heads(model) -> tuple[int, int]:
    cfg = text_config(model)
    return cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _sink_logit_columns(model, batch: dict, layers, keep_graph: bool):
    """Run the model once; per layer: (B, H, T) logits of every query to the first real token, and (B, T) which
    entries count (real query t > s that sees s). With ``keep_graph`` the q_proj outputs (B, T, H*d) and
    k_proj inputs stay in the autograd graph."""
    arch = arch_for(model)
    blocks = decoder_layers(model)
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    B, T = ids.shape
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    first = first_real_position(mask, B, ids.device)
    after = torch.arange(T, device=ids.device)[None, :] > first[:, None]
    columns, q_out, k_in, handles = {}, {}, {}, []

    def column(call):
        logits = call.logits()                                         # (B, H, T, S), masked at -inf
        S = logits.shape[-1]
        col = logits[torch.arange(B), :, :, first + (S - T)]           # (B, H, T)
        sees = call.visible().expand(B, 1, T, S)[torch.arange(B), 0, :, first + (S - T)]
        valid = sees & real & after
        columns[call.layer] = (torch.where(valid[:, None], col, torch.zeros_like(col)), valid)
        return None

    for layer in layers:
        block = blocks[layer]
        handles.append(get_module(block, arch.q_proj).register_forward_hook(
            lambda m, a, out, layer=layer: q_out.__setitem__(layer, out)))
        handles.append(get_module(block, arch.k_proj).register_forward_pre_hook(
            lambda m, a, layer=layer: k_in.__setitem__(layer, a[0])))
    try:
        with torch.set_grad_enabled(keep_graph), intervene(model, {("attn", x): column for x in layers}), \
                capture(model, points=(), layers=[max(layers)], stop_early=True):
            embeds = model.get_input_embeddings()(ids).detach()
            if keep_graph:
                embeds.requires_grad_(True)
            model.get_decoder()(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return columns, q_out, k_in, first


def sink_logits(model, batch: dict, layers) -> dict:
    """{layer: (B, H, T) float32 logit of each query to the first real token}, NaN where it does not count
    (padding, the first token itself, keys outside a sliding window). Use it to watch the protected logits."""
    columns, _, _, _ = _sink_logit_columns(model, batch, sorted(layers), keep_graph=False)
    return {layer: torch.where(valid[:, None], col, torch.full_like(col, float("nan"))).float()
            for layer, (col, valid) in columns.items()}


def _top_directions(rows: torch.Tensor, rank: int | None, energy: float | None) -> tuple[torch.Tensor, float]:
    """Orthonormal (m, r) basis of the top right singular directions of ``rows`` (N, m), and its energy share."""
    if rows.shape[0] == 0 or not torch.isfinite(rows).all() or rows.abs().max() == 0:
        return rows.new_zeros(rows.shape[1], 0), 0.0
    _, sigma, vh = torch.linalg.svd(rows, full_matrices=False)
    share = sigma.pow(2).cumsum(0) / sigma.pow(2).sum()
    if energy is not None:
        r = int(torch.searchsorted(share, torch.tensor(energy, dtype=share.dtype)).item()) + 1
    else:
        r = rank
    r = max(0, min(r, int((sigma > sigma[0] * 1e-10).sum())))
    return vh[:r].T.contiguous(), float(share[r - 1]) if r else 0.0


def _orthonormal_span(vectors: torch.Tensor, rtol: float) -> torch.Tensor:
    """(m, r) orthonormal basis of the column span of ``vectors`` (m, n), singular values > rtol * largest."""
    if vectors.shape[1] == 0:
        return vectors
    u, sigma, _ = torch.linalg.svd(vectors, full_matrices=False)
    return u[:, : int((sigma > sigma[0] * rtol).sum())].contiguous()


@dataclass
class LayerDirections:
    q_rows: torch.Tensor         # (n,) rows of q_proj the query projection acts on
    q_basis: torch.Tensor        # (n, r) orthonormal, in the coordinates of those rows
    k_rows: torch.Tensor         # (m,) rows of k_proj the key projection acts on
    k_basis: torch.Tensor        # (D or D + 1, r_k) orthonormal sink-input directions (last coordinate: the bias)
    q_energy: dict               # head -> captured share of sum_t ||w(t)||^2


def sink_directions(model, batch: dict, heads: dict, rank: int | None = 1, energy: float | None = None,
                    k_rtol: float = 1e-3) -> dict[int, LayerDirections]:
    """The query- and key-side directions of every sink head (module docstring), in float64 on the CPU."""
    _check_rank(rank, energy)
    if not heads:
        return {}
    arch = arch_for(model)
    layerwise = arch.qk_norm == "layerwise"
    H, Hkv = _kv_heads(model)
    d = head_dim(model)
    columns, q_out, k_in, first = _sink_logit_columns(model, batch, sorted(heads), keep_graph=True)
    B = first.shape[0]
    out = {}
    blocks = decoder_layers(model)
    for layer, layer_heads in sorted(heads.items()):
        col, valid = columns[layer]
        k_proj = get_module(blocks[layer], arch.k_proj)
        bases, energies = [], {}
        for h in layer_heads:
            (grad,) = torch.autograd.grad(col[:, h].sum(), q_out[layer], retain_graph=True)
            rows = grad.detach().double()[valid]                      # (N, H*d): one w(t) per counted query
            if not layerwise:
                rows = rows[:, h * d:(h + 1) * d]
            basis, share = _top_directions(rows, rank, energy)
            energies[h] = share
            if not layerwise:
                full = basis.new_zeros(H * d, basis.shape[1])
                full[h * d:(h + 1) * d] = basis
                basis = full
            bases.append(basis)
        q_basis = torch.cat(bases, dim=1)
        if layerwise:
            q_rows = torch.arange(H * d)
            q_basis = _orthonormal_span(q_basis, 1e-10)
        else:   # disjoint head blocks: already orthonormal; keep the protected heads' rows only
            q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in layer_heads])
            q_basis = q_basis[q_rows]
        xi = k_in[layer].detach().double()[torch.arange(B), first]               # (B, D) sink inputs
        if k_proj.bias is not None:
            xi = torch.cat([xi, xi.new_ones(B, 1)], dim=1)
        k_basis = _orthonormal_span(xi.T.cpu(), k_rtol)
        groups = H // Hkv
        kv = sorted({h // groups for h in layer_heads})
        k_rows = torch.arange(Hkv * d) if layerwise else torch.cat([torch.arange(g * d, (g + 1) * d) for g in kv])
        out[layer] = LayerDirections(q_rows, q_basis.cpu(), k_rows, k_basis, energies)
    return out


# ---- the protection -----------------------------------------------------------------------------------------

def _project_left(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(I - U U^T) delta for delta (n, ...) with U (n, r)."""
    flat = delta.reshape(delta.shape[0], -1)
    return (flat - basis @ (basis.T @ flat)).view_as(delta)


def _project_right(delta: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """delta (I - V V^T) for delta (m, D') with V (D', r)."""
    return delta - (delta @ basis) @ basis.T


def _project_rows(delta_w: torch.Tensor, delta_b: torch.Tensor | None, rows, project):
    """Apply ``project`` to the chosen rows of [dW | db] (the bias as a last column); other rows pass unchanged."""
    stacked = delta_w[rows] if delta_b is None else torch.cat([delta_w[rows], delta_b[rows, None]], dim=1)
    projected = project(stacked)
    w = delta_w.clone()
    w[rows] = projected[:, :delta_w.shape[1]]
    if delta_b is None:
        return w, None
    b = delta_b.clone()
    b[rows] = projected[:, -1]
    return w, b


@dataclass
class SinkProtection:
    """Frozen layers below the first sink layer + projected sink-head W_q / W_k updates (module docstring)."""
    first_layer: int | None
    heads: dict                               # layer -> tuple of sink heads
    directions: dict                          # layer -> LayerDirections
    rule: str = "given"
    census: SinkCensus | None = None
    freeze_norms: bool = True
    settings: dict = field(default_factory=dict)
    batch: dict | None = None                 # the calibration batch (refresh re-measures on it)
    _handles: list = field(default_factory=list, repr=False)
    _flags: list = field(default_factory=list, repr=False)
    _model: object = field(default=None, repr=False)
    _snapshot: dict = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        """Whether attaching freezes or projects anything at all."""
        return bool(self.heads) or bool(self.first_layer)

    @property
    def reason(self) -> str:
        n_heads = sum(map(len, self.heads.values()))
        if self.first_layer is None and not n_heads:
            return f"no sink layer on the calibration prompts (rule {self.rule!r}): nothing is frozen or projected"
        frozen = f"layers below {self.first_layer} frozen" if self.first_layer else "no layer frozen"
        if not n_heads:
            return f"{frozen}; no head passes alpha > {self.settings.get('eps', EPS)}, nothing projected"
        return f"{frozen}; {n_heads} sink heads projected"

    def summary(self):
        """One row per protected head: layer, head, kv head, query-side rank and captured energy, key-side rank."""
        import pandas as pd
        rows = []
        for layer, dirs in sorted(self.directions.items()):
            for h in self.heads[layer]:
                rows.append({"layer": layer, "head": h, "q_rank_layer": dirs.q_basis.shape[1],
                             "q_energy": dirs.q_energy.get(h), "k_rank": dirs.k_basis.shape[1],
                             "k_rows": len(dirs.k_rows)})
        return pd.DataFrame(rows, columns=["layer", "head", "q_rank_layer", "q_energy", "k_rank", "k_rows"])

    # -- the linear maps (usable on any update or gradient) --

    def _modules(self, model, layer):
        arch = arch_for(model)
        block = decoder_layers(model)[layer]
        return get_module(block, arch.q_proj), get_module(block, arch.k_proj)

    def project_q(self, layer: int, delta_w: torch.Tensor, delta_b: torch.Tensor | None = None):
        """(I - U U^T) applied to the protected rows of a q_proj update (full matrix in, full matrix out)."""
        dirs = self.directions[layer]
        rows = dirs.q_rows.to(delta_w.device)
        basis = dirs.q_basis.to(delta_w.device, delta_w.dtype)
        return _project_rows(delta_w, delta_b, rows, lambda m: _project_left(m, basis))

    def project_k(self, layer: int, delta_w: torch.Tensor, delta_b: torch.Tensor | None = None):
        """delta [W | b] (I - u u^T) on the protected rows of a k_proj update."""
        dirs = self.directions[layer]
        rows = dirs.k_rows.to(delta_w.device)
        basis = dirs.k_basis.to(delta_w.device, delta_w.dtype)
        return _project_rows(delta_w, delta_b, rows, lambda m: _project_right(m, basis))

    def protected_components(self, model, before: dict) -> dict:
        """Per protected layer, the largest |component| of the update since ``before`` (a state dict of the
        model, e.g. ``{k: v.clone() for k, v in model.state_dict().items()}``) that the projection removes:
        ``q``: max |U^T dW~_q| over the protected rows, ``k``: max |dW~_k u| (both 0 after a protected step)."""
        out = {}
        names = {id(p): n for n, p in model.named_parameters()}
        for layer, dirs in self.directions.items():
            q, k = self._modules(model, layer)
            res = {}
            for side, module in (("q", q), ("k", k)):
                rows = (dirs.q_rows if side == "q" else dirs.k_rows).to(module.weight.device)
                dw = (module.weight.detach() - before[names[id(module.weight)]])[rows]
                db = None if module.bias is None else (module.bias.detach() - before[names[id(module.bias)]])[rows]
                stacked = dw if db is None else torch.cat([dw, db[:, None]], dim=1)
                if side == "q":
                    comp = dirs.q_basis.to(stacked.device, stacked.dtype).T @ stacked
                else:
                    comp = stacked @ dirs.k_basis.to(stacked.device, stacked.dtype)
                res[side] = float(comp.abs().max()) if comp.numel() else 0.0
                res[side + "_update"] = float(stacked.abs().max())
            out[layer] = res
        return out

    # -- attaching to a training run --

    def attach(self, model, optimizer, project_grads: bool = False) -> "SinkProtection":
        """Freeze the layers below the first sink layer (and the norm gains of protected layers), and make every
        ``optimizer.step()`` project the sink heads' q_proj / k_proj updates. Call after the trainable parameters
        are chosen and the optimizer is built; ``detach()`` undoes both."""
        if self._handles or self._flags:
            raise RuntimeError("this protection is already attached; call detach() first")
        self._model = model
        if not self.active:
            return self
        arch = arch_for(model)
        blocks = decoder_layers(model)
        frozen = [p for block in blocks[:self.first_layer or 0] for p in block.parameters()]
        if self.freeze_norms:
            paths = [x for x in (arch.input_norm, arch.q_norm, arch.k_norm) if x]
            frozen += [p for layer in self.directions for path in paths
                       for p in get_module(blocks[layer], path).parameters()]
        # A parameter listed twice would record False the second time and detach would restore that.
        for p in {id(p): p for p in frozen}.values():
            self._flags.append((p, p.requires_grad))
            p.requires_grad_(False)
            p.grad = None
        self._handles.append(optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self._before_step(project_grads)))
        self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step()))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        for p, flag in self._flags:
            p.requires_grad_(flag)
        self._handles, self._flags, self._snapshot = [], [], {}

    def _targets(self):
        for layer in sorted(self.directions):
            q, k = self._modules(self._model, layer)
            yield layer, "q", q
            yield layer, "k", k

    @torch.no_grad()
    def _before_step(self, project_grads: bool) -> None:
        self._snapshot = {}
        for layer, side, module in self._targets():
            if not module.weight.requires_grad:
                continue
            self._snapshot[layer, side] = (module.weight.detach().clone(),
                                           None if module.bias is None else module.bias.detach().clone())
            if project_grads and module.weight.grad is not None:
                gb = module.bias.grad if module.bias is not None else None
                project = self.project_q if side == "q" else self.project_k
                gw, gb_new = project(layer, module.weight.grad, gb)
                module.weight.grad.copy_(gw)
                if gb_new is not None:
                    module.bias.grad.copy_(gb_new)

    @torch.no_grad()
    def _after_step(self) -> None:
        for layer, side, module in self._targets():
            if (layer, side) not in self._snapshot:
                continue
            w0, b0 = self._snapshot[layer, side]
            project = self.project_q if side == "q" else self.project_k
            dw, db = project(layer, module.weight - w0, None if b0 is None else module.bias - b0)
            rows = (self.directions[layer].q_rows if side == "q" else self.directions[layer].k_rows).to(w0.device)
            module.weight[rows] = w0[rows] + dw[rows]
            if b0 is not None:
                module.bias[rows] = b0[rows] + db[rows]
        self._snapshot = {}

    def refresh(self, model=None) -> "SinkProtection":
        """Re-measure every direction on the current weights (same heads, batch and settings)."""
        model = model or self._model
        if self.batch is None:
            raise ValueError("this protection holds no calibration batch; build it with calibrate_protection")
        s = self.settings
        self.directions = sink_directions(model, self.batch, self.heads, s.get("rank", 1), s.get("energy"),
                                          s.get("k_rtol", 1e-3))
        return self


def calibrate_protection(model, batch: dict, first_layer="auto", heads="auto", rule: str = "auto",
                         eps: float = EPS, t_eps: int = T_EPS, min_fraction: float = MIN_FRACTION,
                         rank: int | None = 1, energy: float | None = None, k_rtol: float = 1e-3,
                         freeze_norms: bool = True) -> SinkProtection:
    """Find the first sink layer and the sink heads on ``batch`` (``core.models.encode`` of calibration prompts),
    measure their directions, and return the (unattached) protection.

    ``first_layer``: "auto" (the rule), an int, or None (freeze nothing). ``heads``: "auto" (alpha^h > eps at
    the layers from the first sink layer on) or an explicit {layer: [heads]}. ``rank`` / ``energy``: how many
    query-side directions per head (module docstring); ``energy``, when given, decides instead of ``rank``.
    Arguments out of range raise ValueError before anything is run."""
    _check_settings(rule, eps, t_eps, min_fraction, rank, energy, k_rtol)
    n = len(decoder_layers(model))
    if first_layer not in ("auto", None):
        first_layer = _layer_index(first_layer, n, "first_layer")
    if heads != "auto":
        heads = _explicit_heads(heads, n, _kv_heads(model)[0])
    census = sink_census(model, batch, eps, t_eps)
    used = "given"
    if first_layer == "auto":
        first_layer, used = first_sink_layer(census.phi_first, census.sink_eps, rule, min_fraction)
    if heads == "auto":
        heads = sink_heads(census.alpha, first_layer, eps)
    settings = {"eps": eps, "t_eps": t_eps, "min_fraction": min_fraction, "rank": rank, "energy": energy,
                "k_rtol": k_rtol}
    directions = sink_directions(model, batch, heads, rank, energy, k_rtol)
    return SinkProtection(first_layer, heads, directions, used, census, freeze_norms, settings, batch)


def _check_settings(rule, eps, t_eps, min_fraction, rank, energy, k_rtol) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if not 0 < eps < 1:
        raise ValueError(f"eps is an attention share and must lie in (0, 1); got {eps}")
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must lie in (0, 1]; got {min_fraction}")
    if not (isinstance(t_eps, int) and t_eps >= 1):
        raise ValueError(f"t_eps must be a positive number of queries; got {t_eps!r}")
    _check_rank(rank, energy)
    if not 0 < k_rtol < 1:
        raise ValueError(f"k_rtol must lie in (0, 1); got {k_rtol}")


def _check_rank(rank, energy) -> None:
    if energy is not None:        # energy, when given, decides the rank
        if not 0 < energy <= 1:
            raise ValueError(f"energy is a share of sum_t ||w(t)||^2 and must lie in (0, 1]; got {energy}")
    elif not (_is_int(rank) and rank >= 1):
        raise ValueError(f"rank must be a positive int (or pass energy in (0, 1]); got rank={rank!r}")


def _layer_index(layer, n: int, what: str) -> int:
    if not _is_int(layer) or not -n <= layer < n:
        raise ValueError(f"{what} must be 'auto', None or a layer index in -{n}..{n - 1}; got {layer!r}")
    return int(layer) % n


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _explicit_heads(heads, n: int, n_heads: int) -> dict:
    if not hasattr(heads, "items"):
        raise ValueError(f"heads must be 'auto' or a mapping {{layer: [head, ...]}}; got {heads!r}")
    out = {}
    for layer, hs in heads.items():
        layer = _layer_index(layer, n, "a layer of heads")
        bad = [h for h in hs if not _is_int(h) or not 0 <= h < n_heads]
        if bad:
            raise ValueError(f"heads {bad} at layer {layer} are not query-head indices 0..{n_heads - 1}")
        if hs:
            out[layer] = tuple(sorted({int(h) for h in hs}))
    return out
