"""Sink Strength: G from logits, exclusions, agreement with a direct eager computation, memory, CLI, prompts."""
from __future__ import annotations

import ast
import copy
import inspect
import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from sinkbook.core import prompts as prompt_data
from sinkbook.measures import strength as sinkstrength
from sinkbook.core.models import encode, load_model
from sinkbook.measures.strength import gap_from_logits, sink_strength

TEXTS = ["The cat sat on the mat.", "A much longer sentence, so that the batch needs left padding here."]


# ---- G from logits ------------------------------------------------------------------------------------------

def test_gap_matches_log_odds_of_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11) * 3
    gap, argmax = gap_from_logits(logits)
    probs = torch.softmax(logits, -1)
    top = probs.gather(-1, argmax[..., None])[..., 0]
    assert torch.equal(argmax, probs.argmax(-1))
    torch.testing.assert_close(gap, torch.log(top / (1 - top)), rtol=1e-4, atol=1e-4)


def test_gap_stays_exact_when_the_sink_takes_everything():
    logits = torch.tensor([[40.0, 0.0, 0.0], [0.0, float("-inf"), float("-inf")]])
    gap, _ = gap_from_logits(logits)
    assert gap[0].item() == pytest.approx(40.0 - math.log(2.0), abs=1e-5)   # softmax would round a to 1.0
    assert math.isnan(gap[1].item())                                        # a single visible key: excluded


# ---- against a direct eager computation ------------------------------------------------------------------------

def _eager_gaps(loaded, texts, chat=None):
    """G = log(a / (1 - a)) at the argmax key from eager attention probabilities (output_attentions)."""
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("eager")
    batch = encode(loaded.tokenizer, texts, chat=chat)
    with torch.no_grad():
        attentions = model(**batch, output_attentions=True, use_cache=False).attentions
    mask = batch["attention_mask"].bool()
    out = []
    for probs in attentions:                                       # (B, H, T, T)
        probs = probs.double() * mask[:, None, None, :]
        probs = probs / probs.sum(-1, keepdim=True)
        top = probs.max(-1).values
        gap = torch.log(top / (1 - top))
        visible = (mask[:, None, :, None] & mask[:, None, None, :]).tril().sum(-1) >= 2   # (B, 1, T)
        out.append(torch.where(visible & (1 - top > 1e-5), gap, torch.nan).float())
    return out


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gemma3", "tiny-qwen3"])
def test_gaps_agree_with_eager_attention(loaded_model, spec):
    loaded = loaded_model(spec)
    result = sink_strength(loaded, TEXTS, layers="all")
    eager = _eager_gaps(loaded, TEXTS)
    for layer, expected in enumerate(eager):
        ours = result.gaps[layer]
        both = ~torch.isnan(expected)
        assert both.any()
        assert torch.isnan(ours[:, :, 0]).all()                   # query 0 (no padding in row 1) is left out
        torch.testing.assert_close(ours[both], expected[both], rtol=2e-3, atol=2e-3)


@pytest.mark.real_model
def test_gaps_agree_with_eager_attention_on_smollm2(loaded_model):
    loaded = loaded_model("smollm2-135m-instruct")
    texts = [p for p in prompt_data.prompt_texts(2)]
    result = sink_strength(loaded, texts, layers="all")
    eager = _eager_gaps(loaded, texts)
    for layer in (0, 15, 29):
        both = ~torch.isnan(eager[layer])
        torch.testing.assert_close(result.gaps[layer][both], eager[layer][both], rtol=5e-3, atol=5e-3)
    # S on the last 10 layers: the median over exactly the gaps the eager computation sees.
    eager_last = torch.cat([g.flatten() for g in eager[-10:]])
    ours_last = result.values(10)
    assert ours_last.numel() >= (~torch.isnan(eager_last)).sum()


