"""Training data: global batches of token sequences, identical on every rank. The package's modules, bottom first:

- ``samples``: a sequence and its labels (``Sample``), a global batch (``GlobalBatch``), which data a source yields
  (``DataIdentity``), a record that cannot train and why (``BadRecordError``, ``Defect``), the lengths a run trained
  on (``LengthStats``);
- ``encoding``: a record → a sample (``RecordEncoder``: token ids, chats, prompt–completion pairs, text), and the
  tokenizer (``load_tokenizer``);
- ``records``: the records of a JSONL, parquet, CSV or JSON file, a dataset folder or a Hub data set, read one at a
  time (``open_records``);
- ``sources``: what ``--data`` names, as global batches in each epoch's order (``make_source``: synthetic lengths,
  or records);
- ``record_check`` (every record checked before the first step) and ``evaluation`` (the held-out set and its loss).

Hugging Face Hub ids are ``trainer_client.hub``'s. The public names of the first four are importable from here.
"""

from __future__ import annotations

from trainer_client.data.encoding import CHAT_ROLES, SHAREGPT_ROLES, RecordEncoder, load_tokenizer, record_encoder
from trainer_client.data.records import DatasetRecords, JsonlRecords, RecordReader, open_records
from trainer_client.data.samples import (
    IGNORE_INDEX,
    BadRecordError,
    DataIdentity,
    Defect,
    GlobalBatch,
    LengthStats,
    RecordTooLongError,
    Sample,
    length_summary,
)
from trainer_client.data.sources import DataSource, RecordSource, SyntheticSource, make_source

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
    "RecordReader",
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
