"""Which tokens are sinks, and how strong is the sink?

The chapter puts three papers' sink criteria side by side on the same models and prompts:

- the OutRo paper's Q1 (Sec. 3, Fig. 1a, App. A.2, Tables 1, A.1, A.3): the massive-activation criterion
  Phi_LLM against the sink-dimension ratio criterion Phi_VLM, sink dimensions against outlier dimensions, and
  Zero-K (Sec. 4, Figs. 4-5);
- the VL paper's Sink Strength S (Sec. 3.2), its strong-sink share (App. D.2), and its robustness to the
  calibration sample size (App. D.1), the window and the median (App. E.4, Table 13);
- the gradient-sinks paper's head-fraction criterion Sink^eps (Sec. 3).

Formulas of every criterion and statistic: the book's methods page (book/methods.md). Measurements come
from ``sinkbook.measures.criteria``, ``sinkbook.measures.strength`` and ``sinkbook.interventions.zero_k``;
the finding functions below only turn them into tables, figures and claims, so they run on synthetic
tables in the tests. Any model runs: a model with no massive activation, no sink layer, a single model
(no comparison across models) or fewer layers than the window gives "not comparable" claims and a note.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from ..core.claims import Finding, Rule, check, claim, slug
from ..core.models import REAL_MODELS
from ..core.profiles import NON_EMPTY, NON_NEGATIVE, POSITIVE, Profiles, above, at_least, between, each
from ..core.prompts import prompt_texts
from ..figures.sink_criteria import census_figure, head_fraction_figure, head_heatmaps, layer_boxes, zero_k_figure
from ..measures.criteria import census_summary
from ..measures.strength import STRONG_SINK_G, THIRDS, WINDOWS_E4, window_sweep
from ..runs.criteria import CriteriaRuns, TAU_SWEEP
from .base import Chapter, finding


NAME = "sink_criteria"
N_CALIBRATION, N_POOL = len(prompt_texts()), len(prompt_texts(None, "pool"))

_BOOK = dict(models=list(REAL_MODELS), n_prompts=15, census_prompts=15, zero_k_prompts=10, window=10, eps=0.3, t_eps=64,
             tau=20.0, seed=0, sweep_all_models=True, pool_prompts=100, sweep_sizes=[5, 10, 15, 25, 50, 100],
             sweep_seeds=3, explorer_prompts=3, explorer_tokens=64, interactive=False)
PROFILES = Profiles({
    # quick (CI): a 3-prompt census, Zero-K on 2 prompts, the sample-size sweep on the first model only and
    # over the 15 calibration prompts (no pool forward), a one-prompt explorer of 16 tokens.
    "quick": {**_BOOK, "census_prompts": 3, "zero_k_prompts": 2, "sweep_all_models": False, "pool_prompts": 0,
              "sweep_sizes": [5, 10, 15], "sweep_seeds": 2, "explorer_prompts": 1, "explorer_tokens": 16},
    "default": _BOOK,
    # gpu: the same measurements; pass hub models with -y 'models: [...]' on a machine that reaches the hub.
    "gpu": dict(_BOOK),
}, limits=dict(models=NON_EMPTY, n_prompts=between(1, N_CALIBRATION), census_prompts=between(1, N_CALIBRATION),
               zero_k_prompts=between(1, N_CALIBRATION), window=POSITIVE, eps=between(0, 1), t_eps=POSITIVE,
               tau=above(0), seed=NON_NEGATIVE, pool_prompts=between(0, N_POOL), sweep_sizes=each(POSITIVE),
               sweep_seeds=POSITIVE, explorer_prompts=between(1, N_CALIBRATION), explorer_tokens=at_least(2)))
ZERO_K_SINK_LAYER = 0.3               # ours: a layer counts as a sink layer when baseline attention to token 0 >= 0.3
HEAD_FRACTION_VOTE = 0.5              # ours: token 0 is the layer's sink when at least half the heads vote for it

# ---- the verdict rules, each written once ---------------------------------------------------------------------
# OutRo Q1 (Sec. 3): Phi_LLM "yields a sparse and stable set of sinks, typically one dominant token per layer".
# Read as: in the layers where it flags anything, the median number of tokens it flags per prompt rounds to one
# (<= 1.5); "typically" is the median over those layers.
PHI_LLM_PER_LAYER = 1.5
PHI_LLM_SPARSE = Rule.at_most(PHI_LLM_PER_LAYER, "median over flagging layers of tokens flagged per prompt "
                              "('typically one dominant token per layer')")
# OutRo Q1 / Fig. 1a, App. A.2: "As depth increases, the majority of tokens are classified as sinks" under Phi_VLM.
# Read as: more than half of the tokens flagged in the deep layers, the last third (where the census reads it).
PHI_VLM_MAJORITY = 0.5
PHI_VLM_OVERIDENTIFIES = Rule.above(PHI_VLM_MAJORITY, "share of tokens flagged, last third of layers ('the "
                                    "majority of tokens')")
SINK_DIMS_ARE_OUTLIERS = Rule("all sink dims are outlier dims", lambda share: share == 1)
ZERO_K_COLLAPSES = Rule("after/before <= 0.5 and lower in >= 90% of sink layers (thresholds ours)",
                        lambda v: v[0] <= 0.5 and v[1] >= 0.9)
HEAD_FRACTION_MOST_LAYERS = Rule(f"share of layers with Sink^eps >= {HEAD_FRACTION_VOTE:g} > 0.5 (thresholds ours)",
                                 lambda share: share > 0.5)
PER_HEAD_ABOVE_LAYERWISE = Rule("every per-head model's share > every layerwise model's share",
                                lambda v: v[0] > v[1])
PER_HEAD_ABOVE_NONE = Rule("every per-head model's share > every no-QK-norm model's share", lambda v: v[0] > v[1])
# VL Sec. 3.2: "per-head QK-RMSNorm pairs occupy the high-S range, no-QK-RMSNorm pairs the mid-S range". The
# sentence gives no bounds for the ranges, so we read it as the ordering it implies: every per-head model's S
# above every no-QK-norm model's. To keep the chat template from standing in for the architecture, the ordering
# must hold both with each model scored as the chapter scores it and with every model scored without a template.
ARCHITECTURE_ORDER = Rule.true("min S of the per-head QK-norm models > max S of the no-QK-norm models, with each "
                               "model's own scoring and with every model scored without a chat template")
SAMPLE_SIZE_SHIFT = Rule.at_most(0.11, "|S(5) - S(15)| (seed means)")
RISES_WITH_DEPTH = Rule("early < middle < late (mean over models)", lambda v: v[0] < v[1] < v[2])
WINDOW_ORDER_KEPT = Rule.true("no pair of models changes order by S across the last-K windows K = "
                              + ", ".join(str(k) for k in WINDOWS_E4) + " (clipped to the depth)")
MEAN_KEEPS_SIGN_AND_ORDER = Rule.true("mean G has the sign of S for every model and orders the models as S "
                                      "does, at the window K")
S_FINITE = Rule.true("S finite and no infinite G")
ALL_QUERIES_COUNTED = Rule.true("finite gaps == (real tokens - 1 per prompt) x heads x layers")
EXPLORER_COVERS = Rule.true("(layers, heads) of every pattern == the model's, and every prompt present")


def _per_model(statement: str, spec: str) -> str:
    return f"{statement} ({spec})"


def _one_model_reason(specs) -> tuple[bool, str]:
    return len(specs) >= 2, "one model in this run: there is no ordering of models to compare"


# ---- the models ------------------------------------------------------------------------------------------------

def models_finding(infos: list[dict]) -> Finding:
    """The models of the run (``architecture_info`` rows): one column per model, so the table stays narrow."""
    keep = ["family", "layers", "heads", "kv_heads", "head_dim", "hidden_size", "qk_norm", "chat_template"]
    table = pd.DataFrame(infos).set_index("spec")[keep].T
    return Finding("The models", table=table)


# ---- 1. Phi_LLM against Phi_VLM ---------------------------------------------------------------------------------

def census_finding(census: dict, hidden_sizes: dict, tau: float, taus=TAU_SWEEP) -> Finding:
    """Phi_LLM is sparse and Phi_VLM over-identifies (OutRo Q1): ``census`` maps spec -> ``sink_census``."""
    taus = sorted({float(tau), *map(float, taus)})
    specs = list(census)
    rows = {spec: census_summary(census[spec], hidden_sizes[spec], taus) for spec in specs}
    claims, notes = [], []
    for spec in specs:
        r = rows[spec]
        share, vlm, llm = r["Phi_LLM share (all layers)"], r[f"Phi_VLM tau={tau:g} share, last third"], \
            r["Phi_LLM share, last third"]
        has_massive = r["Phi_LLM flags"] > 0
        no_massive = "Phi_LLM flags no token on this model: it has no massive activation"
        per_layer = census[spec]["layers"]
        flagging = per_layer.phi_llm_sinks[per_layer.phi_llm_sinks > 0] / census[spec].get("n_prompts", 1)
        typical = float(flagging.median()) if len(flagging) else math.nan
        claims.append(claim(f"phi_llm_sparse_{slug(spec)}", "measured", "OutRo, Sec. 3 (Q1) and App. A.2",
                            _per_model("Phi_LLM finds a sparse, stable sink set, typically one token per layer", spec),
                            "typically one dominant token per layer", round(typical, 3), PHI_LLM_SPARSE,
                            precondition=(has_massive, no_massive)))
        fires = tau <= r["sqrt(D)"]
        why = (no_massive + ", so the sink dimensions are a fallback, not D_sink" if not r["massive dims found"]
               else f"tau = {tau:g} exceeds sqrt(D) = {r['sqrt(D)']:.1f}: Phi_VLM cannot flag any token")
        claims.append(claim(f"phi_vlm_overidentifies_{slug(spec)}", "measured", "OutRo, Q1 / Table A.3",
                            _per_model(f"Phi_VLM (tau={tau:g}) classifies the majority of tokens as sinks in the deep "
                                       "layers", spec),
                            "majority of tokens in deeper layers", round(float(vlm), 4), PHI_VLM_OVERIDENTIFIES,
                            value=float(vlm), precondition=(r["massive dims found"] and fires, why)))
        if has_massive:
            notes.append(f"{spec}: Phi_LLM flags {100 * share:.1f}% of tokens over all layers, "
                         f"{100 * r['Phi_LLM flags that are token 0']:.0f}% of them the first token.")
        else:
            notes.append(f"{spec}: Phi_LLM flags no token at any layer (no entry reaches max(100, 1000 x median |h|)); "
                         f"its sink dimensions {r['sink dims']} are the dims with the largest |h| / median |h| "
                         f"instead.")
        capped = [f"{t:g}" for t in taus if t > r["sqrt(D)"]]
        if capped:
            notes.append(f"{spec}: sqrt(D) = {r['sqrt(D)']:.1f}, so Phi_VLM cannot fire at tau = {', '.join(capped)}.")
    fig = census_figure({spec: (census[spec]["layers"], census[spec]["n_tokens"]) for spec in specs}, taus)
    table = pd.DataFrame(rows).drop(index=["Phi_LLM flags"])
    return Finding("Sinks per layer under Phi_LLM and Phi_VLM", claims=claims, table=table, figures=[fig],
                   notes=notes, data={"summary": rows})


# ---- 2. sink dimensions against outlier dimensions ---------------------------------------------------------------

def dimensions_finding(census: dict) -> Finding:
    """Sink dimensions are outlier dimensions (OutRo Table 1 / A.1); needs a model with massive activations."""
    rows, claims, notes = {}, [], []
    for spec, c in census.items():
        sink, outlier = set(c["sink_dims"]), set(c["outlier_dims"])
        overlap = len(sink & outlier)
        rows[spec] = {"sink dims": sorted(sink), "outlier dims": sorted(outlier), "n outlier dims": len(outlier),
                      "sink dims that are outliers": overlap, "share": overlap / max(len(sink), 1)}
        claims.append(claim(f"sink_dims_are_outliers_{slug(spec)}", "measured", "OutRo, Table 1 / A.1",
                            _per_model("sink dimensions are outlier dimensions", spec), "strong overlap",
                            f"{overlap}/{len(sink)}", SINK_DIMS_ARE_OUTLIERS, value=rows[spec]["share"],
                            precondition=(bool(c["sink_dims_are_massive"]),
                                          "no massive activation on this model: its sink dimensions are a fallback")))
        notes.append(f"{spec}: {overlap} of {len(sink)} sink dimensions are outlier dimensions "
                     f"({len(outlier)} outlier dimensions in all).")
    return Finding("Sink dimensions and outlier dimensions", claims=claims, table=pd.DataFrame(rows), notes=notes)


# ---- 3. Zero-K ------------------------------------------------------------------------------------------------

def zero_k_finding(zero_k: dict) -> Finding:
    """Zeroing the top-1 dim of the sink key suppresses attention to it (OutRo Sec. 4 / Figs. 4-5).

    ``zero_k`` maps spec -> DataFrame(layer, before, after) from ``zero_k_effect``; the claim looks at the sink
    layers only (baseline attention to token 0 >= 0.3) and is not comparable on a model without one."""
    rows, claims = {}, []
    for spec, z in zero_k.items():
        sink_layers = z[z.before >= ZERO_K_SINK_LAYER]
        n = len(sink_layers)
        before, after = (float(sink_layers.before.mean()), float(sink_layers.after.mean())) if n else (math.nan,) * 2
        ratio = after / before if n else math.nan
        dropped = float((sink_layers.after < sink_layers.before).mean()) if n else math.nan
        rows[spec] = {f"sink layers (baseline >= {ZERO_K_SINK_LAYER:g})": n, "mean before": before,
                      "mean after": after, "after / before": ratio, "layers where it dropped": dropped}
        claims.append(claim(f"zero_k_{slug(spec)}", "measured", "OutRo, Sec. 4 / Fig. 4-5",
                            _per_model("zeroing the top-1 dim of the sink key suppresses attention to the sink "
                                       "across layers", spec), "substantially eliminated", round(ratio, 3),
                            ZERO_K_COLLAPSES, value=(ratio, dropped),
                            precondition=(n > 0, f"no layer pays token 0 an attention of {ZERO_K_SINK_LAYER:g} or "
                                                 f"more at baseline: there is no sink to suppress")))
    return Finding("Zero-K", claims=claims, table=pd.DataFrame(rows), figures=[zero_k_figure(zero_k)])


# ---- 4. Sink Strength ---------------------------------------------------------------------------------------------

def _shares(table: pd.DataFrame, kind: str) -> pd.Series:
    return table.loc[table.qk_norm == kind, "strong fraction (G>2)"]


def _per_head_against(per_head: pd.Series, other: pd.Series, other_model: str, label: str):
    """(lowest per-head share, highest other share), its text, and the precondition: both kinds in the run."""
    missing = [kind for kind, shares in (("per-head QK-norm model", per_head), (other_model, other)) if shares.empty]
    if missing:
        return (math.nan, math.nan), "no pair", (False, "the run has no " + " and no ".join(missing))
    low, high = float(per_head.min()), float(other.max())
    return (low, high), f"{100 * low:.1f}% (per-head) vs {100 * high:.1f}% ({label})", (True, "")


def strength_finding(measured: dict) -> Finding:
    """S, the distribution of G and the strong-sink share by QK-norm kind (VL Sec. 3.2, App. D.2).

    ``measured`` maps spec -> {"summary": ``StrengthResult.summary``, "qk_norm", "heads": ``head_table`` (all
    layers), "boxes": ``layer_quantiles`` (window), "n_gaps", "expected_gaps", "g_finite"}."""
    table = pd.DataFrame({spec: {"qk_norm": m["qk_norm"], "chat": m["summary"]["chat"], "S": m["summary"]["S"],
                                 "mean G": m["summary"]["mean_G"],
                                 "strong fraction (G>2)": m["summary"]["strong_fraction"],
                                 **m["summary"]["quantiles"], "gaps": m["summary"]["n_gaps"],
                                 "seconds": m["summary"]["seconds"]} for spec, m in measured.items()}).T
    numeric = [c for c in table.columns if c not in ("qk_norm", "chat")]
    table[numeric] = table[numeric].astype(float)
    claims, notes = [], []
    per_head = _shares(table, "per-head")
    value, text, why = _per_head_against(per_head, _shares(table, "layerwise"), "layerwise QK-norm model", "layerwise")
    claims.append(claim("strong_sinks_per_head_vs_layerwise", "measured", "VL paper, App. D.2",
                        "the per-head QK-norm backbone has a larger share of strong sinks (G > 2) than the "
                        "layerwise QK-norm one", "58% (Qwen3-8B, per-head) vs 8.5% (Molmo2-O, layerwise)",
                        text, PER_HEAD_ABOVE_LAYERWISE, value=value, precondition=why))
    value, text, why = _per_head_against(per_head, _shares(table, "none"), "model without QK-norm", "none")
    claims.append(claim("strong_sinks_per_head_vs_none", "measured", "ours (after VL paper, App. D.2)",
                        "the per-head QK-norm model has a larger share of strong sinks (G > 2) than the model "
                        "without QK-norm", "not stated (the paper compares per-head with layerwise)",
                        text, PER_HEAD_ABOVE_NONE, value=value, origin="ours", precondition=why))
    for spec, m in measured.items():
        s = m["summary"]
        kind = "no QK-norm" if m["qk_norm"] == "none" else f"{m['qk_norm']} QK-norm"
        notes.append(f"{spec} ({kind}): S = {s['S']:.2f} over the last {s['window']} layers; "
                     f"{100 * s['strong_fraction']:.1f}% of (layer, head, query) have G > {STRONG_SINK_G:g}.")
        claims.append(check(f"check_s_finite_{slug(spec)}", _per_model("S is finite and G has no infinities", spec),
                            bool(math.isfinite(s["S"]) and m["g_finite"]), S_FINITE, expected=True))
        claims.append(check(f"check_every_query_counted_{slug(spec)}",
                            _per_model("every real query but the first of each prompt is counted", spec),
                            m["n_gaps"] == m["expected_gaps"], ALL_QUERIES_COUNTED, expected=True))
    return Finding("Sink Strength S and the distribution of G", claims=claims, table=table.T,
                   figures=[head_heatmaps({spec: m["heads"] for spec, m in measured.items()}),
                            layer_boxes({spec: (m["boxes"], m["summary"]["window"]) for spec, m in measured.items()})],
                   notes=notes)


def architecture_finding(measured: dict, without_template: dict) -> Finding:
    """The VL paper's architectural correlate (Sec. 3.2) on the models of the run: S by QK-norm kind, scored as
    in ``strength_finding`` (``measured``) and with every model scored without a chat template
    (``without_template``: spec -> S)."""
    rows = {spec: {"QK-norm": m["qk_norm"], "chat template used": bool(m["summary"]["chat"]),
                   "S (as scored above)": float(m["summary"]["S"]), "S (no chat template)": without_template[spec]}
            for spec, m in measured.items()}
    table = pd.DataFrame(rows).T
    kinds = {spec: m["qk_norm"] for spec, m in measured.items()}
    per_head = [spec for spec, k in kinds.items() if k == "per-head"]
    none = [spec for spec, k in kinds.items() if k == "none"]
    present = (bool(per_head and none), "the run needs a per-head QK-norm model and a model without QK-norm "
               f"(kinds here: {', '.join(f'{s} {k}' for s, k in kinds.items())})")

    def ordered(column):
        return bool(per_head and none and min(rows[s][column] for s in per_head) > max(rows[s][column] for s in none))

    native, plain = ordered("S (as scored above)"), ordered("S (no chat template)")
    text = "; ".join(f"{s} ({kinds[s]}): S {rows[s]['S (as scored above)']:.2f}"
                     f"{' with its chat template' if rows[s]['chat template used'] else ''}, "
                     f"{rows[s]['S (no chat template)']:.2f} without" for s in rows)
    found = claim("s_architecture_correlate", "measured", "VL paper, Sec. 3.2",
                  "models with per-head QK-RMSNorm sit above models without QK-norm in S (high-S against mid-S "
                  "range)", "per-head: high S; no QK-norm: mid S", text, ARCHITECTURE_ORDER,
                  value=native and plain, precondition=present)
    instruct = [s for s in rows if rows[s]["chat template used"]]
    # what the two models cannot separate, stated in the verdict itself
    found.caveat = (f"{len(per_head)} per-head and {len(none)} no-QK-norm model(s), so family, size, training data "
                    "and instruction tuning all differ with the QK-norm kind"
                    + (f"; {', '.join(instruct)} scored with a chat template, the others (base models) without: "
                       "the no-template column removes the template, not the instruction tuning" if instruct else ""))
    notes = [f"Ordering per-head above no-QK-norm: {'yes' if native else 'no'} as scored above, "
             f"{'yes' if plain else 'no'} with no chat template for any model."]
    return Finding("Sink Strength and the QK-norm architecture", claims=[found], table=table, notes=notes)


def cost_finding(timings: dict) -> Finding:
    """One timing per model: S (all layers) against a plain forward pass over the same prompts. No verdict:
    one run on a shared machine is not a benchmark (``scripts/bench_strength.py`` is)."""
    table = pd.DataFrame({spec: {"plain forward s": t["forward_s"], "S (all layers) s": t["strength_s"],
                                 "ratio": t["strength_s"] / t["forward_s"]} for spec, t in timings.items()}).T
    notes = [f"{spec}: S took {r['ratio']:.2f}x the time of a plain forward pass over the same prompts "
             f"(one run each)." for spec, r in table.iterrows()]
    return Finding("Cost of S", table=table, notes=notes)


# ---- 5. robustness of S ---------------------------------------------------------------------------------------------

def sample_size_finding(sweeps: dict) -> Finding:
    """S moves little between N = 5 and N = 15 prompts (VL App. D.1). ``sweeps``: spec -> ``sample_size_sweep``."""
    claims, notes, frames = [], [], []
    for spec, sweep in sweeps.items():
        s = (sweep.groupby("N").agg(S_mean=("S", "mean"), S_sd=("S", "std")) if len(sweep)
             else pd.DataFrame(columns=["S_mean", "S_sd"]))
        frames.append(s.assign(model=spec).reset_index())
        have = {5, 15} <= set(s.index)
        shift = abs(s.loc[5, "S_mean"] - s.loc[15, "S_mean"]) if have else math.nan
        claims.append(claim(f"s_sample_size_{slug(spec)}", "measured", "VL paper, App. D.1",
                            _per_model("S moves little between N=5 and N=15 calibration prompts", spec), "<= 0.11",
                            round(float(shift), 3), SAMPLE_SIZE_SHIFT,
                            precondition=(have, "the sweep has no N = 5 and N = 15 subsets (too few prompts "
                                                "measured)")))
        if len(s.index) >= 2 and 10 in s.index:
            largest = int(s.index.max())
            notes.append(f"{spec}: S moves by {abs(s.loc[10, 'S_mean'] - s.loc[largest, 'S_mean']):.3f} between "
                         f"N=10 and N={largest}.")
    table = (pd.concat(frames).pivot(index="N", columns="model", values=["S_mean", "S_sd"]) if frames
             else pd.DataFrame())
    return Finding("Sample size", claims=claims, table=table, notes=notes)


def _orders_agree(a: dict, b: dict) -> bool:
    """Every pair of models is ordered the same way by the values in ``a`` and in ``b`` (spec -> number)."""
    return all(np.sign(a[x] - a[y]) == np.sign(b[x] - b[y]) for x, y in itertools.combinations(a, 2))


def window_finding(windows: dict, at_window: dict) -> Finding:
    """The last-K window and the median (VL App. E.4).

    ``windows``: spec -> ``window_sweep`` over ``WINDOWS_E4`` (K clipped to the depth); ``at_window``: spec ->
    (S, mean G, K) at the chapter's window, K clipped to the model's depth."""
    specs = list(windows)
    table = pd.concat([w.assign(model=spec) for spec, w in windows.items()])
    table["window"] = pd.Categorical(table["window"], categories=list(dict.fromkeys(table["window"])), ordered=True)
    by_window = table.pivot(index="window", columns="model", values="S")
    comparable = _one_model_reason(specs)
    columns = [dict(by_window.loc[k, specs]) for k in by_window.index]
    order_kept = all(_orders_agree(columns[0], c) for c in columns[1:])
    median = {spec: at_window[spec][0] for spec in specs}
    mean = {spec: at_window[spec][1] for spec in specs}
    sign_kept = all(np.sign(median[s]) == np.sign(mean[s]) for s in specs)
    mean_order_kept = _orders_agree(median, mean)
    claims = [
        claim("s_window_ordering", "measured", "VL paper, App. E.4",
              "the ordering of models by S does not depend on the last-K window", "no pairwise reversal",
              ("same" if order_kept else "reversed") if comparable[0] else "one model", WINDOW_ORDER_KEPT,
              value=order_kept, precondition=comparable),
        claim("s_median_vs_mean", "measured", "VL paper, App. E.4",
              "using the mean instead of the median keeps the sign of S and the model ordering", "preserved",
              f"ordering {'kept' if mean_order_kept else 'changed'}, sign {'kept' if sign_kept else 'changed'}"
              if comparable[0] else f"one model; sign {'kept' if sign_kept else 'changed'}",
              MEAN_KEEPS_SIGN_AND_ORDER, value=mean_order_kept and sign_kept, precondition=comparable)]
    notes = [f"{spec}: over the last {at_window[spec][2]} layers S = {median[spec]:.2f}, mean G = {mean[spec]:.2f}."
             for spec in specs]
    shown = table.pivot(index="window", columns="model", values=["S", "mean_G"])
    return Finding("Window and median", claims=claims, table=shown, notes=notes)


def thirds_finding(thirds: dict) -> Finding:
    """S rises with depth over equal thirds of the decoder (VL Table 13). ``thirds``: spec -> ``window_sweep``
    over ``THIRDS``, or None for a model with fewer than three layers."""
    rows = {}
    for spec, t in thirds.items():
        values = t.set_index("window").loc[list(THIRDS), "S"].round(3).tolist() if t is not None else []
        rows[spec] = dict(zip(THIRDS, values))
    # Table 13 prints the mean over its six pairs, so the claim is about the mean over our models (each model's
    # thirds are in the table)
    complete = [v for v in rows.values() if len(v) == 3]
    mean = [round(float(np.mean([v[k] for v in complete])), 3) for k in THIRDS] if complete else []
    claims = [claim("s_rises_with_depth", "measured", "VL paper, Table 13",
                    f"S, averaged over the models, rises from the early to the middle to the late third of the decoder "
                    f"({len(complete)} model{'s' if len(complete) != 1 else ''})",
                    "+0.20 / +0.91 / +1.56 (mean of six pairs)", mean, RISES_WITH_DEPTH,
                    precondition=(bool(complete), "no model has three layers: the thirds are not defined"))]
    notes = ["Table 13 also reports the rank correlation of each third's S with the IFEval gap (the early third "
             "carries almost no signal); that needs the VLM pairs and is not measured here."]
    return Finding("S by third of the decoder", claims=claims, table=pd.DataFrame(rows), notes=notes)


# ---- 6. head fraction --------------------------------------------------------------------------------------------

def _corr(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 and a.std() > 0 and b.std() > 0 else math.nan


def head_fraction_finding(census: dict) -> Finding:
    """Token 0 is the sink by the gradient-sinks paper's head-fraction criterion in most layers (Sec. 3)."""
    rows, claims = {}, []
    vote = f"layers with Sink^eps >= {HEAD_FRACTION_VOTE:g}"
    for spec, c in census.items():
        per_layer = c["layers"]
        rows[spec] = {vote: float((per_layer.sink_eps >= HEAD_FRACTION_VOTE).mean()),
                      "median Sink^eps": float(per_layer.sink_eps.median()),
                      "median M_0": float(per_layer.M_s.median()),
                      "median S_0 / M_0": float((per_layer.S_s / per_layer.M_s).median()),
                      "corr(Sink^eps, attention to token 0)": _corr(per_layer.sink_eps, per_layer.attn_to_first)}
        # the criterion is the paper's, the question and both vote thresholds are ours: origin "ours"
        claims.append(claim(f"head_fraction_{slug(spec)}", "measured", "ours (the gradient-sinks paper's Sink^eps, "
                            "Sec. 3, with our vote thresholds)",
                            _per_model("token 0 is a sink by the head-fraction criterion in most layers", spec),
                            "not stated (the paper uses Sink^eps as a measure)", round(rows[spec][vote], 3),
                            HEAD_FRACTION_MOST_LAYERS, origin="ours"))
    fig = head_fraction_figure({spec: c["layers"] for spec, c in census.items()})
    return Finding("Head fraction and column mass", claims=claims, table=pd.DataFrame(rows), figures=[fig])


