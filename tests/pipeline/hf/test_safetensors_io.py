"""Safetensors read and written one tensor at a time (pipeline/hf/safetensors_io.py): the files are what the
safetensors package and transformers read; damaged files are refused by name; imports and exports make each
tensor only when it is written (never a second copy of the model); sharded and base-model Hugging Face
directories import as transformers loads them."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model, LlamaConfig, LlamaForCausalLM

from pipeline.hf.convert import from_hf
from pipeline.hf.importer import import_hf
from pipeline.hf.safetensors_io import (HF_INDEX, PlannedTensor, SafetensorsError, SafetensorsFiles, write_hf_weights,
                                        write_safetensors)
from pipeline.hf.export import export_hf, max_relative_difference
from pipeline.checkpoints.state_dicts import read_state_dict


def _mixed():
    base = torch.randn(6, 4)
    return {"a": base[:3], "b": base[3:], "t": base.t(), "i": torch.arange(5), "h": torch.randn(3, 2).bfloat16(),
            "s": torch.tensor(3.0), "z": torch.empty(0, 3), "f": torch.randn(2, 2).half(),
            "p": PlannedTensor((2, 3), torch.float32, lambda: torch.full((2, 3), 7.0))}


def _value(v):
    return v.make() if isinstance(v, PlannedTensor) else v


def test_written_files_are_what_safetensors_reads(tmp_path):
    tensors = _mixed()
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    theirs = load_file(str(tmp_path / "x.safetensors"))
    ours = SafetensorsFiles([tmp_path / "x.safetensors"])
    assert sorted(theirs) == sorted(ours) == sorted(tensors)
    for name, value in tensors.items():
        want = _value(value)
        assert theirs[name].dtype == ours[name].dtype == want.dtype
        assert torch.equal(theirs[name], want) and torch.equal(ours[name], want), name
        assert ours.shape_of(name) == tuple(want.shape)
    # and ours reads what the safetensors package writes
    save_file({k: _value(v).contiguous().clone() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    again = SafetensorsFiles([tmp_path / "theirs.safetensors"])
    assert all(torch.equal(again[k], _value(v)) for k, v in tensors.items())


def test_a_planned_tensor_must_match_its_plan(tmp_path):
    bad = {"w": PlannedTensor((2, 2), torch.float32, lambda: torch.zeros(2, 3))}
    with pytest.raises(SafetensorsError, match=r"w: produced \[2, 3\] torch.float32, planned \[2, 2\]"):
        write_safetensors(tmp_path / "bad.safetensors", bad)


def test_damaged_files_are_refused_by_name(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(64, 64)})
    data = (tmp_path / "w.safetensors").read_bytes()
    cases = {"cut": data[: len(data) - 100], "tiny": data[:5], "header": data[:8] + b"{not json" + data[17:],
             "huge": (2 ** 40).to_bytes(8, "little") + data[8:]}
    for name, raw in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(raw)
        with pytest.raises(SafetensorsError, match=rf"{name}\.safetensors is not a readable safetensors file"):
            SafetensorsFiles([tmp_path / f"{name}.safetensors"])


def test_reading_lazily_reads_each_tensor_only_when_asked(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", {"a": torch.ones(3), "b": torch.zeros(2)})
    lazy = read_state_dict(tmp_path / "w.safetensors", lazy=True)
    (tmp_path / "w.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes())  # same bytes, new inode
    assert lazy.shape_of("a") == (3,) and torch.equal(lazy["a"], torch.ones(3))


class CountingReads(dict):
    """A state dict that counts how often each tensor is read; it knows shapes and dtypes without a read, as
    SafetensorsFiles does."""

    def __init__(self, *a):
        super().__init__(*a)
        self.reads = {}

    def shape_of(self, k):
        return tuple(super().__getitem__(k).shape)

    def dtype_of(self, k):
        return super().__getitem__(k).dtype

    def __getitem__(self, k):
        self.reads[k] = self.reads.get(k, 0) + 1
        return super().__getitem__(k)


def _llama(tie=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=24, tie_word_embeddings=tie)).eval()


def test_an_export_makes_each_tensor_once_while_it_is_written(tmp_path):
    hf = _llama()
    config, full = from_hf(hf)
    counting = CountingReads(full)
    export_hf(config, counting, tmp_path / "out")
    # q/k/v and gate/up are blocks of one project tensor: it is read once per block written, never kept
    assert counting.reads["layers.0.attention.qkv.weight"] == 3
    assert counting.reads["layers.0.mlp.fc_in.weight"] == 2
    assert counting.reads["embedding.word_embeddings.weight"] == 1
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_relative_difference(back(tokens).logits, hf(tokens).logits) == 0.0


def test_sharded_and_base_model_directories_import_as_transformers_loads_them(tmp_path):
    hf = _llama()
    hf.save_pretrained(tmp_path / "one")
    # the same weights in three shards with an index, as huggingface_hub writes a big model
    (tmp_path / "sharded").mkdir()
    for f in ("config.json", "generation_config.json"):
        (tmp_path / "sharded" / f).write_bytes((tmp_path / "one" / f).read_bytes())
    files = write_hf_weights(tmp_path / "sharded", read_state_dict(tmp_path / "one" / "model.safetensors"),
                             max_shard_bytes=20_000)
    assert len(files) >= 3 and (tmp_path / "sharded" / HF_INDEX).is_file()
    index = json.loads((tmp_path / "sharded" / HF_INDEX).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), hf.state_dict().values()))
    _, want = from_hf(hf)
    for name in ("one", "sharded"):
        import_hf(tmp_path / name, tmp_path / f"imported-{name}")
        got = read_state_dict(tmp_path / f"imported-{name}" / "model.safetensors")
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    # a GPT-2 saved as the base model (no "transformer." prefix, as the original gpt2 files are)
    torch.manual_seed(0)
    base = GPT2Model(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    base.save_pretrained(tmp_path / "gpt2-base")
    cfg = json.loads((tmp_path / "gpt2-base" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "gpt2-base" / "config.json").write_text(json.dumps(cfg))
    assert not any(k.startswith("transformer.") for k in load_file(str(tmp_path / "gpt2-base" / "model.safetensors")))
    config, ours = from_hf(tmp_path / "gpt2-base")
    theirs = from_hf(AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2-base", dtype=torch.float32))[1]
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
