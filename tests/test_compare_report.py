"""minizero/compare_report.py: the table's cells."""


def test_step_cells_keep_three_significant_digits_of_a_tiny_prediction():
    """The tiny model's predicted step is well under a millisecond: it must not print as 0.000."""
    from minizero.compare_report import _step

    assert _step({"step_s": 0.0123, "predicted_step_s": 0.000217}) == ("0.0123 / 0.000217", "56.7x")
    assert _step({"step_s": 1.5}) == ("1.5 / -", "-")
    assert _step({}) == ("-", "-")


def test_device_totals_by_world_size_pivot_rank_0_s_measured_bytes():
    from minizero.compare_report import MIB, totals_by_world_size
    from minizero.memory.estimator import DEVICE_CATEGORIES

    def run(strategy, ranks, mib, ok=True):
        per_rank = dict.fromkeys(DEVICE_CATEGORIES, 0)
        per_rank["parameters"] = mib * MIB
        return dict(strategy=strategy, ranks=ranks, ok=ok, measured=dict(per_rank=[per_rank]))

    assert totals_by_world_size([run("baseline", 2, 1.0)]) == []  # one world size: the main table says it all
    lines = totals_by_world_size([run("baseline", 1, 1.0), run("zero3", 1, 2.5), run("baseline", 2, 1.0),
                                  run("zero3", 2, 1.25, ok=False)])
    assert lines[3:] == ["| strategy | 1 rank | 2 ranks |", "|---|---:|---:|", "| baseline | 1.00 | 1.00 |",
                         "| zero3 | 2.50 | failed |"]


def test_the_table_says_in_one_short_line_that_its_device_total_is_no_simultaneous_peak():
    """Before: a process peak below the device total was explained only inside a caption of ~1,000 characters."""
    from minizero.compare_report import markdown

    lines = markdown([], "### title", {}).splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("| ranks |"))
    near = lines[top - 2]  # one blank line between it and the table
    assert "not one simultaneous peak" in near and "process peak" in near and len(near) <= 100, near


def test_the_caption_says_the_planner_hides_data_parallel_traffic_behind_compute_not_only_backward():
    """Before: "hidden behind backward"; the planner's step_time hides ZeRO-3's behind forward as well (lesson 08)."""
    from minizero.compare_report import markdown

    assert "data-parallel traffic partly hidden behind compute" in " ".join(markdown([], "### title", {}).split())


def test_the_terminal_shows_the_paragraphs_in_lines_of_at_most_120_columns_and_the_tables_whole():
    """Before: compare printed compare.md as is, its caption one line of ~960 columns."""
    from minizero.compare_report import markdown, on_terminal

    text = markdown([], "### title", {})
    shown = on_terminal(text).splitlines()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows and [line for line in shown if line.startswith("|")] == rows  # a table row cut in two is no row
    assert max(len(line) for line in shown if not line.startswith("|")) <= 120
    assert " ".join(on_terminal(text).split()) == " ".join(text.split())  # the same words


def test_the_comm_column_names_every_category_it_sums():
    """Before: headed 'comm + gathered' while its cells summed comm_buffers, comm_scratch and gathered."""
    import re

    from minizero.compare_report import markdown

    header = next(line for line in markdown([], "### title", {}).splitlines() if line.startswith("| ranks |"))
    source = (__import__("pathlib").Path(__file__).parent.parent / "minizero" / "compare_report.py").read_text()
    summed = re.search(r"cell\(('comm_buffers'[^)]*)\)", source).group(1)
    assert summed == "'comm_buffers', 'comm_scratch', 'gathered'" and "| comm + scratch + gathered |" in header
