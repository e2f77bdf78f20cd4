"""The vision-language adaptation pipeline: prompts, labels, the image embedding, frozen parts, saving,
and two-process training under accelerate against one process with the same global batch."""
from __future__ import annotations

import dataclasses

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkbook.core.models import load_model
from sinkbook.training.adapt import AdaptConfig, adapt, trainable_parameters, vision_encoder
from sinkbook.training.digits import TASKS, WORDS, load_digit_splits, make_examples, question_and_answer
from sinkbook.training.vlm import (IMAGE_MARKER, PATCHES_PER_DIGIT, PromptFormat, answer_loss, build_vlm,
                                   encode_examples, load_vlm, train_encoder)

HELPER = Path(__file__).parent / "helpers" / "adapt_run.py"


@pytest.fixture(scope="module")
def tiny_vlm():
    torch.manual_seed(0)
    loaded = load_model("tiny-llama", device="cpu")
    return build_vlm(loaded, vision_encoder("cpu")), loaded


def test_digit_split_is_stratified_and_disjoint():
    train, test = load_digit_splits()
    assert len(train) + len(test) == 1797
    for digit in range(10):
        share = float((test.labels == digit).sum()) / float(((train.labels == digit).sum() + (test.labels == digit).sum()))
        assert 0.22 < share < 0.28
    assert not set(map(bytes, test.images.numpy())) & set(map(bytes, train.images.numpy()))


def test_examples_have_the_answers_their_digits_imply():
    train, _ = load_digit_splits()
    examples = make_examples(train, 50, seed=3)
    assert [e.task for e in examples[:5]] == list(TASKS)
    for e in examples:
        assert e.images.shape == (len(e.digits), 8, 8)
        assert (e.task == "row") == (len(e.digits) > 1)
        assert question_and_answer(e.task, e.digits) == (e.question, e.answer)
        if e.task == "parity":
            assert e.answer == ("yes" if e.digits[0] % 2 == 0 else "no")
        if e.task == "row":
            assert e.answer.split() == [str(d) for d in e.digits]
        assert e.text_stand_in == "Digits: " + " ".join(WORDS[d] for d in e.digits)
    assert make_examples(train, 5, seed=3)[0].digits == examples[0].digits


@pytest.mark.parametrize("spec", ["tiny-llama", "smollm2-135m-instruct"])
def test_image_tokens_sit_inside_the_prompt_and_labels_cover_only_the_answer(spec):
    loaded = load_model(spec, device="cpu")
    tok, fmt = loaded.tokenizer, PromptFormat.for_tokenizer(loaded.tokenizer)
    train, _ = load_digit_splits()
    examples = make_examples(train, 5, seed=1)
    batch = encode_examples(examples, tok, fmt, "vision")
    for row, ex in enumerate(examples):
        image = batch["image_mask"][row]
        assert int(image.sum()) == PATCHES_PER_DIGIT * len(ex.digits)
        positions = torch.nonzero(image).flatten()
        assert positions[0] > 0 and (positions.diff() == 1).all()          # one block, never at position 0
        labels = batch["labels"][row]
        answer = tok.decode(labels[labels != -100])
        assert answer.startswith(ex.answer) and answer.strip() != ex.answer or answer.strip() == ex.answer
        assert fmt.answer_text(tok, ex.question, IMAGE_MARKER, ex.answer).startswith(answer[: len(ex.answer)] if fmt.chat else " ")
        assert not (labels != -100)[image].any()
        real = batch["attention_mask"][row].bool()
        assert (labels[~real] == -100).all()
    text = encode_examples(examples, tok, fmt, "text")
    assert "images" not in text and not text["image_mask"].any()
    assert tok.decode(text["input_ids"][0][text["attention_mask"][0].bool()]).count("Digits: ") == 1
    # the text-only counterpart supervises exactly the same answer tokens
    assert [tok.decode(r[r != -100]) for r in text["labels"]] == [tok.decode(r[r != -100]) for r in batch["labels"]]


def test_projected_patches_replace_the_placeholders_in_reading_order(tiny_vlm):
    vlm, loaded = tiny_vlm
    train, _ = load_digit_splits()
    examples = make_examples(train, 4, seed=2, tasks=("row",))
    batch = encode_examples(examples, loaded.tokenizer, PromptFormat(chat=False), "vision")
    embeds = vlm.embed(batch["input_ids"], batch["image_mask"], batch["images"])
    plain = loaded.model.get_input_embeddings()(batch["input_ids"])
    patches = vlm.projector(vlm.encoder.patches(batch["images"]).flatten(0, 1))
    torch.testing.assert_close(embeds[batch["image_mask"]], patches)
    torch.testing.assert_close(embeds[~batch["image_mask"]], plain[~batch["image_mask"]])


