"""The training records checked before the first step: one pass finds every record that cannot train, so that no step
fails on one, hours into a run.

``check_records`` reads and encodes records exactly as the batches will (the run's ``RecordEncoder``), keeping 16
bytes per record: its tokens and its tokens with loss, as trained. The trainer gives every rank a share of the records
(rank r: records r, r + world, …) and gathers the shares, so the pass costs one encoding of the data set divided by
the ranks, and every rank then holds the same verdict (``RecordCheck.merged``). Encoding is deterministic: a record
that passed cannot fail when a batch reaches it.

A record cannot train (``samples.Defect``) when it is longer than ``--max-length`` without ``--truncate``, longer than
any plan of the layout holds, has no token with loss, is an empty chat or a chat without an assistant turn, when
the chat template does not render a prefix of the chat as a prefix of its tokens, or when it is malformed (not JSON,
no known shape, wrong types, token ids outside the vocabulary). ``RecordCheck.report`` lists them all, by defect,
with counts, their places (``file:line``, ``dir[row]``) and each defect's fix. What the trainer does with them
(``--skip-bad-records``) is its policy; ``write_bad_records`` lists them in the run folder.

The same pass gives the length distribution of what will train (``RecordCheck.summary``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from trainer_client.config_choices import CHAT_TEMPLATES
from trainer_client.data.encoding import RecordEncoder
from trainer_client.data.records import RecordReader
from trainer_client.data.samples import BadRecordError, Defect, length_summary

__all__ = ["BAD_RECORDS_FILE", "BadRecord", "BadRecordsError", "RecordCheck", "check_records", "write_bad_records"]

BAD_RECORDS_FILE = "bad-records.jsonl"  # in the run folder (--checkpoint-dir): one JSON line per record left out
_SHOWN_PER_DEFECT = 5  # places a report names per defect; the file lists them all


class BadRecordsError(ValueError):
    """Records of ``--data`` cannot train and the run does not skip them: every rank stops before the first step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BadRecord:
    """A record that cannot train: its index in the source, where it is, why, and its tokens where its length is
    the defect."""

    index: int
    where: str
    defect: Defect
    message: str
    num_tokens: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordCheck:
    """What the pass found of records ``indices`` (ascending): each one's tokens and tokens with loss as trained
    (0 for a bad record), and the bad records, by index."""

    indices: npt.NDArray[np.int64]
    num_tokens: npt.NDArray[np.int64]
    num_loss_tokens: npt.NDArray[np.int64]
    bad: tuple[BadRecord, ...]

    @classmethod
    def merged(cls, shares: Sequence[RecordCheck]) -> RecordCheck:
        """The check of every record the ``shares`` checked, in index order."""
        indices = np.concatenate([share.indices for share in shares])
        order = np.argsort(indices, kind="stable")
        return cls(indices=indices[order],
                   num_tokens=np.concatenate([share.num_tokens for share in shares])[order],
                   num_loss_tokens=np.concatenate([share.num_loss_tokens for share in shares])[order],
                   bad=tuple(sorted((record for share in shares for record in share.bad), key=lambda r: r.index)))

    @property
    def num_records(self) -> int:
        return int(self.indices.size)

    @property
    def bad_indices(self) -> tuple[int, ...]:
        return tuple(record.index for record in self.bad)

    def summary(self) -> str:
        """The length distribution of the records that train."""
        trained = self.num_tokens > 0
        return length_summary(self.num_tokens[trained], int(self.num_loss_tokens[trained].sum()), unit="records")

    def report(self, *, max_length: int, plan_capacity: str) -> list[str]:
        """One line per defect found: what it is, how many records have it and where the first ones are (a
        malformed record's own message, each on a line of its own, since each says something else).
        ``plan_capacity``: what a plan holds, as the user reads it (``512 tokens: bucket size 256 × cp 2``)."""
        by_defect: dict[Defect, list[BadRecord]] = defaultdict(list)
        for record in self.bad:
            by_defect[record.defect].append(record)
        lines = []
        for defect in Defect:  # a fixed order of the defects, whatever the records' order
            found = by_defect.get(defect)
            if not found:
                continue
            shown, more = found[:_SHOWN_PER_DEFECT], len(found) - _SHOWN_PER_DEFECT
            title = _DESCRIPTION[defect].format(max_length=max_length, plan_capacity=plan_capacity)
            if defect is Defect.MALFORMED:
                lines.append(f"  {title}, {_records(len(found))}:")
                lines += [f"    {record.message}" for record in shown]
                if more > 0:
                    lines.append(f"    … and {more} more")
            else:
                places = ", ".join(record.where + (f" ({record.num_tokens} tokens)" if record.num_tokens else "")
                                   for record in shown)
                lines.append(f"  {title}, {_records(len(found))}: {places}" + (f", … and {more} more" if more > 0
                                                                                 else ""))
        return lines

    def fixes(self) -> list[str]:
        """What the user can do about each defect found, in the order ``report`` names them."""
        found = {record.defect for record in self.bad}
        return list(dict.fromkeys(fix for defect, fix in _FIX.items() if defect in found))


