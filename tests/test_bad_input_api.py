"""The public Python API refuses bad input by name (ValueError), as the programs do."""
import re

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


def test_gpt_forward_refuses_targets_of_another_shape(tiny):
    """Before: targets.T of a (2, 3) idx was reshaped to b*t and paired with the wrong positions."""
    idx = np.arange(6).reshape(2, 3)
    with pytest.raises(ValueError, match=re.escape("targets must have idx's shape (2, 3), got (3, 2)")):
        tiny(idx, idx.T)


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


@pytest.mark.parametrize("kw,said", [
    ({"max_new_tokens": -1}, "got -1 and 1.0"),  # before: returned the prompt, nothing said
    ({"temperature": float("nan")}, "got 2 and nan"),  # before: NumPy's 'Probabilities contain NaN'
    ({"temperature": -1.0}, "got 2 and -1.0"),  # before: sampled from the inverted distribution
])
def test_generate_names_bad_length_or_temperature(tiny, kw, said):
    with pytest.raises(ValueError, match="GPT.generate: max_new_tokens must be an int >= 0 and temperature a "
                                         "finite number >= 0 .*" + re.escape(said)):
        tiny.generate(np.array([[1]]), **{"max_new_tokens": 2, "temperature": 1.0, **kw})


def test_data_and_quantization_helpers_name_bad_sizes():
    """Before: block_size 0 was a ZeroDivisionError; global_batch with block 0 or batch 0 returned empty arrays,
    a text shorter than a window NumPy's 'high <= 0', seed -1 its unnamed 'expected non-negative integer'."""
    from minizero.data import encode, global_batch, train_val_split
    from minizero.quantization import dequantize_blockwise, dynamic_code, quantize_blockwise
    code = dynamic_code()
    for call in (lambda: quantize_blockwise(np.ones(8, np.float32), code, block_size=0),
                 lambda: dequantize_blockwise(np.zeros(8, np.uint8), np.ones(1, np.float32), code, block_size=0)):
        with pytest.raises(ValueError, match=r"block_size=0; allowed: an int >= 1"):
            call()
    tokens = encode("hello world " * 10)
    for args in ((0, 2, 0, 0), (0, 0, 8, 0), (-1, 2, 8, 0), (0, 2, 8, -1)):
        with pytest.raises(ValueError, match=r"global_batch: batch .* must be >= 1, step .* >= 0"):
            global_batch(tokens, args[0], args[1], args[2], args[3])
    with pytest.raises(ValueError, match=r"global_batch: tokens has 120 tokens; needs more than block_size \+ 1"):
        global_batch(tokens, 0, 2, 200, 0)
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\), got nan"):
        train_val_split(tokens, float("nan"))


def test_generate_names_a_prompt_that_is_not_b_by_t(tiny):
    """Before: a 1-d prompt was a bare IndexError; now forward's (B, T) message."""
    with pytest.raises(ValueError, match=re.escape("idx must be a (B, T) array of token ids, B and T >= 1, got "
                                                   "shape (2,)")):
        tiny.generate(np.array([1, 2]), 2)


@pytest.mark.parametrize("ids,said", [
    (np.array([-1]), "id -1 at position (0,) is outside"),  # before: the last row, nothing said
    (np.array([[3, 4], [10, 2]]), "ids must lie in [0, 10); id 10 at position (1, 0)"),  # before: a bare IndexError
])
def test_embedding_names_the_first_id_out_of_range(ids, said):
    from minizero.nn import Embedding
    with pytest.raises(ValueError, match=re.escape(said)):
        Embedding(10, 4)(ids)
    with pytest.raises(TypeError, match=re.escape("ids must be integers in [0, 10), got dtype float64")):
        Embedding(10, 4)(np.zeros(2))


