"""bench/*.py refuse bad flags argparse-style (exit 2, the flag, the value, what is allowed) before any run.

Each script's ``main`` runs in this process (bench_setup_peak, which starts MPI on import, in a child) with the
functions that start its work (LAUNCHERS) replaced by ones that fail the test, so a missing check shows as a failure
here, never as a benchmark run. Every script that takes flags must be in LAUNCHERS, with a case in CASES.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import earlier_json, one_refusal

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO_ROOT, "bench")


def load(name):
    """bench/NAME.py as a module (its own sys.path set-up runs)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAUNCHERS = {  # per script, the functions that start its work: a test replaces them, so no bad flag can start a run
    "bench_allreduce": ("launch", "measure"), "bench_defaults": ("run",), "bench_memory": ("run",),
    "bench_overlap": ("run",), "bench_speedup": ("run",), "bench_train": ("run",), "bench_heldout": ("measure",),
    "bench_seq_memory": ("sweep", "attention_main"), "bench_3d_main_job": ("run", "load"),
    "bench_qlora": ("train_base", "finetune_main"),
    "bench_quantization": ("table_weights", "table_adam", "table_codes", "table_comm", "table_prune_one_shot",
                           "table_sparse_training"),
    "bench_flight": ("job", "per_op_us", "ops_per_step"), "bench_header": ("exchange",),
    "bench_low_precision": ("run_in_threads",), "bench_precision": ("run_in_threads",),
    "bench_multihost": ("rank_main", "launch"), "bench_recompute": ("saved_after_forward", "step_time"),
    "bench_setup_peak": ("measure",), "bench_vs_torch": ("import_torch", "sgemm_peak", "bench"),
    "gpu_check": ("probe", "nccl_worker", "torch_worker"), "profile_collective": ("launch", "profile"),
    "profile_step": ("profile_worker", "main_precision", "import_torch", "profile"),
}
IN_A_PROCESS = {"bench_setup_peak"}  # imports mpi4py's MPI (MPI_Init) when loaded: not in the test process

# a child process that runs bench/NAME.py's main with LAUNCHERS[NAME] replaced: each exits 3, saying so
PATCHED = """import importlib.util, sys
path, launchers, argv = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
spec = importlib.util.spec_from_file_location("_bench", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
def launched(*a, **k):
    print(f"{argv[0]} {argv[1:]} started a run", file=sys.stderr)
    sys.exit(3)
for fn in launchers:
    getattr(module, fn)  # AttributeError: LAUNCHERS names a function the script lacks
    setattr(module, fn, launched)
sys.argv = argv
sys.exit(module.main())
"""


