"""minizero/memory/attribution.py: the activation hotspots line."""


def test_hotspots_count_the_modules_left_out_that_tie_with_the_last_one_shown():
    """A list cut in the middle of a tie must not make the layers shown look special."""
    from minizero.memory.attribution import format_top_modules

    peaks = {f"h.{i}.mlp": 512 * 1024 for i in range(4)} | {"": 2048, "h.0.attn": 100}
    text = format_top_modules([peaks, peaks], n=3)
    assert text.splitlines()[1] == "  every rank: 4 modules at 512.00 KiB each: h.{0-3}.mlp"
    assert format_top_modules([peaks], n=4).splitlines()[1] == "  r0: 4 modules at 512.00 KiB each: h.{0-3}.mlp"


def test_hotspots_say_a_tie_once_and_fold_block_indices():
    """Before: "h.0.mlp 512.00 KiB, h.1.mlp 512.00 KiB, ... and 6 more at 512.00 KiB" (one size said 7 times)."""
    from minizero.memory.attribution import format_top_modules

    peaks = {f"h.{i}.{m}": 512 * 1024 for i in range(4) for m in ("attn:scores", "mlp")} | {"lm_head": 600 * 1024,
                                                                                          "h.0.attn": 100, "h.2.x": 1}
    text = format_top_modules([peaks], n=3)
    assert text.splitlines()[1] == ("  r0: lm_head 600.00 KiB; 8 modules at 512.00 KiB each: h.{0-3}.attn:scores, "
                                    "h.{0-3}.mlp")
    assert all(len(line) <= 100 for line in text.splitlines())


def test_hotspots_name_rank_groups_as_the_memory_table_does():
    """Before: "r0, r1, r2, r3: ..." under a memory table whose columns read r0-3 and r4-7."""
    from minizero.memory.attribution import format_top_modules

    first, last = {"h.0.mlp": 512 * 1024}, {"h.2.mlp": 256 * 1024}
    lines = format_top_modules([first] * 4 + [last] * 4, n=3).splitlines()
    assert lines[1].startswith("  r0-3: h.0.mlp") and lines[2].startswith("  r4-7: h.2.mlp")


def test_hotspots_say_none_when_no_module_kept_activations():
    """Before: "  every rank:" and nothing after it (--offload-activations cpu: the saved arrays are offloaded)."""
    from minizero.memory.attribution import format_top_modules

    assert format_top_modules([{"h.0.mlp": 0}, {}]).splitlines()[1] == (
        "  every rank: none (no saved array stayed in the activations category)")


def test_hotspots_of_many_differing_ranks_show_the_largest_and_the_smallest():
    """Before: 8 MoE ranks, 8 blocks of lines (routing makes every rank's bytes differ)."""
    from minizero.memory.attribution import format_top_modules

    per_rank = [{"h.0.mlp": 1000 + 100 * r, "h.1.mlp": 900} for r in range(8)]
    per_rank[3]["h.1.mlp"] = 5000  # the most in all
    per_rank[5]["h.1.mlp"] = 1  # the least
    lines = format_top_modules(per_rank, n=2).splitlines()
    assert lines[1].startswith("  (8 ranks, 8 kinds: shown r3, which saved the most bytes, and r5, the least")
    shown = [line for line in lines if line.startswith("  r")]
    assert [line.split(":")[0] for line in shown] == ["  r3", "  r5"]
    assert all(len(line) <= 100 for line in lines)


def test_the_root_modules_own_arrays_are_not_called_the_loss():
    """A pipeline stage's loss is its child ``loss`` now; the root's own forward (a plain GPT computes its loss
    inline) keeps a neutral label, and the stage's loss is named as a module."""
    from minizero.memory.attribution import format_top_modules

    text = format_top_modules([{"": 2048, "loss": 1024}], n=2)
    assert text.splitlines()[1] == "  r0: (top level: the root module's own forward) 2.00 KiB, loss 1.00 KiB"


def test_block_1_holds_its_own_modules_not_block_10_s():
    """A prefix match "transformer.h.1" would take "transformer.h.10" (and its scores) into block 1."""
    from minizero.memory.attribution import compare_layer, layer_bytes

    measured = {"h.1": 1, "h.1.mlp": 10, "h.1:scores": 100, "h.10.mlp": 1000, "h.10:scores": 10000, "h.11": 7}
    assert layer_bytes(measured, "h.1") == 111
    assert compare_layer(measured, "h.1", {"mlp": [("GeLU input", 10)]}) == [
        ("h.1.mlp", "GeLU input", 10, 10), ("h.1", "(no formula row)", 0, 1),
        ("h.1:scores", "(no formula row)", 0, 100)]
