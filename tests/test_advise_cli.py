"""``skrull-advise`` and ``POST /advise``: the same advice from a data set, a lengths file, a synthetic sample or an
HTTP request; the table, the JSON document and the chart; outliers no layout holds left out (or, with --truncate,
cut) with what each layout loses, as --max-length and --truncate do in the trainer; every bad input a clear error
naming its field or flag, never a traceback or a 500; and the winner's config file holds the run its printed
command line describes, and trains under torchrun."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from skrull_proto.advise import AdviceDocument

from scheduler_service.runtime.settings import Settings
from scheduler_service.web.app import create_app
from tests.hub_cache import WORDS, save_tokenizer
from trainer_client.advise.command import build_parser
from trainer_client.advise.command import main as advise_main
from trainer_client.advise.inputs import read_lengths
from trainer_client.data import make_source
from trainer_client.demo import trainer_env
from trainer_client.flags import config_from_args
from trainer_client.train import build_parser as build_train_parser

LENGTHS = [120, 3000, 80, 45000, 700, 9000, 64, 30000, 1500, 250, 18000, 5000] * 8


@pytest.fixture
def lengths_file(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return path


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(cpsat_warmup=False, max_advise_cells=1 << 20))) as test_client:
        deadline = time.monotonic() + 120
        while test_client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)  # the planner warms up (JIT cache) before the first answer
        yield test_client


def _advise(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = advise_main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_lengths_file_gives_the_ranked_table_the_json_document_and_the_chart(
    lengths_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _advise(["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "16",
                                "--global-batch", "32", "--json", str(tmp_path / "advice.json"),
                                "--plot", str(tmp_path / "advice.png")], capsys)
    assert status == 0, err
    document = AdviceDocument.model_validate_json((tmp_path / "advice.json").read_text())
    assert document.data == str(lengths_file) and document.sample.num_sequences == len(LENGTHS)
    best = document.layouts[0]
    assert f"{best.dp_size} × {best.cp_size}" in out.splitlines()[2] and f"{best.tokens_per_s_per_gpu:,.0f}" in out
    assert f"why: {document.why}" in out and best.trainer_command in out
    chart = (tmp_path / "advice.png").read_bytes()
    assert chart.startswith(b"\x89PNG") and len(chart) > 10_000


@pytest.mark.parametrize(("flags", "fields"), [
    ([], {}),
    (["--max-length", "20000", "--truncate"], {"max_length": 20000, "truncate": True}),
])
def test_the_service_answers_the_documents_numbers(
    flags: list[str], fields: dict[str, object], lengths_file: Path, tmp_path: Path, client: TestClient,
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert _advise(["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "16", "--global-batch", "32",
                    "--json", str(tmp_path / "advice.json"), *flags], capsys)[0] == 0
    response = client.post("/advise", json={"sequence_lengths": LENGTHS, "model": "qwen2.5-7b", "gpus": 16,
                                            "global_batch": 32, **fields})
    assert response.status_code == 200, response.text
    from_cli, from_service = json.loads((tmp_path / "advice.json").read_text()), response.json()
    commands = [(ours.pop("trainer_command"), theirs.pop("trainer_command"))
                for ours, theirs in zip(from_cli["layouts"], from_service["layouts"], strict=True)]
    assert {**from_service, "data": from_cli["data"]} == from_cli  # the service has no --data to name
    assert all(ours == theirs.replace(" --global-batch", f" --data {from_cli['data']} --global-batch")
               for ours, theirs in commands)


def test_a_histogram_is_the_sample_it_counts(client: TestClient) -> None:
    histogram = [{"length": length, "count": LENGTHS.count(length)} for length in sorted(set(LENGTHS))]
    by_histogram = client.post("/advise", json={"histogram": histogram, "model": "qwen2.5-7b", "gpus": 8})
    assert by_histogram.status_code == 200, by_histogram.text
    assert by_histogram.json()["sample"] == {"num_sequences": len(LENGTHS), "longest": max(LENGTHS),
                                             "mean_length": sum(LENGTHS) / len(LENGTHS)}


def test_records_are_measured_as_the_trainer_encodes_them(tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"input_ids": list(range(1, length + 1))}) + "\n"
                               for length in (5, 17, 300)))
    assert read_lengths(str(records), sample_size=10, seed=0).tolist() == [5, 17, 300]
    assert sorted(read_lengths(str(records), sample_size=2, seed=0).tolist()) in ([5, 17], [5, 300], [17, 300])


def test_python_m_trainer_client_advise_is_the_same_command(
    lengths_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "8", "--no-progress"]
    module = subprocess.run([sys.executable, "-m", "trainer_client.advise", *argv, "--json", str(tmp_path / "a.json")],
                            env=trainer_env(), capture_output=True, text=True, timeout=120, check=False)
    assert module.returncode == 0, module.stderr
    assert advise_main([*argv, "--json", str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out == module.stdout
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["--data", "synthetic:nope"], "error: --data synthetic:nope: unknown synthetic set; known: wikipedia"),
    (["--data", "missing.jsonl"], "error: --data missing.jsonl: no such file: 'missing.jsonl' in "),
    (["--data", "data/trian.jsonl"], "error: --data data/trian.jsonl: no such file: 'data/trian.jsonl' in "),
    (["--gpus", "0"], "error (gpus): gpus must be"),
    (["--gpus", "12", "--gpus-per-node", "8"], "error (gpus): gpus 12 is not a whole number of nodes"),
    (["--model", "qwen2.5-14b", "--gpus", "1"], "error (model): model qwen2.5-14b fits in no layout of 1 GPUs"),
    (["--num-batches", "0"], "error (num_batches): num_batches must be"),
    (["--sample-size", "0"], "error: --sample-size must be positive, got 0"),
    (["--cp-sizes", "3"], "error (cp_sizes): cp_sizes must be powers of two that divide gpus 8"),
    (["--max-length", "0"], "error (max_length): max_length must be an integer between 1 and 16777216, got 0"),
    (["--max-length", "10"], "error (max_length): every sequence of the sample is longer than max_length 10"),
])
def test_bad_flags_exit_2_with_one_line_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--data": "synthetic:lmsys", "--model": "qwen2.5-7b", "--gpus": "8"}
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    status, _, err = _advise([word for flag, value in {**base, **flags}.items() for word in (flag, value)], capsys)
    assert status == 2
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty"),
    ("100\n200\nseventy\n", ":3: 'seventy' is not a sequence length"),
    ("100\n-5\n", "error (sequence_lengths[1]): "),
    ("100\n5000000000\n", "error (sequence_lengths[1]): "),
])
def test_bad_lengths_files_are_refused_naming_the_line_or_index(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    status, _, err = _advise(["--data", str(path), "--model", "qwen2.5-7b", "--gpus", "8"], capsys)
    assert status == 2 and message in err and err.count("\n") == 1, err


def test_an_outlier_no_layout_holds_is_left_out_and_the_layouts_ranked_with_what_each_loses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("100\n900000\n")
    status, out, err = _advise(["--data", str(path), "--model", "qwen2.5-7b", "--gpus", "8",
                                "--json", str(tmp_path / "advice.json")], capsys)
    assert status == 0, err
    document = AdviceDocument.model_validate_json((tmp_path / "advice.json").read_text())
    assert document.layouts and all(layout.longest_trainable_sequence < 900000 for layout in document.layouts)
    assert all((layout.num_sequences_too_long, layout.too_long_token_share) == (1, pytest.approx(900000 / 900100))
               for layout in document.layouts)
    assert out.splitlines()[1].endswith("seqs left out") and out.splitlines()[2].endswith("1 (99.99%)")
    assert "It leaves out the sample's 1 sequence(s) longer than" in document.why
    assert ("the trainer refuses a record longer than --max-length "
            f"{document.layouts[0].longest_trainable_sequence} (synthetic data is drawn cut to it): leave the 1 "
            "longer sequence(s) out of --data, or add --truncate to cut them") in out


def test_max_length_and_truncate_change_what_each_layout_loses_as_in_the_trainer(
    lengths_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LENGTHS holds 16 sequences over 20,000 tokens (45,000 and 30,000, 8 of each): --max-length 20000 leaves them
    out, and with --truncate cuts them to 20,000; every command passes both on to the trainer."""
    total = sum(LENGTHS)
    for truncate, lost, column in ((False, 8 * 45000 + 8 * 30000, "seqs left out"),
                                   (True, 8 * 25000 + 8 * 10000, "seqs cut")):
        argv = ["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "16", "--max-length", "20000",
                "--json", str(tmp_path / "advice.json"), *(["--truncate"] if truncate else [])]
        status, out, err = _advise(argv, capsys)
        assert status == 0, err
        document = AdviceDocument.model_validate_json((tmp_path / "advice.json").read_text())
        assert (document.max_length, document.truncate) == (20000, truncate)
        assert out.splitlines()[1].endswith(column)
        for layout in document.layouts:
            assert (layout.num_sequences_too_long, layout.too_long_token_share) == (16, pytest.approx(lost / total))
            flags = shlex.split(layout.trainer_command)
            config = config_from_args(build_train_parser().parse_args(flags[flags.index("trainer_client.train") + 1:]))
            assert (config.max_length, config.truncate) == (20000, truncate)
        assert "longer than 20,000 tokens (max_length)" in document.why