def patched_process(name, argv) -> subprocess.CompletedProcess:
    """``main()`` of bench/NAME.py with ``argv`` in a child process, its launchers replaced (exit 3 when one is
    reached)."""
    cmd = [sys.executable, "-c", PATCHED, os.path.join(BENCH, f"{name}.py"), ",".join(LAUNCHERS[name]), f"{name}.py"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def refusal(monkeypatch, capsys, name, argv) -> str:
    """``main()`` of bench/NAME.py with ``argv`` (in a child process for IN_A_PROCESS): asserts exit 2 and nothing
    launched; returns stderr, its lines joined (one refusal, wrapped at 120 columns: conftest.one_refusal)."""
    if name in IN_A_PROCESS:
        r = patched_process(name, argv)
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        module = load(name)

        def launched(*a, **k):
            raise AssertionError(f"{name} {argv} started a run")

        for fn in LAUNCHERS[name]:
            monkeypatch.setattr(module, fn, launched)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        with pytest.raises(SystemExit) as e:
            module.main()
        (out, err), code = capsys.readouterr(), e.value.code
    assert code == 2 and out == "", (code, out, err)  # no header (date, CPU, BLAS) above the refusal
    assert err.startswith(f"{name}.py: error:"), err  # no usage block above it
    assert "Traceback" not in err and "UsageError" not in err, err
    return one_refusal(err)


CASES = [
    ("bench_allreduce", ["--min-bytes", "0"], "'0' is below 1"),
    ("bench_allreduce", ["--min-bytes", "-5"], "'-5' is below 1"),
    ("bench_allreduce", ["--launch", "0"], "argument --launch: '0'"),
    ("bench_allreduce", ["--launch", "2,,x"], "argument --launch: '2,,x'"),
    ("bench_allreduce", ["--launch", "2,"], "argument --launch: '2,'"),
    ("bench_allreduce", ["--min-bytes", "100", "--max-bytes", "8"], "--min-bytes 100 > --max-bytes 8"),
    ("bench_allreduce", ["--warmup", "-1"], "argument --warmup: '-1' is below 0"),
    # before: the sweep ran, doubling its arrays until one did not fit in memory: a MemoryError traceback
    ("bench_allreduce", ["--max-bytes", "99999999999999"], "argument --max-bytes: '99999999999999' is above this "
                                                           "machine's memory"),
    ("bench_overlap", ["--ranks", "0"], "argument --ranks: '0'"),
    ("bench_overlap", ["--steps", "1", "--figure", "X"], "needs --steps >= 2, got 1"),
    ("bench_overlap", ["--bucket-mb", "nan"], "argument --bucket-mb: 'nan'"),
    ("bench_overlap", ["--bucket-mb", "-1"], "argument --bucket-mb: '-1'"),
    ("bench_overlap", ["--strategies", "dp,"], "--strategies"),
    ("bench_overlap", ["--model", "nosuch"], "'nosuch'"),
    # before: the runs, then a WriteError (or FileNotFoundError) traceback at the end
    ("bench_overlap", ["--figure", "/"], "--figure '/' is a directory; give a file path"),
    ("bench_seq_memory", ["--png", "/no-such-folder/x.png"], "--png '/no-such-folder/x.png': folder "),
    ("bench_seq_memory", ["--attention", "--png", "/"], "--png '/' is a directory"),
    ("bench_3d_main_job", ["--reuse", "/no-such-folder"], "--reuse '/no-such-folder' holds no dp8_short/summary"),
    ("bench_3d_main_job", ["--reuse", "/", "--keep", "x"], "with --reuse it makes none"),
    ("bench_3d_main_job", ["--keep", "/dev/null"], "--keep '/dev/null' exists and is not a folder"),
    ("bench_quantization", ["--ranks", "1"], "--ranks 1: table 4 compares the bytes ranks send each other; allowed"),
    # before: accepted, four runs of 8 ranks, then a StatisticsError traceback (no steps after the short runs')
    ("bench_3d_main_job", ["--steps", "21", "--short-steps", "21"], "and --steps > --short-steps"),
    ("bench_allreduce", ["--json", "/"], "--json '/' is a directory"),  # before: the sweep, then IsADirectoryError
    # before: '' ignored, the runs done and nothing written (seq_memory: its default file written instead)
    ("bench_allreduce", ["--launch", "2", "--json", ""], "argument --json: '': expected a file path"),
    ("bench_overlap", ["--figure", ""], "argument --figure: '': expected a file path"),
    ("bench_seq_memory", ["--png", ""], "argument --png: '': expected a file path"),
    ("bench_allreduce", ["--json", "x.json", "--launch", "2"], "with --launch (which gives each run its own)"),
    # before: tables 2-4 ran, then a FileNotFoundError traceback at table 5a; or --weights unused, unsaid
    ("bench_quantization", ["--weights", "/no-such.npz", "--only", "2,5a"], "--weights '/no-such.npz': no such file"),
    ("bench_quantization", ["--weights", "/no-such.npz", "--only", "2"], "--only '2' runs neither: drop --weights"),
    ("bench_speedup", ["--precision", "--ranks", "1,x"], "argument --ranks: '1,x'"),
    ("bench_speedup", ["--precision", "--ranks", "0"], "argument --ranks: '0'"),
    ("bench_speedup", ["--precision", "--ranks", "100000"], "in [1, 64]"),
    ("bench_speedup", ["--precision", "--steps", "0"], "argument --steps: '0' is below 1"),
    ("bench_speedup", ["--base", "nosuchrev"], "--base 'nosuchrev' is not a known revision"),
    ("bench_speedup", ["--malloc", "--repeats", "0"], "argument --repeats: '0'"),
    ("bench_speedup", [], "give --base REV, --precision or --malloc"),
    ("bench_train", ["--steps", "0"], "argument --steps: '0' is below 1"),
    ("bench_heldout", ["--slices", "0"], "argument --slices: '0' is below 1"),
    # the corpus (CPython's pydoc_data.topics) has another length on another Python: its numbers are not asserted
    ("bench_heldout", ["--slices", "100000"], "--slices 100000 cuts the training split ("),
    ("bench_heldout", ["--slices", "99999"], "bytes) into slices below the 130 bytes that drawing a 129-byte window "
                                             "of model 'default' needs; allowed: 1.."),
    ("bench_heldout", ["--batches", "10001"], "argument --batches: '10001' is above 10,000; allowed: an integer in 1.."),
    ("bench_heldout", ["--model", "tiny", "--steps", "2000000000"], "python -m minizero.train refuses these flags"),
    ("bench_train", ["--ranks", "1,,8"], "argument --ranks: '1,,8'"),
    ("bench_train", ["--against", "nosuchrev"], "--against 'nosuchrev' is not a known revision"),
    ("bench_train", ["--model", "nosuch"], "argument --model: 'nosuch': allowed: a model preset, one of deep, "),
    ("bench_memory", ["--ranks", "0"], "argument --ranks: '0'"),
    ("bench_memory", ["--ranks", "-3"], "argument --ranks: '-3'"),
    ("bench_memory", ["--steps", "0"], "argument --steps: '0'"),
    ("bench_memory", ["--configs", "fp16,"], "unknown config ''"),
    ("bench_defaults", ["--settings", "3e-3,auto"], "'3e-3,auto' in '3e-3,auto': allowed: ';'-separated"),
    ("bench_defaults", ["--settings", "3e-3,auto,1;"], "'' in '3e-3,auto,1;'"),
    ("bench_defaults", ["--settings", "nan,auto,1"], "--lr must be a normal float32 number"),
    # before: the base model trained (minutes), then fine-tune refused what it was given
    ("bench_qlora", ["--data", "/no-such.txt"], "--data '/no-such.txt': no such file"),
    ("bench_qlora", ["--data", "/"], "--data '/' is a directory"),
    ("bench_qlora", ["--data", os.path.abspath(__file__), "--lora-rank", "129"], "--lora-rank 129 is above the "
                                                                                  "default model's width 128"),
    # before: a CalledProcessError traceback (train refused the steps); the base trained, then fine-tune refused
    ("bench_qlora", ["--base-steps", "2000000000"], "refuses these flags at 1 rank(s): --steps must be <= 1,000,"),
    ("bench_qlora", ["--steps", "2000000000"], "--steps 2,000,000,000 is above fine-tune's 1,000,000,000"),
    ("bench_flight", ["--zero", "4"], "argument --zero: '4': allowed: a ZeRO stage, 0, 1, 2 or 3"),
    ("bench_header", ["--sizes", "4096,"], "argument --sizes: '4096,'"),
    # before: accepted; under mpiexec every rank then failed to allocate the 100 TB message (MemoryError)
    ("bench_header", ["--sizes", "4096,99999999999999"], "argument --sizes: '4096,99999999999999': allowed: "
                                                         "comma-separated byte counts in 4.."),
    # before: accepted; 5 bytes sent 4 (a float32 array of 5 // 4), 2 bytes an empty message, shown as "0 KiB"
    ("bench_header", ["--sizes", "4096,5"], "argument --sizes: '4096,5': allowed: comma-separated byte counts in 4.."),
    ("bench_header", ["--sizes", "2"], "multiples of 4 (float32 messages), e.g. 4096,65536"),
    # before: accepted, and MPI's start then waited 600 s (the watchdog re-read the flag, refusing what is out of range)
    ("bench_header", ["--comm-timeout", "0.5"], "--comm-timeout 0.5: allowed: seconds in [1, 600000)"),
    ("bench_header", ["--comm-timeout", "1e9"], "--comm-timeout 1e+09: allowed: seconds in [1, 600000)"),
    ("bench_multihost", ["--mib", "nan"], "argument --mib: 'nan': allowed: a finite number > 0"),
    ("bench_multihost", ["--mib", "1e12"], "--mib 1e+12 is above this machine's memory"),  # before: MemoryError
    ("bench_precision", ["--window", "0"], "argument --window: '0' is below 1"),
    ("bench_quantization", ["--ranks", "-2"], "argument --ranks: '-2': allowed: a number of ranks in [1, 64]"),
    ("bench_vs_torch", ["--batch", "8,,32"], "argument --batch: '8,,32'"),
    # before: accepted, then a (B, 128, 256) logits array of 13 GB for --batch 100000
    ("bench_vs_torch", ["--batch", "8,100000"], "argument --batch: '8,100000': allowed: comma-separated micro-batch "
                                                "sizes in 1..4096 (train's --micro-batch-size bound)"),
    ("bench_quantization", ["--only", "1,6"], "--only '1,6': allowed: comma-separated table numbers from 1, 2"),
    ("profile_collective", ["--sizes", "-4,8"], "argument --sizes: '-4,8': allowed: comma-separated sizes in bytes"),
    ("profile_collective", ["--sizes", "0"], "argument --sizes: '0': allowed: comma-separated sizes in bytes, "
                                             "positive multiples of 4"),
    ("profile_collective", ["--sizes", "4096,x"], "argument --sizes: '4096,x': allowed"),
    ("profile_collective", ["--sizes", "４０９６"], "argument --sizes: '４０９６': allowed"),  # int() read it as 4096
    ("profile_collective", ["--sizes", "4_096"], "argument --sizes: '4_096': allowed"),  # int() read it as 4096
    ("profile_collective", ["--sizes", "1048576000"], "argument --sizes: '1048576000': allowed"),
    ("profile_collective", ["--runs", "0"], "argument --runs: '0' is below 1; allowed: an integer >= 1"),
    ("profile_collective", ["--runs", "nan"], "argument --runs: invalid int value: 'nan'; allowed: an integer"),
    ("profile_collective", ["--warmup", "-1"], "argument --warmup: '-1' is below 0"),
    ("profile_collective", ["--launch", "０"], "argument --launch: invalid int value: '０'"),
    ("profile_collective", ["--launch", "-2"], "argument --launch: '-2': allowed: a number of ranks in [1, 64]"),
    ("profile_collective", ["--launch", "3"], "--launch 3: needs a power of two >= 2"),
    # before: each started its work and ended in a traceback (a failed mpiexec job, a KeyError, a UsageError)
    *[(name, ["--model", "nosuch"], "argument --model: 'nosuch': allowed: a model preset, one of deep, default")
      for name in ("bench_flight", "bench_heldout", "bench_low_precision", "bench_precision", "bench_quantization",
                   "bench_recompute", "bench_seq_memory")],
    ("bench_flight", ["--zero", "3", "--ranks", "3", "--model", "tiny", "--steps", "2000000000"],
     "python -m minizero.train refuses these flags at 3 rank(s): --steps must be <= 1,000,000,000"),
    ("bench_low_precision", ["--micro-batch-size", "5000"], "python -m minizero.train refuses these flags at 1 rank"),
    ("bench_precision", ["--initial-loss-scale", "1e30"], "python -m minizero.train refuses these flags at 1 rank"),
    ("bench_recompute", ["--dropout", "1.5"], "argument --dropout: '1.5': allowed: a probability in [0, 1)"),
    # bench_setup_peak: in a child process (MPI_Init), its launcher replaced
    ("bench_setup_peak", ["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ("bench_setup_peak", ["--max-fraction"], "argument --max-fraction: expected one argument"),
    ("bench_setup_peak", ["--max-fraction", "abc"], "argument --max-fraction: invalid float value: 'abc'"),
    ("bench_setup_peak", ["--max-fraction", "nan"], "argument --max-fraction: 'nan': allowed: a number in (0, 1]"),
    ("bench_setup_peak", ["--max-fraction", "-1"], "argument --max-fraction: '-1'"),
    ("bench_setup_peak", ["--zero", "7"], "--zero"),
    ("bench_setup_peak", ["--max-fraction", "0.25"], "--max-fraction 0.25 only applies with --check"),  # it ran
    # before: accepted; a MemoryError after the header (bench_multihost: after both runs, a ZeroDivisionError; as
    # root, 64 namespace hosts and 4,096 ranks); seq_memory --attention ignored --batch
    ("bench_recompute", ["--batch", "100000"], "argument --batch: '100000': allowed: a micro-batch size in 1..4096"),
    ("bench_seq_memory", ["--batch", "5000"], "argument --batch: '5000': allowed: a micro-batch size in 1..4096"),
    ("bench_seq_memory", ["--attention", "--batch", "8"], "--batch: --attention measures one layer of the small "
                                                          "model at b = 1 and takes none of --model, --batch"),
    ("bench_multihost", ["--hosts", "64", "--slots", "64"], "--hosts 64 x --slots 64 is 4,096 ranks; allowed: at "
                                                            "most 64"),
    ("bench_multihost", ["--mib", "1e-9"], "--mib 1e-09 is below one float32 (4 bytes); allowed: at least 3.815e-06"),
    ("gpu_check", ["--budget-s", "-1"], "--budget-s must be a number of seconds in (0, 86400], got -1.0"),
    ("gpu_check", ["--steps", "8,3"], "--steps '8,3': give K,K+S, two integers with 1 <= K < K+S"),
    ("profile_step", ["--threads", "0"], "argument --threads: '0' is below 1; allowed: 1.."),
    # before: accepted, 100,000 BLAS threads on this machine's cores (profile_step alone refused it)
    *[(name, ["--threads", "100000"], "argument --threads: '100000' is above ")
      for name in ("bench_vs_torch", "bench_recompute", "profile_step")],
    ("profile_step", ["--batch", "8,8"], "--batch gives 8 twice; allowed: each batch size once"),
    ("profile_step", ["--batch", "8,5000"], "argument --batch: '8,5000': allowed: comma-separated micro-batch sizes"),
    ("profile_step", ["--steps", "100000"], "argument --steps: '100000' is above 10,000; allowed: an integer in 1.."),
    ("profile_step", ["--precision", "fp32", "--model", "x"], "argument --model: 'x': allowed: a model preset, one "),
    # before: the worker ran first, its other flags unchecked
    ("profile_step", ["--profile-worker", "[]", "--device", "strict"], "give --precision too"),
    # before: accepted, one row of the loss table (the same as --window STEPS)
    ("bench_low_precision", ["--steps", "10", "--window", "11"], "--window 11 is above --steps 10; allowed: 1..10"),
    ("bench_precision", ["--steps", "10", "--window", "40"], "--window 40 is above --steps 10; allowed: 1..10"),
    # before: the hidden worker modes (gpu_check's own children) ran before any other flag was checked
    ("gpu_check", ["--nccl-worker", "n.json", "--json", "/"], "--json '/': is a directory"),
    ("gpu_check", ["--torch-worker", "fp16", "--budget-s", "-1"], "--budget-s must be a number of seconds in (0,"),
    ("gpu_check", ["--torch-worker", "fp8"], "argument --torch-worker: invalid choice: 'fp8'"),
    ("gpu_check", ["--nccl-worker", "n.json", "--torch-worker", "fp16"], "--nccl-worker and --torch-worker: give one"),
    ("profile_step", ["--precision", "fp8"], "--precision takes fp32 and fp16, each once"),
    ("profile_step", ["--device", "strict"], "--device and --model profile the main job's loop: give --precision too"),
]


@pytest.mark.parametrize("name,argv,says", CASES, ids=[f"{n}:{' '.join(a)}" for n, a, _ in CASES])
def test_bad_flag_is_refused_before_any_run(monkeypatch, capsys, name, argv, says):
    assert says in refusal(monkeypatch, capsys, name, argv)


def test_allowed_values_are_named(monkeypatch, capsys):
    assert "allowed: an integer >= 1" in refusal(monkeypatch, capsys, "bench_allreduce", ["--min-bytes", "0"])
    assert "allowed: a finite number > 0" in refusal(monkeypatch, capsys, "bench_overlap", ["--bucket-mb", "inf"])
    assert "allowed: a number of ranks in [1, 64]" in refusal(monkeypatch, capsys, "bench_memory", ["--ranks", "0"])


def script(name, *argv):
    """``python bench/NAME.py ARGV`` as a process (short timeout: none of these may start a run)."""
    return subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), *argv], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT)


