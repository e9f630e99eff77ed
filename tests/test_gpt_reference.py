"""The GPT's forward and loss against a plain NumPy GPT-2 written here from nanoGPT's model.py (float64).

Every technique test compares with the one-process GPT, so none of them can see a wrong model: a post-LN block,
a missing ln_f, an attention scale of 1/D, an untied head. Here the reference shares no code with minizero.
"""
import numpy as np

from minizero.nn import GPT, get_config


def _ln(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_gpt(sd, idx, targets, n_layer, n_head):
    """nanoGPT's GPT.forward on the state dict ``sd``: (logits (B, T, V), mean cross-entropy)."""
    b, t = idx.shape
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:t]
    c, d = x.shape[-1], x.shape[-1] // n_head
    causal = np.tril(np.ones((t, t), bool))
    for i in range(n_layer):
        p = {k[len(f"transformer.h.{i}."):]: v for k, v in sd.items() if k.startswith(f"transformer.h.{i}.")}
        qkv = _ln(x, p["ln_1.weight"], p["ln_1.bias"]) @ p["attn.c_attn.weight"].T + p["attn.c_attn.bias"]
        q, k, v = (z.reshape(b, t, n_head, d).transpose(0, 2, 1, 3) for z in np.split(qkv, 3, axis=-1))
        att = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(d), -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True)) @ v
        y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + y @ p["attn.c_proj.weight"].T + p["attn.c_proj.bias"]
        h = _gelu(_ln(x, p["ln_2.weight"], p["ln_2.bias"]) @ p["mlp.c_fc.weight"].T + p["mlp.c_fc.bias"])
        x = x + h @ p["mlp.c_proj.weight"].T + p["mlp.c_proj.bias"]
    logits = _ln(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]) @ sd["lm_head.weight"].T
    z = logits.reshape(b * t, -1)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logits, -logp[np.arange(b * t), targets.reshape(-1)].mean()


def test_gpt_forward_and_loss_equal_a_plain_numpy_gpt2():
    cfg = get_config("tiny", dtype="float64", dropout=0.0)  # 2 layers, 2 heads, width 16, 16 positions, 256 tokens
    model = GPT(cfg, seed=0)
    rng = np.random.default_rng(0)
    # every parameter random (init has LayerNorm 1 and 0 and zero biases: a swapped weight and bias would not show)
    sd = {k: rng.normal(scale=0.5, size=v.shape) for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied, as nanoGPT's
    model.load_state_dict(sd)
    idx, targets = rng.integers(0, cfg.vocab_size, (3, cfg.block_size)), rng.integers(0, cfg.vocab_size, (3, 16))
    logits, loss = model(idx, targets)
    want_logits, want_loss = reference_gpt(sd, idx, targets, cfg.n_layer, cfg.n_head)
    np.testing.assert_allclose(logits.data, want_logits, rtol=0, atol=1e-12 * np.abs(want_logits).max())
    assert abs(loss.item() - want_loss) <= 1e-12 * want_loss
    short = idx[:, :5]  # T < block_size: the first T positions
    np.testing.assert_allclose(model(short).data, reference_gpt(sd, short, short, cfg.n_layer, cfg.n_head)[0],
                               rtol=0, atol=1e-12 * np.abs(want_logits).max())