# ---- the explorer -------------------------------------------------------------------------------------------------

def explorer_finding(datasets: list[dict], expected_prompts: int) -> Finding:
    """Checks that the explorer's data (``book.explorer.explorer_data`` per model) covers every layer and head."""
    claims = []
    for d in datasets:
        covered = all(p["pattern"].shape[:2] == (d["layers"], d["heads"]) for p in d["prompts"])
        claims.append(check(f"check_explorer_covers_{slug(d['model'])}",
                            _per_model(f"the explorer covers every layer and head of {expected_prompts} prompts",
                                       d["model"]),
                            bool(covered and len(d["prompts"]) == expected_prompts), EXPLORER_COVERS, expected=True))
    return Finding("Per-head attention explorer", claims=claims)


# ---- the chapter ------------------------------------------------------------------------------------------------

class SinkCriteriaChapter(Chapter):
    """The chapter's findings in notebook order, each reading ``runs.criteria`` measurements (computed once)."""
    NAME = NAME
    PROFILES = PROFILES

    def __init__(self, settings):
        super().__init__(settings)
        self.runs = CriteriaRuns(settings)

    @finding
    def models(self) -> Finding:
        return models_finding(list(self.runs.info().values()))

    @finding
    def criteria(self) -> Finding:
        return census_finding(self.runs.census(), {spec: i["hidden_size"] for spec, i in self.runs.info().items()},
                              self.settings.tau)

    @finding
    def dimensions(self) -> Finding:
        return dimensions_finding(self.runs.census())

    @finding
    def zero_k(self) -> Finding:
        return zero_k_finding(self.runs.zero_k_tables())

    @finding
    def strength(self) -> Finding:
        return strength_finding(self.runs.strength_measured())

    @finding
    def architecture(self) -> Finding:
        return architecture_finding(self.runs.strength_measured(), self.runs.strength_without_template())

    @finding
    def cost(self) -> Finding:
        return cost_finding(self.runs.timings())

    @finding
    def sample_size(self) -> Finding:
        return sample_size_finding(self.runs.sample_sweeps())

    @finding
    def windows(self) -> Finding:
        results = self.runs.strength_results()
        at_window = {spec: (s["S"], s["mean_G"], s["window"]) for spec, s in self.runs.strength_summaries().items()}
        return window_finding({spec: window_sweep(r, WINDOWS_E4) for spec, r in results.items()}, at_window)

    @finding
    def thirds(self) -> Finding:
        return thirds_finding({spec: window_sweep(r, THIRDS) if r.n_layers >= 3 else None
                               for spec, r in self.runs.strength_results().items()})

    @finding
    def head_fraction(self) -> Finding:
        return head_fraction_finding(self.runs.census())

    @finding
    def explorer(self) -> Finding:
        """The checks on the explorer's data; the finding's ``data["datasets"]`` is what the explorer draws."""
        datasets = self.runs.explorer_data()
        found = explorer_finding(datasets, len(self.runs.explorer_prompts()))
        found.data["datasets"] = datasets
        return found

    def model_records(self) -> list[dict]:
        return [m.record() for m in self.runs.loaded.values()]

    def extra(self) -> dict:
        return {"sink_strength": self.runs.sink_strength_extra()}
