"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): the schedule, its bubble, and training equal to one process."""

import pytest

import tests.mp_reference as R
from minizero.args import UsageError
from minizero.comm import run_in_threads
from minizero.parallel.interleaved import rank_of_layer
from minizero.parallel.schedule import (ascii_timeline, bubble_formula, bubble_fraction, bubble_over_ideal, bubble_ratio,
                                        interleaved,
                                        make_schedule, one_f_one_b, peak_in_flight, simulate)
from minizero.train import parse_args
from tests.test_pipeline import add_deep_narrow_presets


PMV = [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (4, 8, 4), (2, 6, 3), (8, 16, 2)]


@pytest.mark.parametrize("p, m, v", PMV)
def test_every_rank_runs_every_chunk_of_every_micro_batch_forward_before_backward(p, m, v):
    for ops in interleaved(p, m, v):
        assert sorted((o.kind, o.mb, o.chunk) for o in ops) == sorted(
            (k, i, c) for k in "FB" for i in range(m) for c in range(v))
        assert all(ops.index(("F", i, c)) < ops.index(("B", i, c)) for i in range(m) for c in range(v))


@pytest.mark.parametrize("p, m, v", PMV)
@pytest.mark.parametrize("f, b", [(1, 1), (1, 2)])
def test_simulated_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v, f, b):
    """Idle over busy time = (p-1)/(v m) (Narayanan et al.'s bubble); idle share = (p-1)/(v m + p - 1)."""
    timeline = simulate(interleaved(p, m, v), f, b)
    assert bubble_ratio(timeline) == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert bubble_over_ideal(p, m, v) == (p - 1) / (v * m)  # the planner's step time uses this one
    assert bubble_fraction(timeline) == pytest.approx(bubble_formula(p, m, v), abs=1e-12)
    plain = simulate(one_f_one_b(p, m), f * v, b * v)  # one chunk per stage: v times the work per op
    assert bubble_ratio(plain) == pytest.approx((p - 1) / m, abs=1e-12)
    assert bubble_ratio(timeline) < bubble_ratio(plain)


