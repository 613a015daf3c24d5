"""Where the service keeps each job's feedback state, so that it outlives a process and is shared by workers.

A job's state (``core.feedback.JobFeedback``: base and refit profile, the
observation windows, the refit coefficients, the BucketSize cap) is stored as
one JSON document, described once (``_JobDocument``, read and written by a
pydantic ``TypeAdapter``: ``encode_job``, ``decode_job``); nothing is pickled.
``SKRULL_STATE_URL`` picks the store:

* a file path, or ``sqlite://`` followed by one (the default,
  ``settings.default_state_url``): an embedded SQLite database in WAL mode,
  shared by the workers of one host;
* ``redis://`` or ``rediss://``: a Redis server, shared by workers and
  replicas alike (standalone, or one shard: eviction deletes keys a script
  computes). Options of redis-py's URL apply (``?socket_timeout=0.5`` lowers
  the 2 s a call may wait for an answer).

Both hold what the in-memory store held: at most ``max_jobs`` jobs, the least
recently used forgotten first (a plan, an adopted refit or a registered profile
uses a job), each bounded by its refit windows (``FeedbackConfig.window``) and,
where its trainer registered its base profile, by that document's size
(``profiles.MAX_PROFILE_FILE_BYTES``).

Concurrency: every job carries a *revision*, a random token renewed on every
write. A refit is adopted only if the job still has the revision it was refit
from (``replace``: a compare-and-set, in a SQLite transaction or a Redis Lua
script), so two workers refitting the same job never overwrite each other:
the later refit is refused (the service answers 429, and the report can be
sent again onto the newer state). A record written by another format version
reads as absent (the job starts again).

Off the event loop: the service calls a store through ``AsyncJobStore``,
each call in a worker thread, at most 4 at once (``_STORE_THREADS``). A store
that hangs (a stopped Redis holds a call up to its 2 s timeout, a SQLite file
another process locked up to 5 s) holds those threads and the requests that
wait for them, never the event loop (``/healthz``, ``/readyz``, ``/metrics``
and plans without a ``job_id`` answer meanwhile) nor the threads that parse
large bodies. A store may be called from several threads at once.

Cost, measured on the 2-core development machine with full windows (256):
encoding a job takes about 0.15 ms and decoding one 0.6 ms; a plan of a known
job costs p50 0.1 ms in SQLite and 0.3 ms in a local Redis, plus about 0.1 ms
for each of its two hops to a worker thread and back; a job another worker
changed is decoded again once (about 1 ms with its read).

Failures: a call that meets its backend's own failure (a corrupt, locked, full
or read-only file or folder; an unreachable or unanswering server) raises
``JobStoreUnavailableError``, is counted (``ServiceEvents.job_store_failed``),
and leaves ``state`` saying why until a call succeeds. The service then plans
without the job's state and says so in the answer, and refuses reports (503):
a write is one transaction or one script, so a refused one changed nothing.
The store recovers without a restart: SQLite lets go of the file after a
failure and opens it again at the next call (a connection that met a corrupt
file keeps failing after the file is restored), and redis-py connects again by
itself. Opening the store is the exception: one that cannot be opened stops the
start, so a wrong URL or path is found then, not at the first request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import sqlite3
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, TypeVarTuple

import anyio
import anyio.to_thread
import redis
from pydantic import BeforeValidator, ConfigDict, PlainSerializer, PlainValidator, TypeAdapter

from scheduler_service.core.feedback import (
    ComputeObservation,
    FeedbackConfig,
    JobFeedback,
    MemoryObservation,
    job_key,
)
from scheduler_service.core.models import ModelShape
from scheduler_service.core.profile import Profile, parse_profile
from scheduler_service.runtime.errors import JobStoreUnavailableError, unavailable_job_state
from scheduler_service.runtime.events import ServiceEvents

__all__ = [
    "AsyncJobStore",
    "JobStore",
    "RedisJobStore",
    "SQLiteJobStore",
    "StoredJob",
    "decode_job",
    "encode_job",
    "open_job_store",
]

logger = logging.getLogger("scheduler_service.runtime.job_store")

# Store calls in flight at once (``AsyncJobStore``): a hung store holds at most these threads.
_STORE_THREADS = 4
_SQLITE_BUSY_TIMEOUT_S = 5.0  # how long a write waits for another worker's transaction before it fails
_REDIS_TIMEOUT_S = 2.0  # a Redis call that takes longer fails rather than holding its request

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredJob:
    job: JobFeedback
    revision: str  # renewed on every write; ``replace`` adopts a refit only from the revision it was made from


# ---- the stored document ----------------------------------------------------------------------------------

def _from_rows(observation_type: type[Any]) -> Callable[[Any], list[dict[str, Any]]]:
    """Reads a window's rows of numbers as ``observation_type``'s fields, in their order."""
    names = tuple(field.name for field in fields(observation_type))
    return lambda rows: [dict(zip(names, row, strict=True)) for row in rows]


def _to_rows(observation_type: type[Any]) -> Callable[[Any], list[tuple[Any, ...]]]:
    """Writes a window of ``observation_type`` as it is stored: each one's fields' values, in their order."""
    row = operator.attrgetter(*(field.name for field in fields(observation_type)))
    return lambda window: [row(observation) for observation in window]


def _profile_document(profile: Profile) -> dict[str, Any]:
    return profile.raw


# A profile is stored as its own document, which ``parse_profile`` reads (it checks the values' ranges).
_StoredProfile = Annotated[Profile, PlainValidator(parse_profile), PlainSerializer(_profile_document)]
# A window is stored as rows of numbers ([work_s, num_fixed, time_s]; [tokens, peak_bytes]), up to 256 by default.
_ComputeWindow = Annotated[tuple[ComputeObservation, ...], BeforeValidator(_from_rows(ComputeObservation)),
                           PlainSerializer(_to_rows(ComputeObservation))]
_MemoryWindow = Annotated[tuple[MemoryObservation, ...], BeforeValidator(_from_rows(MemoryObservation)),
                          PlainSerializer(_to_rows(MemoryObservation))]


@dataclass(frozen=True, kw_only=True, slots=True)
class _JobDocument:
    """A job as it is stored: ``format``, then ``JobFeedback``'s fields by name (``encode_job`` passes every one, so
    a field added there and not here fails the first write). Model and config as their fields by name."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    format: Literal[1]  # of this document: a record of another format reads as absent
    job_id: str
    base: _StoredProfile
    base_registered: bool = False  # absent from records written before it existed
    model: ModelShape
    dp_size: int
    cp_size: int
    memory_budget_bytes: float
    config: FeedbackConfig
    profile: _StoredProfile
    compute_scale: float
    fixed_s: float
    memory_slope: float | None
    memory_intercept: float | None
    bucket_cap: int | None
    fit_median_relative_error: float | None
    num_observations: int
    num_downweighted: int
    compute_window: _ComputeWindow
    memory_window: _MemoryWindow


