"""Records by index, read one at a time, so no rank holds the data (``open_records``: the one place that decides
what a ``--data`` or ``--eval-data`` spec is):

- a JSONL file (``.jsonl``, a ``.json`` file of JSON lines, any other suffix),
  read by ``JsonlRecords`` from the byte offset of its line (an index of the
  offsets is built once, 12 bytes per record);
- a parquet, CSV or ``.json`` file that holds a JSON array;
- a dataset folder: ``Dataset.save_to_disk``'s, or data files laid out as on
  the Hub (``DIR:SPLIT`` picks a split; without one, ``train``, and a
  ``save_to_disk`` folder of a single ``Dataset`` has no splits);
- a Hugging Face Hub data set, ``ORG/NAME[@REVISION][:SPLIT]``: its snapshot
  in the Hugging Face cache (``trainer_client/hub.py``), read as a folder.

A name with a data file's suffix that is not a file is missing, never a Hub
id (``hub.hub_ref`` decides what is one).

Every source but a JSONL file is read as memory-mapped Arrow rows (``DatasetRecords``): ``datasets.load_dataset``
converts a file, a folder of data files or a Hub snapshot once into its own cache (``HF_DATASETS_CACHE``), and a
``save_to_disk`` folder is Arrow already.

What the records are (``identity``), without reading a large file whole:

- a JSONL file: its path, its size and a digest of its first and last records;
- a parquet, CSV or JSON file: its path, its size, its rows and a digest of its
  first and last 64 KiB;
- a ``save_to_disk`` folder: its path (and split), its rows and the
  fingerprint ``datasets`` saved with it;
- a folder of data files: its path and split, its rows and the fingerprint
  ``datasets`` derives from the files' paths and modification times (touching
  a file counts as a change);
- a Hub data set: its id and split, the commit read and its rows, wherever the
  cache lies.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from trainer_client.data.samples import DataIdentity, malformed
from trainer_client.hub import HubSnapshot, RepoKind, fetch, hub_ref, is_data_file_name

__all__ = ["DEFAULT_SPLIT", "DatasetRecords", "JsonlRecords", "RecordReader", "open_records"]

DEFAULT_SPLIT = "train"  # of a dataset folder or a Hub data set given without :SPLIT
_TAIL_BLOCK_BYTES = 1 << 16  # a JSONL file's last record is looked for this many bytes at a time, from the end
_DIGEST_BYTES = 1 << 16  # a parquet, CSV or JSON file's identity digests this many bytes at each end
_SNIFF_BYTES = 1 << 12  # where a .json file's first character is looked for


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
            raise malformed(where, f"record {where} is not JSON: {error}") from None

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
