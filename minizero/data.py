"""Text data: a byte-level tokenizer, the embedded corpus, and the distributed sampler.

Tokens are UTF-8 bytes (vocabulary 256); default corpus CPython's ``pydoc_data.topics`` (90% train, 10% val).
Rank r of N sees exactly one process's rows (``torch.utils.data.DistributedSampler``'s contract).
"""
from __future__ import annotations

import codecs
import hashlib
import os
import stat

import numpy as np

from minizero.autograd.functional import IGNORE_INDEX  # the target of a padding position
from minizero.comm.collectives import check_int, check_rank
from minizero.files import content_digest

VOCAB_SIZE = 256
DOCUMENT_SEPARATOR = 0x03  #: ASCII ETX ("end of text"): the byte that ends a document in --data


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as a uint8 array of shape (n_bytes,)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def prompt_problem(prompt: str) -> str | None:
    """Why ``--prompt`` cannot be :func:`encode`-d, as one message naming the value; None when it can.

    Empty, or not UTF-8 text: bytes of the command line that are not UTF-8 reach Python as lone
    surrogates (PEP 383), which ``str.encode("utf-8")`` refuses.
    """
    if not prompt:
        return "--prompt must hold at least one character, got ''"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = prompt.encode("utf-8", "surrogateescape")  # the command line's bytes again
        except UnicodeEncodeError:  # a surrogate no command line makes (from Python)
            raw = prompt
        return f"--prompt {raw!r} is not UTF-8 text (the tokens are its UTF-8 bytes); give UTF-8 text"
    return None


def decode(tokens) -> str:
    """Bytes back to text; invalid UTF-8 (possible mid-sample) becomes U+FFFD."""
    ids = np.asarray(tokens)
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= VOCAB_SIZE):  # -1 was byte 255
        span = f"values in [{ids.min()}, {ids.max()}]" if ids.dtype.kind in "iu" else f"dtype {ids.dtype}"
        raise ValueError(f"decode: tokens must be integer byte ids in [0, {VOCAB_SIZE}), got {span}")
    return bytes(ids.astype(np.uint8).reshape(-1).tolist()).decode("utf-8", errors="replace")


def builtin_corpus() -> str:
    """The Python language reference shipped with CPython (``pydoc_data.topics``), topics in sorted order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def load_tokens(path: str | None = None) -> np.ndarray:
    """Tokens (uint8, (n,)) of the text file ``path``, or of the built-in corpus when None.

    Raises FileNotFoundError: ``path`` missing; ValueError: empty, not UTF-8 text, or larger than memory.
    """
    if path is None:
        return encode(builtin_corpus())
    what = describe_non_file(path)
    if what:
        raise (FileNotFoundError if what == ": no such file" else ValueError)(f"--data {path!r}{what}")
    try:
        tokens = np.fromfile(path, dtype=np.uint8)  # read straight into the array: one copy of the file
        if not tokens.size:
            raise ValueError(f"--data {path!r} is empty")
        if tokens.max() >= 0x80:  # ASCII is UTF-8; else decode the array's own bytes, 16 MiB at a time
            check = codecs.getincrementaldecoder("utf-8")()
            for i in range(0, tokens.size, 1 << 24):
                check.decode(tokens.data[i:i + (1 << 24)], final=i + (1 << 24) >= tokens.size)
    except UnicodeDecodeError as e:  # its position is within the piece at byte i
        bom = next((c for c, m in (("UTF-32", codecs.BOM_UTF32_LE), ("UTF-32", codecs.BOM_UTF32_BE),
                                   ("UTF-16", codecs.BOM_UTF16_LE), ("UTF-16", codecs.BOM_UTF16_BE))
                    if bytes(tokens[:len(m)]) == m), None)  # a byte-order mark (UTF-32-LE's starts as UTF-16's)
        raise ValueError(f"--data {path!r} is not UTF-8 text ({e.reason} at byte {i + e.start:,}"
                         + (f"; it starts with a {bom} byte-order mark: iconv -f {bom} -t UTF-8 converts it"
                            if bom else "") + "); give a UTF-8 text file") from None
    except MemoryError:
        raise ValueError(f"--data {path!r} has {os.path.getsize(path):,} bytes, more than this process can hold: "
                         "every rank reads the file whole, so it must fit in each rank's memory") from None
    return tokens


def data_digest(path: str | None) -> dict:
    """``{what: digest}`` of the text ``path`` (the built-in corpus when None) for the ranks to compare
    (:func:`minizero.flags.inputs_refusal`): each node has its own disk, and its own Python's corpus."""
    if path is not None:
        return {f"--data {path!r}": content_digest(path)}
    return {"the built-in corpus (pydoc_data.topics)": text_digest(encode(builtin_corpus()))}


