"""ZeRO is one package (minizero/zero/): no other module branches on a ZeRO stage number."""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ZERO = REPO / "minizero" / "zero"


def stage_comparisons(source: str) -> list[str]:
    """Comparisons (``==``, ``in``, ``>=``, ``<`` ...) of an ``X.stage`` attribute, X not the pipeline's ``stage``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Attribute) and side.attr == "stage" and \
                        not (isinstance(side.value, ast.Name) and side.value.id == "stage"):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_zero_stage_comparison_outside_the_zero_package():
    outside = [f"{p.relative_to(REPO)}:{f}" for p in sorted((REPO / "minizero").rglob("*.py"))
               if ZERO not in p.parents for f in stage_comparisons(p.read_text())]
    assert not outside, "ask the ZeRO optimizer through its methods instead:\n" + "\n".join(outside)


def test_the_scan_finds_a_stage_branch_and_spares_the_pipeline_stage():
    assert stage_comparisons("def f(zero):\n    return 1 if zero.stage >= 2 else 0\n") == \
        ["2: zero.stage >= 2"]
    assert stage_comparisons("def f(self):\n    return self.stage in (1, 2)\n") == ["2: self.stage in (1, 2)"]
    assert stage_comparisons("def f(stage, comm):\n    return comm.rank != stage.stage\n") == []