# What each defect is, as a report's line names it, and how to train such records; records of a defect without a fix
# can only be left out (--skip-bad-records) or corrected in the data.
_DESCRIPTION: dict[Defect, str] = {
    Defect.TOO_LONG: "longer than --max-length {max_length}",
    Defect.BEYOND_PLAN: "longer than a plan of this layout holds ({plan_capacity})",
    Defect.NO_LOSS: "no token with loss",
    Defect.EMPTY_CHAT: "an empty chat",
    Defect.NO_ASSISTANT: "a chat without an assistant turn",
    Defect.TEMPLATE: "the chat template does not render a prefix of the chat as a prefix of its tokens",
    Defect.MALFORMED: "malformed",
}
_EVERY_TOKEN = "--loss-on all trains every token of chats and prompt–completion records"
_FIX: dict[Defect, str] = {
    Defect.TOO_LONG: "--truncate cuts records to --max-length",
    Defect.BEYOND_PLAN: "a larger --bucket-size, or more ranks, holds longer records; --max-length with --truncate "
                        "cuts them to what a plan holds",
    Defect.NO_LOSS: _EVERY_TOKEN,
    Defect.NO_ASSISTANT: _EVERY_TOKEN,
    Defect.TEMPLATE: f"--chat-template ({', '.join(CHAT_TEMPLATES)}, or a file of Jinja) renders the chats with "
                     "another template; --loss-on all needs no prefixes",
}


def _records(count: int) -> str:
    return f"{count} record" if count == 1 else f"{count} records"


def check_records(records: RecordReader, encoder: RecordEncoder, *, indices: npt.NDArray[np.int64],
                  plan_capacity: int | None = None) -> RecordCheck:
    """Encode records ``indices`` of ``records`` as the batches will and find those that cannot train; a record
    longer than ``plan_capacity`` tokens is one no plan holds. A failure that is no record's (a chat without a
    tokenizer) is raised at once: every record would have it."""
    num_tokens = np.zeros(indices.size, dtype=np.int64)
    num_loss_tokens = np.zeros(indices.size, dtype=np.int64)
    bad = []
    for position, index in enumerate(indices.tolist()):
        try:
            record, where = records.read(index)  # a JSON line that is not JSON is a bad record too
            sample = encoder.encode(record, where)
        except BadRecordError as error:
            bad.append(BadRecord(index=index, where=error.where, defect=error.defect, message=str(error),
                                 num_tokens=error.num_tokens))
            continue
        if plan_capacity is not None and sample.num_tokens > plan_capacity:
            bad.append(BadRecord(index=index, where=where, defect=Defect.BEYOND_PLAN, num_tokens=sample.num_tokens,
                                 message=f"record {where} has {sample.num_tokens} tokens; a plan holds at most "
                                         f"{plan_capacity}"))
        elif sample.num_loss_tokens == 0:
            bad.append(BadRecord(index=index, where=where, defect=Defect.NO_LOSS,
                                 message=f"record {where} has no token with loss"))
        else:
            num_tokens[position], num_loss_tokens[position] = sample.num_tokens, sample.num_loss_tokens
    return RecordCheck(indices=indices, num_tokens=num_tokens, num_loss_tokens=num_loss_tokens, bad=tuple(bad))


def write_bad_records(path: Path, bad: Sequence[BadRecord]) -> None:
    """List ``bad`` in ``path``, one JSON object a line (``where``, ``defect``, ``message``, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(record)) + "\n" for record in bad))
