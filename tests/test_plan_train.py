"""The planner searches and accepts only what the trainer runs: every strategy ``plan_search`` enumerates for a
minizero preset, dense or a mixture of experts, written as ``python -m minizero.train`` flags, passes train's
argument checks (parsed and validated, not run). Before, the MoE search offered cp, sequence parallelism, ep with
8-bit Adam or an offloaded optimizer and interleaved pipelines, and any search bf16/fp8 with tp > 1 and flash
attention with ring cp: train refused each of them."""
import pytest

from minizero import plan_search
from minizero.args import UsageError, parse_args
from minizero.memory.estimator import ModelShape
from minizero.models import get_model
from minizero.nn import get_config
from minizero.parallel.expert_parallel import MoEConfig
from minizero.plan_report import describe
from minizero.plan_search import enumerate_strategies
from minizero.plan_strategy import parse_strategy

#: the planner's precision -> train's flags ("mixed": FP16 with FP32 master weights and loss scaling)
PRECISION = {"mixed": ["--precision", "fp16"], "fp32": [], "fp64": ["--dtype", "float64"],
             "bf16": ["--precision", "bf16"], "fp8": ["--precision", "fp8"]}


def train_argv(st, preset: str, seq_len: int, experts: int = 0, top_k: int = 2) -> list[str]:
    """``st`` as train's flags. Train has no parameter offload (ZeRO-Infinity's): offload=params is given as the
    optimizer offload it includes, so that train's optimizer-offload rules see it. fp8 with recompute takes current
    scaling (train refuses delayed scaling there; the planner's estimate is the same for both)."""
    a = ["--model", preset, "--block-size", seq_len, "--dp", st.dp, "--tp", st.tp, "--pp", st.pp, "--zero", st.zero,
         "--micro-batch-size", st.micro_batch, "--micro-batches", st.micro_batches, "--recompute", st.recompute,
         "--attention", st.attention, "--optimizer", {"adam": "adamw"}.get(st.optimizer, st.optimizer),
         *PRECISION[st.precision], "--no-save", "--progress", "none"]
    a += ["--fp8-scaling", "current"] if st.precision == "fp8" and st.recompute != "none" else []
    a += ["--cp", st.cp, "--cp-attention", st.cp_attention] if st.cp > 1 else []
    a += ["--dp-shard", st.dp_shard] if st.dp_shard else []
    a += ["--sequence-parallel"] if st.sequence_parallel else []
    a += ["--offload-optimizer", "cpu"] if st.offload != "none" else []
    a += ["--offload-activations", "cpu"] if st.offload_activations else []
    a += ["--schedule", st.schedule] if st.pp > 1 else []  # at pp 1 train refuses --schedule as idle
    a += ["--virtual-stages", st.virtual_stages] if st.virtual_stages > 1 else []
    a += ["--moe-experts", experts, "--moe-top-k", top_k, "--ep", st.ep] if experts else []
    return [str(x) for x in a]


SETTINGS = [  # (preset, GPUs, experts, sequence length, the search's settings)
    ("default", 8, 0, 128, {}),
    ("default", 8, 0, 128, dict(attention="flash")),
    ("default", 8, 0, 126, {}),  # 126 tokens do not split over tp 4
    ("default", 8, 0, 128, dict(precision="bf16", optimizer="adam8bit")),
    ("default", 8, 0, 128, dict(precision="fp8", schedule="gpipe", global_batch=16)),
    ("default", 8, 0, 128, dict(schedule="interleaved", global_batch=16)),
    ("default", 8, 4, 128, {}),
    ("default", 8, 4, 128, dict(optimizer="adam8bit", precision="bf16", global_batch=16)),
    ("default", 8, 4, 128, dict(schedule="gpipe", attention="flash", global_batch=16)),
    ("default", 8, 4, 128, dict(schedule="interleaved", global_batch=16)),
    ("gpt2", 16, 4, 1024, dict(precision="fp32", global_batch=32)),
]


def _shape(preset, experts):
    return ModelShape.from_gpt_config(get_config(preset), name=f"minizero-{preset}",
                                      moe=MoEConfig(experts, 2) if experts else None)