def test_allreduce_min_bytes_zero_exits_at_once():  # it looped forever, allocating
    r = script("bench_allreduce", "--min-bytes", "0")
    assert r.returncode == 2 and "argument --min-bytes: '0' is below 1" in r.stderr


def test_setup_peak_help_is_its_own():
    r = script("bench_setup_peak", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: bench_setup_peak.py")
    text = " ".join(r.stdout.split())  # argparse wraps at the terminal's width
    assert "--max-fraction F" in text and "python -m minizero.train --help" in text


@pytest.mark.parametrize("name", ["bench_memory", "bench_header", "bench_flight"])
def test_bench_help_says_every_default(name):
    """Before: "--steps STEPS" alone (no help text, so argparse showed no default), and bench_header's
    description read "``MPICommunicator``"."""
    r = script(name, "--help")
    assert r.returncode == 0 and "``" not in r.stdout
    blocks = [" ".join(b.split()) for b in r.stdout.split("options:")[1].split("\n  -")[1:]]
    assert blocks and all("(default" in b for b in blocks if not b.startswith(("h, --help", "-json", "-check"))), blocks


@pytest.mark.parametrize("name", ["bench_train", "bench_seq_memory", "profile_step"])
def test_bench_model_help_gives_each_presets_size_as_train_does(name):
    """Before: "--model MODEL (default: default)", no preset named. Any ``type=_args.preset`` flag now starts
    with train's text (nn.gpt.preset_sizes), then its own help or default."""
    from minizero.nn.gpt import preset_sizes

    text = " ".join(script(name, "--help").stdout.split())
    assert f"--model MODEL {preset_sizes()} (" in text and "tiny 2x2x16 T=16 (10,944)" in text


def test_header_table_shows_each_size_whole():
    """Before: 100 bytes showed as "0 KiB", 1,536 as "1 KiB"."""
    label = load("bench_header").size_label
    assert [label(n) for n in (100, 1536, 4096, 3 * 2**20)] == ["100 B", "1,536 B", "4 KiB", "3 MiB"]


class Launched(Exception):
    """The stub launcher was reached: every check passed."""


@pytest.mark.parametrize("name,argv", [
    ("bench_allreduce", ["--launch", "2,4,8", "--op", "all"]),
    ("bench_allreduce", ["--min-bytes", "8", "--max-bytes", "8", "--warmup", "0"]),
    ("bench_overlap", ["--ranks", "4,2", "--steps", "5", "--figure", "x.png"]),
    ("bench_speedup", ["--malloc", "--ranks", "1,2,8", "--steps", "20", "--repeats", "2"]),
    ("bench_speedup", ["--base", "HEAD", "--precision", "--ranks", "1", "--micro-batch-size", "8"]),
    ("bench_train", ["--ranks", "1,2,4,8", "--steps", "30"]),
    ("bench_train", ["--against", "HEAD", "--ranks", "1,8"]),
    ("bench_heldout", []),
    ("bench_heldout", ["--model", "small", "--steps", "100"]),
    ("bench_memory", []),
    ("bench_defaults", []),
    ("bench_defaults", ["--settings", "3e-3,auto,1.0;2e-3,30,0"]),
    ("bench_3d_main_job", []),  # both layouts' flags pass train's checks at 8 ranks
    ("bench_flight", ["--model", "tiny"]),
    ("bench_header", []),
    ("bench_low_precision", ["--model", "tiny"]),
    ("bench_precision", ["--model", "tiny"]),
    ("bench_multihost", []),
    ("bench_multihost", ["--rank"]),
    ("bench_multihost", ["--hosts", "8", "--slots", "8", "--mib", "3.815e-06"]),  # the largest and the smallest
    ("bench_recompute", ["--model", "tiny"]),
    ("bench_recompute", ["--batch", "4096"]),
    ("bench_seq_memory", ["--attention"]),
    ("bench_seq_memory", ["--batch", "4096", "--model", "tiny", "--repeats", "1"]),
    ("bench_setup_peak", ["--model", "tiny"]),
    ("bench_vs_torch", ["--default-malloc"]),
    ("gpu_check", ["--json", "g.json"]),
    ("gpu_check", ["--nccl-worker", "n.json"]),
    ("gpu_check", ["--torch-worker", "fp32"]),
    ("profile_collective", []),
    ("profile_collective", ["--launch", "2"]),
    ("profile_step", ["--default-malloc"]),
    ("profile_step", ["--precision", "fp32", "--default-malloc"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_documented_flags_reach_the_run(monkeypatch, tmp_path, name, argv):
    """Good flags reach one of LAUNCHERS[name]: the functions listed are the ones that start the work."""
    if name in IN_A_PROCESS:
        r = patched_process(name, argv)
        assert r.returncode == 3 and "started a run" in r.stderr, (r.returncode, r.stderr)
        return
    monkeypatch.chdir(tmp_path)  # gpu_check's --json, bench_overlap's figure: paths in a fresh folder
    module = load(name)

    def launched(*a, **k):
        raise Launched

    for fn in LAUNCHERS[name]:
        monkeypatch.setattr(module, fn, launched)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(Launched):
        module.main()


def scripts() -> list:
    """The names of bench/*.py that are programs (not the shared _args, _machine)."""
    return sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py") and f[0] != "_")


def takes_flags(name) -> bool:
    """bench/NAME.py declares an argparse flag."""
    with open(os.path.join(BENCH, f"{name}.py")) as f:
        return ".add_argument(" in f.read()


ONE_BAD_FLAG = {  # per script, a flag refused after argparse's own checks (the ones that were late), else a type
    "bench_3d_main_job": ["--short-steps", "5"], "bench_allreduce": ["--op", "all"],
    "bench_defaults": ["--settings", "nan,auto,1"], "bench_flight": ["--zero", "9"], "bench_header": ["--runs", "0"],
    "bench_heldout": ["--slices", "100000"],
    "bench_low_precision": ["--window", "0"], "bench_memory": ["--configs", "x"], "bench_multihost": ["--mib", "nan"],
    "bench_overlap": ["--strategies", "x"], "bench_precision": ["--initial-loss-scale", "1e30"],
    "bench_qlora": ["--weights", "/no-such.npz"], "bench_quantization": ["--only", "9"],
    "bench_recompute": ["--threads", "0"], "bench_seq_memory": ["--png", "/"], "bench_setup_peak": ["--zero", "7"],
    "bench_speedup": ["--ranks", "x"], "bench_train": ["--model", "x"], "bench_vs_torch": ["--threads", "-1"],
    "gpu_check": ["--budget-s", "-1"], "profile_collective": ["--runs", "0"], "profile_step": ["--threads", "-1"],
}


def test_every_script_is_in_the_bad_flag_sweep():
    assert sorted(ONE_BAD_FLAG) == scripts()


@pytest.mark.parametrize("name", sorted(ONE_BAD_FLAG))
def test_a_bad_flag_is_the_only_output(monkeypatch, capsys, name):
    """One refusal on stderr, nothing on stdout, exit 2, before any work. Before: bench_flight, bench_recompute,
    bench_seq_memory, bench_quantization, bench_low_precision and bench_3d_main_job printed their header (date, CPU,
    BLAS) on stdout first; bench_qlora --weights a missing file printed the header and the plan, then fine-tune's
    refusal; bench_3d_main_job's --short-steps exited 1 without its name."""
    refusal(monkeypatch, capsys, name, ONE_BAD_FLAG[name])


def test_every_script_with_flags_has_its_launchers_listed():
    """A script missing from LAUNCHERS would really run (minutes) when a regression accepts a test's bad flag."""
    assert [n for n in scripts() if takes_flags(n) and n not in LAUNCHERS] == []
    assert sorted(set(LAUNCHERS) - set(scripts())) == []  # no entry for a removed script


def test_every_listed_script_has_a_bad_flag_case():
    assert sorted(set(LAUNCHERS) - {name for name, _, _ in CASES}) == []


GPU_CHECK_CASES = [
    (["--peak-tflops", "１００"], "--peak-tflops '１００': give one or two positive finite numbers"),
    (["--peak-tflops", "1_000"], "--peak-tflops '1_000': give one or two positive finite numbers"),
    (["--peak-tflops", "0"], "--peak-tflops '0': give one or two positive finite numbers"),
    (["--peak-tflops", "100,-5"], "--peak-tflops '100,-5': give one or two positive finite"),
    (["--peak-tflops", "nan"], "--peak-tflops 'nan': give one or two positive finite numbers"),
    (["--peak-tflops", "fast"], "--peak-tflops 'fast': give one or two positive finite numbers"),
    (["--steps", "３,８"], "--steps '３,８': give K,K+S, two integers with 1 <= K < K+S"),
    (["--steps", "3,1_0"], "--steps '3,1_0': give K,K+S"),
    (["--steps", "0,8"], "--steps '0,8': give K,K+S"),
    (["--steps", "-3,8"], "--steps '-3,8': give K,K+S"),
    (["--steps", "nan,8"], "--steps 'nan,8': give K,K+S"),
    (["--budget-s", "０"], "argument --budget-s: invalid float value: '０'"),
    (["--budget-s", "-1"], "--budget-s must be a number of seconds in (0, 86400], got -1.0"),
    (["--budget-s", "nan"], "--budget-s must be a number of seconds in (0, 86400], got nan"),
]


@pytest.mark.parametrize("argv,says", GPU_CHECK_CASES)
def test_gpu_check_reads_numbers_in_ascii_and_in_range(tmp_path, argv, says):
    """Before: float()/int() read '１００', '1_000' and '３,８'; the check then ran on them."""
    r = script("gpu_check", *argv, "--json", str(tmp_path / "g.json"))
    assert r.returncode == 2 and r.stderr.startswith(f"gpu_check.py: error: {says}"), r.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("name", ["bench_allreduce", "profile_collective"])
def test_a_bad_all_reduce_size_rule_in_the_environment_is_refused(monkeypatch, capsys, name):
    """Before: MINIZERO_SMALL_ALLREDUCE_MAX_BYTES=foo was ignored (the default rule measured, and the table said it
    ran recursive doubling up to 262144 bytes); train and finetune refuse it."""
    monkeypatch.setenv("MINIZERO_SMALL_ALLREDUCE_MAX_BYTES", "foo")
    r = script(name)
    assert r.returncode == 2 and f"{name}.py: error: MINIZERO_SMALL_ALLREDUCE_MAX_BYTES='foo'; allowed: an integer " \
                                  ">= -1" in r.stderr, r.stderr


def test_gpu_check_workers_need_no_writable_default_json(monkeypatch, tmp_path):
    """A worker writes no --json, so the default gpu_check.json in its folder is not checked there (the main run
    refuses a gpu_check.json that is not its own); one given with the worker flags is (CASES)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpu_check.json").write_text("{}")
    module = load("gpu_check")
    monkeypatch.setattr(module, "probe", lambda: pytest.fail("the main run passed its --json check"))
    monkeypatch.setattr(module, "torch_worker", lambda precision: print("worker ran"))
    assert module.main(["--torch-worker", "fp16"]) == 0
    with pytest.raises(SystemExit) as e:
        module.main([])
    assert e.value.code == 2


def test_bench_allreduce_json_is_written_whole_or_not_at_all(tmp_path):
    """Before: open(--json, "w") emptied the previous file first, and a write that failed part-way left half of it."""
    code = ("import importlib.util, sys\nimport minizero.comm as comm\n"
            "spec = importlib.util.spec_from_file_location('_bench', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
            "m.measure = lambda *a: (1, {8: {'ring': 1.0}})\n"
            "import builtins, errno, os\n"  # a file opened for writing takes half its text, then the disk is full
            "def half(opener):\n"
            "    def opened(*a, **k):\n"
            "        f = opener(*a, **k)\n"
            "        if 'w' in str(a[1] if len(a) > 1 else k.get('mode', 'r')):\n"
            "            put = f.write\n"
            "            def write(t):\n"
            "                put(t[:len(t) // 2])\n"
            "                raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "            f.write = write\n"
            "        return f\n"
            "    return opened\n"
            "builtins.open, os.fdopen = half(builtins.open), half(os.fdopen)\n"
            "comm.world = lambda: type('W', (), {'rank': 0})()\n"
            "sys.argv = ['bench_allreduce.py', '--json', sys.argv[2], '--quiet']\nm.main()\n")
    path = tmp_path / "timings.json"
    path.write_text(earlier_json(world_size=2, results={}))
    r = subprocess.run([sys.executable, "-c", code, os.path.join(BENCH, "bench_allreduce.py"), str(path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert r.returncode == 1 and "no space left on device" in r.stderr, r.stderr
    assert path.read_text() == earlier_json(world_size=2, results={})  # the previous file, whole


@pytest.mark.parametrize("op", ["all_reduce", "all"])
def test_bench_allreduce_output_begins_with_its_title(monkeypatch, capsys, op):
    """Before: a blank line above the first table."""
    module = load("bench_allreduce")
    monkeypatch.setattr(module, "launch", lambda sizes, args: {2: {4096: {"ring": 1e-4, "MPI": 1e-4}}})
    monkeypatch.setattr(sys, "argv", ["bench_allreduce.py", "--launch", "2", "--op", op, "--default-malloc"])
    module.main()
    out = capsys.readouterr().out
    titles = [i for i, line in enumerate(out.splitlines()) if " bus bandwidth, GB/s | " in line]
    assert titles[0] == 0 and len(titles) == (4 if op == "all" else 1), out
    assert all(out.splitlines()[i - 1] == "" and out.splitlines()[i - 2] != "" for i in titles[1:]), out


def test_gpu_check_probes_its_jsons_own_temporary(tmp_path):
    """Before: its folder was probed with a short name: a 240-character --json ran every check, then failed."""
    problem = load("gpu_check").json_target_problem(str(tmp_path / ("g" * 235 + ".json")))
    assert "longer than the file system's" in problem, problem


def test_gpu_check_writes_its_json_into_dev_null_and_refuses_a_fifo(tmp_path):
    """Before: --json /dev/null was refused ("not a regular file"), where train.py's --json writes into it."""
    gpu_check = load("gpu_check")
    assert gpu_check.json_target_problem(os.devnull) is None
    os.mkfifo(tmp_path / "pipe")
    problem = gpu_check.json_target_problem(str(tmp_path / "pipe"))
    assert "is a named pipe (FIFO)" in problem, problem


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_gpu_check_refuses_a_device_that_takes_no_bytes_as_train_does():
    """A device is probed as train.py's --json probes it. Before: once /dev/null was taken, every device passed the
    check unprobed, and --json /dev/full failed after the whole check ("No space left on device")."""
    problem = load("gpu_check").json_target_problem("/dev/full")
    assert problem is not None and "No space left on device" in problem, problem


def test_3d_main_job_refuses_a_keep_folder_train_would_refuse_before_any_run(monkeypatch, capsys, tmp_path):
    """Before: the fourth run's --out (a user's file in --keep) was refused by train after three runs, a traceback."""
    (tmp_path / "3d_long").write_text("notes")
    says = refusal(monkeypatch, capsys, "bench_3d_main_job", ["--keep", str(tmp_path)])
    assert "minizero.train refuses these flags at 8 rank(s): --out" in says and "3d_long" in says, says
    assert (tmp_path / "3d_long").read_text() == "notes"


def test_a_base_tree_is_named_by_its_commit_id(monkeypatch, capsys):
    """--against / --base HEAD (a branch, HEAD~3): the table said 'HEAD', which names another commit tomorrow."""
    sha = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    module = load("bench_train")
    unpacked = []

    def unpack(rev, folder):
        unpacked.append(rev)
        raise Launched

    monkeypatch.setattr(module, "unpack", unpack)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--against", "HEAD", "--ranks", "1"])
    with pytest.raises(Launched):
        module.main()
    assert unpacked == [sha] and f"| tokens/s at {sha} |" in capsys.readouterr().out


def test_3d_main_job_reuse_says_when_its_runs_were_made_and_shows_step_20_once(monkeypatch, capsys, tmp_path):
    """Before: --reuse printed only the header (today's date and checkout, not the runs'), and --short-steps 21
    showed 'train loss at steps 0 / 10 / 20 / 20'."""
    import json
    steps = {"dp8_short": 21, "3d_short": 21, "dp8_long": 22, "3d_long": 22}
    peak = {"parameters": 1, "gradients": 1, "optimizer_state": 1, "activations": 1}
    for name, n in steps.items():
        (tmp_path / name).mkdir()
        dp, tp, pp = (8, 1, 1) if name.startswith("dp8") else (2, 2, 2)
        summary = {"dp": dp, "tp": tp, "pp": pp, "world_size": 8, "train_loss": [1.0 + i / 100 for i in range(n)],
                   "grad_norm": [1.0] * n, "val_loss": 1.0, "tokens_per_s": 1.0, "ledger_peak_bytes": [peak] * 8,
                   "ledger_peak_total_bytes": [4] * 8, "process_peak_bytes": [4] * 8, "bytes_sent": [0] * 8}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
        os.utime(tmp_path / name / "summary.json", (0, 86400 * 365 * (1 if name.endswith("short") else 2)))
    monkeypatch.setattr(sys, "argv", ["bench_3d_main_job.py", "--reuse", str(tmp_path), "--short-steps", "21",
                                      "--steps", "22"])
    load("bench_3d_main_job").main()
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"runs re-read from {tmp_path}, made 1971-01-01 00:00 UTC to 1972-01-01 00:00 UTC (their "
                      "summary.json files' times; summary.json records no commit): the line above is this machine "
                      "and checkout now, not the runs'"), out[:2]
    assert "| `--steps 21`: train loss at steps 0 / 10 / 20 | 1.0000 / 1.1000 / 1.2000 |" in "\n".join(out), out


@pytest.mark.timeout(120)
def test_setup_peak_prints_a_tiny_model_in_kib():
    """Before: every column of a tiny model's table read 0.0 (MiB)."""
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_setup_peak.py"), "--model", "tiny"],
                       capture_output=True, text=True, timeout=100, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("whole model: ") and lines[1].split()[3] == "KiB", r.stdout
    assert lines[2].endswith("(KiB)") and float(lines[3].split()[1]) > 1, r.stdout  # params peak, KiB