def test_a_sample_no_layout_holds_any_of_is_refused_with_the_longest_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("900000\n")
    status, _, err = _advise(["--data", str(path), "--model", "qwen2.5-7b", "--gpus", "8"], capsys)
    assert status == 2
    assert err.startswith("error (sequence_lengths): no layout of 8 GPUs holds any sequence of the sample: the "
                          "shortest has 900000 tokens, and at most "), err


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"sequence_lengths": [100], "model": "qwen2.5-7b"}, 422, "gpus"),
    ({"sequence_lengths": [], "model": "qwen2.5-7b", "gpus": 8}, 422, "sequence_lengths"),
    ({"sequence_lengths": [0, 5], "model": "qwen2.5-7b", "gpus": 8}, 422, "sequence_lengths[0]"),
    ({"model": "qwen2.5-7b", "gpus": 8}, 422, "body"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "global_batch": 8, "tokens_per_step": 9},
     422, "body"),
    ({"sequence_lengths": [100], "model": "gpt-9", "gpus": 8}, 422, "model"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "profile": "nope"}, 422, "profile"),
    ({"sequence_lengths": [100], "model": "qwen2.5-14b", "gpus": 1}, 422, "model"),
    ({"sequence_lengths": [10 ** 6], "model": "qwen2.5-7b", "gpus": 8}, 422, "sequence_lengths"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 6, "gpus_per_node": 6}, 422, "gpus_per_node"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "num_batches": 200, "global_batch": 60000},
     422, "num_batches"),
    ({"histogram": [{"length": 100, "count": 1 << 30}], "model": "qwen2.5-7b", "gpus": 8}, 422, "histogram"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "max_length": 0}, 422, "max_length"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "max_length": 1 << 30}, 422, "max_length"),
    ({"sequence_lengths": [100, 200], "model": "qwen2.5-7b", "gpus": 8, "max_length": 50}, 422, "max_length"),
    ({"sequence_lengths": [100], "model": "qwen2.5-7b", "gpus": 8, "truncate": "maybe"}, 422, "truncate"),
])
def test_bad_requests_get_a_4xx_naming_the_field_never_a_500(
    client: TestClient, body: dict[str, object], status: int, field: str
) -> None:
    response = client.post("/advise", json=body)
    assert response.status_code == status, response.text
    problem = response.json()
    assert field in [error["field"] for error in problem["errors"]], problem
    if field in ("num_batches", "histogram"):
        assert "at most" in problem["detail"]  # the limit is named
    if field == "max_length" and body.get("max_length") == 1 << 30:
        assert "between 1 and 16777216" in problem["detail"]