def test_answer_loss_equals_the_models_own_loss(tiny_vlm):
    vlm, loaded = tiny_vlm
    train, _ = load_digit_splits()
    batch = encode_examples(make_examples(train, 6, seed=4), loaded.tokenizer, PromptFormat(chat=False), "vision")
    embeds = vlm.embed(batch["input_ids"], batch["image_mask"], batch["images"])
    ours = answer_loss(loaded.model, embeds, batch["attention_mask"], batch["labels"])
    theirs = loaded.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(ours, theirs)
    count = int((batch["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(answer_loss(loaded.model, embeds, batch["attention_mask"], batch["labels"], count), ours)


def test_stages_train_what_the_recipe_says(tiny_vlm):
    vlm, loaded = tiny_vlm
    stage1 = set(map(id, trainable_parameters(vlm, 1)))
    assert stage1 == set(map(id, vlm.projector.parameters()))
    stage2 = set(map(id, trainable_parameters(vlm, 2)))
    assert id(loaded.model.get_input_embeddings().weight) not in stage2
    assert not any(id(p) in stage2 for p in vlm.encoder.parameters())
    assert stage1 < stage2 and len(stage2) > len(stage1) + 10


def _state(directory):
    vlm, loaded, _ = load_vlm(directory, device="cpu")
    return {**{f"llm.{k}": v for k, v in loaded.model.state_dict().items()},
            **{f"projector.{k}": v for k, v in vlm.projector.state_dict().items()},
            **{f"encoder.{k}": v for k, v in vlm.encoder.state_dict().items()}}


def test_training_changes_only_the_trainable_parts_and_round_trips(tmp_path):
    before_llm = load_model("tiny-llama", device="cpu").model.state_dict()
    encoder = vision_encoder("cpu").state_dict()
    cfg = AdaptConfig("tiny-llama", steps=3, stage1_steps=2, batch_size=4, lr=1e-3, stage1_lr=1e-2)
    run = adapt(cfg, device="cpu", use_cache=False, progress=False, out=tmp_path / "run")
    after = _state(tmp_path / "run" / "model")
    embed = "llm.model.embed_tokens.weight"
    assert torch.equal(after[embed], before_llm["model.embed_tokens.weight"])
    assert all(torch.equal(after[f"encoder.{k}"], v) for k, v in encoder.items())
    changed = [k for k, v in before_llm.items() if not torch.equal(after[f"llm.{k}"], v)]
    assert any("q_proj" in k for k in changed) and "model.embed_tokens.weight" not in changed
    assert [h["stage"] for h in run.history] == [0, 1, 1, 2, 2, 2]
    # the saved directory is a plain causal LM for load_model (text-only backbone) and a VLM for load_vlm
    reloaded = load_model(str(tmp_path / "run" / "model"), device="cpu")
    ids = torch.tensor([[256, 72, 105]])
    torch.testing.assert_close(reloaded.model(ids).logits, run.vlm.llm(ids).logits)
    cached = adapt(cfg, device="cpu", progress=False, out=tmp_path / "run")
    assert cached.from_cache and cached.history == run.history


def test_text_only_run_skips_stage_one(tmp_path):
    cfg = AdaptConfig("tiny-llama", modality="text", steps=2, stage1_steps=5, batch_size=4)
    run = adapt(cfg, device="cpu", use_cache=False, progress=False, out=tmp_path / "t")
    assert [h["stage"] for h in run.history] == [2, 2]


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    one = subprocess.run([sys.executable, str(HELPER), "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", "29533", str(HELPER), "--out", str(tmp_path / "two")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    import json
    runs = [json.loads((tmp_path / name / "run.json").read_text()) for name in ("one", "two")]
    assert runs[1]["processes"] == 2
    for h1, h2 in zip(runs[0]["history"], runs[1]["history"]):        # the global loss and gradient, step by step
        assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-5)
        if h1["stage"] == 0:                                           # projector alignment: no clipped step
            assert h2["grad_norm"] is None and h1["grad_norm"] is None
        else:
            assert h2["grad_norm"] == pytest.approx(h1["grad_norm"], rel=1e-4)
    # Weights: AdamW divides by the root of tiny second moments, so float32 rounding between one and two
    # processes moves a handful of near-zero-gradient elements by a tenth of a step or so (the max-element
    # distance is no guide). A wrong reduction or a different batch moves the whole update by O(1), so test the
    # update as a whole and count the elements that stray.
    a, b = _state(tmp_path / "one" / "model"), _state(tmp_path / "two" / "model")
    before = {f"llm.{k}": v for k, v in load_model("tiny-llama", device="cpu").model.state_dict().items()}
    update = torch.cat([(a[k] - before[k]).flatten() for k in before])
    between = torch.cat([(a[k] - b[k]).flatten() for k in before])
    assert between.norm() <= 1e-3 * update.norm(), (between.norm().item(), update.norm().item())
    strays = (between.abs() > 0.01 * update.abs().max()).float().mean().item()
    assert strays <= 1e-3, strays
    projector = [k for k in a if k.startswith("projector.")]
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=0.2 * update.abs().max().item()) for k in projector)


def test_bad_configurations_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        AdaptConfig("tiny-llama", steps=0)
    with pytest.raises(ValueError, match="modality"):
        AdaptConfig("tiny-llama", modality="audio")


def test_command_line_refuses_bad_input_in_one_line(tmp_path, capsys):
    from sinkbook.book.cli import main
    cases = [(["adapt", "nosuch-model", "--steps", "2", "--out", str(tmp_path / "a")], "unknown model"),
             (["adapt", "tiny-llama", "--steps", "2", "--out", "/proc/no/such"], "cannot write to --out")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("sinkbook: error:") and message in err and "\n" not in err
    assert not (tmp_path / "a").exists()
    with pytest.raises(SystemExit):
        main(["adapt", "tiny-llama", "--steps", "0", "--out", str(tmp_path / "b")])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "run.json").write_text("{}")
    assert main(["adapt", "tiny-llama", "--steps", "2", "--out", str(tmp_path / "c")]) == 2
    assert "already holds an adapted model" in capsys.readouterr().err


def test_command_line_adapts_and_evaluates(tmp_path, capsys):
    import json
    from sinkbook.book.cli import main
    out = tmp_path / "run"
    assert main(["adapt", "tiny-llama", "--steps", "2", "--stage1-steps", "1", "--batch-size", "4",
                 "--probe-items", "2", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"S", "heldout_loss", "vision_accuracy"} <= set(summary["before"]) and summary["after"]["step"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["model", "run.json"]        # no lock file left behind
    assert main(["evaluate", str(out / "model"), "--arithmetic", "2", "--knowledge", "2", "--ifeval", "0",
                 "--vision", "3", "--json"]) == 0
    tasks = json.loads(capsys.readouterr().out)["tasks"]
    assert {"arithmetic_strict", "knowledge_mc", "image_tasks"} <= set(tasks)


def test_stage_zero_aligns_the_projector_without_touching_the_language_model(tiny_vlm):
    from sinkbook.training.adapt import align_projector
    vlm, loaded = tiny_vlm
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    losses = align_projector(vlm, loaded.tokenizer, steps=60, seed=0)
    assert losses[-1] < 0.5 * losses[0]
    assert all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items())


def test_the_encoder_is_the_same_whatever_the_callers_thread_count():
    train, _ = load_digit_splits()
    images, labels = train.images[:256], train.labels[:256]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = train_encoder(images, labels, seed=0, epochs=2).state_dict()
        torch.set_num_threads(2)
        two = train_encoder(images, labels, seed=0, epochs=2).state_dict()
        assert torch.get_num_threads() == 2               # the caller's setting comes back
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_the_probe_measures_the_sink_on_the_first_prompts_it_is_given(tiny_vlm):
    from sinkbook.core.models import encode
    from sinkbook.core.prompts import prompt_texts
    from sinkbook.measures.margins import sink_state, window_layers
    from sinkbook.training.probes import AdaptationProbe
    vlm, loaded = tiny_vlm
    probe = AdaptationProbe(loaded, window=2, arithmetic=0, vision=0, heldout_windows=1, heldout_length=16, prompts=3)
    assert probe.batch["input_ids"].shape[0] == 3
    direct = sink_state(loaded.model, encode(loaded.tokenizer, prompt_texts(3)), window_layers(loaded.model, 2))[0]
    everything = sink_state(loaded.model, encode(loaded.tokenizer, prompt_texts()), window_layers(loaded.model, 2))[0]
    out = probe(0, vlm, loaded, PromptFormat.for_tokenizer(loaded.tokenizer), "text")
    assert out["S"] == pytest.approx(direct["S"], abs=1e-6) and out["S"] != pytest.approx(everything["S"], abs=1e-6)
    assert out["margin_median_B"] == pytest.approx(0.0, abs=1e-5)     # the model is still its own reference


def test_a_configuration_rebuilds_from_its_record_with_the_same_cache_key():
    for cfg in (AdaptConfig("tiny-llama", "vision", steps=3, tasks=("parity", "caption")),
                AdaptConfig("tiny-llama", "vision", seed=2, intervention="lora")):
        again = AdaptConfig(**cfg.record())
        assert again == cfg and again.key("x") == cfg.key("x") and isinstance(again.tasks, tuple)


def test_each_seed_trains_and_reads_its_own_encoder(monkeypatch, tmp_path):
    from sinkbook.training import adapt as A
    from sinkbook.training.vlm import DigitEncoder
    monkeypatch.setenv("SINKBOOK_CACHE", str(tmp_path))
    trained = []

    def quick_encoder(images, labels, seed, epochs, width):      # the real one takes ~40 s; the seed is what counts
        trained.append(seed)
        torch.manual_seed(seed)
        return DigitEncoder(width)
    monkeypatch.setattr(A, "train_encoder", quick_encoder)
    three, four, three_again = A.vision_encoder("cpu", 3), A.vision_encoder("cpu", 4), A.vision_encoder("cpu", 3)
    assert trained == [3, 4] and A.encoder_path(3).exists() and A.encoder_path(3) != A.encoder_path(4)
    first = next(iter(three.state_dict()))
    assert torch.equal(three.state_dict()[first], three_again.state_dict()[first])
    assert not torch.equal(three.state_dict()[first], four.state_dict()[first])
    run = adapt(AdaptConfig("tiny-llama", steps=1, stage1_steps=0, align_steps=0, batch_size=2, seed=5),
                device="cpu", use_cache=False, progress=False, out=tmp_path / "run")
    assert trained == [3, 4, 5]
    assert torch.equal(run.vlm.encoder.state_dict()[first], A.vision_encoder("cpu", 5).state_dict()[first])


def test_bfloat16_runs_are_keyed_apart_and_float32_keys_stay_as_they_were(tmp_path):
    plain = AdaptConfig("tiny-llama", steps=1, stage1_steps=1, align_steps=0, batch_size=2)
    fast = dataclasses.replace(plain, precision="bfloat16")
    assert "precision" not in plain.record() and fast.record()["precision"] == "bfloat16"
    assert plain.key() != fast.key()
    from sinkbook.runs.adaptation import RECIPE, eval_spec
    assert "precision" not in eval_spec(RECIPE.resolve("default", precision="float32"))
    assert eval_spec(RECIPE.resolve("default", precision="bfloat16"))["precision"] == "bfloat16"
    with pytest.raises(ValueError, match="precision"):
        AdaptConfig("tiny-llama", precision="float16")
    run = adapt(fast, device="cpu", use_cache=False, progress=False, out=tmp_path / "fast")
    reference = adapt(plain, device="cpu", use_cache=False, progress=False, out=tmp_path / "plain")
    losses = [h["loss"] for h in run.history]
    assert losses != [h["loss"] for h in reference.history]                      # trained in bfloat16
    assert losses == pytest.approx([h["loss"] for h in reference.history], rel=2e-2)
    assert {p.dtype for p in run.vlm.parameters()} == {torch.float32}
    assert AdaptConfig(**run.config.record()) == fast                              # the record round-trips


def test_a_run_that_will_not_fit_on_the_disk_is_refused_before_training(tmp_path, monkeypatch):
    """A full disk found when the weights are written lost a 30-minute build's last run; the room is checked first,
    against the weights' size with tied tensors counted once."""
    import collections
    import shutil

    from sinkbook.core import paths
    from sinkbook.training import adapt as adapt_module
    tied = torch.nn.Linear(4, 4)
    pair = torch.nn.ModuleDict({"a": tied, "b": torch.nn.Linear(4, 4)})
    pair["b"].weight = tied.weight
    assert paths.weight_bytes(pair) == 4 * (16 + 4 + 4)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    trained = []
    monkeypatch.setattr(adapt_module, "fit", lambda *a, **k: trained.append(1))
    cfg = AdaptConfig("tiny-llama", steps=2, stage1_steps=1, batch_size=4)
    with pytest.raises(paths.NoRoom, match=r"has 0\.0 GB free and run needs about .* point SINKBOOK_CACHE"):
        adapt(cfg, device="cpu", use_cache=False, progress=False, out=tmp_path / "deep" / "run")
    assert not trained and not (tmp_path / "deep").exists()
