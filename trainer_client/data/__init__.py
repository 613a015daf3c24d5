"""Training data: global batches of token sequences, identical on every rank. Beside it in this package: ``hub``
(Hugging Face Hub ids: the snapshot in the cache each reads), ``check`` (every record checked before the first step) and
``evaluation`` (the held-out set and its loss).

Sources, chosen by ``--data``:

- ``synthetic:NAME`` (NAME in wikipedia | lmsys | chatqa2): lengths drawn from
  the planning core's Table-1-shaped samplers
  (``scheduler_service.core.samplers.sample_lengths``), token ids uniform over the
  vocabulary. Global batch ``s`` depends on ``(seed, s)`` alone, so every rank,
  every scheduler and every rerun sees the same batches in the same order.
- records (``open_records``), one a line of a JSONL file, or one a row of a
  ``datasets`` table:

  - a JSONL file (``.jsonl``, a ``.json`` file of JSON lines, any other
    suffix), read by ``JsonlRecords``;
  - a parquet, CSV or ``.json`` file that holds a JSON array;
  - a dataset folder: ``Dataset.save_to_disk``'s, or data files laid out as on
    the Hub (``DIR:SPLIT`` picks a split; without one, ``train``, and a
    ``save_to_disk`` folder of a single ``Dataset`` has no splits);
  - a Hugging Face Hub data set, ``ORG/NAME[@REVISION][:SPLIT]``: its snapshot
    in the Hugging Face cache (``hub.py``), read as a folder.

  A name with a data file's suffix that is not a file is missing, never a Hub
  id (``hub.hub_ref`` decides what is one).

  Global batch ``s`` is the next ``B`` records of the current epoch's order, or
  the records left where fewer than ``B`` are: no batch holds two epochs'
  records, so every epoch ends with a step, as Hugging Face Trainer's last batch
  with ``drop_last=False`` does, and ``--epochs N`` trains each record exactly N
  times. The order is file order, or with ``shuffle`` a permutation seeded by
  ``(seed, epoch)``, another each epoch and the same on every rank and rerun.

Records (``RecordEncoder``), the first key present (and not null) decides:

- ``{"input_ids": [...]}``, tokenized already, with optional ``"labels"`` (same
  length; -100 = no loss, Hugging Face convention) or ``"loss_mask"`` (0/1);
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a chat of the roles
  ``CHAT_ROLES`` (another role is a malformed record), rendered with
  the tokenizer's chat template (``--tokenizer``) or ``--chat-template``; by
  default (``--loss-on assistant``) only assistant turns carry loss, every prompt
  token (system, user, tool, the template's markup before each answer) is
  masked;
- ``{"conversations": [{"from": ..., "value": ...}, ...]}``: ShareGPT's chat,
  its speakers (human, gpt, system, …) read as roles;
- ``{"prompt": ..., "completion": ...}``: TRL's prompt–completion record, two
  strings or two lists of messages; the completion carries loss;
- ``{"text": "..."}`` (the key ``--text-field``): plain text, tokenized (with
  the end-of-text token) and trained on every token.

``--loss-on completion`` trains only a chat's last assistant turn, ``--loss-on
all`` every token of chats and prompt–completion records.

Both record readers read a record at a time, so no rank holds the data. A JSONL
file is read from the byte offset of its line (an index of the offsets is built
once, 12 bytes per record). Every other source is read as memory-mapped Arrow
rows (``DatasetRecords``): ``datasets.load_dataset`` converts a file, a folder
of data files or a Hub snapshot once into its own cache (``HF_DATASETS_CACHE``),
and a ``save_to_disk`` folder is Arrow already.
Where the next batch starts (``GlobalBatch.next_position``: the epoch and the
index in its order) is saved in checkpoints and restored with ``seek``, so a
resumed run continues the same order. What a source is
(``DataSource.identity``) is saved beside them, so that a resume can tell
whether it reads the same data (``run_identity.py``):

- a synthetic set: its name and longest length (its seed, ``order_seed``, is compared on its own);
- a JSONL file: its path, its size and a digest of its first and last records;
- a parquet, CSV or JSON file: its path, its size, its rows and a digest of its
  first and last 64 KiB;
- a ``save_to_disk`` folder: its path (and split), its rows and the
  fingerprint ``datasets`` saved with it;
- a folder of data files: its path and split, its rows and the fingerprint
  ``datasets`` derives from the files' paths and modification times (touching
  a file counts as a change);
- a Hub data set: its id and split, the commit read and its rows, wherever the
  cache lies;

and for records, their order (shuffled, with ``order_seed``, or file order) and
the records left out.

None of these reads a large file whole.

Labels follow the Hugging Face convention (aligned with ``input_ids``); the
token at position ``t`` is trained to predict ``labels[t + 1]``
(``Sample.targets``). A record longer than ``max_length`` is an error naming the
record, unless ``truncate`` is set. ``LengthStats`` summarises the lengths a
run trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from scheduler_service.core.samplers import DATASETS, sample_lengths
from trainer_client.choices import CHAT_TEMPLATES, SYNTHETIC_PREFIX, LossOn, chat_template_of
from trainer_client.data.hub import HubError, HubSnapshot, RepoKind, fetch, hub_ref, is_data_file_name

__all__ = [
    "CHAT_ROLES",
    "IGNORE_INDEX",
    "SHAREGPT_ROLES",
    "BadRecordError",
    "DataIdentity",
    "DataSource",
    "DatasetRecords",
    "Defect",
    "GlobalBatch",
    "JsonlRecords",
    "LengthStats",
    "RecordEncoder",
    "RecordSource",
    "RecordTooLongError",
    "Sample",
    "SyntheticSource",
    "length_summary",
    "load_tokenizer",
    "make_source",
    "open_records",
    "record_encoder",
]

IGNORE_INDEX = -100
DEFAULT_SPLIT = "train"  # of a dataset folder or a Hub data set given without :SPLIT
_TAIL_BLOCK_BYTES = 1 << 16  # a JSONL file's last record is looked for this many bytes at a time, from the end
_DIGEST_BYTES = 1 << 16  # a parquet, CSV or JSON file's identity digests this many bytes at each end
_SNIFF_BYTES = 1 << 12  # where a .json file's first character is looked for


class Defect(StrEnum):
    """Why a record cannot train; ``data.check`` reports the records of each defect together, with its fix."""

    TOO_LONG = "too_long"  # longer than --max-length, and --truncate is off
    BEYOND_PLAN = "beyond_plan"  # longer than any plan of the layout holds (a --max-length above it)
    NO_LOSS = "no_loss"  # no token carries loss: nothing to learn from it
    EMPTY_CHAT = "empty_chat"
    NO_ASSISTANT = "no_assistant"  # a chat with no assistant turn, and only assistant turns carry loss
    TEMPLATE = "template"  # the chat template does not render a prefix of the chat as a prefix of its tokens
    MALFORMED = "malformed"  # not JSON, no known shape, wrong types, token ids outside the vocabulary


class BadRecordError(ValueError):
    """A record that cannot train, and why (``defect``); the message names the record."""

    def __init__(self, message: str, *, defect: Defect, where: str, num_tokens: int | None = None) -> None:
        super().__init__(message)
        self.defect = defect
        self.where = where
        self.num_tokens = num_tokens  # the record's tokens, where the defect is its length


class RecordTooLongError(BadRecordError):
    """A record exceeds the configured maximum length and truncation is off."""


def _malformed(where: str, message: str) -> BadRecordError:
    return BadRecordError(message, defect=Defect.MALFORMED, where=where)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One sequence: token ids and labels aligned with them (``IGNORE_INDEX`` = no loss)."""

    input_ids: npt.NDArray[np.int64]
    labels: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        if self.input_ids.ndim != 1 or len(self.input_ids) == 0:
            raise ValueError(f"a sample needs a non-empty 1-D input_ids, got shape {self.input_ids.shape}")
        if self.labels.shape != self.input_ids.shape:
            raise ValueError(f"labels shape {self.labels.shape} != input_ids shape {self.input_ids.shape}")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def targets(self) -> npt.NDArray[np.int64]:
        """What each position is trained to predict: ``labels`` shifted left by one; the last predicts nothing."""
        return np.concatenate([self.labels[1:], np.array([IGNORE_INDEX], dtype=np.int64)])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.targets != IGNORE_INDEX))


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalBatch:
    step: int
    samples: tuple[Sample, ...]
    next_position: dict[str, int] = field(default_factory=dict)  # where the source resumes after this batch
    sequence_lengths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequence_lengths", tuple(sample.num_tokens for sample in self.samples))

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_lengths)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sample.num_loss_tokens for sample in self.samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataIdentity:
    """Which data a source yields: two sources with the same identity give the same global batches."""

    source: str  # synthetic:NAME, the absolute path of a file or folder (and split), or a Hub ORG/NAME:SPLIT
    fingerprint: str  # what the source holds, as a user can read it

    def __str__(self) -> str:
        return f"{self.source} ({self.fingerprint})"


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticSource:
    dataset: str
    global_batch_size: int
    vocab_size: int
    max_length: int
    seed: int

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown synthetic data set {self.dataset!r}; known: {', '.join(DATASETS)}")
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")

    def batch(self, step: int) -> GlobalBatch:
        rng = np.random.default_rng([self.seed, step])
        lengths = sample_lengths(self.dataset, self.global_batch_size, rng, max_length=self.max_length)
        samples = []
        for length in lengths:
            input_ids = rng.integers(0, self.vocab_size, size=int(length), dtype=np.int64)
            samples.append(Sample(input_ids=input_ids, labels=input_ids.copy()))
        return GlobalBatch(step=step, samples=tuple(samples))

    def seek(self, position: Mapping[str, int]) -> None:
        """Nothing to restore: batch ``s`` depends on ``(seed, s)`` alone."""

    @property
    def order_seed(self) -> int:
        """The seed the batches depend on (``run_identity`` compares it on its own)."""
        return self.seed

    def identity(self) -> DataIdentity:
        # The batch size is the run's (checked on its own); the longest length clips the lengths drawn; the seed is
        # order_seed.
        return DataIdentity(source=f"{SYNTHETIC_PREFIX}{self.dataset}", fingerprint=f"max length {self.max_length}")


