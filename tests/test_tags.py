"""Every kind of message minizero sends has a tag of its own: a blocking collective that runs while an overlapped one
is in flight on the same communicator must never receive the other's message (MPI matches by source and tag)."""
import ast
import pathlib

import minizero

PACKAGE = pathlib.Path(minizero.__file__).parent


def _tags() -> dict:
    """{file: NAME: value} of every module-level ``*_TAG`` assigned an int literal (or a tuple of them) in the package,
    read from the source (an import of another module's tag is not a second tag)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign):
                continue
            targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for target, value in zip(targets, values):
                name = getattr(target, "id", "")
                if name.endswith("_TAG") and name != "MAX_TAG" and isinstance(value, ast.Constant):
                    found[f"{path.relative_to(PACKAGE)}: {name}"] = value.value
    return found


def test_every_message_kind_has_its_own_tag():
    tags = _tags()
    assert len(tags) >= 15, tags  # the collectives, overlap, pipeline, tracing, checkpoint, flight tags
    by_value = {}
    for where, value in tags.items():
        by_value.setdefault(value, []).append(where)
    shared = {v: names for v, names in by_value.items() if len(names) > 1}
    assert shared == {}, f"tags used by more than one kind of message: {shared}"
