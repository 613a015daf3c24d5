"""One config, declared once: ``TrainConfig``'s fields are the trainer's flags (generated, their spellings kept) and
the keys of a ``--config`` file (YAML, TOML or JSON); a flag given overrides its key; every wrong key or value is
named where it was given, by its flag or by its key in the file, and nothing is ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from scheduler_service.core.memory import Sharding
from trainer_client.config import TrainConfig
from trainer_client.config_choices import Tracker
from trainer_client.config_file import load_config, read_config_file
from trainer_client.distributed import ParallelDims
from trainer_client.foreign_keys import FOREIGN_KEYS
from trainer_client.train import build_parser, config_from_args, main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft.yaml"
# Every flag the trainer has taken, as users, docs and the advisor's command lines spell them.
FLAGS = [
    "--dp", "--cp", "--model", "--data", "--tokenizer", "--global-batch", "--steps", "--epochs", "--no-shuffle",
    "--scheduler", "--scheduler-url", "--bucket-size", "--profile", "--seed", "--lr", "--weight-decay",
    "--lr-scheduler", "--warmup-steps", "--min-lr-ratio", "--max-grad-norm", "--sharding",
    "--activation-checkpointing", "--compile", "--loss-chunk-tokens", "--checkpoint-dir", "--checkpoint-every",
    "--keep-last", "--async-checkpoint", "--resume", "--resume-accept-data-change", "--output-dir", "--export-every",
    "--export-lora", "--collective-timeout", "--max-length", "--truncate", "--metrics-out", "--plan-timeout",
    "--plan-attempts", "--attention-backend", "--dtype", "--no-progress", "--feedback", "--job-id", "--eval-data",
    "--eval-every", "--lora-rank", "--lora-alpha", "--lora-targets", "--report-to", "--logging-dir", "--fail-rank",
    "--fail-at-step", "--no-spanning", "--no-schemes", "--skip-bad-records", "--debug", "--loss-on",
    "--chat-template", "--text-field", "--logging-steps", "--cuda-graphs", "--token-buckets", "--fsdp-units",
]
# A bool's other form, so that a flag turns a config file's value either way.
OTHER_FORMS = [
    "--shuffle", "--no-compile", "--no-async-checkpoint", "--no-resume", "--no-resume-accept-data-change",
    "--no-truncate", "--progress", "--no-feedback", "--spanning", "--schemes", "--no-skip-bad-records", "--no-debug",
    "--no-cuda-graphs",
]


def _parse(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_field_has_one_flag_and_every_flag_keeps_its_spelling() -> None:
    actions = [action for action in build_parser()._actions if action.dest not in ("help", "config")]
    assert sorted(flag for action in actions for flag in action.option_strings) == sorted(FLAGS + OTHER_FORMS)
    assert sorted(action.dest for action in actions) == sorted(TrainConfig.model_fields)


def test_flags_not_given_are_the_models_defaults_and_flags_given_their_fields_values() -> None:
    assert _parse("--dp", "1", "--cp", "1") == TrainConfig(dp=1, cp=1)
    config = _parse("--dp", "2", "--cp", "1", "--plan-timeout", "2.5", "--collective-timeout", "30",
                    "--no-shuffle", "--no-progress", "--sharding", "zero3", "--checkpoint-dir", "ck", "--keep-last",
                    "2", "--lora-rank", "4", "--lora-targets", "q_proj, v_proj", "--report-to", "mlflow,tensorboard")
    assert (config.plan_timeout_s, config.collective_timeout_s, config.shuffle, config.progress) == (
        2.5, 30.0, False, False)
    assert (config.sharding, config.checkpoint_dir, config.keep_last) == (Sharding.ZERO3, Path("ck"), 2)
    assert (TrainConfig(dp=1, cp=1).spanning, _parse("--dp", "2", "--cp", "1", "--no-spanning").spanning) == (
        True, False)
    assert (TrainConfig(dp=1, cp=2).schemes, _parse("--dp", "1", "--cp", "2", "--no-schemes").schemes) == (
        True, False)
    assert (config.lora_rank, config.lora_targets, config.report_to) == (
        4, ("q_proj", "v_proj"), (Tracker.MLFLOW, Tracker.TENSORBOARD))
    with pytest.raises(ValueError, match="frozen"):
        config.steps = 3


def test_help_shows_each_default_once_and_the_key_of_a_flag_spelled_otherwise() -> None:
    text = " ".join(build_parser().format_help().split())  # unwrapped
    assert "(default: None)" not in text and "(default: False)" not in text and "PydanticUndefined" not in text
    assert "sequences per global batch (default: 16)" in text
    assert "longest record accepted (default: bucket_size × cp)" in text  # the help's own words, not a second one
    assert "seconds per POST /plan attempt (default: 5.0) [config key plan_timeout_s]" in text
    assert "--resume, --no-resume continue from the newest complete checkpoint" in text
    assert "--shuffle, --no-shuffle train each epoch's records in a permutation" in text


def test_a_flag_turns_a_files_bool_either_way(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\ncheckpoint_dir: ck\nresume: true\ntruncate: true\n"
                                        "shuffle: false\nprogress: false\n")
    config = _parse("--config", str(run))
    assert (config.resume, config.truncate, config.shuffle, config.progress) == (True, True, False, False)
    config = _parse("--config", str(run), "--no-resume", "--no-truncate", "--shuffle", "--progress")
    assert (config.resume, config.truncate, config.shuffle, config.progress) == (False, False, True, True)
    assert _parse("--dp", "1", "--cp", "1", "--no-shuffle", "--no-progress").model_dump(
        include={"shuffle", "progress"}) == {"shuffle": False, "progress": False}


@pytest.mark.parametrize(("name", "text", "message"), [
    ("run.yaml", "dp: 1\ncp: 1\nlr: 0.1\nlr: 0.2\n", "{path}:4:1: duplicate key 'lr'"),
    ("run.json", '{"dp": 1, "cp": 1, "lr": 0.1, "lr": 0.2}', "{path}: duplicate key 'lr'"),
    ("run.toml", "dp = 1\ncp = 1\nlr = 0.1\nlr = 0.2\n",
     "{path}: Cannot overwrite a value (at line 4, column 9): lr = 0.2"),
])
def test_a_key_given_twice_in_the_file_is_refused_naming_it(name: str, text: str, message: str,
                                                             tmp_path: Path) -> None:
    path = _write(tmp_path / name, text)
    with pytest.raises(ValueError) as refused:
        read_config_file(path)
    assert str(refused.value) == message.format(path=path)


def test_a_yaml_merge_may_give_a_key_again() -> None:
    from trainer_client.config_file import _parse as parse

    assert parse(Path("run.yaml"), "base: &base\n  lr: 0.1\n  dp: 1\nrun:\n  <<: *base\n  lr: 0.2\n") == {
        "base": {"lr": 0.1, "dp": 1}, "run": {"lr": 0.2, "dp": 1}}


@pytest.mark.parametrize("scheduler", ["linear", "cosine", "constant_with_warmup"])
def test_min_lr_ratio_given_with_a_schedule_that_does_not_read_it_is_refused(scheduler: str, tmp_path: Path) -> None:
    readers = "warmup_cosine, cosine_with_min_lr, warmup_stable_decay"
    with pytest.raises(ValueError, match=rf"^--lr-scheduler {scheduler} does not read --min-lr-ratio \(only "
                                         rf"{readers} do\): leave it out, or choose one of those$"):
        _parse("--dp", "1", "--cp", "1", "--lr-scheduler", scheduler, "--min-lr-ratio", "0.2")
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nmin_lr_ratio: 0.1\n")
    with pytest.raises(ValueError, match=rf"\(only {readers} do\): leave it out, or choose one of those "
                                         rf"\({run}: min_lr_ratio\)$"):
        _parse("--config", str(run), "--lr-scheduler", scheduler)
    assert _parse("--dp", "1", "--cp", "1", "--lr-scheduler", scheduler).lr_scheduler == scheduler  # default: unread
    for reader in readers.split(", "):
        assert _parse("--config", str(run), "--lr-scheduler", reader).min_lr_ratio == 0.1


@pytest.mark.parametrize(("name", "text"), [
    ("run.yaml", "dp: 2\ncp: 1\nsharding: zero3\nlora_rank: 4\nlora_targets: [q_proj, v_proj]\nlr: 2.0e-4\n"),
    ("run.toml", 'dp = 2\ncp = 1\nsharding = "zero3"\nlora_rank = 4\nlora_targets = ["q_proj", "v_proj"]\n'
                 "lr = 2.0e-4\n"),
    ("run.json", json.dumps({"dp": 2, "cp": 1, "sharding": "zero3", "lora_rank": 4,
                             "lora_targets": ["q_proj", "v_proj"], "lr": 2e-4})),
])
def test_a_yaml_toml_or_json_file_holds_the_run_keyed_by_field_name(name: str, text: str, tmp_path: Path) -> None:
    assert _parse("--config", str(_write(tmp_path / name, text))) == TrainConfig(
        dp=2, cp=1, sharding="zero3", lora_rank=4, lora_targets=("q_proj", "v_proj"), lr=2e-4)


def test_flags_given_override_the_files_keys_and_steps_replace_its_epochs(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 2\ncp: 2\ndata: records.jsonl\nepochs: 3\nlr: 0.01\nshuffle: false\n")
    config = _parse("--config", str(run), "--dp", "4", "--cp", "1", "--steps", "7", "--lr", "0.02")
    assert (config.dp, config.cp, config.steps, config.epochs, config.lr, config.shuffle) == (4, 1, 7, None, 0.02,
                                                                                            False)
    assert _parse("--config", str(run)).epochs == 3
    both = _write(tmp_path / "both.yaml", "dp: 1\ncp: 1\nsteps: 5\nepochs: 2\n")
    with pytest.raises(ValueError, match=rf"^--steps and --epochs exclude each other: give one \({both}: steps, "
                                         r"epochs\)$"):
        load_config({}, config_file=both)


def test_dp_and_cp_are_required_from_the_flags_or_the_file(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "cp: 2\n")
    assert ParallelDims.of(_parse("--config", str(run), "--dp", "3")).world_size == 6
    with pytest.raises(ValueError, match=rf"^--dp is required \(or dp in {run}\)$"):
        _parse("--config", str(run))
    with pytest.raises(ValueError, match=r"^--dp is required; --cp is required$"):
        _parse()


@pytest.mark.parametrize(("text", "message"), [
    ("lora_rank: 0", "{run}: lora_rank: must be positive, got 0"),
    ("lora_rnak: 4", "{run}: lora_rnak: unknown key; did you mean lora_rank?"),
    ("global-batch: 8", "{run}: global-batch: unknown key; did you mean global_batch?"),
    ("sharding: zero4", "{run}: sharding: 'zero4' is unknown; known: zero2, zero3, none"),
    ("global_batch: many", "{run}: global_batch: Input should be a valid integer, unable to parse string as an "
                           "integer, got 'many'"),
    ("report_to: 3", "{run}: report_to: Input should be a valid tuple, got 3"),
    ("lora_rank: 4\nlora_targets: [q_proj, 3]", "{run}: lora_targets[1]: Input should be a valid string, got 3"),
    ("job_id: has space", "{run}: job_id: 'has space' is not a valid job id: 1 to 128 characters, letters, digits "
                          "and . _ : - only, starting with a letter or digit"),
    ("keep_last: 2", "--keep-last and --async-checkpoint need --checkpoint-dir ({run}: keep_last)"),
    ("plan_timeout_s: 0", "{run}: plan_timeout_s: must be positive, got 0.0"),
    ("plan_attempts: 0", "{run}: plan_attempts: must be positive, got 0"),
    ("lora_rank: 0\nlora_rnak: 4", "{run}: lora_rank: must be positive, got 0; {run}: lora_rnak: unknown key; did "
                                   "you mean lora_rank?"),
])
def test_a_wrong_key_or_value_in_the_file_is_named_by_its_key_there(text: str, message: str, tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", f"dp: 1\ncp: 1\n{text}\n")
    with pytest.raises(ValueError) as refused:
        _parse("--config", str(run))
    assert str(refused.value) == message.format(run=run)


def test_a_wrong_value_given_as_a_flag_is_named_by_the_flag_over_a_file(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nlora_rank: 0\n")
    with pytest.raises(ValueError, match=r"^--lora-rank must be positive, got -1$"):
        _parse("--config", str(run), "--lora-rank", "-1")
    with pytest.raises(ValueError, match=r"^--plan-timeout must be positive, got -1.0; --plan-attempts must be "
                                         r"positive, got 0$"):
        _parse("--dp", "1", "--cp", "1", "--plan-timeout", "-1", "--plan-attempts", "0")
    assert _parse("--config", str(run), "--lora-rank", "8").lora_rank == 8  # the file's wrong value is overridden


@pytest.mark.parametrize(("name", "text", "message"), [
    ("missing.yaml", None, "--config {path}: No such file or directory"),
    ("run.ini", "dp = 1", "--config {path}: a config file is YAML, TOML or JSON, named .yaml, .yml, .toml, .json"),
    ("run.yaml", "dp: 1\ncp: [1\n", "{path}:3:1: expected ',' or ']', but got '<stream end>'"),
    ("run.json", '{"dp": 1,}', "{path}:1:10: Expecting property name enclosed in double quotes"),
    ("run.toml", "dp = 1\ncp = \n", "{path}: Invalid value (at line 2, column 6): cp ="),
    ("run.yaml", "- dp: 1\n", "{path}: holds a list, not a mapping of settings to values"),
])
def test_a_file_that_cannot_be_read_or_parsed_is_named_with_the_line(
    name: str, text: str | None, message: str, tmp_path: Path
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as refused:
        read_config_file(path)
    assert str(refused.value) == message.format(path=path)


def test_the_cli_exits_2_with_one_line_naming_the_key_before_any_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nlora_rank: 0\n")
    assert main(["--config", str(run)]) == 2
    assert capsys.readouterr().err == f"error: {run}: lora_rank: must be positive, got 0\n"
    assert not dist.is_initialized()


def test_the_example_sft_config_is_a_run_the_trainer_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # its paths are relative to the working directory
    config = load_config({}, config_file=EXAMPLE)
    assert (ParallelDims.of(config).world_size, config.keep_last, config.resume, config.report_to) == (
        8, 2, True, (Tracker.WANDB, Tracker.MLFLOW))
    assert set(read_config_file(EXAMPLE)) <= set(TrainConfig.model_fields)


def test_the_closed_sets_the_config_names_are_those_the_implementations_take() -> None:
    # config_choices.py mirrors them so that the configuration imports no torch; the implementations must agree.
    from trainer_client import config_choices
    from trainer_client.dacp import kernels
    from trainer_client.models import lora, loss

    assert [m.value for m in config_choices.AttentionBackend] == [m.value for m in kernels.AttentionBackend]
    assert [m.value for m in config_choices.LoraExport] == [m.value for m in lora.LoraExport]
    assert config_choices.DEFAULT_CHUNK_TOKENS == loss.DEFAULT_CHUNK_TOKENS


def test_a_chat_template_that_is_neither_a_name_nor_a_file_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--chat-template 'llama9' is neither a file of Jinja nor a template known by "
                                         r"name \(chatml\)"):
        _parse("--dp", "1", "--cp", "1", "--chat-template", "llama9")
    template = _write(tmp_path / "chat.jinja", "{{ messages }}")
    assert _parse("--dp", "1", "--cp", "1", "--chat-template", str(template)).chat_template == str(template)
    with pytest.raises(ValueError, match=r"--loss-on 'prompt' is unknown; known: assistant, completion, all"):
        TrainConfig(dp=1, cp=1, loss_on="prompt")



# ---- names people type: TRL's, transformers' and axolotl's settings (foreign_keys.py) ------------------------------


TRL_CONFIG = """\
dp: 4
cp: 2
model_name_or_path: Qwen/Qwen2.5-0.5B
dataset_name: HuggingFaceH4/ultrachat_200k:train_sft
dataset_text_field: body
learning_rate: 2.0e-5
max_steps: 500
lr_scheduler_type: cosine
max_seq_length: 8192
bf16: true
gradient_checkpointing: true
packing: true
assistant_only_loss: true
save_steps: 100
save_total_limit: 2
checkpoint_dir: ckpt
eval_steps: 50
eval_data: HuggingFaceH4/ultrachat_200k:test_sft
run_name: ultrachat-sft
report_to: tensorboard
save_strategy: steps
optim: adamw_torch
"""
AXOLOTL_CONFIG = """\
dp: 2
cp: 1
base_model: tiny
learning_rate: 0.0002
num_epochs: 2
sequence_len: 4096
lora_r: 16
lora_alpha: 32
lora_target_modules: q_proj,v_proj
lora_dropout: 0.0
adapter: lora
sample_packing: true
train_on_inputs: false
flash_attention: true
torch_compile: false
"""


def test_trl_and_axolotl_names_are_read_as_the_skrull_settings_they_are(tmp_path: Path) -> None:
    trl = _parse("--config", str(_write(tmp_path / "trl.yaml", TRL_CONFIG)), "--data", "d.jsonl")
    assert (trl.model, trl.text_field, trl.lr, trl.steps, trl.lr_scheduler, trl.max_length, trl.dtype) == (
        "Qwen/Qwen2.5-0.5B", "body", 2e-5, 500, "cosine", 8192, "bfloat16")
    assert (trl.activation_checkpointing, trl.loss_on, trl.checkpoint_every, trl.keep_last, trl.job_id) == (
        "full", "assistant", 100, 2, "ultrachat-sft")
    assert (trl.eval_every, trl.report_to) == (50, (Tracker.TENSORBOARD,))
    axolotl = _parse("--config", str(_write(tmp_path / "axolotl.yaml", AXOLOTL_CONFIG)), "--data", "d.jsonl")
    assert (axolotl.model, axolotl.lr, axolotl.epochs, axolotl.max_length) == ("tiny", 2e-4, 2, 4096)
    assert (axolotl.lora_rank, axolotl.lora_alpha, axolotl.lora_targets) == (16, 32, ("q_proj", "v_proj"))
    assert (axolotl.loss_on, axolotl.attention_backend, axolotl.compile) == ("assistant", "flash_attn", False)


def test_a_setting_skrull_has_not_is_refused_with_what_replaces_it_from_the_files_values(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 4\ncp: 2\nper_device_train_batch_size: 4\n"
                                        "gradient_accumulation_steps: 8\nmax_steps: 1000\nwarmup_ratio: 0.03\n"
                                        "packing: false\n")
    with pytest.raises(ValueError) as refused:
        _parse("--config", str(run))
    batch, warmup, packing = str(refused.value).splitlines()
    assert batch.startswith(f"{run}: per_device_train_batch_size, gradient_accumulation_steps: not settings of "
                            "Skrull: Skrull plans every global batch's micro-batches itself")
    assert batch.endswith("give global_batch, the sequences per optimizer step: here per_device_train_batch_size 4 "
                          "× gradient_accumulation_steps 8 × dp 4 = 128")
    assert warmup == (f"{run}: warmup_ratio: not a setting of Skrull: give warmup_steps, the steps of linear warmup: "
                      "here warmup_ratio 0.03 × steps 1000 = 30")
    assert packing.startswith(f"{run}: packing: not a setting of Skrull: Skrull always packs")


def test_an_unknown_key_is_answered_with_the_closest_setting_or_where_they_are_listed(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        _parse("--config", str(_write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nzqxv: 3\n")))
    assert str(refused.value) == (f"{tmp_path / 'run.yaml'}: zqxv: unknown key; `python -m trainer_client.train "
                                  "--help` lists the settings (a key is the flag's name with _ for -)")


def test_a_foreign_key_and_the_skrull_key_it_is_may_not_both_be_given(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nlr: 0.001\nlearning_rate: 0.0002\n")
    with pytest.raises(ValueError, match=r"learning_rate: lr sets lr too; give one$"):
        _parse("--config", str(run))


def test_a_wrong_value_under_a_foreign_key_is_named_by_that_key(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nlearning_rate: -0.001\n")
    with pytest.raises(ValueError, match=f"^{run}: learning_rate: must be positive, got -0.001$"):
        _parse("--config", str(run))


def test_a_single_value_is_a_list_where_a_list_is_expected(tmp_path: Path) -> None:
    run = _write(tmp_path / "run.yaml", "dp: 1\ncp: 1\nreport_to: tensorboard\nlora_rank: 4\n"
                                        "lora_targets: q_proj\n")
    config = _parse("--config", str(run))
    assert (config.report_to, config.lora_targets) == ((Tracker.TENSORBOARD,), ("q_proj",))
    assert _parse("--dp", "1", "--cp", "1", "--report-to", "none").report_to == ()


def test_another_trainers_flag_is_read_as_skrulls_or_refused_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse("--dp", "1", "--cp", "1", "--learning-rate", "2e-5", "--max-steps=7").lr == 2e-5
    with pytest.raises(SystemExit) as stopped:
        main(["--dp", "1", "--cp", "1", "--gradient-accumulation-steps", "4"])
    assert stopped.value.code == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert error == "error: unrecognized arguments: --gradient-accumulation-steps 4"
    assert hint.startswith("hint: --gradient-accumulation-steps is not a setting of Skrull: Skrull plans every global "
                           "batch's micro-batches itself")


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides"


def _guide_block(page: str, opening: str) -> str:
    """The code block of a docs page whose first line is ``opening``, without its fences."""
    text = (GUIDE / page).read_text()
    start = text.index(opening)
    return text[start:text.index("```", start)]


def test_the_training_guides_trl_config_and_its_skrull_twin_say_what_the_trainer_does(tmp_path: Path) -> None:
    skrull = _write(tmp_path / "sft.yaml", _guide_block("training.md", "# sft.yaml\n"))
    config = _parse("--config", str(skrull))
    assert (config.dp, config.cp, config.global_batch, config.loss_on) == (4, 2, 64, "assistant")
    trl = _write(tmp_path / "trl.yaml", _guide_block("training.md", "# trl.yaml\n") + "dp: 4\ncp: 2\n")
    with pytest.raises(ValueError) as refused:
        _parse("--config", str(trl))
    shown = _guide_block("training.md", "error: trl.yaml: ").replace("trl.yaml", str(trl))
    assert f"error: {refused.value}" == shown.strip()


def test_the_page_for_trl_users_lists_every_name_the_trainer_reads_or_refuses() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line for line in (GUIDE / "from-trl.md").read_text().splitlines()
            if line.startswith("| `")}
    for name, foreign in FOREIGN_KEYS.items():
        assert name in rows, name
        assert f"| {foreign.tools} |" in rows[name], name
        skrull = f"`{foreign.key}`" if foreign.key is not None else ("accepted" if foreign.accepts else "refused")
        assert rows[name].split("|")[3].strip().startswith(skrull), name


def test_a_negative_number_is_a_flags_value_not_another_flag() -> None:
    with pytest.raises(ValueError, match=r"^--lr must be positive, got -0.0001$"):
        _parse("--dp", "1", "--cp", "1", "--lr", "-1e-4")
    assert _parse("--dp", "1", "--cp", "1", "--seed", "-3", "--weight-decay", "-0").seed == -3


def test_epochs_may_be_a_fraction_of_the_records(tmp_path: Path) -> None:
    config = _parse("--dp", "1", "--cp", "1", "--data", "records.jsonl", "--epochs", "0.5")
    assert config.epochs == 0.5
    with pytest.raises(ValueError, match=r"--epochs must be positive, got 0.0"):
        _parse("--dp", "1", "--cp", "1", "--data", "records.jsonl", "--epochs", "0")