@pytest.mark.parametrize("args,kw,said", [
    ((-1, 4), {}, "in_features must be an integer >= 0, got -1"),  # before: NumPy's 'negative dimensions'
    ((2.5, 3), {}, "in_features must be an integer >= 0, got 2.5"),
    (("4", 3), {}, "in_features must be an integer >= 0, got '4'"),
    ((True, 3), {}, "in_features must be an integer >= 0, got True"),  # before: a (3, 1) weight
    ((4, 3), {"std": float("nan")}, "std must be a finite number >= 0, got nan"),  # before: NaN weights
])
def test_linear_names_bad_sizes_and_std(args, kw, said):
    from minizero.nn import Linear
    with pytest.raises(ValueError, match=re.escape(said)):
        Linear(*args, **kw)


def test_linear_names_an_input_of_another_width():
    from minizero.autograd import Tensor
    from minizero.nn import Linear
    with pytest.raises(ValueError, match=re.escape("Linear(in_features=4): x's last dimension is 5")):
        Linear(4, 3)(Tensor(np.ones((2, 5))))


@pytest.mark.parametrize("kw,said", [({"lr": "1e-3"}, "lr='1e-3'"),  # before: TypeError '<=' between int and str
                                     ({"betas": 0.9}, "betas=0.9"),  # 'float' object is not subscriptable
                                     ({"betas": (0.9,)}, "betas=(0.9,)"),  # a bare IndexError
                                     ({"eps": True}, "eps=True")])