# ---------------------------------------------------------------------------------------------------- records


class Tokenizer(Protocol):
    """What the encoder needs of a transformers tokenizer."""

    eos_token_id: int | None
    chat_template: str | dict[str, str] | None

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from a local directory (``save_pretrained``), or from a Hugging Face Hub id's snapshot in the
    Hugging Face cache (``hub.py``)."""
    path = Path(spec)
    if not path.is_dir():
        ref = hub_ref(spec, RepoKind.TOKENIZER)
        if ref is None:
            raise ValueError(f"--tokenizer {spec!r} is not a local tokenizer directory, nor a Hugging Face Hub id "
                             "(ORG/NAME[@REVISION])")
        try:
            path = fetch(ref).path
        except HubError as error:
            raise ValueError(f"--tokenizer {spec}: {error}") from None
    from transformers import AutoTokenizer

    try:
        tokenizer: Tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer {spec}: transformers cannot load a tokenizer from {path}: {error}") from None
    return tokenizer


# The roles of a chat's turns (``messages``, a prompt–completion record's messages, ShareGPT's speakers as these):
# transformers' and TRL's. A template renders any role it is given (ChatML: ``<|im_start|>bot``), and an answer in a
# turn of another role would be masked as a prompt, so another role is a malformed record, named.
CHAT_ROLES = ("system", "user", "assistant", "tool")

# ShareGPT's speakers (``from``) as chat roles: FastChat's and axolotl's human/gpt, and LLaMA-Factory's tool turns.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "function_call": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_response": "tool"}

Tokens = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]  # input ids, and labels aligned with them


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordEncoder:
    """A record (one JSON line or dataset row) → ``Sample``, with every error naming the record.

    The first key present (and not null) decides what a record is: ``input_ids`` (with its own ``labels`` or
    ``loss_mask``), a chat (``messages`` of ``role``/``content``, or ShareGPT's ``conversations`` of
    ``from``/``value``), TRL's ``prompt`` and ``completion`` (two strings, or two lists of messages), or plain text
    (the key ``text_field``). ``loss_on`` picks the tokens with loss of the records the encoder renders
    (``choices.LossOn``); a text record trains every token. ``chat_template`` (Jinja) renders chats instead of the
    tokenizer's own.
    """

    max_length: int
    truncate: bool = False
    vocab_size: int | None = None
    tokenizer: Tokenizer | None = None
    loss_on: LossOn = LossOn.ASSISTANT
    chat_template: str | None = None
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.vocab_size is not None and len(self.tokenizer) > self.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens; the model's vocabulary only "
                             f"{self.vocab_size}")

    def encode(self, record: object, where: str) -> Sample:
        """The sample of ``record``; ``BadRecordError`` naming it (``where``) and its defect when it cannot train,
        a ``ValueError`` when no record of this kind could (a chat without ``--tokenizer``)."""
        if not isinstance(record, dict):
            raise _malformed(where, f"record {where} is not a JSON object")
        # A datasets row holds every column of the set: a column that is None in this row is absent.
        if record.get("input_ids") is not None:
            input_ids, labels = self._tokenized(record, where)
        elif record.get("messages") is not None:
            input_ids, labels = self._chat(_messages(record["messages"], where, key="messages"), where)
        elif record.get("conversations") is not None:
            input_ids, labels = self._chat(_sharegpt(record["conversations"], where), where)
        elif record.get("prompt") is not None:
            input_ids, labels = self._prompt_completion(record, where)
        elif record.get(self.text_field) is not None:
            input_ids, labels = self._text(record[self.text_field], where)
        else:
            shapes = f"'input_ids', 'messages', 'conversations', 'prompt' and 'completion', '{self.text_field}'"
            hint = "" if self.text_field != "text" else "; --text-field names another key of plain text"
            raise _malformed(where, f"record {where} has none of {shapes} (its keys: "
                                    f"{', '.join(map(str, record)) or 'none'}){hint}")
        if input_ids.ndim != 1 or input_ids.size == 0:
            raise _malformed(where, f"record {where}: input_ids must be a non-empty list of token ids")
        if labels.shape != input_ids.shape:
            raise _malformed(where, f"record {where}: labels has {labels.size} entries, input_ids {input_ids.size}")
        if self.vocab_size is not None and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise _malformed(where, f"record {where}: token ids must lie in [0, {self.vocab_size})")
        if input_ids.size > self.max_length:
            if not self.truncate:
                raise RecordTooLongError(
                    f"record {where} has {input_ids.size} tokens; the maximum is {self.max_length} "
                    f"(bucket_size × cp_size unless --max-length says otherwise); pass --truncate to cut it",
                    defect=Defect.TOO_LONG, where=where, num_tokens=int(input_ids.size),
                )
            input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        return Sample(input_ids=input_ids, labels=labels)

    @staticmethod
    def _tokenized(record: dict[str, Any], where: str) -> Tokens:
        try:
            input_ids = np.asarray(record["input_ids"], dtype=np.int64)
            if record.get("labels") is not None:
                return input_ids, np.asarray(record["labels"], dtype=np.int64)
            if record.get("loss_mask") is not None:
                mask = np.asarray(record["loss_mask"], dtype=bool)
                if mask.shape != input_ids.shape:
                    raise _malformed(where, f"record {where}: loss_mask has {mask.size} entries, input_ids "
                                            f"{input_ids.size}")
                return input_ids, np.where(mask, input_ids, IGNORE_INDEX)
        except (TypeError, ValueError) as error:
            if isinstance(error, BadRecordError):
                raise
            raise _malformed(where, f"record {where}: input_ids, labels and loss_mask must be lists of integers: "
                                    f"{error}") from None
        return input_ids, input_ids.copy()

    def _needs_tokenizer(self, kind: str, where: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"record {where} holds {kind}: give --tokenizer (a local tokenizer directory or a "
                             "Hugging Face Hub id)\nhint: skrull-tokenizer DIR writes a small chat tokenizer offline, "
                             "which the built-in models take: then --tokenizer DIR; or --tokenizer ORG/NAME, a Hub "
                             "model's own")
        return self.tokenizer

    def _text(self, text: object, where: str) -> Tokens:
        if not isinstance(text, str):
            raise _malformed(where, f"record {where}: '{self.text_field}' must be a string")
        input_ids = self._encoded(text, where, kind="text", end=True)
        return input_ids, input_ids.copy()

    def _encoded(self, text: str, where: str, *, kind: str, end: bool) -> npt.NDArray[np.int64]:
        """``text``'s tokens, with the end-of-text token after them where ``end`` (the model learns where a document
        or an answer ends)."""
        tokenizer = self._needs_tokenizer(kind, where)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if end and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return np.asarray(ids, dtype=np.int64)

    def _prompt_completion(self, record: dict[str, Any], where: str) -> Tokens:
        """TRL's prompt–completion record: two strings, tokenized apart (so that no token straddles them) and the
        completion ended with the end-of-text token; or two lists of messages, one chat whose completion turns are
        the answer. The completion carries loss, the prompt too with ``--loss-on all``."""
        prompt, completion = record["prompt"], record.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt_ids = self._encoded(prompt, where, kind="a prompt", end=False)
            completion_ids = self._encoded(completion, where, kind="a completion", end=True)
            input_ids = np.concatenate([prompt_ids, completion_ids])
            if self.loss_on is LossOn.ALL:
                return input_ids, input_ids.copy()
            return input_ids, np.concatenate([np.full(prompt_ids.size, IGNORE_INDEX, dtype=np.int64), completion_ids])
        if isinstance(prompt, list) and isinstance(completion, list) and completion:
            turns = _messages(prompt, where, key="prompt") + _messages(completion, where, key="completion")
            return self._chat(turns, where, answers=set(range(len(prompt), len(turns))))
        raise _malformed(where, f"record {where}: 'prompt' and 'completion' must be two strings, or two lists of "
                                "messages (the completion's not empty)")

    def _chat(self, messages: list[dict[str, str]], where: str, *, answers: set[int] | None = None) -> Tokens:
        """Render the chat; train the tokens of the turns ``--loss-on`` picks (``answers``, where a record says which
        they are), each after its prompt, or with ``--loss-on all`` every token.

        The prompt of answer turn ``k`` (an assistant's) is the template of ``messages[:k]`` with the generation
        prompt; its answer is what the template of ``messages[:k + 1]`` adds to that. Templates render prefixes of a
        chat as prefixes of its tokens (checked: a template that does not is a bad record).
        """
        tokenizer = self._needs_tokenizer("a chat", where)
        if tokenizer.chat_template is None and self.chat_template is None:
            raise ValueError(f"record {where} holds a chat, and the tokenizer has no chat template: give "
                             f"--chat-template ({', '.join(CHAT_TEMPLATES)}, or a file of Jinja)")
        if not messages:
            raise BadRecordError(f"record {where}: the chat is empty", defect=Defect.EMPTY_CHAT, where=where)

        def render(turns: list[dict[str, str]], *, prompt: bool) -> list[int]:
            from jinja2 import TemplateError

            try:
                ids: list[int] = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                                               add_generation_prompt=prompt,
                                                               chat_template=self.chat_template)
            except TemplateError as error:  # a template that refuses the chat ("roles must alternate")
                raise BadRecordError(f"record {where}: the chat template refuses the chat: {error}",
                                     defect=Defect.TEMPLATE, where=where) from None
            return ids

        if self.loss_on is LossOn.ALL:
            input_ids = np.asarray(render(messages, prompt=False), dtype=np.int64)
            return input_ids, input_ids.copy()
        if answers is None:
            assistant = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
            answers = set(assistant[-1:] if self.loss_on is LossOn.COMPLETION else assistant)
        if not answers:
            raise BadRecordError(f"record {where}: the chat has no assistant turn to train on",
                                 defect=Defect.NO_ASSISTANT, where=where)
        ids: list[int] = []
        trained: list[bool] = []
        for k, message in enumerate(messages):
            if k in answers and message["role"] == "assistant":
                prompt = render(messages[:k], prompt=True) if k else []
                self._extend(ids, trained, prompt, train=False, where=where)
            self._extend(ids, trained, render(messages[: k + 1], prompt=False), train=k in answers, where=where)
        input_ids = np.asarray(ids, dtype=np.int64)
        return input_ids, np.where(np.asarray(trained), input_ids, IGNORE_INDEX)

    @staticmethod
    def _extend(ids: list[int], trained: list[bool], rendered: list[int], *, train: bool, where: str) -> None:
        """Append what ``rendered`` adds to ``ids`` (which it must start with), marked ``train``."""
        if rendered[: len(ids)] != ids:
            raise BadRecordError(f"record {where}: the chat template does not render a prefix of the chat as a "
                                 "prefix of its tokens; prompt masking needs it to", defect=Defect.TEMPLATE,
                                 where=where)
        trained.extend([train] * (len(rendered) - len(ids)))
        ids.extend(rendered[len(ids):])


def _messages(messages: object, where: str, *, key: str) -> list[dict[str, str]]:
    """The chat's turns under ``key``, each a ``role`` of ``CHAT_ROLES`` and a ``content`` string;
    ``BadRecordError`` for anything else."""
    if not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise _malformed(where, f"record {where}: '{key}' must be a list of {{role, content}} strings")
    unknown = sorted({m["role"] for m in messages} - set(CHAT_ROLES))
    if unknown:
        raise _malformed(where, f"record {where}: '{key}' has roles {', '.join(map(repr, unknown))}; a chat's are "
                                f"{', '.join(CHAT_ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt(conversations: object, where: str) -> list[dict[str, str]]:
    """ShareGPT's ``conversations`` (``from``, ``value``) as a chat's turns, its speakers as roles
    (``SHAREGPT_ROLES``)."""
    if not (isinstance(conversations, list) and all(
            isinstance(c, dict) and isinstance(c.get("from"), str) and isinstance(c.get("value"), str)
            for c in conversations)):
        raise _malformed(where, f"record {where}: 'conversations' must be a list of {{from, value}} strings")
    unknown = sorted({c["from"] for c in conversations} - SHAREGPT_ROLES.keys())
    if unknown:
        raise _malformed(where, f"record {where}: 'conversations' has speakers {', '.join(map(repr, unknown))}; "
                                f"ShareGPT's are {', '.join(SHAREGPT_ROLES)}")
    return [{"role": SHAREGPT_ROLES[c["from"]], "content": c["value"]} for c in conversations]


Position = dict[str, int]  # where a record source resumes: {"epoch": e, "index": i in epoch e's order}


class RecordReader(Protocol):
    """Records by index, ``0 … num_records − 1``."""

    @property
    def num_records(self) -> int: ...

    def read(self, index: int) -> tuple[object, str]:
        """Record ``index`` and where it is (for errors)."""
        ...

    def identity(self) -> DataIdentity: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlRecords:
    """A JSONL file, a record per non-blank line, read from the byte offset of its line."""

    path: Path
    _offsets: array = field(init=False, repr=False)  # of each record's line
    _line_numbers: array = field(init=False, repr=False)

    def __post_init__(self) -> None:
        offsets, line_numbers = array("Q"), array("I")
        with self.path.open("rb") as lines:
            offset = 0
            for line_number, line in enumerate(lines, start=1):
                if line.strip():
                    offsets.append(offset)
                    line_numbers.append(line_number)
                offset += len(line)
        if not offsets:
            raise ValueError(f"{self.path} holds no records")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_line_numbers", line_numbers)

    @property
    def num_records(self) -> int:
        return len(self._offsets)

    def read(self, index: int) -> tuple[object, str]:
        where = f"{self.path}:{self._line_numbers[index]}"
        with self.path.open("rb") as lines:
            lines.seek(self._offsets[index])
            line = lines.readline()
        try:
            return json.loads(line), where
        except json.JSONDecodeError as error:
            raise _malformed(where, f"record {where} is not JSON: {error}") from None

    def identity(self) -> DataIdentity:
        """The path, the size and a digest of the first and last records: appending, cutting or replacing the file
        changes it, without reading a large file whole."""
        num_bytes = self.path.stat().st_size
        with self.path.open("rb") as lines:
            first = next((line for line in lines if line.strip()), b"").strip()
            last = _last_line(lines, num_bytes)
        digest = hashlib.sha256(first + b"\n" + last).hexdigest()[:16]
        return DataIdentity(source=str(self.path.resolve()),
                            fingerprint=f"{num_bytes} bytes, first and last records sha256 {digest}")


def _last_line(lines: IO[bytes], num_bytes: int) -> bytes:
    """The last non-blank line of a file of ``num_bytes``, stripped, read backwards a block at a time."""
    tail, end = b"", num_bytes
    while True:
        start = max(0, end - _TAIL_BLOCK_BYTES)
        lines.seek(start)
        tail = lines.read(end - start) + tail
        end = start
        stripped = tail.rstrip()
        if b"\n" in stripped or start == 0:  # a whole line, or the file's first
            return stripped.rsplit(b"\n", 1)[-1].strip()


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetRecords:
    """The rows of a Hugging Face ``datasets`` table, in order, memory-mapped: a ``save_to_disk`` folder, a parquet,
    CSV or JSON file, a folder of data files, or a Hub data set's snapshot (one constructor each)."""

    dataset: Any  # datasets.Dataset
    name: str  # how errors name the set: the path (and split), or ORG/NAME:SPLIT
    source: str  # DataIdentity.source: the absolute path (and split), or ORG/NAME:SPLIT
    content: str  # what DataIdentity.fingerprint says of the content, the rows aside

    def __post_init__(self) -> None:
        if self.dataset.num_rows == 0:
            raise ValueError(f"{self.name} holds no records")

    @classmethod
    def from_saved(cls, path: Path, split: str | None = None) -> DatasetRecords:
        """A ``save_to_disk`` folder: of a ``Dataset``, or of a ``DatasetDict``, whose ``split`` it reads
        (``train`` when none is given and it has one)."""
        datasets = _datasets_package()
        loaded = _loading(str(path), lambda: datasets.load_from_disk(str(path)))
        name, source = str(path), str(path.resolve())
        if isinstance(loaded, datasets.DatasetDict):
            if split is None and DEFAULT_SPLIT in loaded:
                split = DEFAULT_SPLIT
            if split is None or split not in loaded:
                asked = f"none is {DEFAULT_SPLIT}, so give one" if split is None else f"it has no split {split!r}"
                raise ValueError(f"{path} holds the splits {', '.join(loaded)}; {asked}: {path}:SPLIT")
            loaded, name, source = loaded[split], f"{path}:{split}", f"{source}:{split}"
        elif split is not None:
            raise ValueError(f"{path} holds one Dataset, no splits: give it without :{split}")
        return cls(dataset=loaded, name=name, source=source, content=f"datasets fingerprint {loaded._fingerprint}")

    @classmethod
    def from_file(cls, path: Path, builder: str) -> DatasetRecords:
        """A parquet, CSV or JSON file, through datasets' ``builder`` of that name."""
        datasets = _datasets_package()
        loaded = _loading(str(path), lambda: datasets.load_dataset(builder, data_files=str(path), split="train"))
        return cls(dataset=loaded, name=str(path), source=str(path.resolve()), content=_file_digest(path))

    @classmethod
    def from_folder(cls, path: Path, split: str | None = None) -> DatasetRecords:
        """A folder of data files, laid out as a Hub data set's (``datasets.load_dataset`` of the folder)."""
        split = split or DEFAULT_SPLIT
        datasets = _datasets_package()
        loaded = _loading(f"{path}:{split}", lambda: datasets.load_dataset(str(path), split=split))
        return cls(dataset=loaded, name=f"{path}:{split}", source=f"{path.resolve()}:{split}",
                   content=f"datasets fingerprint {loaded._fingerprint}")

    @classmethod
    def from_hub(cls, snapshot: HubSnapshot, split: str | None = None) -> DatasetRecords:
        """A Hub data set: its snapshot folder in the Hugging Face cache, read as a folder of data files."""
        split = split or DEFAULT_SPLIT
        name = f"{snapshot.ref.repo_id}:{split}"
        datasets = _datasets_package()
        loaded = _loading(name, lambda: datasets.load_dataset(str(snapshot.path), split=split))
        # The commit is the content, wherever the cache lies: datasets' fingerprint would name the cache's path.
        return cls(dataset=loaded, name=name, source=name, content=f"Hub commit {snapshot.commit}")

    @property
    def num_records(self) -> int:
        return int(self.dataset.num_rows)

    def read(self, index: int) -> tuple[object, str]:
        return self.dataset[index], f"{self.name}[{index}]"

    def identity(self) -> DataIdentity:
        return DataIdentity(source=self.source, fingerprint=f"{self.dataset.num_rows} rows, {self.content}")


def _datasets_package() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError("reading parquet, CSV and JSON files, dataset folders and Hub data sets needs the "
                         "'datasets' package (pip install 'skrull[data]')") from None
    return datasets


def _loading(name: str, load: Callable[[], Any]) -> Any:
    """``load()``, its failure to read the set (no data files, no such split, a malformed file) a ``ValueError``
    naming ``name``."""
    from datasets.exceptions import DatasetGenerationError

    try:
        return load()
    except DatasetGenerationError as error:  # the builder's own error is its cause
        raise ValueError(f"{name} cannot be read as a data set: {error.__cause__ or error}") from None
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"{name} cannot be read as a data set: {error}") from None


