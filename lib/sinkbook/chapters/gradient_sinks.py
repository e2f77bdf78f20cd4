"""Gradient sinks and V-scale: Llama models trained from scratch on Shakespeare, and two pretrained models; the
second half (a synthetic setting with a sink, the V-scale retrofit, quantisation) is in ``gradient_sinks_with_sink``.

The gradient-sinks paper argues that an attention sink on token 0 is also a gradient sink (its value state
collects the upstream gradient of every query that attends to it), that massive activations on token 0 damp
that concentrated gradient through the pre-norm RMSNorm, and that V-scale, a learned valve on small value
states, removes most of the gradient sink and of the massive activations while keeping the attention sink and
the loss. We train a baseline and a V-scale model with identical data, seed and recipe at sizes a CPU can
afford, run the paper's probes on them and on two pretrained models, and compare with the paper's 0.3B numbers
(``data/gradient_sinks_paper/reported_0p3b.csv``). Formulas (R_GS, Bloat / Change / Compress, V-scale,
Sink^eps) are on the book's methods page (``book/methods.md``); the probes are
``sinkbook.measures.gradprobes``.

A claim is only tested on a model that has what it is about: "baseline shows a gradient sink" needs an
attention sink in the baseline, every V-scale claim needs both the attention sink and the massive activation in
the baseline, a pretrained model's claims need its attention sink. Otherwise the claim is "not comparable" and
a note says what is missing. Every model the library supports runs through the probes, including tiny random
models without any sink.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..core.arch import UnsupportedArchitecture
from ..core.claims import Finding, Rule, check, claim, slug
from ..core.models import ModelNotAvailable, load_model, resolve_device
from ..core.paths import REPO_ROOT
from ..core.profiles import Profiles, Settings, SettingsError
from ..measures.gradprobes import (RGS_T_E, SINK_EPS, ProbeResult, probe_batch, shows_sink_and_massive_activation,
                                   text_windows)
from ..interventions.vscale import SIGMA, learned_theta, raw_value_norms, raw_values
from ..training.corpus import load_corpus, validation_batches
from ..training.scratch import SIZES, TrainConfig, load_checkpoints, train

CHAPTER = "gradient_sinks"
PAPER_CSV = REPO_ROOT / "data" / "gradient_sinks_paper" / "reported_0p3b.csv"
EMERGENCE_DIR = REPO_ROOT / "measurements" / "sink_emergence"
SRC = "Gradient-sinks paper"
REAL_MODELS = ["smollm2-135m-instruct", "gemma3-270m"]

PROFILES = Profiles({
    # quick: CI smoke run, a tiny model and a few steps; nothing scientific is expected of it
    "quick": dict(size=None, sweep_sizes=["nano"], steps_by_size={"nano": 60}, steps=None, batch_size=8,
                  context=72, bos=True, seed=0, lr=3e-3, real_models=REAL_MODELS, real_batch=1, real_context=80,
                  use_cache=True, sink_steps=200, sink_seeds=[0], retrofit_model="tiny-llama", retrofit_steps=3),
    # default: each model trains in <= 10 minutes on 2 CPU cores (uncontended)
    "default": dict(size=None, sweep_sizes=["nano", "xs"], steps_by_size={"nano": 3000, "xs": 1800, "s": 1200},
                    steps=None, batch_size=16, context=128, bos=True, seed=0, lr=3e-3, real_models=REAL_MODELS,
                    real_batch=2, real_context=256, use_cache=True, sink_steps=2000, sink_seeds=[0, 1, 2],
                    retrofit_model="smollm2-135m-instruct", retrofit_steps=40),
    "gpu": dict(size=None, sweep_sizes=["s", "m", "l", "0.1b"],
                steps_by_size={"s": 5000, "m": 5000, "l": 5000, "0.1b": 5000}, steps=None, batch_size=32,
                context=256, bos=True, seed=0, lr=3e-3, real_models=REAL_MODELS, real_batch=8, real_context=512,
                use_cache=True, sink_steps=4000, sink_seeds=[0, 1, 2, 3, 4], retrofit_model="smollm2-135m-instruct",
                retrofit_steps=500),
})

EVAL_EVERY = 500          # validation every 500 steps and at the end (part of the cached runs' configuration)
SNAPSHOTS = 8             # weight snapshots per baseline run, for the training-trajectory figure

# What a model worth studying shows (our criterion, not the paper's): in the middle layers, Sink^eps(0) >= 0.5
# (an attention sink) and, in some middle layer, a token-0 residual norm >= 5x the mean of tokens 1-31
# (a massive activation). Passed to ``shows_sink_and_massive_activation`` so it is written once.
SINK_MIN, RATIO_MIN = 0.5, 5.0
LOSS_TOLERANCE = 0.02     # nats; ours: the paper reports V-scale 0.01 nats better at 0.3B and calls it parity
KEEP_SINK_SHARE = 0.8     # ours: "keeps the sink" = keeps at least 80 % of the baseline's Sink^eps
GRAD_Q0_TOLERANCE = 1e-5  # about 100 float32 ulps: SDPA leaves |grad q_0| at rounding level (up to 2e-6 seen), not 0

SIZE_WITH_SINK = Rule.true(f"Sink^eps(middle) >= {SINK_MIN:g} and token-0 ratio >= {RATIO_MIN:g} for some size tried")
GRADIENT_SINK = Rule.between(10, 100, "median R_GS(0; 31)")
LOWERS = Rule("V-scale < baseline", lambda pair: pair[1] < pair[0])
KEEPS_SINK = Rule(f"V-scale >= {KEEP_SINK_SHARE:g} x baseline (factor ours)",
                  lambda pair: pair[1] >= KEEP_SINK_SHARE * pair[0])
LOSS_PARITY = Rule(f"|V-scale - baseline| <= {LOSS_TOLERANCE:g} nats (tolerance ours)",
                   lambda pair: abs(pair[1] - pair[0]) <= LOSS_TOLERANCE)
THETA_EARLY_LARGER = Rule("mean theta first half > second half", lambda pair: pair[0] > pair[1])
THETA_LATE_NEGATIVE = Rule.above(0.5, "share of second-half theta below 0")
VALUE_SPIKE = Rule("value spike > key spike", lambda pair: pair[0] > pair[1])
GRAD_Q0_ZERO = Rule.at_most(GRAD_Q0_TOLERANCE, "max |grad q_0| / max |grad q_t|")
FINITE = Rule.true("every R_GS and validation loss is finite")


# ---- published numbers -------------------------------------------------------------------------------------

def reported_0p3b(path: str | Path | None = None) -> dict[str, tuple[float, float]]:
    """{quantity: (baseline, V-scale)} as the paper reports them at 0.3B."""
    table = pd.read_csv(path or PAPER_CSV)
    return {r.quantity: (float(r.baseline), float(r.vscale)) for r in table.itertuples()}


def paper_values_finding(path: str | Path | None = None) -> Finding:
    """The paper's 0.3B baseline and V-scale numbers, as published (no claim: they are what we compare with)."""
    table = pd.read_csv(path or PAPER_CSV).set_index("quantity")
    return Finding("The paper's 0.3B numbers", table=table[["baseline", "vscale", "source"]].rename(
        columns={"vscale": "V-scale"}))


