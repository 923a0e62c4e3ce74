"""A real Hugging Face model both ways: a tiny two-layer Llama built from a config (no
download), saved with ``save_pretrained`` as shards, is imported by aiosnap equal; aiosnap's
export of the same weights, beside the model's ``config.json``, loads with
``from_pretrained`` to equal logits."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.eval()
    return model


def test_save_pretrained_imports_equal_and_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    from aiosnap import SyncCheckpointer
    from aiosnap.interop.safetensors.api import export, open_safetensors

    source = _llama(0)
    hf_dir = tmp_path / "pretrained"
    source.save_pretrained(hf_dir, max_shard_size="40KB")
    assert len(list(hf_dir.glob("model-*.safetensors"))) > 1  # sharded, with an index

    target = _llama(1)
    with SyncCheckpointer({"ram_budget": "4MiB"}, storage=open_safetensors(str(hf_dir))) as ckpt:
        ckpt.load({"model": target})  # in place, through the module's own state_dict
    expected = source.state_dict()
    for name, value in target.state_dict().items():
        assert torch.equal(value, expected[name]), name

    root = tmp_path / "ckpt"
    with SyncCheckpointer({"storage": {"url": str(root)}, "ram_budget": "4MiB"}) as ckpt:
        ckpt.save({"model": target, "step": 7}, step=7).wait()
    exported = tmp_path / "exported"
    export(str(root), str(exported), paths=["model/*"], max_shard_size="30KB")
    shutil.copy(hf_dir / "config.json", exported / "config.json")
    loaded = transformers.LlamaForCausalLM.from_pretrained(exported)
    loaded.eval()
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, source(tokens).logits)

    bf16 = tmp_path / "bf16"
    export(str(root), str(bf16), paths=["model/*"], dtype="bf16")
    shutil.copy(hf_dir / "config.json", bf16 / "config.json")
    half = transformers.LlamaForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    assert torch.equal(half.state_dict()["lm_head.weight"], source.state_dict()["lm_head.weight"].to(torch.bfloat16))
