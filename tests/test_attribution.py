"""minizero/memory/attribution.py: the activation hotspots line."""


def test_hotspots_count_the_modules_left_out_that_tie_with_the_last_one_shown():
    """A list cut in the middle of a tie must not make the layers shown look special."""
    from minizero.memory.attribution import format_top_modules

    peaks = {f"h.{i}.mlp": 512 * 1024 for i in range(4)} | {"": 2048, "h.0.attn": 100}
    text = format_top_modules([peaks, peaks], n=3)
    assert text.splitlines()[1] == ("  every rank: h.0.mlp 512.00 KiB, h.1.mlp 512.00 KiB, h.2.mlp 512.00 KiB, "
                                    "and 1 more at 512.00 KiB")
    assert "more" not in format_top_modules([peaks], n=4)
