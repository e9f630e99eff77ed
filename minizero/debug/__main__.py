"""``python -m minizero.debug hang OUT/flight``: the rank, operation and sequence number a job hung in;
``python -m minizero.debug trace OUT/trace.json``: per rank compute, exposed communication, bubble; the straggler;
``python -m minizero.debug parity "LAYOUT A" "LAYOUT B"``: the first step and parameter where two layouts differ."""
from __future__ import annotations

import sys

from minizero.debug import hang, parity, timeline
from minizero.nn.gpt import PRESETS, preset_sizes
from minizero.numerals import (DefaultsOnce, OneLineParser, description, error_lines, integer,
                               negative_values_reach_checks, real, unrecognized)
from minizero.interrupts import interruptible, refuse_several_ranks

WHAT = {"hang": " (flight records are the rank_R.json files minizero.train writes)",
        "trace": " (a timeline is the Chrome trace JSON that --trace writes)"}  # what each command reads
EXIT = {"hang": "0 nothing found, 1 a finding (a hang, a mismatch or a missing rank: the analysis worked), 2 bad input",
        "parity": "0 the layouts agree, 1 they differ, 2 a run failed or bad input", "trace": "0, or 2 for bad input"}
STOPPED = "130 for SIGINT/Ctrl-C, 143 for SIGTERM"  # interruptible's, any command


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m minizero.debug", description=description(__doc__),  # and its subcommands'
                      epilog=f"exit status: hang {EXIT['hang']}; parity {EXIT['parity']}; trace {EXIT['trace']}; "
                             f"any: {STOPPED}")
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hang", help="compare every rank's flight record (OUT/flight/rank_R.json)",
                       epilog=f"exit status: {EXIT['hang']}; {STOPPED}")
    h.add_argument("folder", help="the folder of rank_R.json files, e.g. out/flight")
    t = sub.add_parser("trace", help="per rank compute / exposed communication / overlap / bubble; the straggler",
                       epilog=f"exit status: {EXIT['trace']}; {STOPPED}")
    t.add_argument("path", help="the merged timeline --trace wrote, e.g. out/trace.json")
    q = negative_values_reach_checks(sub.add_parser(
        "parity", help="two layouts from one seed in float64: the first step and parameter that differ",
        formatter_class=DefaultsOnce, epilog=f"exit status: {EXIT['parity']}; {STOPPED}"))
    q.add_argument("layouts", nargs=2, metavar="LAYOUT", help='train flags of a layout, e.g. "--dp 2" or "-n 2 --tp 2"')
    q.add_argument("--model", default="tiny", choices=sorted(PRESETS),
                   help="both runs' " + preset_sizes() + " (default: %(default)s)")
    q.add_argument("--steps", type=integer, default=5, help="optimizer steps of both runs")
    q.add_argument("--batch-size", type=integer, default=8, help="global batch of both runs (the same data each step)")
    q.add_argument("--tol", type=real, default=1e-10, help="relative difference allowed (float64 rounding: ~1e-15)")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # none given: the error names them (it said "command")
    refuse_several_ranks(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["parity"]:  # a one-flag layout ("--sequence-parallel") read as parity's option: "LAYOUT required"
        argv[1:] = [w + " " if w.startswith("--") and " " not in w and w.split("=")[0] not in q._option_string_actions
                    else w for w in argv[1:]]
    args, extra = p.parse_known_args(argv)
    if extra:  # the words as typed, without the space added above ("--x  --y " before)
        raw = [*(args.layouts if args.command == "parity" else ()), *extra]
        words = [w.strip() for w in raw]
        quoted = [w for w in words if " " in w]  # two: the layouts; the loose words are the stray ones (--bogus 3)
        starts = [i for i, w in enumerate(words) if " " in w or raw[i] != w and not _valued(raw, i)]
        layouts = [words[i] for i in starts]
        if args.command == "parity" and len(layouts) > 2:  # it said "unrecognized arguments: --pp 2" (or
            # "--sequence-parallel"), as if --pp were no flag and a one-flag layout no layout
            alone = layouts != quoted  # a flag meant for a layout, typed outside its quotes
            each, fix = (", each one quoted word", 'quote a flag with its layout ("--tp 2 --sequence-parallel"), or '
                         ) if alone else ("", "")
            q.error(f"compares two layouts{each}, got {len(layouts)}: {', '.join(map(repr, layouts))}; {fix}run it "
                    "once per pair")
        first = starts[0] if starts else 0  # the first layout (none: the first word)
        loose = [i for i in range(first, len(words)) if i not in starts]  # words outside the layouts' quotes
        if args.command == "parity" and any(words[i].startswith("--") for i in loose if i > first):  # it said
            # "unrecognized arguments: 2" for "--dp 2" --tp 2, and "--pp 2" for "--dp 2" "--tp 2" --pp 2
            own = ", ".join(o for o in q._option_string_actions if o.startswith("--") and o != "--help")
            q.error(f"parity takes each layout as one quoted word, got {' '.join(words[i] for i in loose)!r} outside "
                    f"the quotes; give parity {_quoted(words)} (its own options, {own}, go outside them)")
        p.error(unrecognized(p, [w for w in words if " " not in w] if len(quoted) == 2 else words[-len(extra):], args))
    try:
        if args.command == "parity":
            if args.steps < 1 or args.batch_size < 1 or not 0 < args.tol < float("inf"):  # inf: every pair agrees
                q.error(f"--steps and --batch-size must be >= 1 and --tol a finite number > 0, got {args.steps}, "
                        f"{args.batch_size} and {args.tol}")
            common = ["--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
            return parity.main(*(w.strip() for w in args.layouts), common, args.tol)
        if args.command == "hang":
            return hang.main(args.folder)
        return timeline.main(args.path)
    except BrokenPipeError:  # stdout closed by its reader: interruptible ends quietly
        raise
    except OSError as e:  # no such file or folder (named: '' too), a folder given for a file, unreadable
        said = f"{e.filename!r}: {e.strerror}{WHAT.get(args.command, '')}" if e.filename is not None else e
        print(error_lines("python -m minizero.debug", str(said)), file=sys.stderr)
        return 2
    except ValueError as e:  # the loaders name a file of another kind and what it lacks
        print(error_lines("python -m minizero.debug", f"{e}{WHAT.get(args.command, '')}"), file=sys.stderr)
        return 2


def _quoted(words: list[str]) -> str:  # the layouts meant, each one quoted word: a loose flag starts the second
    groups = []
    for w in words:
        if " " in w or not groups or w.startswith("--") and len(groups) < 2:
            groups.append(w)
        else:
            groups[-1] += " " + w
    return " ".join(f'"{g}"' for g in groups)


def _valued(raw: list[str], i: int) -> bool:  # a one-flag word raw[i] followed by a value: "--bogus 3", no layout
    return i + 1 < len(raw) and not raw[i + 1].startswith("-")


if __name__ == "__main__":
    sys.exit(interruptible("minizero.debug", "nothing was written (parity: its runs are ended, their folder removed)",
                           main))