_DOCUMENT = TypeAdapter(_JobDocument)


def encode_job(job: JobFeedback) -> str:
    """The job as JSON (``_JobDocument``)."""
    document = _JobDocument(format=1, **{field.name: getattr(job, field.name) for field in fields(JobFeedback)})
    # JSON has no NaN or infinity, which pydantic would write as null (a NaN compute_scale would lose the job, a NaN
    # memory_slope read back as None): refused here, as a ValueError, before anything is stored.
    return json.dumps(_DOCUMENT.dump_python(document, mode="json"), allow_nan=False, separators=(",", ":"))


def decode_job(text: str) -> JobFeedback | None:
    """The job ``encode_job`` wrote; ``None`` for a document of another format, or one damaged in the store (the
    job then starts again, as a forgotten one does)."""
    try:
        document = _DOCUMENT.validate_json(text)
    # A ValidationError (and a PlanningError of a profile or model) is a ValueError; ``parse_profile`` raises the
    # others on a profile document of the wrong shape.
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("a stored job could not be read; it starts again", extra={"error": repr(error)[:200]})
        return None
    return JobFeedback(**{field.name: getattr(document, field.name) for field in fields(JobFeedback)})


def _key_text(job: JobFeedback) -> str:
    """``job_key`` as text, so a store compares keys without decoding a job."""
    name, model, dp_size, cp_size = job_key(job)
    return json.dumps([name, asdict(model), dp_size, cp_size], sort_keys=True, separators=(",", ":"))