def test_interleaved_needs_whole_groups_of_p_micro_batches():
    with pytest.raises(ValueError, match="multiple of pp=2"):
        make_schedule("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="need the interleaved schedule"):
        make_schedule("1f1b", 2, 4, 2)


def test_the_picture_names_each_chunk_and_holds_at_most_the_warm_up_in_flight():
    text = ascii_timeline(simulate(interleaved(2, 4, 2)))
    assert "F0.1" in text and "B3.1" in text and text.count("\n") == 1
    for r, ops in enumerate(interleaved(4, 8, 2)):
        assert peak_in_flight(ops) == min(2 * (4 - r - 1) + 4, 16) + 1  # warm-up forwards, plus one


def test_virtual_stages_are_dealt_round_robin():
    assert [rank_of_layer(4, 2, 2, i) for i in range(4)] == [0, 1, 0, 1]
    assert [rank_of_layer(8, 2, 2, i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_v_shape_placement_and_each_chunks_neighbours():
    """Round robin: rank r holds c*pp + r; ZB-V: r and 2pp-1-r. Every virtual stage on exactly one rank, and each
    chunk sends to the ranks of virtual stages k-1 and k+1 (before, only the slow pipeline runs checked the V)."""
    from minizero.nn import GPT, get_config
    from minizero.parallel.interleaved import interleave, rank_of_virtual_stage, virtual_stages_of

    assert [virtual_stages_of(r, 3, 2, v_shape=True) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [rank_of_virtual_stage(k, 3, v_shape=True) for k in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [virtual_stages_of(r, 2, 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    for pp, v, vs in ((2, 2, True), (3, 2, True), (2, 3, False), (3, 2, False)):
        ks = [k for r in range(pp) for k in virtual_stages_of(r, pp, v, vs)]
        assert sorted(ks) == list(range(pp * v))
        assert all(rank_of_virtual_stage(k, pp, vs) == r for r in range(pp) for k in virtual_stages_of(r, pp, v, vs))
    model = GPT(get_config("tiny", n_layer=4), seed=1)
    links = {vs: [[(c.stage, c.prev_rank, c.next_rank) for c in interleave(model, r, 2, 2, vs)] for r in range(2)]
             for vs in (True, False)}
    assert links[True] == [[(0, None, 1), (3, 1, None)], [(1, 0, 1), (2, 1, 0)]]
    assert links[False] == [[(0, None, 1), (2, 1, 1)], [(1, 0, 0), (3, 0, None)]]
    # the V has 2 chunks whatever v says (build_stage passes v = 1 for zb-v): 4 virtual stages, not 2
    assert [[(c.stage, c.num_stages) for c in interleave(model, r, 2, 1, True)] for r in range(2)] == [
        [(0, 4), (3, 4)], [(1, 4), (2, 4)]]


def test_a_pipeline_stage_and_an_interleaved_stage_answer_the_engine_alike():
    """The engine and context parallelism read ``stage.chunks`` and ``stage.v_shape`` of either kind of stage."""
    from minizero.nn import GPT, get_config
    from minizero.parallel.interleaved import InterleavedStage, interleave
    from minizero.parallel.pipeline import PipelineStage
    model = GPT(get_config("default"), seed=1)
    one, chunks = PipelineStage(model, 0, 2), interleave(model, 0, 1, 2, v_shape=True)
    assert one.chunks == [one] and one.v_shape is False
    both = InterleavedStage(chunks, 1, v_shape=True)
    assert both.chunks == chunks and both.v_shape is True


def test_the_last_chunks_loss_is_a_module_of_the_interleaved_stage():
    """Before: only lm_head was registered, so the loss had no name (no ledger label, no anomaly hook) under
    --schedule interleaved while a plain last stage names it ``loss``."""
    from minizero.nn import GPT, get_config
    from minizero.parallel.interleaved import InterleavedStage, interleave
    model = GPT(get_config("default"), seed=1)
    last = InterleavedStage(interleave(model, 1, 2, 2), 2)  # rank 1 of 2 holds the last virtual stage
    assert dict(last.named_modules())["loss"] is last.chunks[-1].loss
    from minizero.nn import CrossEntropyLoss  # exported beside the other basic layers
    assert isinstance(last.loss, CrossEntropyLoss)
    assert "loss" not in dict(InterleavedStage(interleave(model, 0, 2, 2), 2).named_modules())


def _wrap_then_look_inside(comm):
    from minizero.nn import GPT, get_config
    from minizero.nn.lora import add_lora
    from minizero.parallel.context_parallel import context_parallelize
    from minizero.parallel.interleaved import InterleavedStage, interleave
    stages = [InterleavedStage(interleave(GPT(get_config("default"), seed=1), 0, 1, 2), 1) for _ in range(2)]
    add_lora(stages[0], 4, 8.0, base="float")
    context_parallelize(stages[1], comm, "ulysses")
    for chunk in stages[0].chunks:
        for blk in chunk.transformer["h"]:
            assert type(blk.attn.c_attn.base).__name__ == "Linear"
    for chunk in stages[1].chunks:
        for blk in chunk.transformer["h"]:
            assert type(blk.attn.core.inner).__name__ == "DenseAttentionCore"


def test_a_replacement_holding_what_it_replaced_is_not_searched_by_the_chunks():
    """LoRA's float base and Ulysses' inner core are the modules they replace: the chunks' own pass of
    InterleavedStage.swap_modules must not replace them again (which made LoRALinear its own base)."""
    run_in_threads(2, _wrap_then_look_inside)


def _split_a_built_interleaved_stage(comm):
    from minizero.nn import GPT, get_config
    from minizero.parallel.interleaved import InterleavedStage, interleave
    from minizero.parallel.sequence_parallel import sequence_parallelize
    from minizero.parallel.vocab_parallel import vocab_parallelize
    stage = InterleavedStage(interleave(GPT(get_config("default"), seed=1), comm.rank, 2, 2), 2)
    before = {n: type(m) for n, m in stage.named_modules()}
    for split in (vocab_parallelize, sequence_parallelize):
        with pytest.raises(TypeError, match="InterleavedStage.*each of its chunks"):
            split(stage, comm)
    assert {n: type(m) for n, m in stage.named_modules()} == before


def test_vocab_and_sequence_splitting_refuse_a_built_interleaved_stage():
    """They replace the stage's own wte / lm_head / loss: a built InterleavedStage's chunks would keep
    the whole embedding and head. build_stage splits each chunk before building it; a built one is refused."""
    run_in_threads(2, _split_a_built_interleaved_stage)


def test_interleaved_is_refused_where_it_cannot_run():
    base = ["--model", "default", "--schedule", "interleaved"]
    with pytest.raises(UsageError, match="needs --pp >= 2 and --virtual-stages >= 2"):
        parse_args([*base, "--pp", "2"], 2)
    with pytest.raises(UsageError, match="must divide the 4 layers"):
        parse_args([*base, "--pp", "2", "--virtual-stages", "3"], 2)
    with pytest.raises(UsageError, match=r"micro-batches per step \(3\) to be a multiple of --pp 2"):
        parse_args([*base, "--pp", "2", "--virtual-stages", "2", "--micro-batches", "3"], 2)
    with pytest.raises(UsageError, match="needs --schedule interleaved"):
        parse_args(["--model", "default", "--pp", "2", "--virtual-stages", "2"], 2)
    with pytest.raises(UsageError, match="--zero 2 with --pp 2 is not supported"):
        parse_args([*base, "--pp", "2", "--virtual-stages", "2", "--zero", "2"], 2)
    assert parse_args([*base, "--pp", "2", "--virtual-stages", "2", "--zero", "1"], 2).virtual_stages == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp, tp, m, extra", [(1, 1, 2, []), (1, 1, 4, ["--zero", "1"]),
                                              (1, 2, 2, ["--sequence-parallel"]), (2, 1, 2, ["--zero", "1"]),
                                              (1, 2, 2, ["--attention", "flash", "--attention-block", "5"])])
def test_interleaved_equals_single_process(monkeypatch, dp, tp, m, extra):
    """pp 2 x 2 virtual stages on the tiny model 4 layers deep (h.0, h.2 on rank 0; h.1, h.3 on rank 1); flash: both
    runs (the chunks' cores are the stage's)."""
    add_deep_narrow_presets(monkeypatch)
    ref = run_in_threads(1, R.run_single, "tiny4", 2 * dp, m, [a for a in extra if a != "--sequence-parallel"])[0]
    got = run_in_threads(dp * tp * 2, R.run_parallel, "tiny4", 2, dp, tp, 2, m, "interleaved",
                         ["--virtual-stages", "2", *extra])
    R.assert_matches(ref, got, f"interleaved dp {dp} tp {tp} m {m} {extra}")


@pytest.mark.timeout(300)
def test_interleaved_from_the_command_line(mpiexec, tmp_path):
    """``mpiexec -n 2 ... --pp 2 --schedule interleaved --virtual-stages 2``: the final weights are one process's."""
    base = ["--model", "default", "--block-size", "16", "--dtype", "float64", "--steps", "3", "--eval-batches", "1",
            "--eval-every", "0", "--sample-tokens", "1", "--progress", "none", "--lr", "1e-2", "--seed", "3"]
    R.cli_matches_one_process(mpiexec, str(tmp_path), base, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages",
                                                             "2", "--micro-batch-size", "2"],
                              ["--micro-batch-size", "2", "--grad-accum", "2"])


def _picture_slots(text: str, width: int) -> tuple[int, int]:
    """(idle, busy) slots of an :func:`ascii_timeline` picture: a slot is ``width`` characters, idle is all dots."""
    idle = busy = 0
    for line in text.splitlines():
        row = line.split("|")[1]
        cells = [row[k:k + width] for k in range(0, len(row), width)]
        idle += sum(c == "." * width for c in cells)
        busy += sum(c != "." * width for c in cells)
    return idle, busy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (3, 6, 3), (4, 8, 4)])
@pytest.mark.parametrize("f, b", [(1, 1), (1, 2)])
def test_the_pictures_show_the_simulated_bubble(p, m, v, f, b):
    """The text picture's idle slots and the drawn picture's bars give the simulator's idle and busy time,
    and idle / busy = (p-1)/(v m) exactly (Narayanan et al. 2021, section 2.2.2) in all three."""
    import matplotlib

    matplotlib.use("Agg")
    from fractions import Fraction

    import matplotlib.pyplot as plt

    from minizero.parallel.schedule import plot_timeline

    timeline = simulate(interleaved(p, m, v), f, b)
    makespan = max(end for stage in timeline for _, _, end in stage)
    busy = sum(end - start for stage in timeline for _, start, end in stage)
    want = Fraction(p - 1, v * m)
    assert Fraction(p * makespan - busy) / Fraction(busy) == want  # the simulator
    width = max(len(str(op)) for stage in timeline for op, _, _ in stage)
    idle_slots, busy_slots = _picture_slots(ascii_timeline(timeline, f, b), width)
    assert (idle_slots, busy_slots) == (p * makespan - busy, busy)  # a slot is one time unit (gcd(f, b) = 1)
    assert Fraction(idle_slots, busy_slots) == want  # the text picture
    fig = plot_timeline(timeline, f=f, b=b)
    ax = fig.axes[0]
    bars = sum(path.get_extents().width for coll in ax.collections for path in coll.get_paths())
    assert bars == pytest.approx(busy, abs=1e-9) and len(ax.collections) == 2 * m * v * p
    assert f"idle / busy = {float(want):.4g}" in ax.get_title()  # the drawn picture says it
    cells = sorted(t.get_text() for t in ax.texts)  # each cell names its micro-batch and chunk, as the text does
    assert cells == sorted(str(op)[1:] for stage in timeline for op, _, _ in stage) and "0.1" in cells
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["forward", "backward"]
    plt.close(fig)