def test_padding_and_first_token_are_excluded(loaded_model):
    loaded = loaded_model("tiny-llama")
    batched = sink_strength(loaded, TEXTS, layers="all")
    alone = sink_strength(loaded, TEXTS[:1], layers="all")
    n_real = batched.attention_mask.sum(-1)
    heads = loaded.model.config.num_attention_heads
    for layer in range(3):
        g = batched.gaps[layer]
        assert int((~torch.isnan(g)).sum()) == int((n_real - 1).sum()) * heads
        # the short prompt is left-padded in the batch: its real-token gaps equal those it has alone
        short = g[0][:, -int(n_real[0]):]
        torch.testing.assert_close(short, alone.gaps[layer][0], rtol=1e-4, atol=1e-4, equal_nan=True)
        assert torch.isnan(short[:, 0]).all()                   # the first real token sees only itself


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gemma3"])
def test_query_blocks_give_the_gaps_of_the_whole_layer(loaded_model, spec, monkeypatch):
    loaded = loaded_model(spec)
    whole = sink_strength(loaded, TEXTS, layers="all")          # padded batch, one block per layer
    monkeypatch.setattr(sinkstrength, "QUERY_BLOCK", 3)         # many blocks, the last one short
    blocked = sink_strength(loaded, TEXTS, layers="all")
    for layer, g in whole.gaps.items():
        # a block is a smaller matmul: float32 rounding may differ in the last bit
        torch.testing.assert_close(blocked.gaps[layer], g, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(blocked.sink_keys[layer], whole.sink_keys[layer])


def test_window_selection_and_statistics(loaded_model):
    loaded = loaded_model("tiny-llama")
    result = sink_strength(loaded, TEXTS, layers="all")
    g_last2 = torch.cat([result.gaps[1].flatten(), result.gaps[2].flatten()])
    g_last2 = g_last2[~torch.isnan(g_last2)]
    assert result.strength(2) == pytest.approx(float(g_last2.quantile(0.5)), abs=1e-6)
    assert result.strength(2, "mean") == pytest.approx(float(g_last2.mean()), abs=1e-6)
    assert result.strong_fraction(2) == pytest.approx(float((g_last2 > 2).float().mean()))
    assert result.layers_for("early") == [0] and result.layers_for("late") == [2]
    with pytest.raises(ValueError, match="out of range"):
        result.layers_for(4)
    only_last = sink_strength(loaded, TEXTS, window=1)
    assert list(only_last.gaps) == [2]
    with pytest.raises(ValueError, match="not measured"):
        only_last.strength(2)


def test_layer_quantiles_and_window_sweeps(loaded_model):
    loaded = loaded_model("tiny-llama")
    result = sink_strength(loaded, TEXTS, layers="all")
    boxes = result.layer_quantiles(2)
    assert list(boxes.layer) == [1, 2]
    for row in boxes.itertuples():
        g = result.gaps[row.layer].flatten()
        g = g[~torch.isnan(g)]
        assert row.median == pytest.approx(float(g.quantile(0.5)), abs=1e-6)
        assert g.min() <= row.lowerfence <= row.q1 <= row.median <= row.q3 <= row.upperfence <= g.max()
    # the App. E.4 windows by default, clipped to the 3 layers; the thirds only when asked for
    windows = sinkstrength.window_sweep(result)
    assert list(windows.window) == ["3", "5", "10", "15", "20"] and set(windows.layers) == {"0-2"}
    assert windows.S.nunique() == 1 and windows.S[0] == pytest.approx(result.strength(3))
    thirds = sinkstrength.window_sweep(result, sinkstrength.THIRDS)
    assert list(thirds.layers) == ["0-0", "1-1", "2-2"]


def test_no_layer_logits_outlive_their_layer(loaded_model, monkeypatch):
    """Each layer's (B, H, T, S) logits must be freed before the next layer computes its own."""
    loaded = loaded_model("tiny-llama")
    seen, alive_at_next = [], []
    original = sinkstrength.gap_from_logits

    def spy(logits):
        alive_at_next.append(sum(ref() is not None for ref in seen))
        out = original(logits)
        seen.append(weakref.ref(logits))
        return out

    monkeypatch.setattr(sinkstrength, "gap_from_logits", spy)
    result = sink_strength(loaded, TEXTS * 2, layers="all")
    assert len(alive_at_next) == 3 and alive_at_next == [0, 0, 0]
    assert all(g.dim() == 3 for g in result.gaps.values())        # only (B, H, T) is kept


# ---- command line ------------------------------------------------------------------------------------------

def test_cli_strength_json(capsys):
    from sinkbook.book.cli import main
    assert main(["strength", "tiny-llama", "--n", "3", "--window", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prompts"] == 3 and out["layers"] == [1, 2] and math.isfinite(out["S"])
    assert 0 <= out["strong_fraction"] <= 1 and set(out["quantiles"]) == {"q05", "q25", "q50", "q75", "q95"}


def test_cli_strength_text_and_errors(tmp_path, capsys):
    from sinkbook.book.cli import main
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt here\n\nsecond prompt here\n")
    assert main(["strength", "tiny-llama", "--prompts-file", str(prompts), "--window", "9"]) == 0
    out = capsys.readouterr().out
    assert "Sink Strength S" in out and "2 (raw text)" in out and "only 3 layers" in out
    assert main(["strength", "tiny-llama", "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["strength", "tiny-llama", "--prompts-file", str(tmp_path / "empty.txt")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(["strength", "no-such-model"]) == 2
    assert main(["strength", "tiny-llama", "--chat"]) == 2
    assert "chat template" in capsys.readouterr().err


# ---- calibration prompts --------------------------------------------------------------------------------------

def _ifeval_registry():
    """Instruction id -> keyword arguments of its build_description, read from lm-eval's source without
    importing it (the import needs langdetect and an NLTK download)."""
    import importlib.util
    spec = importlib.util.find_spec("lm_eval")
    root = Path(spec.origin).parent / "tasks" / "ifeval"
    registry = ast.parse((root / "instructions_registry.py").read_text())
    classes = {}
    for node in ast.walk(ast.parse((root / "instructions.py").read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "build_description":
                    args = item.args
                    classes[node.name] = {a.arg for a in args.args[1:] + args.kwonlyargs}
    prefixes = {}
    for node in registry.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            prefixes[node.targets[0].id] = node.value.value
    ids = {}
    for node in ast.walk(registry):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTRUCTION_DICT":
            for key, value in zip(node.value.keys, node.value.values):
                name = prefixes[key.left.id] + key.right.value
                ids[name] = classes[value.attr]
    return ids


def test_prompt_sets_are_disjoint_and_well_formed():
    calibration, pool = prompt_data.calibration_prompts(), prompt_data.pool_prompts()
    assert len(calibration) == 15 and len(pool) == 100
    texts = [r["prompt"] for r in calibration + pool]
    assert len(set(texts)) == len(texts)
    assert len({r["id"] for r in calibration + pool}) == 115
    registry = _ifeval_registry()
    assert "punctuation:no_comma" in registry and registry["length_constraints:number_words"] == {"num_words", "relation"}
    for record in calibration + pool:
        assert set(record) == {"id", "prompt", "instruction_id_list", "kwargs"}
        assert len(record["instruction_id_list"]) == len(record["kwargs"]) >= 1
        assert len(record["prompt"].split()) <= 40                      # short, like the VL calibration set
        for instruction, kwargs in zip(record["instruction_id_list"], record["kwargs"]):
            assert instruction in registry, instruction
            assert instruction not in prompt_data.NEEDS_PUNKT
            assert set(kwargs) <= registry[instruction], (instruction, kwargs)
            if "relation" in kwargs:
                assert kwargs["relation"] in ("less than", "at least")
            # what the checker will look for is what the prompt asks for
            for key in ("end_phrase", "keyword", "letter", "postscript_marker", "section_spliter"):
                if key in kwargs:
                    assert kwargs[key] in record["prompt"], (record["id"], key)
            for key in ("keywords", "forbidden_words"):
                for word in kwargs.get(key, []):
                    assert f'"{word}"' in record["prompt"], (record["id"], word)
            for key in ("num_words", "num_bullets", "num_highlights", "num_placeholders", "num_paragraphs",
                        "num_sections", "frequency", "let_frequency"):
                if key in kwargs:
                    assert str(kwargs[key]) in record["prompt"], (record["id"], key)


def test_prompt_texts_and_files(tmp_path):
    assert prompt_data.prompt_texts(3) == [r["prompt"] for r in prompt_data.calibration_prompts()[:3]]
    assert len(prompt_data.prompt_texts(source="all")) == 115
    with pytest.raises(ValueError, match="only 15"):
        prompt_data.prompt_texts(16)
    with pytest.raises(ValueError, match="unknown prompt source"):
        prompt_data.prompt_texts(source="ifeval")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        prompt_data.load_prompts_file(tmp_path / "bad.txt")
