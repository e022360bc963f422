"""The vLLM connector's model fingerprint: other weights or another KV-relevant config at the
same path give another namespace; a copy of one checkpoint elsewhere gives the same."""

from __future__ import annotations

import shutil

import pytest

from kvtier.connectors.model_identity import model_fingerprint

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _save(path, seed: int, **overrides) -> dict:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, **overrides)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return cfg.to_dict()


def test_other_weights_at_the_same_path_are_another_model(tmp_path):
    model = tmp_path / "model"  # one mount point, two checkpoints over time
    cfg_a = _save(model, seed=0)
    a = model_fingerprint(str(model), cfg_a)
    shutil.rmtree(model)
    cfg_b = _save(model, seed=1)
    assert cfg_a == cfg_b  # same architecture: only the weights differ
    assert model_fingerprint(str(model), cfg_b) != a


def test_a_copy_elsewhere_is_the_same_model_and_config_overrides_are_not(tmp_path):
    cfg = _save(tmp_path / "a", seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    a = model_fingerprint(str(tmp_path / "a"), cfg)
    assert model_fingerprint(str(tmp_path / "copy"), cfg | {"_name_or_path": "elsewhere"}) == a
    assert model_fingerprint(str(tmp_path / "a"), cfg | {"rope_theta": 1e6}) != a  # hf_overrides change the KV
    assert model_fingerprint(str(tmp_path / "a"), cfg, revision="v2") != a
    assert model_fingerprint(str(tmp_path / "a"), cfg, quantization="fp8") != a


def test_a_hub_id_is_named_by_id_and_revision(tmp_path):
    assert model_fingerprint("org/model", {"x": 1}, "abc") == model_fingerprint("org/model", {"x": 1}, "abc")
    assert model_fingerprint("org/model", {"x": 1}, "abc") != model_fingerprint("org/model", {"x": 1}, "def")
    assert model_fingerprint("org/model", {"x": 1}) != model_fingerprint("org/other", {"x": 1})


def test_a_fine_tune_of_one_tensor_is_another_model(tmp_path):
    """Same config, names, shapes and file size; one of 20 tensors changed (a fine-tuned layer,
    a LoRA merged into one projection): the file's 8 windows all miss it, each tensor's own do not."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 20, "hidden_size": 512}
    torch.manual_seed(0)
    base = {f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(512, 512) for i in range(20)}  # 1 MiB each
    save_file(base, str(tmp_path / "model.safetensors"))
    a = model_fingerprint(str(tmp_path), cfg)
    assert model_fingerprint(str(tmp_path), cfg) == a
    tuned = base | {"model.layers.3.self_attn.q_proj.weight": base["model.layers.3.self_attn.q_proj.weight"] + 0.01}
    save_file(tuned, str(tmp_path / "model.safetensors"))
    assert model_fingerprint(str(tmp_path), cfg) != a
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a safetensors file")  # no header: windows only
    assert len(model_fingerprint(str(tmp_path), cfg)) == 16
