"""Numbers a user types (flags, layout words, environment variables): ASCII digits only.

Python's ``int`` and ``float`` read every Unicode decimal digit (``int("٣") == 3``, fullwidth ``"８"`` is 8), and
``str.isdigit`` is true for superscripts that ``int`` refuses (``"²"``). The programs read numbers through
:func:`integer` and :func:`real` (argparse ``type=``) and test words with :func:`is_count`, so such text is
refused, named, before any work. Tables print numbers in a fixed width through :func:`in_width`, prose in
:func:`significant` digits.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys


class NotANumber(argparse.ArgumentTypeError, ValueError):
    """Text that is not a number in ASCII. A ValueError; as an argparse ``type=`` error its message is the flag's."""


_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")  #: what int() reads, less '٣' and '1_000'


def integer(text) -> int:
    """``int(text)`` of ASCII text (an optional sign, digits 0-9; no '_' separators). Raises :class:`NotANumber`
    naming the text."""
    if _INTEGER.fullmatch(str(text)):
        return int(text)
    raise NotANumber(f"invalid int value: {text!r}; allowed: an integer in ASCII digits 0-9, e.g. 8")


def real(text) -> float:
    """``float(text)`` of ASCII text (``0.5``, ``3e-4``, ``inf``). Raises :class:`NotANumber` naming the text."""
    try:
        if str(text).isascii() and "_" not in str(text):
            return float(text)
    except ValueError:
        pass
    raise NotANumber(f"invalid float value: {text!r}; allowed: a number in ASCII digits, e.g. 0.5 or 3e-4")


class Typed(float):
    """A float that keeps the text it was read from (``.text``), so a check can echo what the user typed."""

    text: str


def real_as_typed(text) -> Typed:
    """:func:`real`, remembering ``text``: ``real_as_typed("-2").text == "-2"``."""
    value = Typed(real(text))
    value.text = str(text)
    return value


def is_count(text: str) -> bool:
    """Whether ``text`` is digits 0-9 only (``"12"``; not ``""``, ``"+1"``, ``"٣"`` nor ``"²"``)."""
    return text.isascii() and text.isdigit()


