"""minizero/compare_report.py: the table's cells."""


def test_step_cells_keep_three_significant_digits_of_a_tiny_prediction():
    """The tiny model's predicted step is well under a millisecond: it must not print as 0.000."""
    from minizero.compare_report import _step

    assert _step({"step_s": 0.0123, "predicted_step_s": 0.000217}) == ("0.0123 / 0.000217", "56.7x")
    assert _step({"step_s": 1.5}) == ("1.5 / -", "-")
    assert _step({}) == ("-", "-")