def text_digest(tokens: np.ndarray) -> str:
    """``'465,123 bytes, SHA-256 0123456789ab'`` of tokens :func:`load_tokens` read: what :func:`data_digest` says
    of their text (the same bytes), without reading it again."""
    return f"{tokens.size:,} bytes, SHA-256 {hashlib.sha256(np.ascontiguousarray(tokens)).hexdigest()[:12]}"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def describe_non_file(path: str) -> str | None:
    """None when ``path`` is a regular file (symlinks followed), else why it cannot be read as text.

    The phrase follows the path: ``" is a named pipe (FIFO), not a regular file"``, ``": no such file"``
    for a missing path (as ``ls`` would tell them apart, instead of one "no such file").
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return ": no such file"
    except OSError as e:
        return f" cannot be read ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f" is {kind}, not a regular file"


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.1):
    """(train, val) as contiguous views: the last ``val_fraction`` of the tokens validate."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"train_val_split: val_fraction must be in [0, 1), got {val_fraction!r}")
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def check_corpus(tokens: np.ndarray, block_size: int, name: str = "corpus") -> None:
    """Raise ValueError if ``tokens`` has fewer than block_size + 2: :func:`global_batch` draws window starts from
    [0, n - block_size - 1), so it needs one token more than a (block_size + 1)-token window and never draws the last
    window (nanoGPT's ``randint(n - block_size)`` does)."""
    if len(tokens) < block_size + 2:
        raise ValueError(f"{name} has {len(tokens)} tokens; needs more than block_size + 1 = {block_size + 1}")


def document_ends(tokens: np.ndarray) -> np.ndarray:
    """Sorted positions (int64) of every :data:`DOCUMENT_SEPARATOR` in ``tokens``: where documents end."""
    return np.flatnonzero(tokens == DOCUMENT_SEPARATOR)


def count_documents(tokens: np.ndarray) -> int:
    """Documents in ``tokens``: one per byte 0x03, plus the text after the last one (1 without any 0x03)."""
    ends = document_ends(tokens)
    return ends.size + int(ends.size == 0 or ends[-1] < tokens.size - 1)


def global_batch(tokens: np.ndarray, step: int, batch: int, block_size: int, seed: int, ends=None):
    """Step ``step``'s global batch, seeded by (seed, step): (x, y) of (batch, block_size) int64, y = x shifted by one.

    ``ends``: None (packed), or :func:`document_ends` (padded: targets after the first separator are ``IGNORE_INDEX``).
    """
    if not (batch >= 1 and block_size >= 1 and step >= 0 and seed >= 0):
        raise ValueError(f"global_batch: batch {batch!r} and block_size {block_size!r} must be >= 1, step {step!r} "
                         f"and seed {seed!r} >= 0")
    check_corpus(tokens, block_size, "global_batch: tokens")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - block_size - 1, size=batch)
    idx = starts[:, None] + np.arange(block_size + 1)[None, :]
    w = tokens[idx].astype(np.int64)
    if ends is None:
        return w[:, :-1], w[:, 1:]
    # the first separator strictly after the start (none: the text's end)
    cut = np.append(ends, len(tokens))[np.searchsorted(ends, starts, side="right")]
    inside = idx <= cut[:, None]  # positions up to and including the document's separator
    return (np.where(inside[:, :-1], w[:, :-1], DOCUMENT_SEPARATOR),
            np.where(inside[:, 1:], w[:, 1:], IGNORE_INDEX))


