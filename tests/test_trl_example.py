"""``examples/trl_sft.py`` runs as the guide says, under torchrun on CPU. Its Hub model comes from an offline cache
built here: the tiny model under the example's model id, with the tests' tokenizer given Qwen2.5's chat template,
which TRL makes a training template of. Its data set is a local folder of chats (``load_dataset`` of a Hub id
offline reads only datasets' own cache). Two processes, so dp 1 × cp 2; the saved model is what trained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_cache import HubCache
from tests.test_hf_sft import chats
from trainer_client.demo import trainer_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_sft.py"
MODEL, DATASET = "Qwen/Qwen2.5-0.5B-Instruct", "trl-lib/Capybara"  # the example's defaults


@pytest.mark.slow
def test_the_trl_example_trains_on_cpu_and_saves_a_model_transformers_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    hub = HubCache(tmp_path / "hub")
    snapshot = hub.add_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(snapshot)
    data = hub.add_dataset(DATASET, {"train": chats(16, seed=3)})  # its snapshot: a folder of parquet files
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--dataset", str(data), "--output-dir", str(out), "--max-length", "256", "--per-device-batch", "4",
         "--gradient-accumulation", "2", "--max-steps", "2", "--cp", "2", "--bucket-size", "160"],
        cwd=tmp_path, env={**trainer_env(), **hub.env()}, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("'loss'") == 2  # the Trainer's log line of each step, from rank 0
    trained = AutoModelForCausalLM.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(snapshot)
    assert any(not (a == b).all() for a, b in zip(trained.parameters(), initial.parameters(), strict=True))
