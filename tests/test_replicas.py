"""``--check-replicas``: a replica that drifted is caught, named (parameter, ranks, step); agreeing replicas pass."""
import numpy as np
import pytest

from minizero.comm import run_in_threads
from minizero.debug.replicas import ReplicaCheck, ReplicaMismatchError, check_replicas, digest


def test_digest_sees_one_ulp_shape_and_dtype():
    a = np.linspace(0, 1, 10)
    b = a.copy()
    b[3] = np.nextafter(b[3], 2)
    assert digest(a) == digest(a.copy()) and digest(a) != digest(b)
    assert digest(a) != digest(a.reshape(2, 5))
    assert digest(np.zeros(4)) != digest(np.zeros(4, dtype=np.float32))


def test_check_replicas_names_the_parameter_the_ranks_and_the_step():
    def fn(comm):
        w = np.arange(6.0).reshape(2, 3)
        b = np.ones(3)
        if comm.rank == 2:
            b[1] += 1e-12
        return check_replicas(comm, [("h.0.w", w), ("h.0.b", b)], step=7, members=[0, 4, 8])

    with pytest.raises(ReplicaMismatchError) as e:
        run_in_threads(3, fn, timeout=10)
    msg = str(e.value)
    assert "after step 7: parameter 'h.0.b' (3,) differs across the data-parallel replicas [0, 4, 8]" in msg, msg
    assert "rank(s) [0, 4] hold digest" in msg and "but rank(s) [8] hold digest" in msg, msg


def test_equal_replicas_pass():
    assert run_in_threads(2, lambda comm: check_replicas(comm, [("w", np.ones(4))], 0)) == [1, 1]


def test_every_must_be_a_positive_int_and_the_flag_is_checked_by_name():
    from minizero.args import UsageError, parse_args
    with pytest.raises(ValueError, match="every=0"):
        ReplicaCheck(0)
    for flag in ("--check-replicas", "--flight-records"):
        with pytest.raises(UsageError, match=f"{flag} must be >= 0, got -1"):
            parse_args([flag, "-1"])


def _train(comm, extra):
    from minizero.train import parse_args, train
    args = parse_args(["--model", "tiny", "--steps", "4", "--eval-every", "0", "--eval-batches", "1",
                       "--no-progress", *extra], comm.world_size)
    return train(args, comm, log=lambda s: None)["train_losses"]


@pytest.mark.timeout(300)
def test_a_drifted_replica_is_caught_at_the_step_it_drifted(monkeypatch):
    monkeypatch.setenv("MINIZERO_FAULT", "1:2:diverge")  # rank 1's first parameter moves after 0-based step 2
    with pytest.raises(ReplicaMismatchError) as e:
        run_in_threads(2, _train, ["--check-replicas", "1"], timeout=240)
    msg = str(e.value)
    assert "after step 3: parameter 'transformer.wte.weight'" in msg and "rank(s) [1] hold" in msg, msg


@pytest.mark.timeout(300)
def test_replicas_agree_in_ordinary_training_with_zero_1_and_tensor_parallelism():
    run_in_threads(4, _train, ["--check-replicas", "2", "--zero", "1", "--tp", "2"], timeout=240)
    run_in_threads(2, _train, ["--check-replicas", "1"], timeout=240)


@pytest.mark.timeout(300)
def test_by_default_the_replicas_are_checked_after_the_last_step_and_0_turns_it_off(monkeypatch):
    """No flag: the check runs once, after the last step (the log's step 4 of 4), and finds the drift of step 3
    (MINIZERO_FAULT's 0-based step 2)."""
    monkeypatch.setenv("MINIZERO_FAULT", "1:2:diverge")
    with pytest.raises(ReplicaMismatchError, match=r"after step 4: parameter 'transformer.wte.weight'"):
        run_in_threads(2, _train, [], timeout=240)
    losses = run_in_threads(2, _train, ["--check-replicas", "0"], timeout=240)  # off: the drift trains on
    assert len(losses[0]) == 4


@pytest.mark.timeout(300)
def test_by_default_each_checkpoint_is_checked_before_it_is_saved(monkeypatch, tmp_path):
    """--save-every 2: the check after step 2 (the first save's step) finds step 1's drift (0-based step 0 of
    MINIZERO_FAULT); nothing is saved."""
    monkeypatch.setenv("MINIZERO_FAULT", "1:0:diverge")
    with pytest.raises(ReplicaMismatchError, match=r"after step 2: "):
        run_in_threads(2, _train, ["--save-every", "2", "--save-dir", str(tmp_path / "ckpt")], timeout=240)
    assert not any((tmp_path / "ckpt").glob("**/*.json"))


def test_the_default_skips_layouts_whose_data_ranks_hold_different_parameters():
    from minizero.train import parse_args
    assert parse_args([]).check_replicas is None
    with pytest.raises(ValueError, match="--ep 2 with --check-replicas"):
        parse_args(["--moe-experts", "4", "--ep", "2", "--check-replicas", "3"], 8)