def _file_digest(path: Path) -> str:
    """The size and a digest of the first and last ``_DIGEST_BYTES`` of a file: appending, cutting or replacing
    it changes them (a parquet file's footer, its last bytes, describes every row group), without reading it
    whole."""
    num_bytes = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(_DIGEST_BYTES)
        file.seek(max(0, num_bytes - _DIGEST_BYTES))
        tail = file.read()
    digest = hashlib.sha256(head + tail).hexdigest()[:16]
    return f"{num_bytes} bytes, first and last {_DIGEST_BYTES >> 10} KiB sha256 {digest}"


@dataclass(kw_only=True, slots=True)
class RecordSource:
    """Global batches of the next ``global_batch_size`` records of the epoch's order, an epoch's last batch the
    records left (module docstring); call ``batch`` for steps in order. ``leave_out`` takes records out of every
    epoch (``--skip-bad-records``)."""

    records: RecordReader
    encoder: RecordEncoder
    global_batch_size: int
    shuffle: bool = False
    seed: int = 0
    position: Position = field(default_factory=dict)
    left_out: tuple[int, ...] = ()  # record indices no epoch holds, ascending
    _trained: npt.NDArray[np.int64] | None = field(default=None, init=False, repr=False)  # the others, ascending
    _order: tuple[int, npt.NDArray[np.int64]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"global batch size must be positive, got {self.global_batch_size}")

    def leave_out(self, indices: tuple[int, ...]) -> None:
        """Train every record but ``indices`` (ascending), from the first batch on; an epoch is then the others.
        With none left out, the order is exactly that of a source that never left any out."""
        if not indices:
            return
        trained = np.setdiff1d(np.arange(self.records.num_records), np.asarray(indices, dtype=np.int64))
        if trained.size == 0:
            raise ValueError("every record is left out: none is left to train")
        self.left_out, self._trained, self._order = tuple(indices), trained, None

    @property
    def num_records(self) -> int:
        """The records an epoch trains: all the source holds but those left out."""
        return self.records.num_records - len(self.left_out)

    def batch(self, step: int) -> GlobalBatch:
        epoch, index = self.position.get("epoch", 0), self.position.get("index", 0)
        if index >= self.num_records:  # the last batch ended the epoch
            epoch, index = epoch + 1, 0
        end = min(index + self.global_batch_size, self.num_records)
        samples = []
        for record_index in self.order(epoch)[index:end]:
            record, where = self.records.read(int(record_index))
            samples.append(self.encoder.encode(record, where))
        self.position = {"epoch": epoch, "index": end}
        return GlobalBatch(step=step, samples=tuple(samples), next_position=dict(self.position))

    def order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The records of ``epoch`` (their indices in the source) in the order they are trained: file order, or a
        permutation seeded by ``(seed, epoch)`` of the records trained."""
        if self._order is None or self._order[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_records) if self.shuffle
                     else np.arange(self.num_records))
            self._order = (epoch, order if self._trained is None else self._trained[order])
        return self._order[1]

    def epochs_done(self, position: Mapping[str, int]) -> float:
        """The epochs trained up to ``position`` (a batch's ``next_position``): 1.5 halfway through the second."""
        return position.get("epoch", 0) + position.get("index", 0) / self.num_records

    @property
    def steps_per_epoch(self) -> int:
        """An epoch's optimizer steps: its last batch holds the records left (``num_records % global_batch_size``
        where that is not 0)."""
        return math.ceil(self.num_records / self.global_batch_size)

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps of ``epochs`` epochs, as Hugging Face Trainer counts them for ``num_train_epochs``:
        ``epochs × steps_per_epoch``, rounded up. ``epochs`` is read as the decimal it prints as: 0.1 of 30 steps is
        3, where the floats' product, 3.0000000000000004, would round up to 4."""
        return math.ceil(Fraction(str(epochs)) * self.steps_per_epoch)

    def epochs_text(self, epochs: float) -> str:
        """What ``epochs`` epochs train, as the trainer logs it: ``1 epoch of 57 records in global batches of 8: 8
        steps, the last of 1 record``."""
        steps = self.steps_for_epochs(epochs)
        text = (f"{epochs:g} {'epoch' if epochs == 1 else 'epochs'} of {_counted(self.num_records, 'record')} in "
                f"global batches of {self.global_batch_size}: {_counted(steps, 'step')}")
        left = self.num_records % self.global_batch_size
        if not left or epochs < 1:
            return text
        last = "the last" if epochs == 1 else "each epoch's last"
        return f"{text}, {last} of {_counted(left, 'record')}"

    def seek(self, position: Mapping[str, int]) -> None:
        if set(position) - {"epoch", "index"}:
            raise ValueError(f"data position {dict(position)} is not one of a record source ({{'epoch', 'index'}})")
        self.position = dict(position)

    @property
    def order_seed(self) -> int | None:
        """The seed of the records' order: shuffled, ``seed``; in file order, none (``run_identity`` compares it on
        its own)."""
        return self.seed if self.shuffle else None

    def identity(self) -> DataIdentity:
        """The records' identity, the records left out and the order (its seed is ``order_seed``): another order or
        choice of records gives other batches from the same position."""
        records = self.records.identity()
        order = "shuffled" if self.shuffle else "file order"
        left_out = ""
        if self.left_out:
            digest = hashlib.sha256(np.asarray(self.left_out, dtype=np.int64).tobytes()).hexdigest()[:16]
            left_out = f", {len(self.left_out)} records left out (sha256 {digest})"
        return DataIdentity(source=records.source, fingerprint=f"{records.fingerprint}{left_out}, {order}")


DataSource = SyntheticSource | RecordSource


def open_records(spec: str) -> RecordReader:
    """The records of a data file, a dataset folder (``DIR:SPLIT`` for a split) or a Hub data set
    (``ORG/NAME[@REVISION][:SPLIT]``, ``hub.py``); a ``ValueError`` says what ``spec`` is not (a missing file, if it
    has a data file's suffix), or why it cannot be read. The caller names the flag."""
    path = Path(spec)
    if path.is_file():
        return _file_records(path)
    if path.is_dir():
        return _folder_records(path, split=None)
    folder, _, split = spec.partition(":")
    if split and Path(folder).is_dir():
        return _folder_records(Path(folder), split=split)
    ref = hub_ref(spec, RepoKind.DATASET)
    if ref is not None:
        return DatasetRecords.from_hub(fetch(ref), ref.split)
    if is_data_file_name(spec):  # data/train.jsonl mistyped: never a Hub id (hub_ref)
        where = "" if path.is_absolute() else f" in {Path.cwd()}"
        raise ValueError(f"no such file: {spec!r}{where} (a name with a data file's suffix is a file, never a Hugging "
                         "Face Hub id)")
    raise ValueError(f"{spec!r} is neither a JSONL file, nor a parquet, CSV or JSON file, nor a dataset folder "
                     "(DIR[:SPLIT]), nor a Hugging Face Hub dataset id (ORG/NAME[@REVISION][:SPLIT])")


def _file_records(path: Path) -> RecordReader:
    """JSON lines by byte offset (what exact resume of a JSONL file has always read); parquet, CSV and a JSON array
    through datasets."""
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".csv"):
        return DatasetRecords.from_file(path, builder=suffix.removeprefix("."))
    if suffix == ".json" and _holds_json_array(path):
        return DatasetRecords.from_file(path, builder="json")
    return JsonlRecords(path=path)


