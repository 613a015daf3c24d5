"""A chat tokenizer offline (``skrull-tokenizer``): what it writes loads as ``--tokenizer``, renders chats with ChatML's
markers as single tokens, is the same files every run, and its bad input is one ``error:`` line naming the argument;
the training guide's offline example runs as written in a folder of its own, and a chat without ``--tokenizer`` is
refused with the command that makes one, as the guide shows it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainer_client.chat_tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS, main, save_chat_tokenizer
from trainer_client.data import load_tokenizer
from trainer_client.demo import trainer_env

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "training.md"
BIN = Path(sys.executable).parent  # the environment's scripts: skrull-tokenizer, skrull-train
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) ")
CHAT = [{"role": "user", "content": "what does the scheduler pack"},
        {"role": "assistant", "content": "short chats beside long ones"}]


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_the_same_arguments_write_the_same_files(tmp_path: Path) -> None:
    save_chat_tokenizer(tmp_path / "a")
    save_chat_tokenizer(tmp_path / "b")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(_files(tmp_path / "a"))


def test_the_folder_loads_as_a_tokenizer_and_renders_chats_in_chatml(tmp_path: Path) -> None:
    save_chat_tokenizer(tmp_path / "tok")
    tokenizer: Any = load_tokenizer(str(tmp_path / "tok"))
    assert len(tokenizer) == DEFAULT_VOCAB_SIZE
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>user\nwhat does the scheduler pack<|im_end|>\n"
                    "<|im_start|>assistant\nshort chats beside long ones<|im_end|>\n")
    markers = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS[2:]]
    assert [ids.count(marker) for marker in markers] == [2, 2]  # each marker one token
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # byte-level: a text of none of the built-in words encodes too, and decodes back
    assert tokenizer.decode(tokenizer.encode("Zürich 42 ✓", add_special_tokens=False)) == "Zürich 42 ✓"


def test_corpus_files_make_their_words_single_tokens(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("checkpointing resumes\n" * 200)
    assert main([str(tmp_path / "tok"), "--corpus", str(corpus), "--vocab-size", "300"]) == 0
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert len(tokenizer) <= 300
    assert len(tokenizer.encode("checkpointing", add_special_tokens=False)) == 1
    builtin = save_chat_tokenizer(tmp_path / "builtin")  # trained on other words: the same word in pieces
    assert len(builtin.encode("checkpointing", add_special_tokens=False)) > 1


@pytest.mark.parametrize(("arguments", "line"), [
    (["--vocab-size", "100"], "error: --vocab-size 100: a byte-level BPE holds the 256 bytes and 4 special tokens, "
                              "so at least 260"),
    (["--corpus", "missing.txt"], "error: --corpus missing.txt: No such file or directory"),
    (["--corpus", "latin1.txt"], "error: --corpus latin1.txt:2: not UTF-8 text (invalid start byte at byte 2 of "
                                 "the line)"),
])
def test_bad_input_is_one_error_line_naming_the_argument_and_the_line(
        arguments: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("latin1.txt").write_bytes("the model\nZürich\n".encode("latin-1"))
    assert main(["tok", *arguments]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_usage_error_is_one_line_and_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--vocab-size", "300"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["error: the following arguments are required: DIR",
                                                    "hint: skrull-tokenizer --help lists the arguments"]


def _block(language: str, containing: str) -> str:
    """The guide's first fenced block of ``language`` that holds ``containing``."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", GUIDE.read_text(), flags=re.MULTILINE | re.DOTALL)
    (block, *_) = [block for block in blocks if containing in block]
    return str(block)


def _run(script: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run by bash in ``folder``, its ``.venv/bin/`` this environment's scripts."""
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script.replace(".venv/bin/", f"{BIN}/")], cwd=folder,
                          env=trainer_env(), capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_the_guides_offline_example_trains_in_a_folder_of_its_own(tmp_path: Path) -> None:
    example = _block("bash", "skrull-tokenizer")
    trained = _run(example, tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert re.findall(r"^step +(\d+) loss", trained.stdout, flags=re.MULTILINE) == ["1", "2"]
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    # the same records without --tokenizer: refused before the first step, as the guide shows it
    (train_line,) = [line for line in example.splitlines() if "skrull-train" in line]
    refused = _run(train_line.replace(" --tokenizer tok", ""), tmp_path)
    assert refused.returncode == 2
    shown = _block("text", "hint: skrull-tokenizer").splitlines()
    assert [line for line in refused.stderr.splitlines() if not LOG_RECORD.match(line)] == shown
    assert shown[0].startswith("error: ") and "run skrull-tokenizer tok, then give --tokenizer tok" in shown[0]