def test_optimizer_names_hyper_parameters_of_the_wrong_type(tiny, kw, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        AdamW(tiny.parameters(), **kw)


def test_optimizer_refuses_a_parameter_listed_twice_or_an_array():
    """Before: AdamW([p, p]) moved p twice per step, silently; AdamW([array]) failed at step() on '.grad'."""
    from minizero.nn.module import Parameter
    from minizero.optim.adam8bit import Adam8bit
    p = Parameter(np.ones(3))
    for opt in (AdamW, Adam8bit):
        with pytest.raises(ValueError, match=re.escape(f"{opt.__name__}: params[1] is params[0] again")):
            opt([p, p])
        with pytest.raises(TypeError, match=re.escape(f"{opt.__name__}: params[1] is a ndarray; allowed: Parameters")):
            opt([p, np.ones(3)])


def test_blockwise_and_int4_unpacking_name_a_wrong_count():
    """Before: dequantize_blockwise with too few block maxima was a bare IndexError (too many were used silently);
    unpack_int4(packed, -1) returned all codes but the last."""
    from minizero.quantization import dequantize_blockwise, dynamic_code, pack_int4, unpack_int4
    code = dynamic_code()
    for absmax in (np.ones(1, np.float32), np.ones(3, np.float32)):
        with pytest.raises(ValueError, match=re.escape(f"absmax has shape {absmax.shape}; 8 elements at offset 0 "
                                                       "with block_size 4 span 2 blocks")):
            dequantize_blockwise(np.zeros(8, np.uint8), absmax, code, 4)
    for n in (-1, 2.0, True):
        with pytest.raises(ValueError, match=re.escape(f"n={n!r}; allowed: an int >= 0")):
            unpack_int4(pack_int4(np.array([1, 2, 3], np.int8)), n)


@pytest.mark.parametrize("shapes,dtype,said", [
    ([(2, 8, 4)] * 3, np.float64, "got shapes (2, 8, 4), (2, 8, 4), (2, 8, 4)"),  # before: 'not enough values to'
    ([(1, 2, 8, 4), (1, 2, 6, 4), (1, 2, 6, 4)], np.float64, "(1, 2, 8, 4), (1, 2, 6, 4), (1, 2, 6, 4)"),  # broadcast
    ([(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 5)], np.float64, "(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 5)"),  # broadcast
    ([(1, 2, 8, 4)] * 3, np.int64, "dtypes int64, int64, int64"),  # before: a float result truncated to int64
])
def test_flash_attention_names_q_k_v_that_do_not_fit(shapes, dtype, said):
    from minizero.autograd import Tensor
    from minizero.nn.flash_attention import flash_attention
    q, k, v = (Tensor(np.ones(s, dtype)) for s in shapes)
    with pytest.raises(ValueError, match="flash_attention: q, k, v must be float .B, H, T, D. arrays of one shape, "
                                         ".*" + re.escape(said)):
        flash_attention(q, k, v, 4)


def test_counts_and_sizes_are_ints_not_bools_or_other_numbers():
    """Before: run_in_threads(True, ...) ran one rank whose world_size was True, and NumPy's 2 was refused;
    apply_recompute(every=True) and generate(max_new_tokens=True) took True for 1; generate's temperature '1'
    was a TypeError from '<='; all_to_all_v counted 2.7 rows as 2 and '2' as 2."""
    from minizero.comm import run_in_threads
    from minizero.comm.all_to_all import all_to_all_v
    from minizero.memory.recompute import apply_recompute
    with pytest.raises(ValueError, match=re.escape("world_size=True; allowed: an int >= 1")):
        run_in_threads(True, lambda comm: None)
    assert run_in_threads(np.int64(2), lambda comm: type(comm.world_size)) == [int, int]
    with pytest.raises(ValueError, match=re.escape("recompute every K blocks needs K >= 1, got True")):
        apply_recompute(GPT(get_config("tiny")), "full", True)
    for new, temperature in ((True, 1.0), (2, "1")):
        with pytest.raises(ValueError, match=re.escape(f"got {new!r} and {temperature!r}")):
            GPT(get_config("tiny")).generate(np.array([[1]]), new, temperature)
    for counts in ([2.7, 1.3], ["2", "2"], [True, 3]):
        said = re.escape(f"{counts} must be 2 non-negative")
        with pytest.raises(ValueError, match=r"rank \d: send_counts " + said):
            run_in_threads(2, lambda comm: all_to_all_v(comm, np.ones(4), counts), timeout=10)
    assert run_in_threads(2, lambda comm: all_to_all_v(comm, np.ones(4), [np.int64(1), 3])[1]) == [[1, 1], [3, 3]]


def test_generate_and_apply_recompute_take_numpy_ints_as_check_int_does():
    """Before: np.int64(2) was refused by both (type(x) is int), unlike comm's check_int; bools, floats still are."""
    from minizero.memory.recompute import apply_recompute
    model = GPT(get_config("tiny"))
    assert model.generate(np.array([[1]]), np.int64(2), 0).shape == (1, 3)
    assert apply_recompute(model, "full", np.int64(2)) == apply_recompute(GPT(get_config("tiny")), "full", 2)
    for bad in (True, 2.0, np.float64(2)):
        with pytest.raises(ValueError, match=re.escape(f"got {bad!r} and 0")):
            GPT(get_config("tiny")).generate(np.array([[1]]), bad, 0)
        with pytest.raises(ValueError, match=re.escape(f"K >= 1, got {bad!r}")):
            apply_recompute(GPT(get_config("tiny")), "full", bad)


@pytest.mark.parametrize("kw,said", [({"lr": float("nan")}, "lr=nan"),  # before: accepted, the first step made NaN
                                     ({"lr": "1"}, "lr='1'"),  # a bare TypeError
                                     ({"betas": 0.9}, "betas=0.9"),  # 'float' object is not subscriptable
                                     ({"stage": True}, "stage=True; allowed: 1, 2, 3")])  # ran ZeroStage1
def test_zero_optimizer_names_hyper_parameters_as_adamw_does(kw, said):
    from minizero.comm import run_in_threads
    from minizero.zero import zero_optimizer
    kw = {"stage": 2, **kw}
    with pytest.raises(ValueError, match=r"ZeroOptimizer: .*" + re.escape(said)):
        run_in_threads(2, lambda comm: zero_optimizer(GPT(get_config("tiny")), comm, **kw), timeout=20)


def test_quantized_collectives_refuse_what_int8_on_the_wire_cannot_carry():
    """Before: an int64 shard all-gathered as zeros, an int64 reduce-scatter returned one rank's part (1, not 2),
    block_size=0 was a ZeroDivisionError and a str array NumPy's 'isfinite not supported'."""
    from minizero.comm import run_in_threads
    from minizero.comm.quantized import quantized_all_gather, quantized_all_reduce, quantized_reduce_scatter
    for op in (quantized_all_gather, quantized_reduce_scatter, quantized_all_reduce):
        for x, said in ((np.ones(4, np.int64), "has dtype int64; quantized collectives carry floats"),
                        (np.array(["a", "b"]), "has dtype <U1"),
                        (np.ones(4, np.float32), "block_size=0; allowed: an int >= 1")):
            bs = 0 if "block_size" in said else 256
            with pytest.raises(ValueError, match=re.escape(said)):
                run_in_threads(2, lambda comm: op(comm, x, block_size=bs), timeout=10)


@pytest.mark.parametrize("which,args,said", [
    ("shard", ((4, 4), 0, -1, 2), "rank=-1 is not a rank; allowed: an int in 0..1"),  # before: the last part
    ("shard", ((4, 4), 0, 0, 0), "size=0; allowed: an int >= 1"),  # before: ZeroDivisionError
    ("cp", ((1, 8), 2, 2, 1), "rank=2 is not a rank; allowed: an int in 0..1"),  # before: IndexError
    ("cp", ((1, 8), 0, 0, 1), "cp=0; allowed: an int >= 1"),  # before: ZeroDivisionError
])
def test_shard_helpers_name_a_rank_outside_the_group(which, args, said):
    from minizero.parallel.context_parallel import split_for_context_parallel
    from minizero.parallel.tensor_parallel import shard_array
    split = shard_array if which == "shard" else split_for_context_parallel
    with pytest.raises(ValueError, match=re.escape(said)):
        split(np.ones(args[0]), *args[1:])


def test_estimator_names_a_seq_len_stage_or_size_it_would_have_guessed():
    """Before: seq_len=0 was the model's, silently, and 8.5 a fractional estimate; comm_bytes_per_step priced
    stage 5 of 2 and seq_len -1; Strategy(dp=True) was one data rank."""
    from minizero.memory.estimator import Strategy, comm_bytes_per_step, estimate_memory
    cfg, st = get_config("tiny"), Strategy(precision="fp32", pp=2)
    for seq in (0, 8.5, True):
        for estimate in (estimate_memory, comm_bytes_per_step):
            with pytest.raises(ValueError, match=re.escape(f"seq_len={seq!r}; allowed: an int >= 1, or None for "
                                                           "the model's 16")):
                estimate(cfg, st, seq_len=seq)
    with pytest.raises(ValueError, match=re.escape("stage must be in [0, 2), got 5")):
        comm_bytes_per_step(cfg, st, stage=5)
    with pytest.raises(ValueError, match=re.escape("Strategy.dp must be a positive integer, got True")):
        estimate_memory(cfg, Strategy(precision="fp32", dp=True))


def test_decode_and_the_sampler_name_ids_and_ranks_outside_their_range():
    """Before: decode([-1, 300]) returned bytes 255 and 44 ('\\ufffd,'), decode([65.5]) 'A'; a DistributedSampler
    of dp_rank 2 of 2 read the rows of rank 0's next micro-batch and grad_accum 0 failed at the first step."""
    from minizero.data import DistributedSampler, decode, encode
    for ids, said in ((np.array([-1, 300]), "values in [-1, 300]"), (np.array([65.5]), "dtype float64")):
        with pytest.raises(ValueError, match=re.escape(f"tokens must be integer byte ids in [0, 256), got {said}")):
            decode(ids)
    assert decode(encode("héllo")) == "héllo" and decode([]) == ""
    tokens = encode("hello world " * 10)
    for kw, said in (({"dp_rank": 2, "dp_size": 2}, "dp_rank=2 is not a rank; allowed: an int in 0..1"),
                     ({"grad_accum": 0}, "grad_accum=0; allowed: an int >= 1"),
                     ({"micro_batch": True}, "micro_batch=True; allowed: an int >= 1")):
        with pytest.raises(ValueError, match=re.escape(said)):
            DistributedSampler(tokens, 8, **{"micro_batch": 2, **kw})


def test_tensor_parallelize_twice_is_named():
    """Before: the second call was an AttributeError ('RowParallelLinear' object has no attribute 'out_features')."""
    from minizero.comm import run_in_threads
    from minizero.parallel.tensor_parallel import tensor_parallelize

    def twice(comm):
        model = GPT(get_config("tiny"))
        tensor_parallelize(model, comm)
        tensor_parallelize(model, comm)
    with pytest.raises(ValueError, match=re.escape("tensor_parallelize: transformer.h.0 is already split")):
        run_in_threads(2, twice, timeout=20)


def test_clipping_and_bucket_sizes_name_nan_and_strings():
    """Before: clip_grad_norm_(params, nan) skipped clipping silently and '1' was a TypeError from '>';
    DataParallel(bucket_bytes='1') a TypeError from '<', bucket_bytes=nan accepted."""
    from minizero.comm import run_in_threads
    from minizero.nn.module import Parameter
    from minizero.optim import clip_grad_norm_
    from minizero.parallel.data_parallel import DataParallel
    p = Parameter(np.ones(3))
    p.grad = np.full(3, 100.0)
    for max_norm in (float("nan"), "1", True):
        with pytest.raises(ValueError, match=re.escape(f"max_norm={max_norm!r}; allowed: a number")):
            clip_grad_norm_([p], max_norm)
    for bucket in ("1", float("nan")):
        with pytest.raises(ValueError, match=re.escape(f"bucket_bytes must be >= 1, got {bucket!r}")):
            run_in_threads(1, lambda comm: DataParallel([p], comm, bucket_bytes=bucket))


def test_zero_optimizer_takes_numpy_s_int_stages():
    """Before the bool check NumPy's 3 was stage 3; the check `type(stage) is not int` refused it (and still took
    nothing else it should not: 3.0 is refused as well)."""
    from minizero.comm import run_in_threads
    from minizero.zero import ZeroStage3, zero_optimizer
    made = run_in_threads(2, lambda comm: type(zero_optimizer(GPT(get_config("tiny")), comm, np.int64(3))),
                          timeout=20)
    assert made == [ZeroStage3, ZeroStage3]
    with pytest.raises(ValueError, match=re.escape("stage=3.0; allowed: 1, 2, 3")):
        run_in_threads(2, lambda comm: zero_optimizer(GPT(get_config("tiny")), comm, 3.0), timeout=20)


def test_generate_takes_numpy_s_numbers_as_a_temperature(tiny):
    """fc76566 sampled greedily at np.int64(0); the check for '1' (int, float, np.floating) refused NumPy's ints."""
    prompt = np.array([[1]])
    np.testing.assert_array_equal(tiny.generate(prompt, 2, np.int64(0)), tiny.generate(prompt, 2, 0.0))
    assert tiny.generate(prompt, 2, np.float32(0.5)).shape == (1, 3)


@pytest.mark.parametrize("kwargs,name", [(dict(step=-2), "step"), (dict(step=1.5), "step"), (dict(warmup=-1), "warmup"),
                                         (dict(total=True), "total")])
def test_cosine_lr_refuses_a_negative_or_fractional_step(kwargs, name):
    """Before: step -2 in warm-up gave the learning rate -max_lr / warmup; 1.5 an lr between two steps'."""
    from minizero.optim.adamw import cosine_lr

    args = {**dict(step=3, max_lr=1.0, warmup=4, total=12, min_lr=0.1), **kwargs}
    with pytest.raises(ValueError, match=f"cosine_lr: {name}="):
        cosine_lr(**args)
    assert cosine_lr(np.int64(3), 1.0, 4, 12, 0.1) == 1.0  # NumPy's integers, as a loop over np.arange gives


def test_pack_int4_refuses_float_codes():
    """Before: float codes were truncated toward zero (1.7 packed as 1, -0.5 as 0) without a word."""
    from minizero.quantization import pack_int4, unpack_int4

    with pytest.raises(ValueError, match="must be an integer array, got dtype float64"):
        pack_int4(np.array([1.7, -0.5]))
    assert unpack_int4(pack_int4([1, -8, 7]), 3).tolist() == [1, -8, 7]  # a list of ints still packs