@pytest.mark.parametrize("preset,gpus,experts,seq_len,kw", SETTINGS)
def test_every_searched_strategy_passes_train_s_checks(preset, gpus, experts, seq_len, kw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_search, "MIN_CP_TOKENS_PER_RANK", 1)  # a planner decision, not train's: cp searched too
    strategies = list(enumerate_strategies(_shape(preset, experts), gpus, seq_len=seq_len, **kw))
    assert strategies
    refused = []
    for st in strategies:
        try:
            parse_args(train_argv(st, preset, seq_len, experts), st.world_size)
        except UsageError as e:
            refused.append(f"{describe(st)}: {e}")
    assert not refused, f"{len(refused)} of {len(strategies)} refused by train, e.g.\n" + "\n".join(refused[:5])


@pytest.mark.parametrize("preset,gpus,experts,seq_len,kw", SETTINGS)
def test_every_searched_strategy_reads_back_through_strategy(preset, gpus, experts, seq_len, kw, monkeypatch):
    """``--strategy`` accepts what the search offers (its rules are the search's): each row's words read back."""
    monkeypatch.setattr(plan_search, "MIN_CP_TOKENS_PER_RANK", 1)
    shape = _shape(preset, experts)
    for st in enumerate_strategies(shape, gpus, seq_len=seq_len, **kw):
        assert parse_strategy(describe(st), shape, gpus, seq_len=seq_len, **kw) == st


@pytest.mark.parametrize("model,gpus,text,kw,words", [
    ("mixtral-8x7b", 16, "dp8 cp2", {}, "cp 2 with mixtral-8x7b's experts: a rank would route its sequence chunks"),
    ("mixtral-8x7b", 16, "dp8 tp2 sp", {}, "sp with mixtral-8x7b's experts: the MoE layer routes whole sequences"),
    ("mixtral-8x7b", 16, "dp16 ep2", dict(optimizer="adam8bit"), "ep 2 with --optimizer adam8bit"),
    ("mixtral-8x7b", 16, "dp16 ep2 zero3 offload=optimizer", {}, "ep 2 with offload=optimizer"),
    ("mixtral-8x7b", 16, "dp8 pp2", dict(schedule="interleaved"), "--schedule interleaved with mixtral-8x7b"),
    ("mixtral-8x7b", 16, "dp16", dict(precision="fp8"), "--precision fp8 with mixtral-8x7b"),
    ("llama3-8b", 8, "dp4 tp2", dict(precision="bf16"), "tp 2 with --precision bf16"),
    ("llama3-8b", 8, "dp4 cp2", dict(attention="flash"), "attention=flash with cp 2 by ring attention"),
    ("llama3-8b", 8, "dp8 zero3 offload=optimizer", dict(optimizer="adam8bit"), "offload=optimizer with --optimizer "
                                                                                 "adam8bit"),
    ("llama3-8b", 8, "dp2 tp4 sp", dict(seq_len=4090), "sp needs the sequence 4090 divisible by tp 4"),
])
def test_strategy_refuses_what_train_refuses(model, gpus, text, kw, words):
    with pytest.raises(ValueError) as e:
        parse_strategy(text, get_model(model), gpus, **{"seq_len": 4096, **kw})
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("argv,words", [
    (["--precision", "fp8"], "--precision fp8 with mixtral-8x7b, a mixture of experts: FP8's amax history is kept per "
                             "tensor, not per expert (as in training); allowed: --precision mixed, bf16, fp32 or fp64"),
    (["--schedule", "interleaved"], "--schedule interleaved with mixtral-8x7b, a mixture of experts: the expert "
                                    "all-to-alls run with 1f1b or gpipe only (as in training); allowed: --schedule "
                                    "1f1b or gpipe"),
])
def test_the_search_refuses_what_train_runs_no_layout_of(capsys, argv, words):
    """Before: both were searched, though train refuses a mixture of experts with either."""
    from minizero import plan
    from tests.conftest import one_refusal

    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "mixtral-8x7b", "--gpus", "16", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in one_refusal(err), err