def _holds_json_array(path: Path) -> bool:
    """Whether a ``.json`` file's first character (after a byte-order mark and white space) opens an array."""
    with path.open("rb") as file:
        start = file.read(_SNIFF_BYTES)
    return start.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")


def _folder_records(path: Path, *, split: str | None) -> DatasetRecords:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # save_to_disk wrote it
        return DatasetRecords.from_saved(path, split)
    return DatasetRecords.from_folder(path, split)


def record_encoder(
    *, max_length: int, vocab_size: int | None, truncate: bool = False, tokenizer: str | None = None,
    loss_on: LossOn = LossOn.ASSISTANT, chat_template: str | None = None, text_field: str = "text",
) -> RecordEncoder:
    """The encoder of the run's flags: ``tokenizer`` a local tokenizer folder or a Hub id, ``chat_template`` a
    template's name or a file of Jinja (``--chat-template``)."""
    return RecordEncoder(max_length=max_length, truncate=truncate, vocab_size=vocab_size,
                         tokenizer=load_tokenizer(tokenizer) if tokenizer is not None else None,
                         loss_on=LossOn(loss_on),
                         chat_template=chat_template_of(chat_template) if chat_template is not None else None,
                         text_field=text_field)


def make_source(
    spec: str, *, global_batch_size: int, vocab_size: int, max_length: int, seed: int, truncate: bool = False,
    tokenizer: str | None = None, shuffle: bool = False, loss_on: LossOn = LossOn.ASSISTANT,
    chat_template: str | None = None, text_field: str = "text",
) -> DataSource:
    """``synthetic:NAME``, or the records of a data file, a dataset folder or a Hub data set (``open_records``),
    encoded as ``record_encoder`` says; ``shuffle``: a record source's epochs in a seeded order, not file order."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(dataset=spec.removeprefix(SYNTHETIC_PREFIX), global_batch_size=global_batch_size,
                               vocab_size=vocab_size, max_length=max_length, seed=seed)
    try:
        records = open_records(spec)
    except ValueError as error:
        raise ValueError(f"--data {spec}: {error}") from None
    encoder = record_encoder(max_length=max_length, truncate=truncate, vocab_size=vocab_size, tokenizer=tokenizer,
                             loss_on=loss_on, chat_template=chat_template, text_field=text_field)
    return RecordSource(records=records, encoder=encoder, global_batch_size=global_batch_size, shuffle=shuffle,
                        seed=seed)


@dataclass(slots=True)
class LengthStats:
    """The sequence lengths a run trained on (4 bytes per sequence), and how many tokens carried loss."""

    lengths: array = field(default_factory=lambda: array("I"))
    num_loss_tokens: int = 0

    def add(self, batch: GlobalBatch) -> None:
        self.lengths.extend(batch.sequence_lengths)
        self.num_loss_tokens += batch.num_loss_tokens

    def summary(self) -> str:
        return length_summary(np.asarray(self.lengths), self.num_loss_tokens, unit="sequences")


def _counted(count: int, noun: str) -> str:
    """``1 record``, ``57 records``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def length_summary(lengths: npt.NDArray[np.integer[Any]], num_loss_tokens: int, *, unit: str) -> str:
    """How many ``unit`` (sequences, records: a plural) of these ``lengths``, their tokens, the share with loss, and
    the length distribution, as the trainer logs it."""
    if not lengths.size:
        return f"no {unit}"
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    total = int(lengths.sum())
    counted = f"{lengths.size} {unit.removesuffix('s') if lengths.size == 1 else unit}"
    return (f"{counted}, {total} tokens ({num_loss_tokens / total:.0%} with loss); "
            f"length min {lengths.min()}, median {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