def _paper(pair: tuple[float, float], fmt: str) -> str:
    return f"{pair[0]:{fmt}} -> {pair[1]:{fmt}}"


# ---- small measured quantities -----------------------------------------------------------------------------

def probe_raw_values(model, input_ids) -> ProbeResult:
    """``probe_batch`` on a V-scale model, with the value path (gradient and norms) taken at the raw value states
    before V-scale, where the paper takes it (the hook library's ``v_proj`` point is after V-scale)."""
    with raw_values(model) as raw:
        probe = probe_batch(model, input_ids)
    return dataclasses.replace(probe, grad_v=raw.grad_norms().numpy(), value_norm=raw.norms().numpy())


def sink_check(probe: ProbeResult) -> dict:
    """Our criterion for an attention sink and a massive activation (thresholds SINK_MIN and RATIO_MIN)."""
    return shows_sink_and_massive_activation(probe, sink_min=SINK_MIN, ratio_min=RATIO_MIN)


def path_spikes(probe: ProbeResult) -> dict[str, float]:
    """Token 0's gradient norm over the mean of tokens 1-31 on the key and value paths (mean over layers)."""
    return {path: float(g[:, 0].mean() / g[:, 1:RGS_T_E + 1].mean())
            for path, g in (("key", probe.grad_k), ("value", probe.grad_v))}


def grad_q0_share(probe: ProbeResult) -> float:
    """Largest |grad q_0| over layers relative to the largest |grad q_t| of any token and layer."""
    largest = float(probe.grad_q.max())
    return float(probe.grad_q[:, 0].max()) / largest if largest > 0 else 0.0


