"""Gradient sinks and V-scale: Llama models trained from scratch on Shakespeare.

The gradient-sinks paper argues that an attention sink on token 0 is also a gradient sink, that massive
activations on token 0 damp that concentrated gradient through the pre-norm RMSNorm, and that V-scale removes most
of both while keeping the attention sink and the loss. We train a baseline and a V-scale model with identical data,
seed and recipe (``runs.gradient_sinks``), run the paper's probes (``measures.gradprobes``) on them and compare
with the paper's 0.3B numbers. Formulas: the book's methods page. A claim is tested
only on a model that has what it is about (an attention sink; for V-scale also a massive activation); otherwise
it is "not comparable" and says what is missing. The chapter ``gradient_sinks_with_sink`` goes where a sink exists
(pretrained models, a synthetic setting).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.claims import Finding, Rule, check, claim
from ..core.profiles import NON_EMPTY, NON_NEGATIVE, POSITIVE, Profiles, SettingsError, above
from ..core.published import GRADIENT_SINKS_0P3B, reported_0p3b
from ..figures.gradient_sinks import per_layer_figure, ratio_scatter, theta_figure, threshold_figure, training_figure
from ..figures.panels import path_figure
from ..interventions.vscale import learned_theta, raw_value_norms, theta_halves
from ..measures.gradprobes import (GRAD_Q0_TOLERANCE, KEEP_SINK_SHARE, LOSS_TOLERANCE, LOWERS, ProbeResult,
                                   RATIO_MIN, RGS_T_E, SINK_EPS, SINK_MIN, grad_q0_share, lowered,
                                   lowers_precondition, path_norms, path_spikes, sink_check)
from ..runs.gradient_sinks import GradientSinkRuns, load_emergence_runs
from ..training.scratch import SIZES
from .base import Chapter, finding


NAME = "gradient_sinks"
SRC = "Gradient-sinks paper"

PROFILES = Profiles({
    # quick: CI smoke run, a tiny model and a few steps; nothing scientific is expected of it
    "quick": dict(size=None, sweep_sizes=["nano"], steps_by_size={"nano": 60}, steps=None, batch_size=8,
                  context=72, bos=True, seed=0, lr=3e-3, use_cache=True),
    # default: each model trains in <= 10 minutes on 2 CPU cores (uncontended)
    "default": dict(size=None, sweep_sizes=["nano", "xs"], steps_by_size={"nano": 3000, "xs": 1800, "s": 1200},
                    steps=None, batch_size=16, context=128, bos=True, seed=0, lr=3e-3, use_cache=True),
    "gpu": dict(size=None, sweep_sizes=["s", "m", "l", "0.1b"],
                steps_by_size={"s": 5000, "m": 5000, "l": 5000, "0.1b": 5000}, steps=None, batch_size=32,
                context=256, bos=True, seed=0, lr=3e-3, use_cache=True),
}, limits=dict(sweep_sizes=NON_EMPTY, batch_size=POSITIVE, context=POSITIVE, seed=NON_NEGATIVE, lr=above(0)))

SIZE_WITH_SINK = Rule.true(f"Sink^eps(middle) >= {SINK_MIN:g} and token-0 ratio >= {RATIO_MIN:g} for some size tried")
GRADIENT_SINK = Rule.between(10, 100, "median R_GS(0; 31)")
KEEPS_SINK = Rule(f"V-scale >= {KEEP_SINK_SHARE:g} x baseline (factor ours)",
                  lambda pair: pair[1] >= KEEP_SINK_SHARE * pair[0])
LOSS_PARITY = Rule(f"|V-scale - baseline| <= {LOSS_TOLERANCE:g} nats (tolerance ours)",
                   lambda pair: abs(pair[1] - pair[0]) <= LOSS_TOLERANCE)
THETA_EARLY_LARGER = Rule("mean theta first half > second half", lambda pair: pair[0] > pair[1])
THETA_LATE_NEGATIVE = Rule.above(0.5, "share of second-half theta below 0")
GRAD_Q0_ZERO = Rule.at_most(GRAD_Q0_TOLERANCE, "max |grad q_0| / max |grad q_t|")
FINITE = Rule.true("every R_GS and validation loss is finite")


# ---- published numbers -------------------------------------------------------------------------------------

def paper_values_finding(path=None) -> Finding:
    """The paper's 0.3B baseline and V-scale numbers, as published (no claim: they are what we compare with)."""
    table = pd.read_csv(path or GRADIENT_SINKS_0P3B).set_index("quantity")
    return Finding("The paper's 0.3B numbers", table=table[["baseline", "vscale", "source"]].rename(
        columns={"vscale": "V-scale"}))