#: a word that starts with '-' then a digit (or '.' and a digit), or is "-inf"/"-nan" (any case), is a value, not an
#: option: "-1,5", "-1e-3", "-2x", "-inf"
VALUE_LIKE = re.compile(r"(?:-\.?[0-9].*|-(?i:inf|infinity|nan))\Z")  # whole word (match() as fullmatch())


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` once: not where the help already says the default, nor for None, False (a switch)."""

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def description(doc: str) -> str:
    """The first paragraph of a program's module docstring as its --help shows it: without reST's double
    backquotes (``python -m x`` reads as python -m x in a terminal)."""
    return doc.split("\n\n")[0].replace("``", "")


def _flags(parser: argparse.ArgumentParser, namespace=None) -> list[str]:
    """Every option string of ``parser`` and of its subcommands' parsers: only the chosen subcommand's where
    ``namespace`` names one (checkpoint's 'inspect --ot' was offered consolidate's --out, which inspect refuses)."""
    found = list(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(namespace, action.dest, None) if action.dest != argparse.SUPPRESS else None
            subs = [action.choices[chosen]] if chosen in action.choices else action.choices.values()
            found += [f for sub in subs for f in _flags(sub, namespace)]
    return list(dict.fromkeys(found))


def unrecognized(parser: argparse.ArgumentParser, words: list[str], namespace=None) -> str:
    """argparse's ``unrecognized arguments: ...``, with the closest flag for each word that looks like one:
    ``--zer 3`` adds ``(did you mean --zero?)``. Close: difflib's ratio >= 0.7 without the leading dashes, case
    and '_' vs '-' ignored; ``parser.synonyms`` (a dict, if set) maps other programs' names (--learning-rate) to
    a flag, or to a note (a value not starting with '-': what minizero has instead), said after '; '.
    ``namespace`` (what was parsed): a subcommand's flags only when it is the one chosen."""
    flags, synonyms, hints, notes = _flags(parser, namespace), getattr(parser, "synonyms", {}), [], []
    bare = {f.lstrip("-"): f for f in flags}
    typos = [t for t in (w.split("=")[0] for w in words) if t.startswith("-") and not VALUE_LIKE.match(t)]
    for typed in typos:
        norm = typed.lower().replace("_", "-")
        if not synonyms.get(norm, "-").startswith("-"):  # with several flags, each note names its own
            notes.append(f"{typed}: {synonyms[norm]}" if len(typos) > 1 else synonyms[norm])
            continue
        close = [bare[m] for m in difflib.get_close_matches(norm.lstrip("-"), bare, n=1, cutoff=0.7)]
        close = [synonyms[norm]] if norm in synonyms else [m for m in close if m != typed]
        hints += [(typed, close[0])] if close else []
    said = f"unrecognized arguments: {' '.join(words)}"
    if len(hints) == 1 and len(typos) == 1:
        said = f"{said} (did you mean {hints[0][1]}?)"
    elif hints:
        said = f"{said} (did you mean {', '.join(f'{m} for {w}' for w, m in hints)}?)"
    return "; ".join([said, *dict.fromkeys(notes)])


SHAPE = re.compile(r"\(\d+,\)|\(\d+(?:, \d+)+\)")  #: a tuple of ints as Python prints it, a shape: "(256, 16)", "(16,)"
SHAPE_WHOLE = 30  #: the longest shape :func:`wrapped` keeps on one line (a longer tuple is cut as other text)
ERROR_WIDTH = 120  #: columns of a line a program prints before the rest goes on an indented line of its own


def wrapped(text: str, width: int = ERROR_WIDTH) -> str:
    """Each line of ``text`` cut into lines of <= ``width`` columns, each further line indented 2 more than its own:
    after the last '; ' that fits, else ': ', else the last ', ' or before the last ' (' (a list is cut between items,
    and its last item stays with it, not with a parenthesis after it; "item (note)" stays whole where a ', ' past half
    the line can be cut instead), else ' ' (never in the first half); where none does, before the word that runs past
    ``width``, which then takes a line of its own however long; a shape (:data:`SHAPE`) of <= :data:`SHAPE_WHOLE`
    characters is never cut. The lines joined with one space are the line (``" ".join(printed.split())``)."""
    out = []  # a shape's spaces stand in as a character the text lacks (a private-use one) while it is cut
    keep = next((c for c in map(chr, range(0xE000, 0xF900)) if c not in text), " ")
    for line in SHAPE.sub(lambda m: m[0].replace(" ", keep) if len(m[0]) <= SHAPE_WHOLE else m[0],
                          text).splitlines() or [""]:
        indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
        k = len(indent)
        while len(line) > width:
            semi, colon, comma, paren, space = (line.rfind(sep, 0, width + 1) + len(sep) - 1
                                                for sep in ("; ", ": ", ", ", " (", " "))
            if paren > comma > max(width // 2, k) and _an_items_note(line, paren):  # "a (x), b (y), c (z)": after
                paren = -1  # "b (y),", not in "c (z)" (with no ', ' past half: before the ' (', never inside it)
            cuts = [semi, colon, max(comma, paren), space]
            cut = next((c for c in cuts if c > max(width // 2, k)), None)  # past the indent: each cut shortens
            if cut is None:  # a word runs past the width: cut before it, or after it where it starts the line
                cut = line.rfind(" ", k + 1, width + 1)
                cut = cut if cut > k else line.find(" ", max(width, k + 1))
            if cut <= k:  # the rest is one word
                break
            out.append(line[:cut].rstrip())
            line = indent + line[cut:].lstrip()
        out.append(line)
    return "\n".join(out).replace(keep, " ")


def _an_items_note(line: str, at: int) -> bool:
    """Whether the parenthesis at ``line[at]`` is an item's note in a comma list, not the whole list's: another item
    follows it ("), ") or the item before it has one too ("), c (")."""
    close, before = line.find(")", at), line.rfind(", ", 0, at)
    return (close > 0 and line.startswith(", ", close + 1)) or (before > 0 and line[before - 1] == ")")


def unwrapped(text: str) -> list[str]:
    """The lines of ``text`` with each line :func:`wrapped` cut whole again (a line indented 2 more than the line it
    goes on joins it, with one space): how compare and parity read the cause in a failed run's stderr."""
    out, base = [], []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if out and line.strip() and indent == base[-1] + 2:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
            base.append(indent)
    return out


def error_lines(prog: str, message: str, width: int = ERROR_WIDTH) -> str:
    """``prog: error: message`` for each line of ``message``, :func:`wrapped` to ``width`` columns (every
    program's refusals: :class:`OneLineParser`'s and the programs' own)."""
    return wrapped("\n".join(f"{prog}: error: {problem}" for problem in message.splitlines() or [""]), width)


def did_you_mean(value, allowed) -> str:
    """`` (did you mean 'gpt2'?)`` for the one of ``allowed`` closest to ``value`` (difflib's ratio >= 0.6, its
    default), else ''; '' for numbers too (letters compared, --zero 12 would read as "did you mean 2?")."""
    if not isinstance(value, str) or not all(isinstance(a, str) for a in allowed):
        return ""
    by_text = {str(a): a for a in allowed}
    close = difflib.get_close_matches(str(value), by_text, n=1)
    return f" (did you mean {by_text[close[0]]!r}?)" if close else ""


class FlagParser(argparse.ArgumentParser):
    """argparse whose ``unrecognized arguments`` message suggests the closest flag (:func:`unrecognized`) and whose
    ``invalid choice`` message the closest choice (:func:`did_you_mean`): every program's parser is one."""

    def parse_args(self, args=None, namespace=None):
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(unrecognized(self, extra, namespace))
        return namespace

    def _check_value(self, action, value):  # argparse's choices check (a subcommand's name too)
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            hint = did_you_mean(value, action.choices)
            if not hint:
                raise
            raise argparse.ArgumentError(action, e.message + hint) from None


class OneLineParser(FlagParser):
    """argparse whose errors are ``prog: error: message`` (:func:`error_lines`: lines of <= 120 columns), exit
    status 2 (no usage block above it).
    ``quiet`` (set by a program on launched ranks other than 0): the same exits, nothing printed (once per job)."""
    quiet = False

    def print_help(self, file=None):
        if not self.quiet:
            super().print_help(file)

    def error(self, message):
        if not self.quiet:
            sys.stderr.write(error_lines(self.prog, message) + "\n")
        sys.exit(2)


def negative_values_reach_checks(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` (no option of its own starts with '-' and a digit) pass "-1,5" or "-1e-3" to the flag's
    ``type=`` and checks, which name the value and what is allowed; returns ``parser``. argparse reads only "-1" and
    "-.5" as negative numbers (its ``_negative_number_matcher``, set per parser) and answered "--steps -1,5" with
    "expected one argument"."""
    parser._negative_number_matcher = VALUE_LIKE
    parser.allow_abbrev = False  # and a flag is read whole: train took "--loss-scale 1024" as --loss-scale-window
    return parser


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``7th``, ``12th``, ``22nd`` (it said "2-th")."""
    return f"{n}{'th' if n % 100 in (11, 12, 13) else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def thousands(n: int) -> str:
    """``1,024``: a bare count (``counted`` names what it counts)."""
    return f"{n:,}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 step``, ``300 steps``, ``1,024 steps`` (it said "after 1 steps"); ``plural`` where not noun + s."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def shortened(text: str, keep: int, most: int | None = None) -> str:
    """``text`` if at most ``most`` (default ``keep``) characters, else its first ``keep`` and its length:
    ``"xxx... (300 characters)"`` (an unbroken word is not wrapped: a long value would make a long line)."""
    return text if len(text) <= (keep if most is None else most) else f"{text[:keep]}... ({len(text):,} characters)"