def _new_revision() -> str:
    return uuid.uuid4().hex


# ---- the interface -----------------------------------------------------------------------------------------

class JobStore(ABC):
    """Jobs by id, least recently used forgotten first beyond ``max_jobs``.

    Decoding a job with full windows costs about 0.6 ms, so each process keeps the jobs it decoded last
    (at most ``max_jobs``) and reads a job's document again only when its revision changed: a job decoded by a
    call that another thread's write overtook is read again at its next use. Every public call raises
    ``JobStoreUnavailableError`` when its backend fails. Calls block (``AsyncJobStore`` runs them off the event
    loop) and may come from several threads at once."""

    _failures: ClassVar[tuple[type[Exception], ...]]  # the backend's own failures (not a bug of this module)

    def __init__(self, *, max_jobs: int, events: ServiceEvents) -> None:
        self.max_jobs = max_jobs
        self._events = events
        self._decoded: dict[str, StoredJob] = {}
        self._unavailable: str | None = None  # why the last call failed; None once a call succeeds
        self._state_lock = threading.Lock()  # guards the two above against calls in other threads

    @property
    def state(self) -> str:
        """``ok``, or ``unavailable: <reason>`` from the last call's failure until a call succeeds."""
        return "ok" if self._unavailable is None else unavailable_job_state(self._unavailable)

    def get(self, job_id: str) -> StoredJob | None:
        """The job and its revision; ``None`` if unknown (never planned, forgotten, or of another format)."""
        with self._call("get"):
            cached = self._decoded.get(job_id)
            if cached is not None and self._revision(job_id) == cached.revision:
                return cached
            record = self._record(job_id)
        if record is None or (job := decode_job(record[1])) is None:
            with self._state_lock:
                self._decoded.pop(job_id, None)
            return None
        return self._remember(StoredJob(job=job, revision=record[0]))

    def keep(self, job: JobFeedback) -> int:
        """Register or use a job after a successful plan: a kept job with the same ``job_key`` stays as it is
        (its refit included), any other is replaced by ``job``. Forgets the least recently used beyond
        ``max_jobs``; the number of jobs kept."""
        return self._write("keep", job, overwrite=False)

    def register(self, job: JobFeedback) -> int:
        """Write ``job`` whatever is kept under its id, even with the same ``job_key`` (a trainer registered another
        profile of that name: the job restarts from it), and use it. Forgets the least recently used beyond
        ``max_jobs``; the number of jobs kept."""
        return self._write("register", job, overwrite=True)

    def _write(self, operation: str, job: JobFeedback, *, overwrite: bool) -> int:
        revision = _new_revision()
        with self._call(operation):
            written, num_jobs = self._keep(job.job_id, _key_text(job), revision, lambda: encode_job(job),
                                           overwrite=overwrite)
        if written:
            self._remember(StoredJob(job=job, revision=revision))
        return num_jobs

    def replace(self, stored: StoredJob, updated: JobFeedback) -> bool:
        """Adopt ``updated`` if the job still has ``stored.revision``; ``False`` (nothing written) otherwise."""
        revision = _new_revision()
        document = encode_job(updated)
        with self._call("replace"):
            replaced = self._replace(updated.job_id, stored.revision, revision, document)
        if not replaced:
            return False
        self._remember(StoredJob(job=updated, revision=revision))
        return True

    def _remember(self, stored: StoredJob) -> StoredJob:
        with self._state_lock:
            self._decoded.pop(stored.job.job_id, None)
            self._decoded[stored.job.job_id] = stored
            if len(self._decoded) > self.max_jobs:
                del self._decoded[next(iter(self._decoded))]
        return stored

    @contextlib.contextmanager
    def _call(self, operation: str) -> Iterator[None]:
        """One call of the store: a failure of its backend lets go of the connection, is counted, kept in
        ``state`` and raised as ``JobStoreUnavailableError``; a call that succeeds clears ``state``. Logged when
        the store becomes unavailable and when it is back."""
        try:
            yield
        except self._failures as error:
            reason = self._reason(error)
            self._let_go()
            with self._state_lock:
                if self._unavailable is None:
                    logger.warning("job store unavailable", extra={"operation": operation, "reason": reason})
                self._unavailable = reason
            self._events.job_store_failed(operation)
            raise JobStoreUnavailableError(reason, operation=operation) from error
        with self._state_lock:
            if self._unavailable is not None:
                logger.info("job store available again", extra={"operation": operation})
                self._unavailable = None

    @staticmethod
    @abstractmethod
    def _reason(error: Exception) -> str:
        """What an answer may say of one of ``_failures``: no path, host or value of a setting."""

    @abstractmethod
    def _let_go(self) -> None:
        """After a failure: drop what the next call should not reuse."""

    @abstractmethod
    def _revision(self, job_id: str) -> str | None:
        """The job's revision; ``None`` if unknown."""

    @abstractmethod
    def _record(self, job_id: str) -> tuple[str, str] | None:
        """The job's revision and document, read together; ``None`` if unknown."""

    @abstractmethod
    def _keep(self, job_id: str, key: str, revision: str, document: Callable[[], str], *,
              overwrite: bool) -> tuple[bool, int]:
        """``keep`` (and ``register``, ``overwrite``): write ``document()`` under ``revision`` unless the job is kept
        with ``key`` and not ``overwrite``; use the job; forget beyond ``max_jobs``. Whether it wrote, and the
        number of jobs kept."""

    @abstractmethod
    def _replace(self, job_id: str, expected: str, revision: str, document: str) -> bool:
        """``replace``: write ``document`` under ``revision`` and use the job, if it has revision ``expected``."""

    @abstractmethod
    def close(self) -> None: ...