def _paper(pair: tuple[float, float], fmt: str) -> str:
    return f"{pair[0]:{fmt}} -> {pair[1]:{fmt}}"


# ---- small measured quantities -----------------------------------------------------------------------------

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
    next_step = ("the 'gpu' profile trains larger ones" if not profile.startswith("gpu")
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


def trajectory_finding(trajectories: dict[str, pd.DataFrame]) -> Finding:
    """Sink, token-0 ratio and largest alpha_0 across each baseline's snapshots, with the thresholds."""
    fig = threshold_figure(trajectories, TRAJECTORY_COLUMNS,
                            ("Sink^eps(0), middle layers", "token-0 ratio (max, middle)",
                             "largest alpha_0 of any head"),
                            (SINK_MIN, RATIO_MIN, SINK_EPS))
    frames = [t.assign(size=size) for size, t in trajectories.items() if len(t)]
    table = pd.concat(frames).set_index(["size", "step"]) if frames else None
    return Finding("How they grow during training", table=table, figures=[fig], notes=trend_notes(trajectories))


# ---- recorded longer runs ----------------------------------------------------------------------------------

def recorded_runs_finding(long_runs: pd.DataFrame) -> Finding:
    """Plot the recorded longer runs as they are, with the last probe of each and the command that made it."""
    title = "Longer runs, recorded"
    if long_runs.empty:
        return Finding(title, notes=["No recorded runs found under measurements/sink_emergence/."])
    curves = {name: run for name, run in long_runs.groupby("run", sort=False)}
    fig = threshold_figure(curves, ("sink_rate_middle", "token0_ratio_middle_max"),
                            ("Sink^eps(0), middle layers", "token-0 ratio (max, middle)"), (SINK_MIN, RATIO_MIN))
    last = long_runs.groupby("run", sort=False).tail(1).set_index("run")
    table = last[["data", "step", "tokens (M)", "sink_rate_middle", "token0_ratio_middle_max", "largest_alpha0",
                  "val_loss", "status"]].rename(columns={"sink_rate_middle": "Sink^eps middle",
                                                         "token0_ratio_middle_max": "token-0 ratio",
                                                         "largest_alpha0": "largest alpha_0", "val_loss": "val loss"})
    notes = [f"{run}: {command}" for run, command in last.command.items()]
    return Finding(title, table=table, figures=[fig], notes=["Commands that recorded them:", *notes])


# ---- late-query attention ----------------------------------------------------------------------------------

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
    notes, losses = [], {}
    for name, r in runs.items():
        h, e = pd.DataFrame(r["history"]), pd.DataFrame(r["evals"])
        losses[name] = (h, e)
        notes.append(f"{name}: {r['steps']} steps in {r['train_seconds'] / 60:.1f} min"
                     f"{' (loaded from cache)' if r['from_cache'] else ''}, final val loss {e.val_loss.iloc[-1]:.4f}")
    return Finding("Baseline and V-scale, same data, seed and recipe", figures=[training_figure(losses)], notes=notes)


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
    sink = has_sink
    massive = (bool(base_check["massive"]), _missing(base_check, need_massive=True))

    def pair(key):
        return base[key], vscale[key]

    def lowers(id_, source, statement, key, quantity, fmt):
        return claim(id_, "measured", source, statement, _paper(paper[key], "g"),
                     f"{base[key]:{fmt}} -> {vscale[key]:{fmt}}", LOWERS, value=lowered(*pair(key)),
                     precondition=lowers_precondition(quantity, sink, massive))

    return [
        claim("baseline_gradient_sink", "measured", f"{SRC}, Sec. 3 / Fig. 1",
              "a scratch-trained baseline with an attention sink has a gradient sink at token 0",
              "median R_GS 10-100", round(base["median_r_gs"], 2), GRADIENT_SINK, precondition=has_sink),
        lowers("vscale_lowers_rgs", f"{SRC}, Sec. 5 / Fig. 6 (0.3B)", "V-scale suppresses the median gradient-sink "
               "ratio", "median_r_gs", "median R_GS", ".2f"),
        lowers("vscale_lowers_token0_norm", f"{SRC}, Sec. 5 (0.3B)", "V-scale suppresses token 0's residual norm "
               "(mean over layers)", "token0_norm_mean", "token-0 norm", ".1f"),
        lowers("vscale_lowers_token0_ratio", f"{SRC}, Sec. 5 (0.3B)", "V-scale suppresses the token-0 / early-token "
               "norm ratio", "token0_ratio_mean", "token-0 ratio", ".2f"),
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
    summaries = {name: {**p.summary(), "val loss": val_loss[name]} for name, p in probes.items()}
    table = pd.DataFrame(summaries).loc[list(SUMMARY_ROWS)]
    base_check = sink_check(probes["baseline"])
    fig = per_layer_figure({name: (p.r_gs(), p.residual_norm[:, 0], p.sink_rate) for name, p in probes.items()})
    return Finding("Gradient sinks, massive activations and the attention sink",
                   claims=vscale_claims(summaries["baseline"], summaries["V-scale"], base_check), table=table,
                   figures=[fig], notes=[scale_verdict(base_check, size)],
                   data={"summary": summaries, "base_check": base_check})


# ---- query / key / value paths -----------------------------------------------------------------------------

def qkv_finding(probes: dict[str, ProbeResult]) -> Finding:
    """Where the gradient goes (Fig. 2 analog): path figure and token-0 spikes per model."""
    notes = []
    for name, p in probes.items():
        spike = path_spikes(p)
        notes.append(f"{name}: token-0 spike over tokens 1-{RGS_T_E}, key {spike['key']:.1f}x, value "
                     f"{spike['value']:.1f}x; largest |grad q_0| over layers = {p.grad_q[:, 0].max():.1e} "
                     f"({grad_q0_share(p):.1e} of the largest |grad q_t|)")
    return Finding("Where the gradient goes: query, key and value paths", figures=[path_figure(path_norms(probes))], notes=notes)


# ---- Bloat / Change / Compress -----------------------------------------------------------------------------

def bloat_finding(probes: dict[str, ProbeResult], size: str) -> Finding:
    """Bloat / Change / Compress against activation norm (Fig. 3 analog), medians for token 0 and the rest."""
    figures, notes = [], []
    for name, p in probes.items():
        figures.append(ratio_scatter(p.input_norm, p.attn_ratios, f"{name} ({size})"))
        b, c = p.attn_ratios["bloat"], p.attn_ratios["compress"]
        notes.append(f"{name}: median Bloat token 0 {np.median(b[:, :, 0]):.2f} vs others "
                     f"{np.median(b[:, :, 1:]):.2f}; "
                     f"median Compress token 0 {np.median(c[:, :, 0]):.3f} vs others {np.median(c[:, :, 1:]):.3f}; "
                     f"median |log10 Change| {np.median(np.abs(np.log10(p.attn_ratios['change']))):.3f}")
    return Finding("Bloat, Change and Compress against activation norm", figures=figures, notes=notes)


# ---- what V-scale learned ----------------------------------------------------------------------------------

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


def _sizes_and_steps(s) -> tuple[list[str], dict[str, int]]:
    """The sizes to train and the steps of each, or ``SettingsError`` saying what is missing."""
    unknown = [x for x in ([s.size] if s.size else []) + list(s.sweep_sizes) if x not in SIZES]
    if unknown:
        raise SettingsError(f"unknown sizes {unknown}; known: {sorted(SIZES)}")
    if s.steps is not None and (isinstance(s.steps, bool) or not isinstance(s.steps, int) or s.steps < 1):
        raise SettingsError(f"steps must be a positive integer (every size) or None, got {s.steps!r}")
    sizes = [s.size] if s.size else list(s.sweep_sizes)
    steps = {size: s.steps for size in sizes} if s.steps is not None else dict(s.steps_by_size)
    missing = [size for size in sizes if size not in steps]
    if missing:
        raise SettingsError(f"no step count for sizes {missing} in profile {s.profile!r}; pass steps=...")
    return sizes, steps


# ---- the chapter -------------------------------------------------------------------------------------------

class GradientSinksChapter(Chapter):
    """The findings in notebook order over ``runs.gradient_sinks`` (trained models cached by configuration)."""
    NAME = NAME
    PROFILES = PROFILES

    def __init__(self, settings):
        super().__init__(settings)
        self.runs = GradientSinkRuns(settings, *_sizes_and_steps(settings))

    def check(self, s) -> None:
        _sizes_and_steps(s)

    @property
    def chosen(self) -> str:
        return self.size_sweep().data["chosen"]

    @finding
    def paper_values(self) -> Finding:
        return paper_values_finding()

    @finding
    def size_sweep(self) -> Finding:
        s, runs = self.settings, self.runs
        rows = runs.size_rows()
        found = sweep_finding(rows, s.size, s.profile)
        found.notes.insert(0, f"{runs.corpus.describe()}. Profile {s.profile!r}, device {runs.device}, sizes "
                              f"{runs.sweep_sizes}, batch {s.batch_size} x {s.context} tokens, BOS={s.bos}.")
        found.data["rows"] = rows
        return found

    @finding
    def trajectories(self) -> Finding:
        self.size_sweep()
        return trajectory_finding(self.runs.snapshot_trajectories())

    @finding
    def recorded_runs(self) -> Finding:
        return recorded_runs_finding(load_emergence_runs())

    @finding
    def late_attention(self) -> Finding:
        self.size_sweep()
        return late_attention_finding(*self.runs.late_attention())

    @finding
    def training(self) -> Finding:
        return training_finding({
            name: {"steps": r.config.steps, "train_seconds": r.train_seconds, "from_cache": r.from_cache,
                   "history": r.history, "evals": r.evals} for name, r in self.runs.runs(self.chosen).items()})

    @finding
    def gradient_sinks(self) -> Finding:
        return gradient_sink_finding(self.runs.probes(self.chosen), self.runs.val_losses(self.chosen), self.chosen)

    @finding
    def qkv_paths(self) -> Finding:
        return qkv_finding(self.runs.probes(self.chosen))

    @finding
    def bloat_change_compress(self) -> Finding:
        return bloat_finding(self.runs.probes(self.chosen), self.chosen)

    @finding
    def vscale_theta(self) -> Finding:
        model = self.runs.vscale(self.chosen).model
        config = model.config
        d_head = config.hidden_size // config.num_attention_heads
        return theta_finding(learned_theta(model).numpy(), raw_value_norms(model, self.runs.probe_ids).numpy(),
                             config.hidden_size, d_head, sink_check(self.runs.probes(self.chosen)["baseline"]))

    @finding
    def checks(self) -> Finding:
        return checks_finding(self.runs.probes(self.chosen), self.runs.val_losses(self.chosen))

    def extra(self) -> dict:
        f = self._findings
        return {"device": self.runs.device, "chosen_size": self.chosen, "sweep": f["size_sweep"].data["rows"],
                "trajectories": {s: t.to_dict("records") for s, t in self.runs.trajectories.items()},
                "late_query_attention": f["late_attention"].data["rows"], "summary": f["gradient_sinks"].data["summary"],
                "theta": learned_theta(self.runs.vscale(self.chosen).model).numpy(),
                "train_seconds": {k: r.train_seconds for k, r in self.runs.runs(self.chosen).items()}}
