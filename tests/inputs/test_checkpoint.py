"""--model resolution: local directories, presets with random weights, the HF cache, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from alignaudit.arch import PRESETS, find_preset
from alignaudit.arch.qwen3 import qwen3_config
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import load_spec, resolve_model
from alignaudit.inputs.synth import synthesize_checkpoint
from helpers import FIXTURE


def test_presets_have_published_shapes():
    p = PRESETS["Qwen3-8B"].config
    assert (p["hidden_size"], p["num_hidden_layers"], p["num_attention_heads"], p["num_key_value_heads"]) == (
        4096,
        36,
        32,
        8,
    )
    assert (p["intermediate_size"], p["vocab_size"], p["tie_word_embeddings"]) == (12288, 151936, False)
    assert PRESETS["Qwen3-0.6B"].config["tie_word_embeddings"] is True
    assert find_preset("qwen/qwen3-14b").name == "Qwen3-14B"
    assert {"Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B"} <= set(PRESETS)


def small_config(tie=False):
    return qwen3_config(
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=300,
        tie_word_embeddings=tie,
    )


def test_synthesis_is_seeded_sharded_and_reused(tmp_path):
    cfg = small_config()
    one = synthesize_checkpoint(cfg, tmp_path / "a", seed=3, shard_bytes=40_000)
    index = json.loads((one / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    tensors = {}
    for f in files:
        tensors.update(load_file(one / f))
    assert set(tensors) == set(index["weight_map"])
    single = synthesize_checkpoint(cfg, tmp_path / "b", seed=3)  # one file: same bytes per tensor
    same = load_file(single / "model.safetensors")
    assert all(torch.equal(same[k].view(torch.int16), tensors[k].view(torch.int16)) for k in same)
    other = load_file(synthesize_checkpoint(cfg, tmp_path / "c", seed=4) / "model.safetensors")
    assert not torch.equal(other["model.norm.weight"], same["model.norm.weight"])
    stamp = (single / "model.safetensors").stat().st_mtime_ns
    synthesize_checkpoint(cfg, tmp_path / "b", seed=3)
    assert (single / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    assert "lm_head.weight" not in load_file(
        synthesize_checkpoint(small_config(tie=True), tmp_path / "t") / "model.safetensors"
    )


def test_preset_with_random_weights_goes_to_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNAUDIT_CACHE", str(tmp_path))
    monkeypatch.setitem(
        PRESETS, "Qwen3-0.6B", PRESETS["Qwen3-0.6B"].__class__("Qwen3-0.6B", "Qwen/Qwen3-0.6B", small_config())
    )
    spec = resolve_model("Qwen3-0.6B", random_weights=True, seed=7)
    assert spec.path == str((tmp_path / "random" / "Qwen3-0.6B-seed7").resolve())
    assert not spec.has_tokenizer and spec.hidden_size == 64


def test_local_directory(tiny_spec):
    spec = resolve_model(str(FIXTURE))
    assert spec == tiny_spec and spec.name == "qwen3-tiny"


def test_fixture_names_resolve_as_on_the_command_line(tiny_spec):
    assert resolve_model("qwen3-tiny") == tiny_spec
    assert resolve_model("llama-tiny").architecture == "LlamaForCausalLM"
    with pytest.raises(InputError, match="qwen3-tiny is an embedded fixture with weights of its own"):
        resolve_model("qwen3-tiny", random_weights=True)


@pytest.mark.parametrize(
    "model, message",
    [
        ("/nonexistent/dir", "no such directory"),
        ("qwen3-small", "not a directory, a preset or a hub id"),
        ("Qwen3-8B", "not in the local Hugging Face cache"),
        ("someorg/some-model", "not in the local Hugging Face cache"),
        ("Qwen3-7B", "presets"),
    ],
)
def test_unresolvable_models(model, message, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match=message):
        resolve_model(model)


def test_null_rope_theta_is_an_input_error(tmp_path):
    """``"rope_theta": null`` reached float(None), a TypeError, rather than the one-line error of a bad config."""
    bad = tmp_path / "null-rope"
    shutil.copytree(FIXTURE, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_theta"] = None
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="rope_theta is null"):
        load_spec(bad)


def test_unsupported_architecture_and_broken_dirs(tmp_path):
    bad = tmp_path / "llama"
    shutil.copytree(FIXTURE, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        InputError,
        match="MambaForCausalLM is not supported; supported: Qwen3ForCausalLM, "
        "Qwen2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM$",
    ):
        load_spec(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="is a file"):
        resolve_model(str(bad / "config.json"))
    with pytest.raises(InputError, match="applies to preset names"):
        resolve_model(str(FIXTURE), random_weights=True)