def open_job_store(url: str, *, max_jobs: int, events: ServiceEvents) -> JobStore:
    """The store ``url`` names: ``redis://``/``rediss://`` for Redis, a path or ``sqlite://PATH`` for SQLite."""
    if url.startswith(("redis://", "rediss://")):
        return RedisJobStore(url, max_jobs=max_jobs, events=events)
    path = url.removeprefix("sqlite://")
    if "://" in path:
        raise ValueError(f"SKRULL_STATE_URL must be a file path, sqlite://PATH, redis:// or rediss://; "
                         f"got a {path.split('://')[0]}:// URL")
    return SQLiteJobStore(Path(path), max_jobs=max_jobs, events=events)


# ---- the event loop's view ----------------------------------------------------------------------------------

class AsyncJobStore:
    """A ``JobStore`` as the event loop calls it: each call in a worker thread, at most ``_STORE_THREADS`` at once
    (a limiter of its own, so a hung store never holds the threads that parse large bodies); the next call waits
    for a free one."""

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._limiter = anyio.CapacityLimiter(_STORE_THREADS)

    @property
    def state(self) -> str:
        """``JobStore.state``: read without calling the store, so a hung store cannot hold a probe."""
        return self._store.state

    async def get(self, job_id: str) -> StoredJob | None:
        """``JobStore.get``."""
        return await self._in_thread(self._store.get, job_id)

    async def keep(self, job: JobFeedback) -> int:
        """``JobStore.keep``."""
        return await self._in_thread(self._store.keep, job)

    async def register(self, job: JobFeedback) -> int:
        """``JobStore.register``."""
        return await self._in_thread(self._store.register, job)

    async def replace(self, stored: StoredJob, updated: JobFeedback) -> bool:
        """``JobStore.replace``."""
        return await self._in_thread(self._store.replace, stored, updated)

    async def _in_thread(self, call: Callable[[*Ts], T], *args: *Ts) -> T:
        return await anyio.to_thread.run_sync(call, *args, limiter=self._limiter)

    def close(self) -> None:
        self._store.close()


