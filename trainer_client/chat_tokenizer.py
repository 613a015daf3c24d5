"""``skrull-tokenizer DIR`` (``python -m trainer_client.chat_tokenizer``): a small chat tokenizer made offline, for
chats, prompt–completion and text records on the built-in models, which have none of their own.

It trains a byte-level BPE with ``tokenizers`` on a built-in text (``builtin_corpus``: sentences of ``WORDS``) or on
``--corpus`` files, gives it ChatML's special tokens and chat template (``CHAT_TEMPLATES["chatml"]``), and
saves it with transformers' ``save_pretrained``, as a Hub tokenizer is saved, so that ``--tokenizer DIR`` loads it.
Byte-level: every text encodes, the words it was not trained on in more tokens. It needs no network and no Hub: on
the built-in text it trains in a fraction of a second, and the command takes 2-3 s with transformers' import.

The same arguments write the same files: the built-in text is drawn from a seeded generator, ``--corpus`` files are
read in the order given, and BPE training is deterministic. The tests' tokenizer is this one with its defaults
(``tests/hub_cache.py``), so the token counts the tests expect are its own.

Bad input exits with status 2 and one line, ``error: …``, naming the argument, or the file and its line (a usage
error adds a ``hint:``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from trainer_client.config import check_output_dir
from trainer_client.config_choices import CHAT_TEMPLATES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["DEFAULT_VOCAB_SIZE", "SPECIAL_TOKENS", "WORDS", "build_parser", "builtin_corpus", "main",
           "save_chat_tokenizer", "train_chat_tokenizer"]

EXIT_BAD_INPUT = 2
DEFAULT_VOCAB_SIZE = 320  # fits every built-in model's vocabulary (tiny's is 1024)
PAD, END_OF_TEXT = "<pad>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, END_OF_TEXT, "<|im_start|>", "<|im_end|>")  # ids 0-3; ChatML's markers, one token each
NUM_BYTES = 256  # a byte-level BPE holds every byte as a token before any merge
# The built-in text's words: what the scheduler does, in the vocabulary of the tests' chats.
WORDS = ("the", "model", "reads", "long", "documents", "and", "answers", "questions", "about", "them", "while",
         "the", "scheduler", "packs", "short", "chats", "beside", "long", "ones", "so", "that", "every", "rank",
         "finishes", "its", "micro", "batches", "at", "the", "same", "time")
NUM_SENTENCES, WORDS_PER_SENTENCE = 400, 12  # a few KB of text


def builtin_corpus() -> list[str]:
    """The built-in text: ``NUM_SENTENCES`` sentences of ``WORDS``, drawn by a generator seeded with 0."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=WORDS_PER_SENTENCE)) for _ in range(NUM_SENTENCES)]


def train_chat_tokenizer(corpus: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens (fewer where ``corpus`` has fewer merges to learn) trained
    on ``corpus``, with ``SPECIAL_TOKENS`` and the ChatML chat template; end of text ``<|endoftext|>``, padding
    ``<pad>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = NUM_BYTES + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE holds the {NUM_BYTES} bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens, so at least {min_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # its bar prints blank lines where stdout is no terminal
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATES["chatml"])


def _lines(paths: Sequence[Path]) -> Iterator[str]:
    """The lines of ``paths``, in order, one at a time (a corpus need not fit in memory); a file that cannot be read,
    or a line that is not UTF-8, is a ``ValueError`` naming it."""
    for path in paths:
        try:
            with path.open("rb") as handle:
                for number, line in enumerate(handle, start=1):
                    try:
                        yield line.decode("utf-8")
                    except UnicodeDecodeError as error:
                        raise ValueError(f"--corpus {path}:{number}: not UTF-8 text ({error.reason} at byte "
                                         f"{error.start + 1} of the line)") from None
        except OSError as error:
            raise ValueError(f"--corpus {path}: {error.strerror or error}") from None


def save_chat_tokenizer(folder: Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                        corpus_files: Sequence[Path] = ()) -> PreTrainedTokenizerFast:
    """Train the tokenizer (``train_chat_tokenizer``) on ``corpus_files``, or on the built-in text where none is
    given, and save it in ``folder`` as a Hub tokenizer is saved (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``); the tokenizer saved."""
    corpus = _lines(corpus_files) if corpus_files else builtin_corpus()
    tokenizer = train_chat_tokenizer(corpus, vocab_size=vocab_size)
    tokenizer.save_pretrained(folder)
    return tokenizer


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is one ``error:`` line and a hint, as every other refusal here."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message}\nhint: {self.prog} --help lists the arguments\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="skrull-tokenizer", usage="%(prog)s DIR [--vocab-size N] [--corpus FILE ...]",
        description="Train a small byte-level BPE tokenizer with a ChatML chat template, offline, and save it where "
                    "skrull-train --tokenizer DIR loads it.")
    parser.add_argument("folder", type=Path, metavar="DIR",
                        help="the folder to write (made if absent; its parent must exist)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, metavar="N",
                        help=f"tokens at most, {NUM_BYTES + len(SPECIAL_TOKENS)} or more; the model's vocabulary "
                             f"holds them (default: {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--corpus", type=Path, nargs="+", default=[], metavar="FILE",
                        help="train on these UTF-8 text files instead of the built-in text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Write the tokenizer the command line asks for; bad input is one ``error:`` line on stderr, exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        check_output_dir(args.folder, flag="DIR")
        tokenizer = save_chat_tokenizer(args.folder, vocab_size=args.vocab_size, corpus_files=args.corpus)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.folder}: a byte-level BPE tokenizer of {len(tokenizer)} tokens with a ChatML chat template; "
          f"give skrull-train --tokenizer {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