def test_the_winners_config_file_holds_the_run_of_its_printed_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    records = tmp_path / "chats.jsonl"  # text records: only a tokenizer encodes them, in the advisor and the trainer
    records.write_text("".join(json.dumps({"text": " ".join(WORDS[: 3 + k % 20])}) + "\n" for k in range(40)))
    config_file = tmp_path / "winner.yaml"
    status, out, err = _advise(["--data", str(records), "--tokenizer", str(tokenizer), "--model", "qwen2.5-7b",
                                "--gpus", "16", "--emit-config", str(config_file),
                                "--json", str(tmp_path / "advice.json")], capsys)
    assert status == 0, err
    by_flags = shlex.split(json.loads((tmp_path / "advice.json").read_text())["layouts"][0]["trainer_command"])
    split = by_flags.index("trainer_client.train") + 1
    launcher, flags = by_flags[:split], by_flags[split:]
    assert out.splitlines()[-2] == f"or with its config file {config_file}:"
    assert shlex.split(out.splitlines()[-1]) == [*launcher, "--config", str(config_file)]  # two nodes of 8
    parser = build_train_parser()
    from_file = config_from_args(parser.parse_args(["--config", str(config_file)]))
    assert from_file == config_from_args(parser.parse_args(flags)) and from_file.dp * from_file.cp == 16
    assert (from_file.data, from_file.tokenizer) == (str(records), str(tokenizer))
    # the trainer's first step with the file's data and tokenizer: every record of the first batch encodes
    source = make_source(from_file.data, global_batch_size=from_file.global_batch, vocab_size=1 << 17,
                         max_length=1 << 20, seed=0, tokenizer=from_file.tokenizer)
    # 40 records, fewer than a global batch: the first batch is the whole epoch (no batch holds two epochs' records)
    assert len(source.batch(0).samples) == min(from_file.global_batch, 40)