# ---- SQLite ------------------------------------------------------------------------------------------------

class SQLiteJobStore(JobStore):
    """One table in a WAL-mode file; every write a ``BEGIN IMMEDIATE`` transaction, so workers sharing the file
    take turns (waiting up to ``_SQLITE_BUSY_TIMEOUT_S``). ``used`` orders jobs by their last use. After a failure
    the connection is closed (which rolls back what it had begun) and the next call opens the file again."""

    # Corrupt (DatabaseError itself); locked beyond the timeout, full, read-only, unopenable (OperationalError).
    _failures = (sqlite3.DatabaseError,)

    def __init__(self, path: Path, *, max_jobs: int, events: ServiceEvents) -> None:
        super().__init__(max_jobs=max_jobs, events=events)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._path = path
        # One connection per process, shared by the threads that call the store (``AsyncJobStore``), one call at a
        # time: SQLite lets one writer in at once anyway.
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        with self._call("open"), self._lock:
            self._connection()

    def _connection(self) -> sqlite3.Connection:
        """The open connection, or a new one (at the start, and at the first call after a failure); called with
        the lock held."""
        if self._db is None:
            # Autocommit mode: transactions are opened explicitly.
            db = sqlite3.connect(self._path, timeout=_SQLITE_BUSY_TIMEOUT_S, isolation_level=None,
                                 check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                # With WAL, NORMAL survives a killed process; only a power loss may cost the last commits.
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, job_key TEXT NOT NULL, "
                           "revision TEXT NOT NULL, used INTEGER NOT NULL, document TEXT NOT NULL)")
                db.execute("CREATE INDEX IF NOT EXISTS jobs_by_use ON jobs (used)")
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    @staticmethod
    def _reason(error: Exception) -> str:
        return str(error)  # SQLite's own words ("database or disk is full"), which name no path

    def _let_go(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _query(self, sql: str, *args: object) -> Any:
        with self._lock:
            return self._connection().execute(sql, args).fetchone()

    def _revision(self, job_id: str) -> str | None:
        row = self._query("SELECT revision FROM jobs WHERE job_id = ?", job_id)
        return None if row is None else str(row[0])

    def _record(self, job_id: str) -> tuple[str, str] | None:
        row = self._query("SELECT revision, document FROM jobs WHERE job_id = ?", job_id)
        return None if row is None else (str(row[0]), str(row[1]))

    @staticmethod
    def _next_use(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT coalesce(max(used), 0) + 1 FROM jobs").fetchone()[0])

    def _keep(self, job_id: str, key: str, revision: str, document: Callable[[], str], *,
              overwrite: bool) -> tuple[bool, int]:
        with self._transaction() as db:
            used = self._next_use(db)
            kept = db.execute("SELECT job_key FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            written = overwrite or kept is None or kept[0] != key
            if written:
                db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?)",
                           (job_id, key, revision, used, document()))
            else:
                db.execute("UPDATE jobs SET used = ? WHERE job_id = ?", (used, job_id))
            db.execute("DELETE FROM jobs WHERE job_id IN (SELECT job_id FROM jobs ORDER BY used DESC "
                       "LIMIT -1 OFFSET ?)", (self.max_jobs,))
            return written, int(db.execute("SELECT count(*) FROM jobs").fetchone()[0])

    def _replace(self, job_id: str, expected: str, revision: str, document: str) -> bool:
        with self._transaction() as db:
            cursor = db.execute("UPDATE jobs SET revision = ?, used = ?, document = ? "
                                "WHERE job_id = ? AND revision = ?",
                                (revision, self._next_use(db), document, job_id, expected))
            return cursor.rowcount == 1

    def close(self) -> None:
        self._let_go()


# ---- Redis -------------------------------------------------------------------------------------------------

# KEYS: the job's hash, the use order (a sorted set of job ids), the use clock. ARGV: job id, key, revision,
# document (empty: only if the job is kept with this key, else answer nil and the caller sends it), max_jobs, the
# prefix of job hashes, "1" to write the document even if the job is kept with this key. Answers whether it wrote
# and the number of jobs kept.
_KEEP = """
local written = 0
if ARGV[7] == '1' or redis.call('HGET', KEYS[1], 'key') ~= ARGV[2] then
  if ARGV[4] == '' then
    return false
  end
  redis.call('HSET', KEYS[1], 'key', ARGV[2], 'revision', ARGV[3], 'document', ARGV[4])
  written = 1
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #oldest, 2 do
    redis.call('DEL', ARGV[6] .. oldest[i])
  end
end
return {written, redis.call('ZCARD', KEYS[2])}
"""
# KEYS: the job's hash, the use order, the use clock. ARGV: job id, expected revision, new revision, document.
_REPLACE = """
if redis.call('HGET', KEYS[1], 'revision') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'revision', ARGV[3], 'document', ARGV[4])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
return 1
"""


class RedisJobStore(JobStore):
    """A hash per job (key, revision, document), a sorted set ordering jobs by last use and a counter as its
    clock, all under ``skrull:jobs:``. Writes are Lua scripts, atomic on the server."""

    _PREFIX = "skrull:jobs:"
    _failures = (redis.RedisError,)

    def __init__(self, url: str, *, max_jobs: int, events: ServiceEvents) -> None:
        super().__init__(max_jobs=max_jobs, events=events)
        self._client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=_REDIS_TIMEOUT_S,
                                            socket_connect_timeout=_REDIS_TIMEOUT_S)
        self._keep_script = self._client.register_script(_KEEP)
        self._replace_script = self._client.register_script(_REPLACE)
        self._order = self._PREFIX + "use-order"
        self._clock = self._PREFIX + "use-clock"
        with self._call("open"):
            self._client.ping()  # a wrong URL stops the start, not the first request

    @staticmethod
    def _reason(error: Exception) -> str:
        return type(error).__name__  # redis-py's messages name the server's host and port

    def _let_go(self) -> None:
        """Nothing to drop: redis-py discards a broken connection and connects again at the next command."""

    def _job_hash(self, job_id: str) -> str:
        return f"{self._PREFIX}job:{job_id}"

    def _revision(self, job_id: str) -> str | None:
        revision = self._client.hget(self._job_hash(job_id), "revision")
        return None if revision is None else str(revision)

    def _record(self, job_id: str) -> tuple[str, str] | None:
        revision, document = self._client.hmget(self._job_hash(job_id), ["revision", "document"])
        return None if revision is None or document is None else (str(revision), str(document))

    def _keep(self, job_id: str, key: str, revision: str, document: Callable[[], str], *,
              overwrite: bool) -> tuple[bool, int]:
        keys = [self._job_hash(job_id), self._order, self._clock]
        flag = "1" if overwrite else "0"
        # Most plans use a job already kept: try without the document first (encoding one costs ~1 ms).
        answer = None if overwrite else self._keep_script(
            keys=keys, args=[job_id, key, revision, "", self.max_jobs, self._job_hash(""), flag])
        if answer is None:
            answer = self._keep_script(keys=keys, args=[job_id, key, revision, document(), self.max_jobs,
                                                        self._job_hash(""), flag])
        written, num_jobs = answer
        return bool(written), int(num_jobs)

    def _replace(self, job_id: str, expected: str, revision: str, document: str) -> bool:
        return bool(self._replace_script(keys=[self._job_hash(job_id), self._order, self._clock],
                                         args=[job_id, expected, revision, document]))

    def close(self) -> None:
        self._client.close()
