"""``python -m minizero.debug hang OUT/flight``: the rank, operation and sequence number a job hung in;
``python -m minizero.debug trace OUT/trace.json``: per rank compute, exposed communication, bubble; the straggler."""
from __future__ import annotations

import argparse
import sys

from minizero.debug import hang, timeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minizero.debug", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hang", help="compare every rank's flight record (OUT/flight/rank_R.json)")
    h.add_argument("folder", help="the folder of rank_R.json files, e.g. out/flight")
    t = sub.add_parser("trace", help="per rank compute / exposed communication / overlap / bubble; the straggler")
    t.add_argument("path", help="the merged timeline --trace wrote, e.g. out/trace.json")
    args = p.parse_args(argv)
    try:
        return hang.main(args.folder) if args.command == "hang" else timeline.main(args.path)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"python -m minizero.debug: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
