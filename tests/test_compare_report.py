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


def test_the_caption_says_the_prediction_charges_data_parallel_traffic_in_full_as_no_overlap_runs_it():
    """Before: "partly hidden behind compute", yet the runs are --no-overlap; predict_step_s is now blocking too."""
    from minizero.compare_report import markdown

    said = " ".join(markdown([], "### title", {}).split())
    assert "data-parallel traffic in full, none hidden behind compute, as `--no-overlap` runs it" in said


def _run(strategy, ranks, ok=True):
    """A record of compare's shape (bytes, seconds), with 15-column-wide cells in compare.md."""
    from minizero.compare_report import MIB, SHOWN

    if not ok:
        return dict(strategy=strategy, ranks=ranks, ok=False, error="exit status 1: [rank 1] minizero.train failed: "
                    "RuntimeError: injected fault, " + "and a cause long enough to need more than one line " * 2)
    peaks = {c: 123_456_789 + i * MIB for i, c in enumerate(SHOWN)}
    return dict(strategy=strategy, ranks=ranks, ok=True, estimate=dict(peaks, total=987_654_321, nvme_optimizer=0),
                measured=dict(per_rank=[peaks], process_peak_bytes=[1_234_567_890], optimizer_disk_bytes=[0],
                              tokens_per_s=123_456.7),
                deviation=dict.fromkeys(SHOWN, 0.0), step_s=12.345678, predicted_step_s=0.000217)


def test_the_terminal_shows_the_essential_columns_in_120_and_compare_md_keeps_every_column():
    """Before: compare printed compare.md's table whole, rows of 173-191 columns that a terminal wraps mid-row (a
    Markdown row cut in two is no row): the terminal now gets a fixed-width table of the essentials."""
    from minizero.compare_report import COLUMNS, markdown, terminal

    runs = [_run("baseline", 1), _run("offload-nvme", 1), _run("zero3", 8), _run("combined", 8, ok=False)]
    shown = terminal(runs).splitlines()
    md = markdown(runs, "### title", dict.fromkeys(("baseline", "offload-nvme", "zero3", "combined"), "adds"))
    assert max(map(len, shown)) <= 120 and not [line for line in shown if line.startswith("|")]
    assert max(len(line) for line in md.splitlines() if line.startswith("| 1 |")) > 120  # the file: every column
    header = next(line for line in md.splitlines() if line.startswith("| ranks |"))
    assert header.count("|") == 16 and "| optimizer state | activations |" in header
    assert shown[0].split() == ("ranks strategy device MiB estimate worst process MiB tokens/s step s predicted "
                                "ratio").split()
    assert [line.split()[:2] for line in shown[1:6]] == [["1", "baseline"], ["1", "offload-nvme"], [], ["8", "zero3"],
                                                         ["8", "combined"]]  # a blank line between world sizes
    row = shown[1]
    assert row.split()[2:] == ["845.16", "941.90", "0.0%", "1,177.38", "123,457", "12.3", "0.000217", "56892.5x"]
    ends = [sum(w + 2 for _, w in COLUMNS[:i + 1]) - 2 for i in range(len(COLUMNS))]
    assert all(line[e - 1] != " " for line in shown[:3] for e in ends[2:])  # numbers under their header, right
    from minizero.numerals import significant_column
    # 0.140 beside 0.109, not 0.14
    assert [significant_column(x, 6) for x in (0.14, 100, 9.05e-05)] == [" 0.140", "   100", "9.05e-05"]
    assert "failed: exit status 1" in shown[5] and shown[6].startswith("      ")  # the cause wrapped, indented
    assert {h.split()[0] for h, _ in COLUMNS} - {"ranks", "strategy", "predicted"} <= {
        line.split()[0] for line in shown if line.startswith("  ")}  # the key names every column


def test_the_comm_column_names_every_category_it_sums():
    """Before: headed 'comm + gathered' while its cells summed comm_buffers, comm_scratch and gathered."""
    import re

    from minizero.compare_report import markdown

    header = next(line for line in markdown([], "### title", {}).splitlines() if line.startswith("| ranks |"))
    source = (__import__("pathlib").Path(__file__).parent.parent / "minizero" / "compare_report.py").read_text()
    summed = re.search(r"cell\(('comm_buffers'[^)]*)\)", source).group(1)
    assert summed == "'comm_buffers', 'comm_scratch', 'gathered'" and "| comm + scratch + gathered |" in header


def test_a_run_s_progress_is_one_short_line_and_a_failure_keeps_its_whole_cause():
    """Before: two lines per run (~105 columns each) that repeated the final table's numbers."""
    from minizero.compare_report import progress

    def ok(strategy, ranks, wall_s):
        return dict(strategy=strategy, ranks=ranks, ok=True, wall_s=wall_s)

    assert progress(3, 18, ok("zero3", 2, 12.34)) == "[ 3/18] zero3 on 2 ranks: ok, 12.3 s"  # [k/of] aligned
    assert progress(1, 2, ok("baseline", 1, 8.9)) == "[1/2] baseline on 1 rank: ok, 8.90 s"  # 3 digits, as step s
    assert progress(3, 18, dict(strategy="zero3", ranks=2)) == "[ 3/18] zero3 on 2 ranks: starting"  # as it starts
    cause = ("exit status 1: [rank 1] minizero.train failed: RuntimeError: injected fault; "
             + " ".join(["more words"] * 12))
    shown = progress(2, 2, dict(strategy="baseline", ranks=2, ok=False, error=cause)).splitlines()
    assert max(map(len, shown)) <= 120
    assert " ".join(" ".join(shown).split()) == f"[2/2] baseline on 2 ranks: failed: {cause}"  # whole


def test_a_worst_gap_of_1000_percent_or_more_is_a_whole_number_not_an_exponent():
    """Before: 1e+03% in the worst column (one decimal did not fit 5 columns)."""
    from minizero.compare_report import terminal

    runs = [_run("baseline", 1), _run("zero3", 1)]
    runs[0]["deviation"] = dict(runs[0]["deviation"], activations=12.345)
    runs[1]["deviation"] = dict(runs[1]["deviation"], activations=0.1234)
    rows = terminal(runs).splitlines()[1:3]
    assert [r.split()[4] for r in rows] == ["1,234%", "12.3%"], rows


def test_the_key_says_why_worst_reads_0_percent_and_that_tokens_per_s_moves_with_load():
    """Before: every row read 'worst 0.0%' and offload-nvme out-ran the baseline (2,869 vs 1,727 tok/s) with nothing
    saying that 0.0% is the minizero accounting matching the ledger, nor that load, not the order, moved tokens/s."""
    from minizero.compare_report import KEY

    key = " ".join(" ".join(KEY).split())
    assert "0.0% when the estimator, counting as minizero allocates, predicts every ledger category exactly" in key
    assert "order does not favour a row" in key and "rerun before ranking rows" in key
    assert all(len(line) <= 120 for line in KEY)