def test_a_lengths_file_gets_no_config_file_and_its_command_asks_for_the_records(
    lengths_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "winner.yaml"
    status, out, err = _advise(["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "8",
                                "--emit-config", str(config_file)], capsys)
    assert (status, out) == (2, "")
    assert err == (f"error: --emit-config {config_file}: --data {lengths_file} is a file of sequence lengths, which "
                   "the advisor reads but the trainer cannot train on; give --data the records they were measured "
                   "from (anything the trainer's --data takes) to write a config file that trains\n")
    assert not config_file.exists()
    status, out, err = _advise(["--data", str(lengths_file), "--model", "qwen2.5-7b", "--gpus", "8"], capsys)
    assert status == 0, err
    assert out.splitlines()[-2] == ("train with the winner (with the records these lengths were measured from as "
                                    "--data: the trainer cannot train on a file of lengths):")


@pytest.mark.slow
def test_the_winners_config_file_trains_under_torchrun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "records.jsonl"
    generator = random.Random(0)
    records.write_text("".join(json.dumps({"input_ids": [generator.randrange(1, 1024) for _ in range(length)]})
                               + "\n" for length in [generator.choice((12, 40, 150, 900)) for _ in range(32)]))
    config_file = tmp_path / "winner.yaml"
    assert advise_main(["--data", str(records), "--model", "tiny", "--gpus", "4", "--profile", "cpu-tiny",
                        "--dtype", "float32", "--global-batch", "8", "--no-progress",
                        "--emit-config", str(config_file)]) == 0
    command = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert command == ["torchrun", "--nproc-per-node", "4", "-m", "trainer_client.train", "--config", str(config_file)]
    metrics = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *command[1:], "--steps", "2",
         "--no-progress", "--metrics-out", str(metrics)],
        env=trainer_env(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(metrics.read_text().splitlines()) == 2


def test_plan_prices_blocks_across_nodes_as_the_advice_does(client: TestClient) -> None:
    body = {"sequence_lengths": LENGTHS[:32], "dp_size": 1, "cp_size": 16, "model": "qwen2.5-7b",
            "bucket_size": 14000, "scheduler": "deepspeed"}
    one_node, two_nodes = (client.post("/plan", json={**body, "gpus_per_node": size}) for size in (16, 8))
    assert one_node.status_code == two_nodes.status_code == 200, two_nodes.text
    assert two_nodes.json()["estimated_iteration_time_ms"] > one_node.json()["estimated_iteration_time_ms"]
    absent = client.post("/plan", json=body).json()  # absent: every CP group on one node
    assert {**absent, "solve_time_ms": 0} == {**one_node.json(), "solve_time_ms": 0}
    no_table = client.post("/plan", json={**body, "model": "tiny", "profile": "cpu-tiny", "cp_size": 4,
                                          "bucket_size": 60000, "gpus_per_node": 2})
    assert no_table.status_code == 422 and no_table.json()["errors"][0]["field"] == "profile", no_table.text
    assert "no inter-node collective table" in no_table.json()["detail"]


def test_the_commands_name_the_profile_file_and_model_folder_as_given(
    lengths_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "measured.json"
    shipped = Path(__file__).parents[1] / "scheduler_service" / "core" / "profiles" / "cpu-tiny.json"
    profile.write_text(shipped.read_text())
    assert _advise(["--data", str(lengths_file), "--model", "tiny", "--gpus", "4", "--profile", str(profile),
                    "--dtype", "float32", "--json", str(tmp_path / "advice.json")], capsys)[0] == 0
    for layout in json.loads((tmp_path / "advice.json").read_text())["layouts"]:
        command = shlex.split(layout["trainer_command"])
        assert command[command.index("--profile") + 1] == str(profile)  # the trainer reads the file, not a name


def test_help_shows_each_default_once_and_none_where_there_is_none() -> None:
    text = build_parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default 64)" in text and "(default: 64)" not in text  # the flag's own wording, not a second one
    assert "(default: 8)" in text  # --gpus-per-node: argparse's, where the help names none
