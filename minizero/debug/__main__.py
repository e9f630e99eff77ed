"""``python -m minizero.debug hang OUT/flight``: name the rank, operation and sequence number a job hung in."""
from __future__ import annotations

import argparse
import sys

from minizero.debug import hang


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minizero.debug", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hang", help="compare every rank's flight record (OUT/flight/rank_R.json)")
    h.add_argument("folder", help="the folder of rank_R.json files, e.g. out/flight")
    args = p.parse_args(argv)
    try:
        return hang.main(args.folder)
    except FileNotFoundError as e:
        print(f"python -m minizero.debug: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
