"""Tensor-, sequence- and context-parallel edges the training equivalence runs miss (a mutation audit's kills).

Each test: float64 against the unsplit layer or an exact figure, in-process ranks (``run_in_threads``).
"""
import re

import numpy as np
import pytest

from minizero.autograd import Tensor
from minizero.comm import run_in_threads
from minizero.nn import GPT, get_config
from minizero.nn.module import Linear
from minizero.parallel.context_parallel import ring_attention, split_for_context_parallel
from minizero.parallel.tensor_parallel import (ColumnParallelLinear, copy_to_tensor_parallel_region,
                                               reduce_from_tensor_parallel_region, shard_array, tensor_parallelize)


def test_split_helpers_name_the_blocks_times_parts_they_need():
    """shard_array's stride x size and split_for_context_parallel's 2 x cp, where the smaller factor divides:
    the named ValueError, not numpy's 'array split does not result in an equal division'."""
    with pytest.raises(ValueError, match=re.escape("cannot split dimension 0 of size 8 into 3 block(s) x 2 parts")):
        shard_array(np.ones((8, 2)), 0, 0, 2, stride=3)
    with pytest.raises(ValueError, match=re.escape("cannot split dimension 1 of size 12 into 3 block(s) x 3 parts")):
        shard_array(np.ones((2, 12)), 1, 0, 3, stride=3)
    with pytest.raises(ValueError, match=re.escape("divisible by 2 x cp = 6")):
        split_for_context_parallel(np.arange(9), 0, 3, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_with_stride_3_keeps_a_nonzero_bias_with_its_rows(tp):
    """c_attn's bias is cut like its rows (Q, K, V slices): a trained (nonzero) bias, not only the zero init."""
    rng = np.random.default_rng(0)
    lin = Linear(4, 24, dtype="float64", rng=rng)
    lin.bias.data[...] = rng.normal(size=24)
    x = rng.normal(size=(2, 3, 4))
    want = lin(Tensor(x)).data

    def rank(comm):
        return ColumnParallelLinear.from_linear(lin, comm, stride=3)(Tensor(x)).data

    for r, got in enumerate(run_in_threads(tp, rank)):
        np.testing.assert_allclose(got, shard_array(want, 2, r, tp, stride=3), rtol=1e-14, atol=0)


@pytest.mark.timeout(60)
def test_tensor_parallelize_refuses_heads_the_group_does_not_divide():
    """n_embd 48 splits 4 ways but 6 heads do not: before the check, rank r would run 1 head of width 12."""
    cfg = get_config("tiny", n_head=6, n_embd=48)

    def rank(comm):
        tensor_parallelize(GPT(cfg, seed=0), comm)

    with pytest.raises(ValueError, match=re.escape("tensor parallel size 4 must divide n_head=6 and n_embd=48")):
        run_in_threads(4, rank, timeout=20)


@pytest.mark.timeout(60)
def test_f_and_g_take_non_contiguous_arrays():
    """The all-reduce needs a contiguous buffer: f's backward and g's forward copy a transposed (strided) one."""
    a = np.arange(6.0).reshape(2, 3)

    def rank(comm):
        x = Tensor(a.T, requires_grad=True)  # (3, 2), strided
        y = reduce_from_tensor_parallel_region(x, comm)
        z = Tensor(a, requires_grad=True)
        copy = copy_to_tensor_parallel_region(z, comm)
        copy.backward(np.asfortranarray(a * (comm.rank + 1)))
        return y.data, z.grad

    for y, gz in run_in_threads(2, rank):
        np.testing.assert_array_equal(y, 2 * a.T)
        np.testing.assert_array_equal(gz, 3 * a)


@pytest.mark.timeout(60)
def test_ring_attention_traffic_is_its_own_kind():
    """Every ring byte under "ring_attention" (Strategy.traffic_by_kind's context_parallel_attention), none under a
    collective's label (an "all_reduce" would be counted as gradient reduction)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 8, 4)) for _ in range(3))

    def rank(comm):
        ql, kl, vl = (Tensor(split_for_context_parallel(a, comm.rank, 2, 2), requires_grad=True) for a in (q, k, v))
        ring_attention(ql, kl, vl, comm).sum().backward()
        return comm.traffic.snapshot()

    for snap in run_in_threads(2, rank):
        assert set(snap["by_op"]) == {"ring_attention"} and snap["by_op"]["ring_attention"] == snap["bytes_sent"] > 0


@pytest.mark.timeout(60)
def test_the_context_group_holds_consecutive_data_ranks_in_order():
    """Data ranks [k cp, (k+1) cp) with cp rank = data rank % cp: the flight recorder's members (name_split) and the
    checkpoint listing's divmod(d, cp) read the group in that order."""
    from minizero.comm.collectives import all_gather
    from minizero.parallel.context_parallel import context_group

    def rank(comm):
        group = context_group(comm, 2)
        return group.rank, all_gather(group, np.array([comm.rank], dtype=np.int64)).tolist()

    assert run_in_threads(4, rank) == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]


