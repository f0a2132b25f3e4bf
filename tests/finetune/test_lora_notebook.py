"""04_lora_sft.ipynb end to end (nbclient, a kernel of this Python) on a tiny Llama with SmolLM2-Instruct's
tokenizer and a few steps: LoRA SFT, the adapter loaded by PEFT on the base's Hugging Face export equal to the
merged export, a reply generated. The notebook's default, SmolLM2-135M-Instruct for 12 steps, takes minutes."""
from test_notebooks import execute, kernel  # noqa: F401  (kernel: the fixture execute needs)
from test_post_training_cli import write_chat_base


def test_lora_sft_notebook(tmp_path, kernel, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    text = execute("04_lora_sft.ipynb", kernel, monkeypatch, BASE_MODEL=write_chat_base(tmp_path / "base"),
                   OUT_DIR=out, STEPS=3, SEQ_LENGTH=128, LR=1e-2)
    assert "8 conversations" in text and "3 steps; loss" in text and "reply:" in text
    diff = float(text.split("max |PEFT - merged| / max |merged| = ")[1].split()[0])
    print(f"notebook 04: PEFT adapter vs merged export {diff:.1e}")
    assert diff < 3e-6  # measured 2.8e-7 (the adapters fp32, the base as read; the run in bf16)
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "hf" / "config.json").is_file()
