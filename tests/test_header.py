"""The run header's lines, built in-process (the main job's header under mpiexec: tests/test_train.py -k header)."""
from types import SimpleNamespace as NS

from threadpoolctl import threadpool_info, threadpool_limits

from minizero import backend
from minizero.args import parse_args
from minizero.header import header_lines
from minizero.nn import get_config


def _device_line() -> str:
    topo = NS(dp=1, tp=1, pp=1, describe_nodes=lambda: "", placement_warnings=lambda: [])
    return header_lines(parse_args(["--model", "tiny"]), get_config("tiny"), NS(topo=topo, cp=1, opt=None), 1)[1]


def test_the_device_line_names_numpys_blas_its_kernel_and_threads_per_rank(monkeypatch):
    """A slow run's first clue (a newcomer's 2 BLAS threads fought other work: 20x slower than 1 thread). Before:
    ``device cpu (NumPy); messages over mpi``, the threads only in the report's last lines; CuPy's line stays."""
    blas = next(i for i in threadpool_info() if i["user_api"] == "blas")
    with threadpool_limits(limits=1):
        line = _device_line()
    if blas["internal_api"] == "openblas":
        assert line == (f"device cpu (NumPy, OpenBLAS {blas['version']} {blas['architecture']} kernel, 1 thread per "
                        "rank); messages over mpi"), line
    assert line.endswith(", 1 thread per rank); messages over mpi") and len(line) <= 100, line
    monkeypatch.setattr(backend, "blas_info", lambda: {"internal_api": "mkl", "version": "2024.0", "num_threads": 2})
    assert _device_line() == "device cpu (NumPy, MKL 2024.0, 2 threads per rank); messages over mpi"
    monkeypatch.setattr(backend, "blas_info", dict)  # threadpoolctl found no BLAS
    assert _device_line() == "device cpu (NumPy, BLAS unknown); messages over mpi"
    monkeypatch.setattr(backend, "name", "cupy")
    monkeypatch.setattr(backend, "device_description", "cuda:0 (CuPy, 1 device(s) visible)")
    assert _device_line() == "device cuda:0 (CuPy, 1 device(s) visible); messages over mpi"


def test_the_precision_line_says_what_the_backend_computes(monkeypatch):
    """README: FP16 is emulated in NumPy (float32 math, float16 stores). The header said "float16 compute" on every
    backend; only CuPy runs half GEMMs. BF16 rounds float32 arrays on every backend."""
    from minizero.header import precision_description
    fp16, bf16 = parse_args(["--precision", "fp16"]), parse_args(["--precision", "bf16"])
    assert precision_description(fp16) == ("fp16 mixed precision: float16 stores, float32 math on float16 values "
                                           "(emulated), float32 master weights, dynamic loss scale 65536")
    assert "emulated" in precision_description(bf16) and "float32 math" in precision_description(bf16)
    monkeypatch.setattr(backend, "name", "cupy")
    assert "cuBLAS half GEMMs with float32 accumulation" in precision_description(fp16)
    assert "emulated" not in precision_description(fp16) and "emulated" in precision_description(bf16)


def test_zero_notes_name_one_cause_each():
    """One data rank: the --zero note alone (its --dp-shard 1 is not a second cause); two data ranks with
    --dp-shard 1: the --dp-shard note alone. Built directly (the main job's: tests/test_reliability.py)."""
    from minizero.header import note_lines
    one = parse_args(["--model", "tiny", "--zero", "3"])
    assert note_lines(one, NS(dp=1, tp=1), None, 1) == [
        "note: --zero 3 over 1 data rank shards nothing (the shard is the whole model); running anyway"]
    two = parse_args(["--model", "tiny", "--zero", "3", "--dp", "2", "--dp-shard", "1"], world_size=2)
    assert note_lines(two, NS(dp=2, tp=1), None, 2) == [
        "note: --dp-shard 1 shards nothing: each ZeRO group is one rank, which holds all of ZeRO-3's states; "
        "running anyway"]


def test_the_documents_line_of_packed_text_says_windows_run_across_documents():
    from minizero.header import documents_description
    assert documents_description(parse_args(["--model", "tiny"]), 3) == (
        "the embedded corpus: 3 documents (ended by byte 0x03) packed (--pack): windows run across them")
    assert documents_description(parse_args(["--model", "tiny"]), 1) == (
        "the embedded corpus: one document (no 0x03 byte splits it)")
