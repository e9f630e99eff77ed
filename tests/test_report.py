"""The main job's final report: what its validation line measures and when it says why validation sits below
training (minizero/report.py's :func:`validation_lines`, no training run needed)."""
from minizero.config import TrainConfig
from minizero.loop import TrainResult
from minizero.report import validation_lines


def _lines(losses, val, start_step=0, data=None, warmup=10):
    args = TrainConfig(model="tiny", steps=start_step + len(losses), warmup=warmup, data=data)
    result = TrainResult(train_losses=losses, val_history=[(start_step, 5.5), (args.steps, val)], elapsed_s=0.4,
                         tokens_per_s=827.0, start_step=start_step)
    return validation_lines(args, result)


def test_a_resumed_run_says_its_time_and_speed_are_its_own_steps():
    """Resumed at step 10 of 20: 'after 20 steps, 0.4 s' read as 20 steps in 0.4 s."""
    fresh = _lines([5.0] * 20, 5.2)[0]
    assert fresh.endswith("after 20 steps, 0.4 s, 827 tokens/s"), fresh
    resumed = _lines([5.0] * 10, 5.2, start_step=10)[0]
    assert resumed.endswith("after 20 steps (10 in this run, 0.4 s, 827 tokens/s)"), resumed
