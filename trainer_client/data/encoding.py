"""A record (one JSON line or dataset row) → a ``Sample``, with every error naming the record.

The first key present (and not null) decides what a record is (``RecordEncoder``):

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
all`` every token of chats and prompt–completion records. A record longer than
``max_length`` is an error naming the record, unless ``truncate`` is set.

The tokenizer (``load_tokenizer``) is a local ``save_pretrained`` folder or a Hugging Face Hub id's snapshot in the
Hugging Face cache (``trainer_client/hub.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from trainer_client.config_choices import CHAT_TEMPLATES, LossOn, chat_template_of
from trainer_client.data.samples import IGNORE_INDEX, BadRecordError, Defect, RecordTooLongError, Sample, malformed
from trainer_client.hub import HubError, RepoKind, fetch, hub_ref

__all__ = ["CHAT_ROLES", "SHAREGPT_ROLES", "RecordEncoder", "Tokenizer", "load_tokenizer", "record_encoder"]


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
            raise malformed(where, f"record {where} is not a JSON object")
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
            raise malformed(where, f"record {where} has none of {shapes} (its keys: "
                                   f"{', '.join(map(str, record)) or 'none'}){hint}")
        if input_ids.ndim != 1 or input_ids.size == 0:
            raise malformed(where, f"record {where}: input_ids must be a non-empty list of token ids")
        if labels.shape != input_ids.shape:
            raise malformed(where, f"record {where}: labels has {labels.size} entries, input_ids {input_ids.size}")
        if self.vocab_size is not None and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise malformed(where, f"record {where}: token ids must lie in [0, {self.vocab_size})")
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
                    raise malformed(where, f"record {where}: loss_mask has {mask.size} entries, input_ids "
                                           f"{input_ids.size}")
                return input_ids, np.where(mask, input_ids, IGNORE_INDEX)
        except (TypeError, ValueError) as error:
            if isinstance(error, BadRecordError):
                raise
            raise malformed(where, f"record {where}: input_ids, labels and loss_mask must be lists of integers: "
                                   f"{error}") from None
        return input_ids, input_ids.copy()

    def _needs_tokenizer(self, kind: str, where: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"record {where} holds {kind}, which needs --tokenizer: run skrull-tokenizer tok, "
                             "then give --tokenizer tok (or a Hub model's id, --tokenizer ORG/NAME)\nhint: "
                             "skrull-tokenizer writes a small byte-level tokenizer with a ChatML template, offline, "
                             "which the built-in models take")
        return self.tokenizer

    def _text(self, text: object, where: str) -> Tokens:
        if not isinstance(text, str):
            raise malformed(where, f"record {where}: '{self.text_field}' must be a string")
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
        raise malformed(where, f"record {where}: 'prompt' and 'completion' must be two strings, or two lists of "
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
        raise malformed(where, f"record {where}: '{key}' must be a list of {{role, content}} strings")
    unknown = sorted({m["role"] for m in messages} - set(CHAT_ROLES))
    if unknown:
        raise malformed(where, f"record {where}: '{key}' has roles {', '.join(map(repr, unknown))}; a chat's are "
                               f"{', '.join(CHAT_ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt(conversations: object, where: str) -> list[dict[str, str]]:
    """ShareGPT's ``conversations`` (``from``, ``value``) as a chat's turns, its speakers as roles
    (``SHAREGPT_ROLES``)."""
    if not (isinstance(conversations, list) and all(
            isinstance(c, dict) and isinstance(c.get("from"), str) and isinstance(c.get("value"), str)
            for c in conversations)):
        raise malformed(where, f"record {where}: 'conversations' must be a list of {{from, value}} strings")
    unknown = sorted({c["from"] for c in conversations} - SHAREGPT_ROLES.keys())
    if unknown:
        raise malformed(where, f"record {where}: 'conversations' has speakers {', '.join(map(repr, unknown))}; "
                               f"ShareGPT's are {', '.join(SHAREGPT_ROLES)}")
    return [{"role": SHAREGPT_ROLES[c["from"]], "content": c["value"]} for c in conversations]


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
