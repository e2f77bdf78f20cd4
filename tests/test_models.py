"""Model specs: built-ins, tiny families, local dirs, clear errors for what cannot be loaded here."""
import json

import numpy as np
import pytest
import torch

from sinkbook.book import cli
from sinkbook.core.arch import UnsupportedArchitecture, arch_for
from sinkbook.core.models import ModelNotAvailable, architecture_info, load_model


def test_unknown_model_names_the_alternatives():
    with pytest.raises(ModelNotAvailable, match="smollm2-135m-instruct"):
        load_model("no-such-model")


def test_offline_hub_id_fails_fast_and_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailable, match="not available here"):
        load_model("example-org/not-in-cache-model")


def test_missing_gguf_file():
    with pytest.raises(ModelNotAvailable, match="does not exist"):
        load_model("/nowhere/model.gguf")


def test_unsupported_architecture_refused_in_one_line():
    # Falcon's attention bypasses transformers' attention interface, so no capture point could be served; the
    # refusal names the family and that reason, in one line, with no path to a file that once held rows.
    from transformers import FalconConfig
    with pytest.raises(UnsupportedArchitecture) as err:
        arch_for(FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4))
    message = str(err.value)
    assert "'falcon'" in message and "attention interface" in message and "\n" not in message
    assert "arch.py" not in message


def test_unknown_tiny_family():
    with pytest.raises(ModelNotAvailable, match="tiny family"):
        load_model("tiny-bert")


def test_local_directory_round_trip(tmp_path, loaded_model, ids):
    lm = loaded_model("tiny-qwen3")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, again.model(ids).logits)
    assert again.files and all(len(h) == 64 for h in again.files.values())


@pytest.mark.parametrize("family,qk", [("llama", "none"), ("qwen3", "per-head"), ("olmo2", "layerwise"),
                                       ("gemma3", "per-head")])
def test_info_reports_qk_norm_kind(loaded_model, family, qk):
    assert architecture_info(loaded_model(f"tiny-{family}"))["qk_norm"] == qk


@pytest.mark.real_model
def test_real_model_facts(real):
    info = architecture_info(real)
    expected = {"smollm2-135m-instruct": dict(family="llama", layers=30, heads=9, kv_heads=3, head_dim=64,
                                              hidden_size=576, qk_norm="none", chat_template=True),
                "gemma3-270m": dict(family="gemma3_text", layers=18, heads=4, kv_heads=1, head_dim=256,
                                    hidden_size=640, qk_norm="per-head", chat_template=False)}[real.spec]
    assert {k: info[k] for k in expected} == expected
    assert all(len(sha) == 64 for sha in real.files.values())


def test_cli_info_json(capsys):
    assert cli.main(["info", "tiny-olmo2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["qk_norm"] == "layerwise" and info["layers"] == 3


def test_cli_error_is_one_line(capsys):
    assert cli.main(["info", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sinkbook: error: unknown model") and "Traceback" not in err


def test_cli_capture_writes_npz(tmp_path, capsys):
    out = tmp_path / "a.npz"
    assert cli.main(["capture", "tiny-gemma3", "--layer", "-1", "--prompt", "hello world", "--out", str(out)]) == 0
    data = np.load(out)
    heads, T, S = data["attention"].shape
    assert (heads, T, S) == (4, 12, 12) and len(data["tokens"]) == T and int(data["layer"]) == 2
    assert np.allclose(data["attention"].sum(-1), 1.0, atol=1e-5)


def test_cli_capture_rejects_bad_layer(tmp_path, capsys):
    assert cli.main(["capture", "tiny-llama", "--layer", "9", "--prompt", "x", "--out", str(tmp_path / "a.npz")]) == 2
    assert "out of range" in capsys.readouterr().err


SPREAD = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
          "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def test_a_model_spread_over_devices_captures_and_measures_as_one(tmp_path):
    """accelerate's dispatch (here two of three layers offloaded to disk, read back layer by layer: the hooks a
    multi-GPU device_map installs) changes neither the captures nor S, and our hooks leave with the context."""
    from sinkbook.core.hooks import capture, hook_count
    from sinkbook.core.prompts import prompt_texts
    from sinkbook.measures.strength import sink_strength
    whole = load_model("tiny-llama", device="cpu")
    spread = load_model("tiny-llama", device_map=SPREAD, offload_folder=tmp_path / "offload")
    assert {p.device.type for p in spread.model.parameters()} == {"cpu", "meta"}      # really offloaded
    assert spread.device == "cpu"
    prompts = prompt_texts(4)
    assert sink_strength(spread, prompts, layers="all").strength(3) == \
        pytest.approx(sink_strength(whole, prompts, layers="all").strength(3), abs=1e-6)
    ids = whole.tokenizer(["The river runs to the sea."], return_tensors="pt")["input_ids"]
    hooks = hook_count(spread.model)
    with capture(whole.model, points=("pattern", "v_proj")) as a:
        whole.model(ids)
    with capture(spread.model, points=("pattern", "v_proj")) as b:
        spread.model(ids)
    for layer in range(3):
        torch.testing.assert_close(b["pattern", layer], a["pattern", layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(b["v_proj", layer], a["v_proj", layer], rtol=0, atol=1e-6)
    assert hook_count(spread.model) == hooks


def test_an_automatic_device_map_within_a_memory_budget_offloads(tmp_path):
    whole = load_model("tiny-llama", device="cpu")
    spread = load_model("tiny-llama", device_map="auto", max_memory={"cpu": "450KiB"},      # the model: 564 KiB
                        offload_folder=tmp_path / "offload")
    assert {"cpu", "disk"} <= set(spread.model.hf_device_map.values())
    ids = torch.tensor([[256, 72, 105, 33]])
    torch.testing.assert_close(spread.model(ids).logits, whole.model(ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="offload_folder"):
        load_model("tiny-llama", device_map=SPREAD)
    with pytest.raises(ValueError, match="device_map must be"):
        load_model("tiny-llama", device_map="balanced-ish")