def micro_batch_rows(k: int, b: int, grad_accum: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[int, int]:
    """(lo, total): data rank ``dp_rank``'s micro-batch ``k`` of ``b`` rows is rows [lo, lo + b) of the step's
    global batch of ``total`` = grad_accum * dp_size * b rows (:class:`DistributedSampler`'s rows)."""
    return (k * dp_size + dp_rank) * b, grad_accum * dp_size * b


class DistributedSampler:
    """One data-parallel rank's micro-batches: ``micro_batches(step)`` yields ``grad_accum`` pairs (x, y) of (b, T)
    int64.

    Rows [(k * dp_size + dp_rank) * b, + b) of step's global batch; ``pad``: windows stop at their document's end.
    """

    def __init__(self, tokens, block_size, micro_batch, grad_accum=1, dp_rank=0, dp_size=1, seed=0, pad=False):
        check_corpus(tokens, block_size, "training split")
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum)):
            check_int(value, name, 1)
        check_rank(dp_rank, "dp_rank", check_int(dp_size, "dp_size", 1))  # dp_rank 2 of 2 read rank 0's next rows
        self.tokens, self.block_size = tokens, block_size
        self.ends = document_ends(tokens) if pad else None
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks: grad_accum * dp_size * micro_batch."""
        return self.grad_accum * self.dp_size * self.micro_batch

    def micro_batches(self, step: int):
        """Yield this rank's ``grad_accum`` micro-batches (x, y) of optimizer step ``step``, each (b, T) int64.

        Copies, not views: a view of the global batch would keep every rank's rows alive in
        this rank's memory for as long as the model saves the token ids for backward.
        """
        x, y = global_batch(self.tokens, step, self.global_batch_size, self.block_size, self.seed, self.ends)
        b = self.micro_batch
        for k in range(self.grad_accum):
            lo, _ = micro_batch_rows(k, b, self.grad_accum, self.dp_rank, self.dp_size)
            yield x[lo:lo + b].copy(), y[lo:lo + b].copy()


class EvalBatches:
    """The fixed validation set: ``n_batches`` pairs (x, y) of (batch, block_size) int64, built lazily, re-iterable."""

    def __init__(self, tokens: np.ndarray, block_size: int, n_batches: int, batch: int, seed: int = 1234,
                 pad: bool = False):
        self.tokens, self.block_size, self.n_batches, self.batch, self.seed = tokens, block_size, n_batches, batch, seed
        self.ends = document_ends(tokens) if pad else None  # the sampler's rule (--pad)

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, i: int):
        """Batch ``i`` (negative counts from the end). Raises IndexError outside ``[-n, n)``."""
        if not -self.n_batches <= i < self.n_batches:
            raise IndexError(f"validation batch {i} of {self.n_batches}")
        return global_batch(self.tokens, i % self.n_batches, self.batch, self.block_size, self.seed, self.ends)

    def __iter__(self):
        return (self[i] for i in range(self.n_batches))


def eval_batches(tokens: np.ndarray, block_size: int, n_batches: int, batch: int, seed: int = 1234,
                 pad: bool = False) -> EvalBatches:
    """The fixed validation set of ``n_batches`` (x, y) pairs from ``tokens`` (the same every call), lazily built."""
    return EvalBatches(tokens, block_size, n_batches, batch, seed, pad)


def min_data_bytes(block_size: int) -> int:
    """The fewest tokens whose validation split (the last 10%) holds one (block_size + 1)-token window."""
    n = 10 * (block_size + 2)
    while len(train_val_split(np.zeros(n, np.uint8))[1]) < block_size + 2:
        n += 1
    return n
