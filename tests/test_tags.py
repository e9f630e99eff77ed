"""Every kind of message minizero sends has a tag of its own: a blocking collective that runs while an overlapped one
is in flight on the same communicator must never receive the other's message (MPI matches by source and tag)."""
import importlib
import pkgutil

import minizero


def _tags() -> dict:
    """{module.NAME: value} of every module-level int named ``*_TAG`` in the package (CuPy-only modules aside)."""
    found = {}
    for info in pkgutil.walk_packages(minizero.__path__, "minizero."):
        if info.name.endswith(("__main__", ".nccl")):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.endswith("_TAG") and name != "MAX_TAG" and isinstance(value, int) and getattr(module, "__name__", "") == info.name:
                if f"{info.name}.{name}" not in found:
                    found[f"{info.name}.{name}"] = value
    return found


def test_every_message_kind_has_its_own_tag():
    tags = _tags()
    assert len(tags) >= 15, tags  # the walk found the collectives, overlap, pipeline, tracing, checkpoint tags
    by_value = {}
    for where, value in tags.items():
        by_value.setdefault(value, []).append(where)
    shared = {v: names for v, names in by_value.items() if len(names) > 1}
    assert shared == {}, f"tags used by more than one kind of message: {shared}"
