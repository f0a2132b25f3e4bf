"""The mLSTM exports as a Hugging Face PreTrainedModel that the Auto classes load without remote code."""
import json

import torch
from transformers import AutoModelForCausalLM

from models import MLSTM, MLSTMConfig
from pipeline.hf.export import export_hf


def test_mlstm_export_loads_with_auto_classes(tmp_path):
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(vocab_size=258, embed_dim=8, hidden_size=32, seq_length=16)).eval()
    export_hf(model.config, model.state_dict(), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mlstm-lm"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # no trust_remote_code
    assert type(hf).__name__ == "MLSTMForCausalLM"
    ids = torch.tensor([list(b"To be, or not to be")])
    with torch.no_grad():
        ours, _ = model(ids)
        out = hf(ids, labels=ids)
    assert torch.equal(out.logits, ours)
    ref = torch.nn.functional.cross_entropy(ours[0, :-1], ids[0, 1:])
    torch.testing.assert_close(out.loss, ref)
