"""What a W&B offline run wrote, read back: its run file's records (``wandb_records``), for tests that check what
the trainer reported."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

__all__ = ["wandb_records"]


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): a header (``:W&B``, magic, version), then LevelDB log
    records (CRC, length, type) in 32 KiB blocks, a record split over blocks as first, middle(s) and last, each
    a ``wandb.proto.wandb_internal_pb2.Record``. W&B's own reader is in its Go core, not in the Python package."""
    from wandb.proto.wandb_internal_pb2 import Record  # importing wandb takes seconds: only a reader pays it

    data = run_file.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block_bytes, header_bytes, full, last = 32768, 7, 1, 4
    position, pieces, records = 7, b"", []
    while position + header_bytes <= len(data):
        left_in_block = block_bytes - position % block_bytes
        if left_in_block < header_bytes:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + header_bytes])
        if length == kind == 0:
            break
        position += header_bytes
        pieces += data[position:position + length]
        position += length
        if kind in (full, last):
            record = Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records
