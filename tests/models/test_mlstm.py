"""The mLSTM: against a naive per-step reference, TBPTT state carrying and reset, BPC, config, save/load."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from models import ConfigError, MLSTM, MLSTMConfig, load_mlstm, save_mlstm
from pipeline.evaluation.metrics_lm import bits_per_char, stream_bpc

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: threads only add OpenMP synchronisation (and fight on a shared CI machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = dict(vocab_size=257, embed_dim=6, hidden_size=8, num_layers=2, seq_length=16)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return MLSTM(MLSTMConfig(**{**TINY, **kw}))


def reference_forward(model, ids, state):
    """The mLSTM written the obvious way: one step at a time from the raw parameters, plain autograd."""
    def wn(v, g):
        return v if g is None else g[:, None] * v / v.norm(dim=1, keepdim=True)
    H = model.config.hidden_size
    x = model.embedding.weight[ids]                                      # [b, s, E]
    for l, layer in enumerate(model.layers):
        w_x, w_h, w_mh = wn(layer.w_x, layer.g_x), wn(layer.w_h, layer.g_h), wn(layer.w_mh, layer.g_mh)
        h, c = state[0][l], state[1][l]
        outs = []
        for t in range(ids.shape[1]):
            m = (x[:, t] @ w_x[4 * H:].t()) * (h @ w_mh.t())
            gates = x[:, t] @ w_x[:4 * H].t() + m @ w_h.t() + layer.bias
            i, f, o, u = gates.split(H, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        x = torch.stack(outs, dim=1)
    return model.lm_head(x)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("weight_norm", ["all", "recurrent", "none"])
def test_matches_naive_reference_outputs_and_gradients(dtype, tol, weight_norm):
    model = tiny(weight_norm=weight_norm).to(dtype)
    b, s = 3, 7
    ids = torch.randint(0, 257, (b, s))
    labels = torch.randint(0, 257, (b, s))
    h0 = (0.5 * torch.randn(2, b, 8, dtype=dtype)).requires_grad_()
    c0 = torch.randn(2, b, 8, dtype=dtype).requires_grad_()
    weights = torch.randn(b, s, 257, dtype=dtype)       # a loss that weighs every logit differently

    logits, (h_n, c_n) = model(ids, state=(h0, c0))
    (logits * weights).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    got_state = h0.grad.clone(), c0.grad.clone()
    model.zero_grad()
    h0.grad = c0.grad = None

    ref = reference_forward(model, ids, (h0, c0))
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits, ref, rtol=tol, atol=tol)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=tol, atol=tol, msg=f"gradient of {name}")
    torch.testing.assert_close(got_state[0], h0.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(got_state[1], c0.grad, rtol=tol, atol=tol)

    loss, _ = model(ids, labels=labels, state=(h0, c0))
    torch.testing.assert_close(loss, F.cross_entropy(ref.reshape(-1, 257), labels.reshape(-1)), rtol=tol, atol=tol)


def test_state_carried_across_chunks_equals_one_long_sequence():
    model = tiny()
    ids = torch.randint(0, 257, (3, 20))
    full, (h_full, c_full) = model(ids)
    first, state = model(ids[:, :9])
    second, (h2, c2) = model(ids[:, 9:], state=state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full)
    torch.testing.assert_close(h2, h_full)
    torch.testing.assert_close(c2, c_full)

    # The same through the model-held state (what a DeepSpeed engine returning only the loss uses).
    model.carry_state = True
    out1 = model(ids[:, :9])
    out2 = model(ids[:, 9:])
    torch.testing.assert_close(torch.cat([out1, out2], dim=1), full)
    assert not any(t.requires_grad for t in model.carried_state), "the carried state must be detached"


def test_reset_zeroes_the_state_of_flagged_rows_only():
    model = tiny()
    ids = torch.randint(0, 257, (3, 12))
    _, state = model(ids[:, :5])
    carried, _ = model(ids[:, 5:], state=state)
    reset = torch.tensor([True, False, True])
    out, _ = model(ids[:, 5:], state=state, reset=reset)
    fresh, _ = model(ids[:, 5:])
    torch.testing.assert_close(out[reset], fresh[reset])
    torch.testing.assert_close(out[~reset], carried[~reset])
    assert not torch.allclose(fresh[1], carried[1])   # the state matters, so the check above means something

    model.carry_state = True
    model(ids[:, :5])
    torch.testing.assert_close(model(ids[:, 5:], reset=reset), out)


def test_carried_state_of_another_batch_size_is_an_error():
    model = tiny()
    model.carry_state = True
    model(torch.randint(0, 257, (3, 4)))
    with pytest.raises(ValueError, match=r"batch size changed .* reset_state\(\)"):
        model(torch.randint(0, 257, (2, 4)))
    model.reset_state()
    model(torch.randint(0, 257, (2, 4)))


def test_isolated_state_leaves_the_training_stream_untouched():
    model = tiny()
    model.carry_state = True
    ids = torch.randint(0, 257, (2, 6))
    model(ids)
    saved = tuple(t.clone() for t in model.carried_state)
    with model.isolated_state():
        logits, _ = model(torch.randint(0, 257, (5, 3)))        # explicit-state mode inside
    assert model.carry_state
    for a, b in zip(model.carried_state, saved):
        torch.testing.assert_close(a, b)


def test_features_are_the_final_cell_state_at_each_length():
    model = tiny()
    ids = torch.randint(0, 257, (3, 10))
    lengths = torch.tensor([10, 4, 7])
    feats = model.features(ids, lengths)
    assert feats.shape == (3, 8) and feats.dtype == torch.float32
    for r in range(3):
        alone = model.features(ids[r:r + 1, :lengths[r]])
        torch.testing.assert_close(feats[r:r + 1], alone)
    _, (_, c_n) = model(ids)
    torch.testing.assert_close(model.features(ids), c_n[-1])
    with pytest.raises(ValueError, match="lengths must be in"):
        model.features(ids, torch.tensor([0, 3, 3]))


def test_bits_per_char_of_a_uniform_model_is_log2_vocab():
    model = tiny().double()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
    text = torch.randint(0, 256, (1000,))
    result = stream_bpc(model, text, batch_size=4, seq_length=16)
    assert result["chars"] == 4 * (999 // 4)
    assert result["bpc"] == pytest.approx(math.log2(257), abs=1e-12)
    assert bits_per_char(math.log(2.0) * 300, 100) == pytest.approx(3.0)
    assert bits_per_char(math.log(4.0)) == pytest.approx(2.0)


def test_stream_bpc_matches_one_pass_and_restores_the_model():
    model = tiny()
    model.carry_state = True
    text = torch.randint(0, 256, (2 * 40 + 1,))
    streams = torch.stack([text[:41], text[40:81]])
    with model.isolated_state():
        logits, _ = model(streams[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, 257), streams[:, 1:].reshape(-1), reduction="sum")
    assert stream_bpc(model, text, batch_size=2, seq_length=7)["bpc"] == pytest.approx(bits_per_char(nll, 80), rel=1e-6)
    assert model.training and model.carry_state and model.carried_state is None


@pytest.mark.parametrize("override,message", [
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(weight_norm="input"), "weight_norm must be one of all, recurrent, none"),
    (dict(dropout=1.0), "dropout must be in [0, 1)"),
    (dict(init_range=-1.0), "init_range must be a positive number"),
    (dict(model_type="gpt"), "model_type is 'gpt', expected 'mlstm'"),
])
def test_bad_config_messages(override, message):
    with pytest.raises(ConfigError) as e:
        MLSTMConfig(**{**TINY, **override})
    assert message in str(e.value)


def test_config_file_round_trip_and_errors(tmp_path):
    cfg = MLSTMConfig(**TINY, weight_norm=True)
    assert cfg.weight_norm == "all"
    path = tmp_path / "mlstm.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert MLSTMConfig.from_file(path) == cfg
    path.write_text(json.dumps({**cfg.to_dict(), "hiden_size": 3}))
    with pytest.raises(ConfigError, match=r"mlstm.json: unknown field\(s\) hiden_size"):
        MLSTMConfig.from_file(path)
    path.write_text('{"hidden_size": 4,\n "num_layers": }')
    with pytest.raises(ConfigError, match="invalid JSON at line 2"):
        MLSTMConfig.from_file(path)


@pytest.mark.parametrize("weight_norm", ["all", "recurrent", "none"])
def test_parameter_count_and_flops(weight_norm):
    model = tiny(weight_norm=weight_norm)
    cfg = model.config
    assert cfg.num_parameters() == model.num_parameters()
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w_x", "w_h", "w_mh")
                         ) + model.lm_head.weight.numel()
    assert cfg.flops_per_token() == 6 * matmul_weights


def test_save_and_load_round_trip(tmp_path):
    model = tiny(weight_norm="recurrent")
    save_mlstm(model, tmp_path / "m")
    loaded = load_mlstm(tmp_path / "m")
    assert loaded.config == model.config
    ids = torch.randint(0, 257, (2, 9))
    torch.testing.assert_close(loaded(ids)[0], model(ids)[0], rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]

    bigger = MLSTMConfig(**{**TINY, "hidden_size": 16, "weight_norm": "recurrent"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(bigger.to_dict()))
    with pytest.raises(ValueError, match=r"model.safetensors does not match .*config.json: .*wrong shape"):
        load_mlstm(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mlstm(tmp_path / "nowhere")
