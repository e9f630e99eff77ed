"""The public Python API refuses bad input by name (ValueError), as the programs do."""
import numpy as np
import pytest

from minizero.nn import GPT, GPTConfig, get_config
from minizero.optim import AdamW


@pytest.fixture(scope="module")
def tiny():
    return GPT(get_config("tiny"))


@pytest.mark.parametrize("idx,said", [
    (np.array([[-1, 1]]), "id -1 at position (0, 0) (batch, time) is outside (1 bad in all)"),  # before: row 255
    (np.array([[1, 300, 300]]), "token ids must lie in [0, 256); id 300 at position (0, 1)"),  # before: IndexError
    (np.zeros((1, 4), np.float32), "idx must hold integer token ids, got dtype float32"),  # IndexError
    (np.zeros(4, np.int64), "idx must be a (B, T) array of token ids, B and T >= 1, got shape (4,)"),  # unpack error
    (np.zeros((1, 0), np.int64), "got shape (1, 0)"),  # before: NumPy's 'zero-size array to reduction operation'
    (np.zeros((1, 17), np.int64), "sequence length 17 exceeds block_size 16"),
])
def test_gpt_forward_names_bad_token_ids(tiny, idx, said):
    with pytest.raises(ValueError) as e:
        tiny(idx)
    assert said in str(e.value)


def test_gpt_config_sizes_are_counts_not_booleans():
    """Before: n_layer=True built a one-layer GPT (bool is an int subclass)."""
    with pytest.raises(ValueError, match="GPTConfig.n_layer must be a positive integer, got True"):
        GPT(GPTConfig(n_layer=True, n_head=2, n_embd=16))


@pytest.mark.parametrize("kw", [{"lr": float("nan")}, {"lr": float("inf")}, {"eps": float("nan")},
                                {"weight_decay": float("nan")}, {"eps": float("inf")}])
def test_adamw_refuses_non_finite_hyper_parameters(tiny, kw):
    """Before: lr=nan (NaN fails ``lr < 0``) was accepted; the first step made every parameter NaN."""
    with pytest.raises(ValueError, match="AdamW: need finite lr >= 0"):
        AdamW(tiny.parameters(), **kw)
