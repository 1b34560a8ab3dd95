"""shared.tools.generate: the tokenizer it picks for an export, and refusals of bad flags with a message."""

import dataclasses
import json
import sys

import pytest
import torch

from shared.model.config import GPTConfig
from shared.model.gpt import GPT
from shared.tools import generate
from shared.tools.prepare_data import prepare
from shared.train import checkpoint
from tests.helpers import generate_error


def _export(path, data):
    cfg = GPTConfig()
    return checkpoint.save_exported(path, GPT(cfg).state_dict(), dataclasses.asdict(cfg), {"data": data, "step": 1})



def test_missing_data_metadata_is_an_error_not_bytes(tmp_path, monkeypatch, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "corpus.txt").write_text("in the beginning was the word. " * 60)
    monkeypatch.chdir(tmp_path / "run")
    prepare("corpus.txt", "data/kjv")  # the run's --data is relative to the folder it was trained in
    weights = _export(tmp_path / "run" / "m.safetensors", "data/kjv")
    assert generate.tokenizer_for({"data": "data/kjv"})[2] == 256
    assert generate.main([str(weights), "--tokens", "2", "--device", "cpu"])
    monkeypatch.chdir(tmp_path)  # elsewhere: the recorded prefix no longer resolves
    with pytest.raises(ValueError, match=r"data/kjv.meta.json' is not found.*run from the folder.*--data PREFIX"):
        generate.tokenizer_for({"data": "data/kjv"})
    assert "--data PREFIX" in generate_error(capsys, [str(weights), "--tokens", "2", "--device", "cpu"])
    assert generate.main([str(weights), "--tokens", "2", "--device", "cpu", "--data", "run/data/kjv"])
    assert generate.tokenizer_for({"data": "synthetic"})[2] == 256  # synthetic tokens stay byte-level
    encode, decode, _ = generate.tokenizer_for({"data": "kjv"})  # the shipped text's bytes, from any folder
    assert decode(encode("In the beginning")) == "In the beginning" and len(encode("God")) == 3


@pytest.mark.parametrize("flags, message", [
    (["--top_k", "-1"], "--top_k must be >= 1, or 0 for no top-k cut, got -1"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0: greedy), got inf"),
    (["--temperature", "-0.5"], "got -0.5"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--seed", str(2**70)], "--seed must fit in 64 bits"),
])
def test_bad_sampling_flags_are_refused_by_name(tmp_path, capsys, flags, message):
    weights = _export(tmp_path / "m.safetensors", "synthetic")
    assert message in generate_error(capsys, [str(weights), "--device", "cpu", *flags])


def test_tiny_temperature_samples_the_argmax_instead_of_nan():
    model = GPT(GPTConfig(dropout=0.0, attn_dropout=0.0, attention="reference")).eval()
    idx = torch.tensor([[1, 2, 3]])
    greedy = generate.generate(model, idx, 4, temperature=0)
    assert torch.equal(generate.generate(model, idx, 4, temperature=1e-45, top_k=0), greedy)


def test_an_empty_prompt_is_refused_not_replaced_by_a_token(tmp_path, capsys):
    weights = _export(tmp_path / "m.safetensors", "synthetic")
    err = generate_error(capsys, [str(weights), "--tokens", "2", "--device", "cpu", "--prompt", ""])
    assert "--prompt '' encodes to no tokens" in err


def test_bpe_data_without_tokenizers_is_a_message(tmp_path, monkeypatch, capsys):
    """A model trained on bpe token files, sampled where Hugging Face's tokenizers is not installed."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    (tmp_path / "d.meta.json").write_text(json.dumps({"tokenizer": "bpe", "tokenizer_file": "d.tokenizer.json"}))
    (tmp_path / "d.tokenizer.json").write_text("{}")
    weights = _export(tmp_path / "m.safetensors", str(tmp_path / "d"))
    err = generate_error(capsys, [str(weights), "--tokens", "2", "--device", "cpu"])
    assert "tokenizer 'bpe' needs Hugging Face's tokenizers package" in err