@pytest.mark.timeout(60)
def test_one_ulysses_core_serves_two_sequence_lengths():
    """The core caches its time permutation per length: a shorter sequence after a longer one (evaluation at
    another length) still equals whole causal attention, on the same core object. No dropout given: before, the
    default dense inner core called it (TypeError: 'NoneType' object is not callable)."""
    import math

    from minizero.autograd import causal_softmax
    from minizero.parallel.context_parallel import unsplit_from_context_parallel
    from minizero.parallel.ulysses import UlyssesAttentionCore

    cp, rng = 2, np.random.default_rng(0)
    inputs = [[rng.normal(size=(1, 2, s, 3)) for _ in range(3)] for s in (16, 8)]

    def rank(comm):
        core = UlyssesAttentionCore(comm)
        return [core(*(Tensor(split_for_context_parallel(a, comm.rank, cp, 2)) for a in qkv)).data for qkv in inputs]

    res = run_in_threads(cp, rank)
    for i, (q, k, v) in enumerate(inputs):
        want = (causal_softmax((Tensor(q) @ Tensor(k).transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(3))) @ Tensor(v)).data
        np.testing.assert_allclose(unsplit_from_context_parallel([r[i] for r in res], 2), want, rtol=0, atol=1e-13)


@pytest.mark.timeout(60)
def test_context_parallelize_names_an_unknown_attention():
    """Before the check any name but "ring" would have built Ulysses cores."""
    from minizero.parallel.context_parallel import context_parallelize
    from minizero.parallel.pipeline import PipelineStage

    def rank(comm):
        context_parallelize(PipelineStage(GPT(get_config("tiny"), seed=0), 0, 1), comm, "Ring")

    with pytest.raises(ValueError, match=re.escape("unknown context-parallel attention 'Ring'; allowed: ('ring', ")):
        run_in_threads(2, rank, timeout=20)


@pytest.mark.timeout(60)
def test_the_ulysses_core_names_heads_the_group_does_not_divide():
    """Called directly (no layout check before it): the named error, not numpy's reshape error."""
    from minizero.parallel.ulysses import UlyssesAttentionCore

    def rank(comm):
        q = Tensor(np.ones((1, 3, 4, 2)))
        UlyssesAttentionCore(comm)(q, q, q)

    with pytest.raises(ValueError, match=re.escape("Ulysses needs the 3 local attention heads divisible by the 2 ")):
        run_in_threads(2, rank, timeout=20)


@pytest.mark.timeout(60)
def test_the_sequence_reduce_scatter_names_a_length_the_group_does_not_divide():
    """s = 3 rows over 2 ranks (b h s even, so the flat reduce-scatter itself would split): the named error."""
    from minizero.parallel.sequence_parallel import reduce_scatter_to_sequence_parallel_region

    def rank(comm):
        reduce_scatter_to_sequence_parallel_region(Tensor(np.ones((2, 3, 2))), comm)

    with pytest.raises(ValueError, match=re.escape("needs the sequence length 3 divisible by the tensor size 2")):
        run_in_threads(2, rank, timeout=20)


@pytest.mark.timeout(60)
def test_sequence_parallelize_refuses_a_stage_not_split_by_tensor_and_vocabulary():
    """Whole blocks would be summed t times by the reduce-scatters (silently); a whole wte has no vocab slice."""
    from minizero.parallel.pipeline import PipelineStage
    from minizero.parallel.sequence_parallel import sequence_parallelize

    def rank(comm, vocab_missing):
        stage = PipelineStage(GPT(get_config("tiny"), seed=0), 0, 1)
        if vocab_missing:
            tensor_parallelize(stage, comm)
        sequence_parallelize(stage, comm)

    with pytest.raises(TypeError, match="sequence_parallelize needs a tensor-parallel stage: call tensor_parallelize"):
        run_in_threads(2, rank, False, timeout=20)
    with pytest.raises(TypeError, match="needs a vocabulary-parallel embedding: call vocab_parallelize first"):
        run_in_threads(2, rank, True, timeout=20)


@pytest.mark.timeout(60)
def test_parallel_linears_own_their_arrays():
    """from_linear copies, as its docstring says: an in-place step on a rank's bias or weight (threads share the
    source layer) leaves the source and the other ranks alone."""
    from minizero.parallel.tensor_parallel import RowParallelLinear

    lin = Linear(4, 4, dtype="float64", rng=np.random.default_rng(0))
    before = [lin.weight.data.copy(), lin.bias.data.copy()]

    def rank(comm):
        layers = ColumnParallelLinear.from_linear(lin, comm), RowParallelLinear.from_linear(lin, comm)
        for p in (q for layer in layers for q in (layer.weight, layer.bias)):
            p.data += 1.0
        return [p.data.copy() for layer in layers for p in (layer.weight, layer.bias)]

    for r, (cw, cb, rw, rb) in enumerate(run_in_threads(2, rank)):
        np.testing.assert_array_equal(rb, before[1] + 1.0)  # once, not once per rank
        np.testing.assert_array_equal(cb, shard_array(before[1], 0, r, 2) + 1.0)
    np.testing.assert_array_equal(lin.weight.data, before[0])
    np.testing.assert_array_equal(lin.bias.data, before[1])


class _Pieces:
    """A synchroniser that reduced in backward and holds elements [0, 2) of one parameter (SequenceParallelGrads)."""

    def __init__(self, p):
        self.p, self.grad = p, np.ones(2)

    def reduce_gradients(self):
        pass

    def held_grad_pieces(self, params):
        return [(self.p, 0, 2, self.grad)]


def test_the_tensor_ranks_must_hold_pieces_of_the_same_parameter():
    """Equal ranges [0, 2) of two different parameters are different pieces: refused, not summed together."""
    from types import SimpleNamespace

    from minizero.parallel.sequence_parallel import SequenceParallelGrads

    def rank(comm):
        params = [SimpleNamespace(sequence_parallel=True) for _ in range(2)]
        with pytest.raises(RuntimeError, match=r"different gradient pieces .* checksums"):
            SequenceParallelGrads(params, comm).reduce(_Pieces(params[comm.rank]))

    run_in_threads(2, rank, timeout=20)