def in_width(x: float, width: int, decimals: int = 0) -> str:
    """``x`` right-aligned in ``width`` columns with ``decimals`` digits after the point: ``22,144,603`` where it
    fits, else ``22144603``, else ``2.21e+10``. A column of several rows: :func:`column`."""
    fits = [t for t in (f"{x:,.{decimals}f}", f"{x:.{decimals}f}") if len(t) <= width]
    return (fits[0] if fits else f"{x:.{max(0, width - 6)}e}").rjust(width)


def column(xs: list[float], width: int, decimals: int = 0) -> list[str]:
    """A table column's numbers in one form, each right-aligned in ``width`` columns: all with thousands commas
    where the widest fits, else all as ``2.21e+10`` (plan's tok/s printed 3504572 beside another table's 25,642)."""
    texts = [f"{x:,.{decimals}f}" for x in xs]
    if all(len(t) <= width for t in texts):
        return [t.rjust(width) for t in texts]
    return [f"{x:.{max(0, width - 6)}e}".rjust(width) for x in xs]


def significant(x: float, digits: int = 3) -> str:
    """``x`` in ``digits`` significant digits, whole with thousands commas where that would need an exponent:
    ``0.0468``, ``36.9``, ``1,354`` (plan's seconds read 1.35e+03 before), ``1,000`` for 999.7."""
    text = f"{x:.{digits}g}"
    return f"{x:,.0f}" if "e+" in text else text


def significant_column(x: float, width: int, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, trailing zeros kept, right-aligned in ``width`` columns: ``0.140``,
    ``9.05e-05`` (a step time well under a millisecond must not read 0.000), ``100``."""
    return f"{x:#.{digits}g}".rstrip(".").rjust(width)
