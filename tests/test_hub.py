"""Hugging Face Hub ids for ``--model``, ``--tokenizer``, ``--data`` and ``--eval-data``, resolved from a cache built
here (``tests/hub_cache.py``) with no network: what each id reads, the commit every rank reads, and the error that
names a missing, unknown, gated or unreachable id with its fix."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from huggingface_hub import constants
from transformers import AutoTokenizer

import trainer_client.hub
from scheduler_service.core.models import MODEL_CATALOGUE
from tests.hub_cache import HubCache, commit_of
from trainer_client.components.run_identity import model_identity
from trainer_client.data import DataIdentity, RecordSource, load_tokenizer, make_source, open_records
from trainer_client.data.evaluation import EvalSet
from trainer_client.distributed import ParallelContext, free_port
from trainer_client.hub import HubError, HubRef, HubSnapshot, RepoKind, fetch, fetch_on_rank_0_first, hub_ref
from trainer_client.models.model import build_model, model_folder, model_shape

RECORDS = [{"input_ids": [k + 1, 7, 1000 - k]} for k in range(5)]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    cache = HubCache(tmp_path / "hub")
    cache.offline(monkeypatch)
    return cache


def _source(spec: str, *, global_batch: int = 2) -> RecordSource:
    source = make_source(spec, global_batch_size=global_batch, vocab_size=1024, max_length=64, seed=0)
    assert isinstance(source, RecordSource)
    return source


def _first_tokens(source: RecordSource) -> list[int]:
    return [int(sample.input_ids[0]) - 1 for sample in source.batch(0).samples]


def test_a_spec_is_a_hub_id_only_when_no_local_path_or_built_in_name_has_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_ref("Qwen/Qwen2.5-0.5B@v1.0", RepoKind.MODEL) == HubRef(kind=RepoKind.MODEL, repo_id="Qwen/Qwen2.5-0.5B",
                                                                      revision="v1.0")
    data = hub_ref("org/set@refs/pr/1:test[:10%]", RepoKind.DATASET)
    assert data is not None and (data.repo_id, data.revision, data.split) == ("org/set", "refs/pr/1", "test[:10%]")
    assert [hub_ref(spec, RepoKind.MODEL) for spec in ("tiny", "qwen2.5-7b", "./model", "/abs/model", "a/b/c",
                                                       "org/model:train")] == [None] * 6
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_ref("org/name", RepoKind.MODEL) is None and hub_ref("org/name:test", RepoKind.DATASET) is None


def test_a_model_id_reads_its_snapshot_from_the_offline_cache(hub: HubCache) -> None:
    snapshot = hub.add_model("org/tiny")
    assert model_folder("org/tiny") == snapshot
    assert model_shape("org/tiny") == replace(MODEL_CATALOGUE["tiny"], name="org/tiny")
    loaded, original = build_model("org/tiny"), build_model("tiny", seed=0)
    assert loaded.config._attn_implementation == "dacp"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values(),
                                                 strict=True))
    # the same model from a local folder or from the Hub: a resume checks its config, wherever it lies
    assert model_identity("org/tiny") == model_identity(str(snapshot))
    text = "the model reads long documents"
    assert load_tokenizer("org/tiny").encode(text) == AutoTokenizer.from_pretrained(snapshot).encode(text)


def test_a_dataset_id_reads_its_split_at_the_cached_commit(hub: HubCache) -> None:
    first = commit_of("first")
    hub.add_dataset("org/records", {"train": RECORDS[:3], "test": RECORDS[3:]}, commit=first)
    train, test = _source("org/records"), _source("org/records:test")
    assert (_first_tokens(train), _first_tokens(test)) == ([0, 1], [3, 4])
    assert train.identity() == DataIdentity(source="org/records:train",
                                            fingerprint=f"3 rows, Hub commit {first}, file order")
    assert train.records.read(2)[1] == "org/records:train[2]"  # errors name a record by the id, not the cache
    evaluation = EvalSet.load("org/records:test", encoder=train.encoder, global_batch_size=2)
    assert evaluation.num_loss_tokens == 2 * 2
    hub.add_dataset("org/records", {"train": RECORDS}, commit=commit_of("second"))  # the Hub moved on
    assert _source(f"org/records@{first}").identity().fingerprint == f"3 rows, Hub commit {first}, file order"
    with pytest.raises(ValueError, match=re.escape("--data org/records:validation: org/records:validation cannot be "
                                                   "read as a data set: Unknown split \"validation\"")):
        _source("org/records:validation")


def test_a_jsonl_dataset_on_the_hub_gives_the_batches_of_its_parquet_copy(hub: HubCache) -> None:
    hub.add_dataset("org/parquet", {"train": RECORDS})
    hub.add_dataset("org/lines", {"train": RECORDS}, file_format="jsonl")
    assert _first_tokens(_source("org/lines", global_batch=5)) == _first_tokens(_source("org/parquet", global_batch=5))


def _rank(global_rank: int) -> ParallelContext:
    return cast(ParallelContext, SimpleNamespace(is_main=global_rank == 0, object_group=None))


def test_every_rank_reads_the_commit_rank_0_resolved(hub: HubCache, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = commit_of("first"), commit_of("second")
    hub.add_dataset("org/records", {"train": RECORDS}, commit=first)
    sent: list[list[object]] = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: sent.append(list(objects)))
    fetch_on_rank_0_first(_rank(0), model="tiny", data="org/records")
    # The Hub moves on before another rank looks: that rank, another process, reads rank 0's commit all the same.
    hub.add_dataset("org/records", {"train": RECORDS[:2]}, commit=second)
    monkeypatch.setattr(trainer_client.hub, "_snapshots", {})
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: objects.__setitem__(0, sent[0][0]))
    fetch_on_rank_0_first(_rank(1), model="tiny", data="org/records")
    assert open_records("org/records").identity().fingerprint == f"5 rows, Hub commit {first}"
    monkeypatch.setattr(trainer_client.hub, "_snapshots", {})
    assert open_records("org/records").identity().fingerprint == f"2 rows, Hub commit {second}"  # unpinned


def test_rank_0s_failure_to_resolve_stops_every_rank_with_its_message(hub: HubCache,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[list[object]] = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: sent.append(list(objects)))
    message = re.escape("--eval-data org/absent:test: the dataset repository org/absent is not in the Hugging Face "
                        "cache")
    with pytest.raises(HubError, match=message):
        fetch_on_rank_0_first(_rank(0), model="tiny", eval_data="org/absent:test")
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: objects.__setitem__(0, sent[0][0]))
    with pytest.raises(HubError, match=message):
        fetch_on_rank_0_first(_rank(1), model="tiny", eval_data="org/absent:test")


def test_a_run_without_hub_ids_joins_no_collective(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broadcast(*args: object, **kwargs: object) -> None:
        raise AssertionError("no collective expected")

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    fetch_on_rank_0_first(_rank(1), model="tiny", tokenizer=str(tmp_path), data="synthetic:lmsys",
                          eval_data=str(tmp_path / "eval.jsonl"))


@pytest.mark.parametrize(("flag", "resolve", "command"), [
    ("--model org/absent", lambda: model_folder("org/absent"), "hf download org/absent"),
    ("--model org/absent@v2", lambda: model_folder("org/absent@v2"), "hf download org/absent --revision v2"),
    ("--tokenizer org/absent", lambda: load_tokenizer("org/absent"), "hf download org/absent"),
    ("--data org/absent:test", lambda: _source("org/absent:test"), "hf download org/absent --repo-type dataset"),
])
def test_an_id_missing_from_the_offline_cache_names_itself_and_how_to_fetch_it(
    hub: HubCache, flag: str, resolve: Callable[[], object], command: str
) -> None:
    kind = "dataset" if "--data" in flag else "model"
    shown = flag.split()[1].removesuffix(":test")
    with pytest.raises(ValueError, match=re.escape(
            f"{flag}: the {kind} repository {shown} is not in the Hugging Face cache ({hub.root}), and HF_HUB_OFFLINE "
            f"is set: fetch it with `{command}` where the Hub can be reached (into this cache: the same HF_HOME or "
            "HF_HUB_CACHE), or unset HF_HUB_OFFLINE; no local path has that name either")):
        resolve()


def test_a_snapshot_without_weights_is_refused_naming_what_it_lacks(hub: HubCache) -> None:
    (hub.snapshot("org/config-only") / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape(
            "--model org/config-only: the model repository org/config-only (commit "
            f"{commit_of('model:org/config-only')}) holds no model.safetensors or model.safetensors.index.json (the "
            "trainer reads a transformers model: its config.json and safetensors weights), or the cache holds only "
            "part of it (`hf download org/config-only` completes it)")):
        model_folder("org/config-only")


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """An empty cache, online: the Hub each test answers with is its own, on loopback."""
    cache = HubCache(tmp_path / "hub")
    cache.offline(monkeypatch)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


def test_a_hub_that_cannot_be_reached_names_the_id_and_how_to_work_offline(
    online: HubCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    with pytest.raises(ValueError, match=re.escape(
            f"--model org/absent: the Hugging Face Hub ({endpoint}) could not be reached for the model repository "
            f"org/absent, which is not in the cache ({online.root}): ConnectError")) as raised:
        model_folder("org/absent")
    assert raised.value.args[0].endswith("fetch it with `hf download org/absent` where the Hub can be reached and run "
                                         "with HF_HUB_OFFLINE=1")


@pytest.fixture
def refusing_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """A Hub on loopback that refuses every request with the error code a test sets; its endpoint."""
    error_code = ["RepoNotFound"]

    class Refusing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", error_code[0])
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)

    def refuse_with(code: str) -> str:
        error_code[0] = code
        return endpoint

    try:
        yield refuse_with
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("code", "spec", "message"), [
    ("RepoNotFound", "org/absent", "the dataset repository org/absent is not on the Hugging Face Hub ({endpoint}), "
                                   "or is private and this machine is not logged in to an account that can read it "
                                   "(hf auth login, or HF_TOKEN); no local path has that name either"),
    ("GatedRepo", "org/gated", "the dataset repository org/gated is gated on the Hugging Face Hub: accept its "
                               "conditions at {endpoint}/datasets/org/gated, and log this machine in to that account"),
    ("RevisionNotFound", "org/set@v9", "the dataset repository org/set has no revision 'v9' on the Hugging Face Hub"),
])
def test_the_hubs_refusals_name_the_id_and_the_fix(
    online: HubCache, refusing_hub: Callable[[str], str], code: str, spec: str, message: str
) -> None:
    endpoint = refusing_hub(code)
    with pytest.raises(ValueError, match=re.escape(f"--data {spec}: {message.format(endpoint=endpoint)}")):
        _source(spec)


def test_a_process_resolves_an_id_once(hub: HubCache) -> None:
    hub.add_dataset("org/records", {"train": RECORDS}, commit=commit_of("first"))
    ref = hub_ref("org/records", RepoKind.DATASET)
    assert ref is not None
    snapshot = fetch(ref)
    hub.add_dataset("org/records", {"train": RECORDS[:1]}, commit=commit_of("second"))
    assert fetch(ref) == snapshot  # the config, the weights, the data and a resume's identity read one commit
    assert np.array_equal(open_records("org/records").read(4)[0]["input_ids"], RECORDS[4]["input_ids"])


@pytest.mark.parametrize(("flag", "spec"), [("data", "data/x.jsonl"), ("data", "x.parquet"),
                                            ("eval_data", "org/held-out.json:test")])
def test_a_missing_data_file_is_a_missing_file_at_the_trainers_first_step_never_a_hub_id(
    hub: HubCache, monkeypatch: pytest.MonkeyPatch, flag: str, spec: str
) -> None:
    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("looked up on the Hub")

    monkeypatch.setattr(dist, "broadcast_object_list", no_hub)
    monkeypatch.setattr(trainer_client.hub, "_download", no_hub)
    for global_rank in (0, 1):
        fetch_on_rank_0_first(_rank(global_rank), model="tiny", **{flag: spec})
    with pytest.raises(ValueError, match=re.escape(f"no such file: {spec!r} in {Path.cwd()} (a name with a data "
                                                   "file's suffix is a file, never a Hugging Face Hub id)")) as raised:
        open_records(spec)
    assert "hf download" not in str(raised.value)


def test_rank_0_raises_its_own_error_with_its_traceback_and_the_others_its_message(
    hub: HubCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(ref: HubRef, revision: str | None) -> HubSnapshot:
        raise OSError("No space left on device")

    monkeypatch.setattr(trainer_client.hub, "_download", full_disk)
    sent: list[list[object]] = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: sent.append(list(objects)))
    with pytest.raises(OSError, match="No space left on device") as raised:
        fetch_on_rank_0_first(_rank(0), model="org/tiny")
    assert raised.traceback[-1].name == "full_disk"  # where it happened, not where it was passed on
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, group: objects.__setitem__(0, sent[0][0]))
    with pytest.raises(RuntimeError, match=re.escape("rank 0 could not fetch the run's Hub ids: OSError: No space "
                                                     "left on device")):
        fetch_on_rank_0_first(_rank(1), model="org/tiny")


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, list[str] | None]]:
    """Every ``snapshot_download`` of this test: the id, the revision and the files asked for."""
    import huggingface_hub

    calls: list[tuple[str, str | None, list[str] | None]] = []
    real = huggingface_hub.snapshot_download

    def recorded(repo_id: str, **kwargs: object) -> object:
        calls.append((repo_id, cast(str | None, kwargs.get("revision")),
                      cast(list[str] | None, kwargs.get("allow_patterns"))))
        return real(repo_id, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorded)
    return calls


def test_the_advisor_needs_only_a_hub_models_config(
    hub: HubCache, downloads: list[tuple[str, str | None, list[str] | None]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer_client.advise.command import main as advise_main

    hub.add_model_config("org/shape-only")  # config.json alone: no weights cached
    assert model_shape("org/shape-only") == replace(MODEL_CATALOGUE["tiny"], name="org/shape-only")
    assert model_identity("org/shape-only").startswith("config.json sha256 ")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(length) for length in (40, 900, 120, 3000) * 4) + "\n")
    assert advise_main(["--data", str(lengths), "--model", "org/shape-only", "--gpus", "2",
                        "--no-progress"]) == 0, capsys.readouterr().err
    assert "--model org/shape-only" in capsys.readouterr().out
    assert downloads == [("org/shape-only", None, ["config.json"])]  # once, for the shape, the identity and the advice


def test_a_models_weights_are_read_at_the_commit_its_config_was(hub: HubCache) -> None:
    first = hub.add_model("org/tiny", commit=commit_of("first"))
    model_shape("org/tiny")  # the config alone
    hub.snapshot("org/tiny", commit=commit_of("second"))  # the Hub moves on (to an empty commit)
    assert model_folder("org/tiny") == first  # the weights of the config's commit


def _shards(folder: Path) -> list[str]:
    """The files of a model's weights, as its index lists them."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_sharded_weights_fetch_exactly_the_shards_their_index_lists(
    hub: HubCache, downloads: list[tuple[str, str | None, list[str] | None]]
) -> None:
    folder = hub.add_model("org/sharded", max_shard_size="300KB")
    shards = _shards(folder)
    assert len(shards) > 1
    (folder / "model-in-another-precision.safetensors").write_bytes(b"")  # not listed: not fetched
    loaded, original = build_model("org/sharded"), build_model("tiny", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values(),
                                                 strict=True))
    commit = commit_of("model:org/sharded")
    assert downloads == [("org/sharded", None, ["*.json"]), ("org/sharded", commit, ["*.json", *shards])]
    model_shape("org/sharded")  # the weights' snapshot holds the config: nothing more to fetch
    assert len(downloads) == 2


def test_a_shard_missing_from_the_cache_is_named(hub: HubCache) -> None:
    folder = hub.add_model("org/broken", max_shard_size="300KB")
    shards = _shards(folder)
    (folder / shards[-1]).unlink()
    with pytest.raises(ValueError, match=re.escape(
            f"--model org/broken: the model repository org/broken (commit {commit_of('model:org/broken')}) lacks "
            f"{shards[-1]}, which its model.safetensors.index.json lists among the {len(shards)} files of its "
            "weights: the repository is broken, or the cache holds only part of it (`hf download org/broken` "
            "completes it)")):
        model_folder("org/broken")
