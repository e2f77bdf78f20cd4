"""The fault suite (issue 25): bad input and damaged files replayed through the `sinkbook` command.

Each case asserts what a user sees: one line `sinkbook: error: ...` naming the problem, exit status 2, and
(where it matters) that the refusal came before the expensive part: the forward pass, the model load, the
text suite. Tiny random-weight models only; the whole file runs in well under a minute.
"""
import pytest
import torch

from sinkbook.book.cli import main


def refused(capsys, argv, *words) -> str:
    """Run the command in this process; assert exit 2 and a single `sinkbook: error:` line holding ``words``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sinkbook: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def no_forward(monkeypatch):
    """load_model returns tiny-llama whose forward pass fails the test: a refusal must come before it."""
    import sinkbook.core.models as models
    real_load = models.load_model

    def load(spec, *args, **kwargs):
        loaded = real_load(spec, *args, **kwargs)

        def forbid(*_):
            raise AssertionError("the forward pass ran before the input was checked")
        loaded.model.register_forward_pre_hook(forbid)
        return loaded
    monkeypatch.setattr(models, "load_model", load)


# ---- prompt length and attention memory (item 1) ---------------------------------------------------------------

def test_a_prompt_longer_than_the_context_window_is_refused_before_the_forward_pass(tmp_path, capsys, no_forward):
    long_file = tmp_path / "long.txt"
    long_file.write_text("x" * 20_000 + "\n")                # byte tokenizer: 20,001 tokens, tiny models read 512
    refused(capsys, ["strength", "tiny-llama", "--prompts-file", str(long_file)], "20001 tokens", "at most 512")
    refused(capsys, ["capture", "tiny-llama", "--layer", "0", "--prompt", "x" * 600, "--out", str(tmp_path / "a.npz")],
            "601 tokens", "at most 512")
    assert not (tmp_path / "a.npz").exists()


def test_attention_memory_past_the_limit_is_refused_and_the_limit_can_be_raised(tmp_path, capsys, monkeypatch):
    argv = ["capture", "tiny-llama", "--layer", "0", "--prompt", "x" * 400, "--out", str(tmp_path / "a.npz")]
    monkeypatch.setenv("SINKBOOK_MAX_ATTENTION_GB", "0.001")  # 4 heads x 401 x 401 x 4 bytes = 2.6 MB > 1 MB
    refused(capsys, argv, "about 0.0026 GB of attention", "SINKBOOK_MAX_ATTENTION_GB=1")
    assert not (tmp_path / "a.npz").exists()
    monkeypatch.setenv("SINKBOOK_MAX_ATTENTION_GB", "0.01")
    assert main(argv) == 0 and (tmp_path / "a.npz").exists()
    monkeypatch.setenv("SINKBOOK_MAX_ATTENTION_GB", "lots")
    refused(capsys, ["strength", "tiny-llama", "--n", "1"], "SINKBOOK_MAX_ATTENTION_GB must be a positive number")