def theta_halves(theta) -> tuple[float, float]:
    """Mean learned theta over the first and over the second half of the layers ((layers, heads) array)."""
    theta = np.asarray(theta)
    return float(theta[: max(1, len(theta) // 2)].mean()), float(theta[len(theta) // 2:].mean())


def _missing(check_: dict, need_massive: bool) -> str:
    """Why a claim is not comparable: what the baseline lacks, with its numbers against the thresholds."""
    lacks = []
    if not check_["sink"]:
        lacks.append(f"no attention sink (Sink^eps middle {check_['sink_rate_middle']:.2f} < {SINK_MIN:g})")
    if need_massive and not check_["massive"]:
        lacks.append(f"no massive activation (token-0 ratio {check_['token0_ratio_middle_max']:.2f} < {RATIO_MIN:g})")
    return "the baseline has " + " and ".join(lacks)


# ---- size sweep --------------------------------------------------------------------------------------------

def choose_size(rows: list[dict], size: str | None, profile: str) -> tuple[str, str]:
    """(size studied, why): the parameter when set, else the smallest size with both a sink and massive
    activation, else the largest size tried."""
    qualifying = [r["size"] for r in rows if r["sink + massive"]]
    if size:
        return size, f"size {size!r} was set as a parameter"
    if qualifying:
        return qualifying[0], (f"{qualifying[0]!r} is the smallest size tried in which the baseline shows both an "
                               f"attention sink and massive activations")
    tried = [r["size"] for r in rows]
    next_step = ("the 'gpu' profile trains larger ones" if profile != "gpu"
                 else "more steps (the steps parameter) or larger sizes would be the next thing to try")
    return tried[-1], (f"no size tried ({', '.join(tried)}) shows both at this training budget; we study the "
                       f"largest, {tried[-1]!r}; {next_step}")


def sweep_finding(rows: list[dict], size: str | None = None, profile: str = "default") -> Finding:
    """The size sweep: one column per size (shape, budget, loss, sink criteria) and the size studied next.

    ``rows``: one dict per size with keys size, shape, parameters (M), steps, tokens seen (M), train minutes,
    val loss, Sink^eps middle, token-0 ratio (max, middle), median R_GS, sink + massive."""
    chosen, why = choose_size(rows, size, profile)
    qualifying = [r["size"] for r in rows if r["sink + massive"]]
    table = pd.DataFrame(rows).set_index("size").T
    table.index.name = None
    found = claim(
        "size_with_sink", "measured", "chapter set-up",
        "a baseline trained here shows an attention sink and massive activations", "n/a",
        "; ".join(f"{r['size']}: sink {r['Sink^eps middle']:.2f}, ratio {r['token-0 ratio (max, middle)']:.1f}"
                  for r in rows), SIZE_WITH_SINK, value=bool(qualifying), origin="ours")
    return Finding("Which size shows a sink at all?", claims=[found], table=table,
                   notes=[f"Chosen size: {chosen} ({why})."], data={"chosen": chosen, "qualifying": qualifying})


# ---- training trajectories ---------------------------------------------------------------------------------

TRAJECTORY_COLUMNS = ("Sink^eps middle", "token-0 ratio (max, middle)", "largest alpha_0 of a head")


def trajectory_row(step: int, probe: ProbeResult) -> dict:
    check_ = sink_check(probe)
    return {"step": step, "Sink^eps middle": check_["sink_rate_middle"],
            "token-0 ratio (max, middle)": check_["token0_ratio_middle_max"],
            "largest alpha_0 of a head": float(probe.alpha0.max()),
            "median R_GS": float(probe.summary()["median_r_gs"]), "sink + massive": check_["both"]}


def training_trajectory(checkpoints, input_ids) -> pd.DataFrame:
    """Probe each (step, model) of ``load_checkpoints`` on one batch: how the attention sink, the token-0 norm
    ratio and the gradient sink grow during training (middle layers, as in the size criterion)."""
    return pd.DataFrame([trajectory_row(step, probe_batch(model, input_ids)) for step, model in checkpoints])


def trend_notes(trajectories: dict[str, pd.DataFrame]) -> list[str]:
    """Per size: the last values against the thresholds, and their change per 1000 steps over the second half."""
    notes = []
    for size, t in trajectories.items():
        if len(t) < 3:
            notes.append(f"{size}: no intermediate snapshots in this (cached) run, so no trend can be read.")
            continue
        half = t[t.step >= t.step.max() / 2]
        sink_slope = np.polyfit(half.step, half["Sink^eps middle"], 1)[0] * 1000
        ratio_slope = np.polyfit(half.step, half["token-0 ratio (max, middle)"], 1)[0] * 1000
        last = t.iloc[-1]
        notes.append(f"{size}: at step {int(last.step)} Sink^eps(middle) = {last['Sink^eps middle']:.2f} "
                     f"(threshold {SINK_MIN:g}), token-0 ratio = {last['token-0 ratio (max, middle)']:.2f} "
                     f"(threshold {RATIO_MIN:g}); over the second half of training they changed by "
                     f"{sink_slope:+.3f} and {ratio_slope:+.2f} per 1000 steps.")
    return notes


def _threshold_figure(curves: dict[str, pd.DataFrame], columns: tuple, titles: tuple, thresholds: tuple):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=titles)
    for name, t in curves.items():
        for col, key in enumerate(columns, start=1):
            fig.add_trace(go.Scatter(x=t.step, y=t[key], name=name, legendgroup=name, showlegend=col == 1,
                                     mode="lines+markers"), 1, col)
    for col, y in enumerate(thresholds, start=1):
        fig.add_hline(y=y, line_dash="dash", row=1, col=col)
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=330)
    return fig


def trajectory_finding(trajectories: dict[str, pd.DataFrame]) -> Finding:
    """Sink, token-0 ratio and largest alpha_0 across each baseline's snapshots, with the thresholds."""
    fig = _threshold_figure(trajectories, TRAJECTORY_COLUMNS,
                            ("Sink^eps(0), middle layers", "token-0 ratio (max, middle)",
                             "largest alpha_0 of any head"),
                            (SINK_MIN, RATIO_MIN, SINK_EPS))
    frames = [t.assign(size=size) for size, t in trajectories.items() if len(t)]
    table = pd.concat(frames).set_index(["size", "step"]) if frames else None
    return Finding("How they grow during training", table=table, figures=[fig], notes=trend_notes(trajectories))


# ---- recorded longer runs ----------------------------------------------------------------------------------

def load_emergence_runs(directory: str | Path | None = None) -> pd.DataFrame:
    """The runs recorded by ``scripts/sink_emergence.py`` (one row per probe; columns run, step, tokens (M),
    sink_rate_middle, token0_ratio_middle_max, largest_alpha0, val_loss, ..., status, command).

    Training batch and context are the file's ``batch`` and ``context`` fields; files written before those
    fields existed were all trained with the script's defaults, which are ``TrainConfig``'s."""
    frames = []
    for path in sorted(Path(directory or EMERGENCE_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        rows = pd.DataFrame(record["rows"])
        batch = int(record.get("batch", TrainConfig.batch_size))
        context = int(record.get("context", TrainConfig.context))
        rows.insert(0, "run", path.stem)
        rows["data"] = record.get("data", "shakespeare")
        rows["tokens (M)"] = rows.step * batch * context / 1e6
        rows["status"], rows["command"] = record.get("status", ""), record.get("command", "")
        frames.append(rows)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def recorded_runs_finding(long_runs: pd.DataFrame) -> Finding:
    """Plot the recorded longer runs as they are, with the last probe of each and the command that made it."""
    title = "Longer runs, recorded"
    if long_runs.empty:
        return Finding(title, notes=["No recorded runs found under measurements/sink_emergence/."])
    curves = {name: run for name, run in long_runs.groupby("run", sort=False)}
    fig = _threshold_figure(curves, ("sink_rate_middle", "token0_ratio_middle_max"),
                            ("Sink^eps(0), middle layers", "token-0 ratio (max, middle)"), (SINK_MIN, RATIO_MIN))
    last = long_runs.groupby("run", sort=False).tail(1).set_index("run")
    table = last[["data", "step", "tokens (M)", "sink_rate_middle", "token0_ratio_middle_max", "largest_alpha0",
                  "val_loss", "status"]].rename(columns={"sink_rate_middle": "Sink^eps middle",
                                                         "token0_ratio_middle_max": "token-0 ratio",
                                                         "largest_alpha0": "largest alpha_0", "val_loss": "val loss"})
    notes = [f"{run}: {command}" for run, command in last.command.items()]
    return Finding(title, table=table, figures=[fig], notes=["Commands that recorded them:", *notes])


# ---- late-query attention ----------------------------------------------------------------------------------

def late_query_attention(model, input_ids, key_masks: dict, first_query: int = 32) -> dict:
    """{name: (layers, heads) array}: the mean attention mass that queries at positions >= ``first_query`` put on
    the keys selected by each (batch, tokens) boolean mask, e.g. token 0 or every line break. Reduced per head
    inside the capture hook, so no (layers x heads x T x T) tensor is kept."""
    from ..core.hooks import capture
    if input_ids.shape[1] <= first_query:
        raise ValueError(f"sequences of {input_ids.shape[1]} tokens have no query at position >= {first_query}")
    device = next(model.parameters()).device
    masks = {name: m.to(device=device, dtype=torch.float32) for name, m in key_masks.items()}
    shares: dict = {name: {} for name in masks}

    def reduce(pattern, layer):                       # (B, H, T, S)
        late = pattern[:, :, first_query:, :].float()
        for name, m in masks.items():
            shares[name][layer] = (late * m[:, None, None, :]).sum(-1).mean((0, 2)).cpu().numpy()
        return None

    with torch.no_grad(), capture(model, points=("pattern",), reducers={"pattern": reduce}):
        model(input_ids=input_ids.to(device))
    return {name: np.stack([per_layer[l] for l in sorted(per_layer)]) for name, per_layer in shares.items()}


def uniform_share(key_mask, first_query: int = 32) -> float:
    """What ``late_query_attention`` would give for a head that spreads attention evenly over the causal past."""
    m = key_mask.float()
    seen = m.cumsum(1) / torch.arange(1, m.shape[1] + 1)  # share of masked keys among 0..t
    return float(seen[:, first_query:].mean())


def late_attention_finding(shares: dict[str, dict[str, np.ndarray]], uniform: dict[str, float]) -> Finding:
    """Per size and layer: the largest head's late-query share on token 0 and on line breaks, against uniform.

    ``shares``: {size: {"token 0": (L, H), "line breaks": (L, H)}}; ``uniform``: {"token 0": x, "line breaks": y}."""
    rows = [{"size": size, "layer": layer,
             "token 0: largest head": float(by_key["token 0"][layer].max()), "token 0: uniform": uniform["token 0"],
             "line breaks: largest head": float(by_key["line breaks"][layer].max()),
             "line breaks: uniform": uniform["line breaks"]}
            for size, by_key in shares.items() for layer in range(by_key["token 0"].shape[0])]
    table = pd.DataFrame(rows).set_index(["size", "layer"])
    size, layer = table["token 0: largest head"].idxmax()
    top = table.loc[(size, layer), "token 0: largest head"]
    note = (f"Largest share of a head's late-query attention on token 0: {top:.3f} ({size}, layer {layer}); a sink "
            f"head would put most of its attention there.")
    return Finding("Where do later queries look instead?", table=table, notes=[note], data={"rows": rows})


# ---- baseline against V-scale ------------------------------------------------------------------------------

def training_finding(runs: dict[str, dict]) -> Finding:
    """Training and validation loss of the baseline and the V-scale model.

    ``runs``: {name: {"steps", "train_seconds", "from_cache", "history": [{"step", "loss"}], "evals": [{"step",
    "val_loss"}]}}."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training loss (50-step mean)", "validation loss"))
    notes = []
    for name, r in runs.items():
        h, e = pd.DataFrame(r["history"]), pd.DataFrame(r["evals"])
        fig.add_trace(go.Scatter(x=h.step, y=h.loss.rolling(50, min_periods=1).mean(), name=f"{name} train"), 1, 1)
        fig.add_trace(go.Scatter(x=e.step, y=e.val_loss, name=f"{name} val", mode="lines+markers"), 1, 2)
        notes.append(f"{name}: {r['steps']} steps in {r['train_seconds'] / 60:.1f} min"
                     f"{' (loaded from cache)' if r['from_cache'] else ''}, final val loss {e.val_loss.iloc[-1]:.4f}")
    fig.update_layout(height=350, xaxis_title="step", xaxis2_title="step")
    return Finding("Baseline and V-scale, same data, seed and recipe", figures=[fig], notes=notes)


def scale_verdict(base_check: dict, size: str) -> str:
    """What the V-scale comparison can test, given whether the chosen baseline has a sink and massive activation."""
    sink, ratio = base_check["sink_rate_middle"], base_check["token0_ratio_middle_max"]
    facts = (f"Sink^eps(middle) {sink:.2f} (threshold {SINK_MIN:g}), token-0 ratio {ratio:.2f} "
             f"(threshold {RATIO_MIN:g})")
    if base_check["sink"] and base_check["massive"]:
        return (f"The {size} baseline has both an attention sink and massive activation ({facts}): the V-scale "
                f"verdicts test the paper's account on a model that has what it describes.")
    if base_check["massive"]:
        return (f"The {size} baseline has a massive activation on token 0 but no attention sink ({facts}): the "
                f"V-scale claims are about a sink this model lacks, so they are not comparable.")
    if base_check["sink"]:
        return (f"The {size} baseline has an attention sink but no massive activation ({facts}): the V-scale "
                f"claims are about a massive activation this model lacks, so they are not comparable.")
    return (f"The {size} baseline has neither an attention sink nor massive activation ({facts}): the V-scale "
            f"claims describe structures this model lacks, so they are not comparable and are not evidence "
            f"either way on the paper's account.")


def vscale_claims(base: dict, vscale: dict, base_check: dict) -> list:
    """The baseline's gradient sink and the V-scale claims of Sec. 5 from two ``ProbeResult.summary()`` dicts
    (each with ``"val loss"`` added) and the baseline's ``sink_check``."""
    paper = reported_0p3b()
    both = (bool(base_check["sink"] and base_check["massive"]), _missing(base_check, need_massive=True))
    has_sink = (bool(base_check["sink"]), _missing(base_check, need_massive=False))

    def pair(key):
        return base[key], vscale[key]

    return [
        claim("baseline_gradient_sink", "measured", f"{SRC}, Sec. 3 / Fig. 1",
              "a scratch-trained baseline with an attention sink has a gradient sink at token 0",
              "median R_GS 10-100", round(base["median_r_gs"], 2), GRADIENT_SINK, precondition=has_sink),
        claim("vscale_lowers_rgs", "measured", f"{SRC}, Sec. 5 / Fig. 6 (0.3B)",
              "V-scale lowers the median gradient-sink ratio", _paper(paper["median_r_gs"], "g"),
              f"{base['median_r_gs']:.2f} -> {vscale['median_r_gs']:.2f}", LOWERS, value=pair("median_r_gs"),
              precondition=both),
        claim("vscale_lowers_token0_norm", "measured", f"{SRC}, Sec. 5 (0.3B)",
              "V-scale lowers token 0's residual norm (mean over layers)", _paper(paper["token0_norm_mean"], "g"),
              f"{base['token0_norm_mean']:.1f} -> {vscale['token0_norm_mean']:.1f}", LOWERS,
              value=pair("token0_norm_mean"), precondition=both),
        claim("vscale_lowers_token0_ratio", "measured", f"{SRC}, Sec. 5 (0.3B)",
              "V-scale lowers the token-0 / early-token norm ratio", _paper(paper["token0_ratio_mean"], "g"),
              f"{base['token0_ratio_mean']:.2f} -> {vscale['token0_ratio_mean']:.2f}", LOWERS,
              value=pair("token0_ratio_mean"), precondition=both),
        claim("vscale_keeps_sink", "measured", f"{SRC}, Sec. 5",
              "the attention sink survives V-scale (Sink^eps at token 0)", "sink rate kept",
              f"{base['sink_rate_mean']:.2f} -> {vscale['sink_rate_mean']:.2f}", KEEPS_SINK,
              value=pair("sink_rate_mean"), precondition=both),
        claim("vscale_loss_parity", "measured", f"{SRC}, Sec. 5 (0.3B)", "V-scale costs no validation loss",
              _paper(paper["val_loss"], ".3f"), f"{base['val loss']:.4f} -> {vscale['val loss']:.4f}", LOSS_PARITY,
              value=pair("val loss"), precondition=both),
    ]


SUMMARY_ROWS = ("median_r_gs", "token0_norm_mean", "early_norm_mean", "token0_ratio_mean", "token0_ratio_max",
                "sink_rate_mean", "mlp_out_token0_mean", "val loss", "grad_q0_max")


def gradient_sink_finding(probes: dict[str, ProbeResult], val_loss: dict[str, float], size: str) -> Finding:
    """Probes of the baseline and the V-scale model on one batch: summary, per-layer figure, V-scale claims.

    ``probes`` and ``val_loss`` have the keys "baseline" and "V-scale"; ``size`` names the baseline."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    summaries = {name: {**p.summary(), "val loss": val_loss[name]} for name, p in probes.items()}
    table = pd.DataFrame(summaries).loc[list(SUMMARY_ROWS)]
    base_check = sink_check(probes["baseline"])
    fig = make_subplots(rows=1, cols=3, subplot_titles=("R_GS(0; 31) per layer", "token-0 residual norm per layer",
                                                        "Sink^eps(0) per layer"))
    for name, p in probes.items():
        x = list(range(p.n_layers))
        for col, y in enumerate((p.r_gs(), p.residual_norm[:, 0], p.sink_rate), start=1):
            fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers", legendgroup=name,
                                     showlegend=col == 1), 1, col)
    fig.update_xaxes(title_text="layer")
    fig.update_layout(height=350)
    return Finding("Gradient sinks, massive activations and the attention sink",
                   claims=vscale_claims(summaries["baseline"], summaries["V-scale"], base_check), table=table,
                   figures=[fig], notes=[scale_verdict(base_check, size)],
                   data={"summary": summaries, "base_check": base_check})


# ---- query / key / value paths -----------------------------------------------------------------------------

def path_figure(probes: dict[str, ProbeResult], tokens: int = 64):
    """Token-wise gradient norms on the query, key and value paths (mean over layers), one panel per model."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=len(probes), subplot_titles=list(probes))
    for j, (name, p) in enumerate(probes.items(), start=1):
        shown = min(tokens, p.grad_q.shape[1])
        for path, g in (("query", p.grad_q), ("key", p.grad_k), ("value", p.grad_v)):
            fig.add_trace(go.Scatter(x=list(range(shown)), y=g[:, :shown].mean(0), name=path, legendgroup=path,
                                     showlegend=j == 1), 1, j)
    fig.update_xaxes(title_text="token position")
    fig.update_yaxes(type="log")
    fig.update_yaxes(title_text="grad norm (mean over layers)", col=1)
    fig.update_layout(height=330)
    return fig


def qkv_finding(probes: dict[str, ProbeResult]) -> Finding:
    """Where the gradient goes (Fig. 2 analog): path figure and token-0 spikes per model."""
    notes = []
    for name, p in probes.items():
        spike = path_spikes(p)
        notes.append(f"{name}: token-0 spike over tokens 1-{RGS_T_E}, key {spike['key']:.1f}x, value "
                     f"{spike['value']:.1f}x; largest |grad q_0| over layers = {p.grad_q[:, 0].max():.1e} "
                     f"({grad_q0_share(p):.1e} of the largest |grad q_t|)")
    return Finding("Where the gradient goes: query, key and value paths", figures=[path_figure(probes)], notes=notes)


# ---- Bloat / Change / Compress -----------------------------------------------------------------------------

def ratio_scatter(probe: ProbeResult, title: str):
    """Bloat, Change and Compress of the attention branch against the layer-input norm; token 0 in red."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 3.2))
    axes = fig.subplots(1, 3)
    x = np.log10(probe.input_norm)
    first = np.zeros_like(x, dtype=bool)
    first[:, :, 0] = True
    for ax, key in zip(axes, ("bloat", "change", "compress")):
        y = np.log10(probe.attn_ratios[key])
        ax.scatter(x[~first], y[~first], s=2, alpha=0.25, color="tab:blue", label="tokens > 0")
        ax.scatter(x[first], y[first], s=10, color="tab:red", label="token 0")
        ax.set_xlabel("log10 ||h^l_t||")
        ax.set_ylabel(f"log10 {key} (attention)")
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def bloat_finding(probes: dict[str, ProbeResult], size: str) -> Finding:
    """Bloat / Change / Compress against activation norm (Fig. 3 analog), medians for token 0 and the rest."""
    figures, notes = [], []
    for name, p in probes.items():
        figures.append(ratio_scatter(p, f"{name} ({size})"))
        b, c = p.attn_ratios["bloat"], p.attn_ratios["compress"]
        notes.append(f"{name}: median Bloat token 0 {np.median(b[:, :, 0]):.2f} vs others "
                     f"{np.median(b[:, :, 1:]):.2f}; "
                     f"median Compress token 0 {np.median(c[:, :, 0]):.3f} vs others {np.median(c[:, :, 1:]):.3f}; "
                     f"median |log10 Change| {np.median(np.abs(np.log10(p.attn_ratios['change']))):.3f}")
    return Finding("Bloat, Change and Compress against activation norm", figures=figures, notes=notes)


# ---- what V-scale learned ----------------------------------------------------------------------------------

def valve_constant(theta, d_model: int, d_head: int, sigma: float = SIGMA) -> np.ndarray:
    """C = d_model d_head sigma^2 exp(theta), per (layer, head)."""
    return d_model * d_head * sigma**2 * np.exp(np.asarray(theta, dtype=float))


def theta_figure(theta, value_norms, d_model: int, d_head: int):
    """Learned theta as a heatmap, and token 0's raw ||v||^2 against C per layer (median over heads)."""
    import seaborn as sns
    from matplotlib.figure import Figure
    theta = np.asarray(theta)
    c = valve_constant(theta, d_model, d_head)
    v0_sq = value_norms[:, :, 0] ** 2
    rest_sq = (value_norms[:, :, 1:RGS_T_E + 1] ** 2).mean(-1)
    fig = Figure(figsize=(11, 3.4))
    axes = fig.subplots(1, 2)
    sns.heatmap(theta, ax=axes[0], cmap="RdBu_r", center=0, annot=theta.size <= 64, fmt=".2f")
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("layer")
    axes[0].set_title("learned theta")
    axes[1].semilogy(np.median(v0_sq / c, axis=1), "o-", label="token 0: ||v_0||^2 / C")
    axes[1].semilogy(np.median(rest_sq / c, axis=1), "s-", label=f"tokens 1-{RGS_T_E}: mean ||v_t||^2 / C")
    axes[1].axhline(1, color="gray", lw=0.8)
    axes[1].set_xlabel("layer")
    axes[1].legend(fontsize=8)
    axes[1].set_title("raw value norm against the valve constant (median over heads)")
    fig.tight_layout()
    return fig


def theta_claims(theta, base_check: dict) -> list:
    """App. C / Fig. 13: theta larger early than late, and mostly negative late (gated like every V-scale claim)."""
    theta = np.asarray(theta)
    early, late = theta_halves(theta)
    late_negative = float((theta[len(theta) // 2:] < 0).mean())
    both = (bool(base_check["sink"] and base_check["massive"]), _missing(base_check, need_massive=True))
    return [
        claim("vscale_theta_layer_pattern", "measured", f"{SRC}, App. C / Fig. 13",
              "learned theta is larger in early layers than in late ones", "positive early, negative late",
              f"{early:+.2f} early, {late:+.2f} late", THETA_EARLY_LARGER, value=(early, late), precondition=both),
        claim("vscale_theta_late_negative", "measured", f"{SRC}, App. C / Fig. 13",
              "learned theta is mostly negative in the later layers", "mostly negative late",
              f"{late_negative:.0%} of the second half's (layer, head) values < 0", THETA_LATE_NEGATIVE,
              value=late_negative, precondition=both),
    ]


def theta_finding(theta, value_norms, d_model: int, d_head: int, base_check: dict) -> Finding:
    """What V-scale learned (Fig. 13 analog). ``value_norms``: (layers, heads, T) raw ||v_t|| before V-scale."""
    early, late = theta_halves(theta)
    note = (f"Mean theta in the first half of the layers {early:+.3f}, in the second half {late:+.3f} "
            f"(paper: larger positive values early, mostly negative late).")
    return Finding("What V-scale learned", claims=theta_claims(theta, base_check),
                   figures=[theta_figure(theta, value_norms, d_model, d_head)], notes=[note])


# ---- pretrained models -------------------------------------------------------------------------------------

def pretrained_claims(spec: str, probe: ProbeResult) -> list:
    """Fig. 1 range and Fig. 9 value-path spike for one pretrained model, gated on its attention sink."""
    check_ = sink_check(probe)
    spike = path_spikes(probe)
    median = float(probe.summary()["median_r_gs"])
    has_sink = (bool(check_["sink"]), f"{spec} shows no attention sink (Sink^eps middle "
                                      f"{check_['sink_rate_middle']:.2f} < {SINK_MIN:g})")
    return [
        claim(f"{slug(spec)}_rgs_range", "measured", f"{SRC}, Fig. 1",
              f"pretrained {spec}: median R_GS in the 10-100 range", "10-100", round(median, 2), GRADIENT_SINK,
              precondition=has_sink),
        claim(f"{slug(spec)}_value_spike", "measured", f"{SRC}, Fig. 9",
              f"pretrained {spec}: the token-0 spike is larger on the value path than on the key path",
              "value > key", f"value {spike['value']:.1f}x, key {spike['key']:.1f}x", VALUE_SPIKE,
              value=(spike["value"], spike["key"]), precondition=has_sink),
    ]


def pretrained_row(spec: str, probe: ProbeResult, seconds: float) -> dict:
    s, spike, check_ = probe.summary(), path_spikes(probe), sink_check(probe)
    return {"model": spec, "layers": probe.n_layers, "median R_GS": s["median_r_gs"],
            "Sink^eps mean": s["sink_rate_mean"], "Sink^eps middle": check_["sink_rate_middle"],
            "token-0 norm": s["token0_norm_mean"], "token-0 ratio": s["token0_ratio_mean"],
            "key spike": spike["key"], "value spike": spike["value"], "max |grad q_0|": s["grad_q0_max"],
            "probe seconds": seconds}


def pretrained_finding(real: dict[str, ProbeResult], ours: dict[str, ProbeResult], size: str,
                       seconds: dict[str, float] | None = None, skipped: dict[str, str] | None = None) -> Finding:
    """The same probes on pretrained models (Figs. 1, 2, 9 analogs); claims only where the model has a sink."""
    import plotly.graph_objects as go
    title = "The same probes on pretrained models"
    seconds = seconds or {}
    notes = [f"{spec}: not available here ({why}); skipped." for spec, why in (skipped or {}).items()]
    if not real:
        return Finding(title, notes=notes or ["No pretrained model was probed."])
    rows = [pretrained_row(spec, p, seconds.get(spec, float("nan"))) for spec, p in real.items()]
    table = pd.DataFrame(rows).set_index("model").T
    table.columns.name = None
    claims = [c for spec, p in real.items() for c in pretrained_claims(spec, p)]
    for spec, p in real.items():
        check_ = sink_check(p)
        if not check_["sink"]:
            notes.append(f"{spec} shows no attention sink (Sink^eps in the middle layers "
                         f"{check_['sink_rate_middle']:.2f}, threshold {SINK_MIN:g}): its claims are not comparable.")
    box = go.Figure()
    for spec, p in real.items():
        box.add_trace(go.Box(y=p.r_gs(), name=spec, boxpoints="all"))
    for name, p in ours.items():
        box.add_trace(go.Box(y=p.r_gs(), name=f"ours: {name} ({size})", boxpoints="all"))
    box.add_hrect(y0=10, y1=100, fillcolor="gray", opacity=0.15, line_width=0)
    box.update_layout(yaxis_type="log", yaxis_title="R_GS(0; 31) over layers", height=380)
    return Finding(title, claims=claims, table=table, figures=[box, path_figure(real)], notes=notes,
                   data={"rows": rows})


# ---- checks of our own code --------------------------------------------------------------------------------

def checks_finding(probes: dict[str, ProbeResult], val_losses: dict[str, float]) -> Finding:
    """Must-hold checks over every probe of the chapter: the causal-mask identity on q_0 and finite numbers."""
    share = max((grad_q0_share(p) for p in probes.values()), default=0.0)
    finite = (all(np.isfinite(p.r_gs()).all() for p in probes.values())
              and all(np.isfinite(v) for v in val_losses.values()))
    return Finding("Checks of our own code", claims=[
        check("grad_q0_zero", "with a causal mask the gradient wrt q_0 is zero, up to float32 kernel rounding "
              f"(|grad q_0| <= {GRAD_Q0_TOLERANCE:g} x the largest |grad q_t|, every probed model)", share,
              GRAD_Q0_ZERO, expected=0.0, source=f"{SRC}, Sec. 4 / App. D.1"),
        check("probes_finite", "every R_GS and validation loss of the chapter is finite", finite, FINITE,
              expected=True),
    ])


# ---- the chapter -------------------------------------------------------------------------------------------

class GradientSinks:
    """Measures and findings of the chapter, in notebook order; every measurement is cached on the instance."""

    FINDINGS = ("paper_values", "size_sweep", "trajectories", "recorded_runs", "late_attention", "training",
                "gradient_sinks", "qkv_paths", "bloat_change_compress", "vscale_theta", "pretrained", "sink_setting",
                "retrofit", "quantisation", "checks")

    def __init__(self, settings: Settings):
        self.settings = s = settings
        unknown = [x for x in ([s.size] if s.size else []) + list(s.sweep_sizes) if x not in SIZES]
        if unknown:
            raise SettingsError(f"unknown sizes {unknown}; known: {sorted(SIZES)}")
        self.sweep_sizes = [s.size] if s.size else list(s.sweep_sizes)
        if s.steps is not None:
            if isinstance(s.steps, bool) or not isinstance(s.steps, int) or s.steps < 1:
                raise SettingsError(f"steps must be a positive integer (every size) or None, got {s.steps!r}")
            self.steps = {size: s.steps for size in self.sweep_sizes}
        else:
            self.steps = dict(s.steps_by_size)
        missing = [size for size in self.sweep_sizes if size not in self.steps]
        if missing:
            raise SettingsError(f"no step count for sizes {missing} in profile {s.profile!r}; pass steps=...")
        self.device = resolve_device(s.device)
        self.started = time.perf_counter()
        self._findings: dict[str, Finding] = {}
        self._corpus = self._probe_ids = None
        self.baselines, self.baseline_probes, self.vscale_run, self._pair = {}, {}, None, None
        self._trajectories: dict[str, pd.DataFrame] = {}
        self.real_probes, self.real_records, self.real_seconds, self.real_skipped = {}, [], {}, {}
        self.setting_models: dict[str, torch.nn.Module] = {}
        self._retrofit: dict | None = None

    # -- measurements --

    @property
    def corpus(self):
        if self._corpus is None:
            self._corpus = load_corpus()
        return self._corpus

    @property
    def probe_ids(self) -> torch.Tensor:
        """One fixed validation batch, the same for every model trained here."""
        if self._probe_ids is None:
            s = self.settings
            self._probe_ids = validation_batches(self.corpus.val_ids, s.batch_size, s.context,
                                                 self.corpus.bos_id if s.bos else None, 1)[0]
        return self._probe_ids

    def config_for(self, size: str, vscale: bool = False) -> TrainConfig:
        s, n = self.settings, self.steps[size]
        return TrainConfig(size=size, steps=n, warmup_steps=n // 10, batch_size=s.batch_size, context=s.context,
                           lr=float(s.lr), seed=s.seed, bos=s.bos, vscale=vscale, eval_every=EVAL_EVERY)

    def baseline(self, size: str):
        if size not in self.baselines:
            run = train(self.config_for(size), self.corpus, device=self.device, use_cache=self.settings.use_cache,
                        checkpoint_every=max(1, self.steps[size] // SNAPSHOTS), progress=False)
            self.baselines[size] = run
            self.baseline_probes[size] = probe_batch(run.model, self.probe_ids)
        return self.baselines[size]

    @property
    def chosen(self) -> str:
        return self.size_sweep().data["chosen"]

    def vscale(self):
        if self.vscale_run is None:
            self.vscale_run = train(self.config_for(self.chosen, vscale=True), self.corpus, device=self.device,
                                    use_cache=self.settings.use_cache, progress=False)
        return self.vscale_run

    def runs(self) -> dict:
        return {"baseline": self.baseline(self.chosen), "V-scale": self.vscale()}

    def probes(self) -> dict[str, ProbeResult]:
        if self._pair is None:
            self._pair = {"baseline": self.baseline_probes[self.chosen],
                          "V-scale": probe_raw_values(self.vscale().model, self.probe_ids)}
        return self._pair

    def val_losses(self) -> dict[str, float]:
        return {name: float(run.evals[-1]["val_loss"]) for name, run in self.runs().items()}

    def probe_real_models(self) -> dict[str, ProbeResult]:
        s = self.settings
        pending = [spec for spec in s.real_models if spec not in self.real_probes and spec not in self.real_skipped]
        if pending:
            val_text = self.corpus.tokenizer.decode(self.corpus.val_ids[: 40 * s.real_batch * s.real_context].tolist())
        for spec in pending:
            try:
                loaded = load_model(spec, device=self.device)
            except (ModelNotAvailable, UnsupportedArchitecture) as err:
                self.real_skipped[spec] = str(err)
                continue
            ids = text_windows(loaded.tokenizer, val_text, s.real_batch, s.real_context, bos=True)
            start = time.perf_counter()
            self.real_probes[spec] = probe_batch(loaded.model, ids)
            self.real_seconds[spec] = time.perf_counter() - start
            self.real_records.append(loaded.record())
            del loaded
        return self.real_probes

    # -- findings, in notebook order --

    def _once(self, name: str, build) -> Finding:
        if name not in self._findings:
            self._findings[name] = build()
        return self._findings[name]

    def paper_values(self) -> Finding:
        return self._once("paper_values", paper_values_finding)

    def size_sweep(self) -> Finding:
        return self._once("size_sweep", self._size_sweep)

    def _size_sweep(self) -> Finding:
        s, rows = self.settings, []
        for size in self.sweep_sizes:
            run = self.baseline(size)
            probe, check_ = self.baseline_probes[size], sink_check(self.baseline_probes[size])
            layers, d_model, heads, _ = run.config.dims
            rows.append({"size": size, "layers x d_model x heads": f"{layers} x {d_model} x {heads}",
                         "parameters (M)": sum(p.numel() for p in run.model.parameters()) / 1e6,
                         "steps": run.config.steps,
                         "tokens seen (M)": run.config.steps * run.config.batch_size * run.config.context / 1e6,
                         "train minutes": run.train_seconds / 60, "val loss": run.evals[-1]["val_loss"],
                         "Sink^eps middle": check_["sink_rate_middle"],
                         "token-0 ratio (max, middle)": check_["token0_ratio_middle_max"],
                         "median R_GS": float(np.median(probe.r_gs())), "sink + massive": check_["both"]})
        finding = sweep_finding(rows, s.size, s.profile)
        finding.notes.insert(0, f"{self.corpus.describe()}. Profile {s.profile!r}, device {self.device}, sizes "
                                f"{self.sweep_sizes}, batch {s.batch_size} x {s.context} tokens, BOS={s.bos}.")
        finding.data["rows"] = rows
        return finding

    def trajectories(self) -> Finding:
        def build():
            self.size_sweep()
            self._trajectories = {
                size: training_trajectory(load_checkpoints(run.config, self.corpus, device=self.device), self.probe_ids)
                for size, run in self.baselines.items()}
            return trajectory_finding(self._trajectories)
        return self._once("trajectories", build)

    def recorded_runs(self) -> Finding:
        return self._once("recorded_runs", lambda: recorded_runs_finding(load_emergence_runs()))

    def late_attention(self) -> Finding:
        def build():
            self.size_sweep()
            ids, tokenizer = self.probe_ids, self.corpus.tokenizer
            newline = torch.tensor([["\n" in tokenizer.decode([int(t)]) for t in row] for row in ids.tolist()])
            first = torch.zeros_like(newline)
            first[:, 0] = True
            masks = {"token 0": first, "line breaks": newline}
            shares = {size: late_query_attention(run.model, ids, masks) for size, run in self.baselines.items()}
            return late_attention_finding(shares, {name: uniform_share(m) for name, m in masks.items()})
        return self._once("late_attention", build)

    def training(self) -> Finding:
        return self._once("training", lambda: training_finding({
            name: {"steps": r.config.steps, "train_seconds": r.train_seconds, "from_cache": r.from_cache,
                   "history": r.history, "evals": r.evals} for name, r in self.runs().items()}))

    def gradient_sinks(self) -> Finding:
        return self._once("gradient_sinks",
                          lambda: gradient_sink_finding(self.probes(), self.val_losses(), self.chosen))

    def qkv_paths(self) -> Finding:
        return self._once("qkv_paths", lambda: qkv_finding(self.probes()))

    def bloat_change_compress(self) -> Finding:
        return self._once("bloat_change_compress", lambda: bloat_finding(self.probes(), self.chosen))

    def vscale_theta(self) -> Finding:
        def build():
            model = self.vscale().model
            config = model.config
            d_head = config.hidden_size // config.num_attention_heads
            return theta_finding(learned_theta(model).numpy(), raw_value_norms(model, self.probe_ids).numpy(),
                                 config.hidden_size, d_head, sink_check(self.probes()["baseline"]))
        return self._once("vscale_theta", build)

    def pretrained(self) -> Finding:
        return self._once("pretrained", lambda: pretrained_finding(
            self.probe_real_models(), self.probes(), self.chosen, self.real_seconds, self.real_skipped))

    def sink_setting(self) -> Finding:
        """Baseline and V-scale on the synthetic setting that has a sink, one pair per seed (cached runs)."""
        def build():
            from . import gradient_sinks_with_sink as ws
            corpus = ws.corpus_for(ws.SETTING["data"])
            ids = ws.setting_probe_ids(corpus)
            pairs, theta, seconds = {}, {}, {}
            for seed in self.settings.sink_seeds:
                pairs[seed] = {}
                for name, vscale in (("baseline", False), ("V-scale", True)):
                    run = train(ws.setting_config(self.settings.sink_steps, seed, vscale), corpus, device=self.device,
                                use_cache=self.settings.use_cache, progress=False)
                    probe = probe_raw_values(run.model, ids) if vscale else probe_batch(run.model, ids)
                    pairs[seed][name] = {**ws.probe_numbers(probe), "val loss": float(run.evals[-1]["val_loss"])}
                    self.setting_models[f"{name} (seed {seed})"] = run.model
                    seconds[f"{name} {seed}"] = 0.0 if run.from_cache else run.train_seconds
                    if vscale:
                        theta[seed] = learned_theta(run.model).numpy()
            return ws.setting_finding(ws.seed_rows(pairs), theta, seconds)
        return self._once("sink_setting", build)

    def retrofit(self) -> Finding:
        def build():
            from . import gradient_sinks_with_sink as ws
            self._retrofit = ws.retrofit_measurements(
                ws.RetrofitConfig(model=self.settings.retrofit_model, steps=self.settings.retrofit_steps),
                probe_batch_size=self.settings.real_batch, probe_context=self.settings.real_context,
                device=self.device)
            return ws.retrofit_finding(self._retrofit)
        return self._once("retrofit", build)

    def quantisation(self) -> Finding:
        def build():
            from . import gradient_sinks_with_sink as ws
            rows = pd.DataFrame(self.sink_setting().data["rows"])
            corpus = ws.corpus_for(ws.SETTING["data"])
            batches = validation_batches(corpus.val_ids, 16, ws.SETTING["context"], corpus.bos_id, 4)
            table = ws.quantisation_rows(self.setting_models, batches)
            self.retrofit()
            return ws.quantisation_finding(table, ws.removed_massive_activation(rows), self._retrofit)
        return self._once("quantisation", build)

    def checks(self) -> Finding:
        return self._once("checks", lambda: checks_finding(
            {**{f"ours: {k}": v for k, v in self.probes().items()}, **self.probe_real_models()}, self.val_losses()))

    # -- results --

    @property
    def claims(self) -> list:
        return [c for name in self.FINDINGS if name in self._findings for c in self._findings[name].claims]

    def results(self) -> dict:
        for name in self.FINDINGS:                    # a claim never goes missing because a cell was skipped
            getattr(self, name)()
        gs = self._findings["gradient_sinks"].data
        extra = {"device": self.device, "chosen_size": self.chosen,
                 "sweep": self._findings["size_sweep"].data["rows"],
                 "trajectories": {s: t.to_dict("records") for s, t in self._trajectories.items()},
                 "late_query_attention": self._findings["late_attention"].data["rows"],
                 "summary": gs["summary"], "theta": learned_theta(self.vscale().model).numpy(),
                 "real": self._findings["pretrained"].data.get("rows", []),
                 "train_seconds": {k: r.train_seconds for k, r in self.runs().items()},
                 "notebook_seconds": time.perf_counter() - self.started}
        return dict(chapter=CHAPTER, parameters=self.settings.as_dict(), claims=self.claims,
                    models=list(self.real_records), extra=extra)
