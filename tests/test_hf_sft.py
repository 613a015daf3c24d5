"""``SkrullSFTTrainer`` keeps TRL's data path and trains what the bundled trainer trains (gloo ranks on CPU, fp32).

The same chats, one tokenizer whose ChatML template marks the assistant's answers (``{% generation %}``, which
TRL's ``assistant_only_loss`` reads and a plain rendering ignores), ``max_length`` cutting the longest: TRL's
assistant-only labels are the bundled trainer's ``loss_on: assistant`` labels token for token, and at DP 1 × CP 2
on the same plans the losses and gradient norms agree step for step. TRL's own metrics (entropy, token accuracy,
tokens seen) are logged every step, of the whole global batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.hf_runs import fresh_accelerate_state, logged_steps, training_arguments, write_jsonl
from tests.hub_cache import WORDS, save_tokenizer
from trainer_client.config import TrainConfig
from trainer_client.distributed import ParallelDims, init_parallel, spawn_gloo
from trainer_client.hf import SkrullArguments, SkrullSFTTrainer
from trainer_client.models.model import build_model
from trainer_client.planning.source import PlanSource
from trainer_client.trainer import Trainer as BundledTrainer

# TRL 1.16's SFTConfig defaults the name transformers 5.23 deprecated (gradient_checkpointing=True)
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")]

RELATIVE_TOLERANCE = 1e-6
PROFILE = "h100-paper"
NUM_STEPS, GLOBAL_BATCH, MAX_LENGTH, BUCKET_SIZE = 2, 8, 160, 96
# ChatML with the assistant's answer and its end of turn inside generation markers: what TRL trains with
# assistant_only_loss, and what the bundled trainer trains of an assistant turn (its rendering after the prompt).
MARKED_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chats(count: int, *, seed: int) -> list[dict[str, Any]]:
    """Chats of a system prompt, then one or two user and assistant turns: 16 of them (seed 3) are 58 to 236
    tokens long, so that some are kept whole on one CP rank, some sharded and some cut at ``MAX_LENGTH``."""
    rng = np.random.default_rng(seed)

    def text(num_words: int) -> str:
        return " ".join(rng.choice(WORDS, size=num_words))

    records = []
    for _ in range(count):
        messages = [{"role": "system", "content": text(3)}]
        for _ in range(int(rng.integers(1, 3))):
            messages += [{"role": "user", "content": text(int(rng.integers(1, 12)))},
                         {"role": "assistant", "content": text(int(rng.integers(1, 40)))}]
        records.append({"messages": messages})
    return records


def _bundled_and_sft(out: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    fresh_accelerate_state()
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(out / f"tokenizer-{rank}"))
    tokenizer.chat_template = MARKED_CHATML
    tokenizer_dir = out / f"marked-tokenizer-{rank}"
    tokenizer.save_pretrained(tokenizer_dir)
    rows = chats(NUM_STEPS * GLOBAL_BATCH, seed=3)
    config = TrainConfig(dp=1, cp=2, model="tiny", data=str(write_jsonl(out / f"chats-{rank}.jsonl", rows)),
                         tokenizer=str(tokenizer_dir), loss_on="assistant", max_length=MAX_LENGTH, truncate=True,
                         shuffle=False, global_batch=GLOBAL_BATCH, steps=NUM_STEPS, scheduler="skrull",
                         bucket_size=BUCKET_SIZE, profile=PROFILE, lr=1e-3, min_lr_ratio=1.0, sharding="none", seed=0,
                         progress=False)
    bundled = BundledTrainer(config, init_parallel(ParallelDims.of(config)))
    bundled_samples = [sample for step in range(NUM_STEPS) for sample in bundled.source.batch(step).samples]
    history = bundled.train()
    bundled.close()

    fresh_accelerate_state()
    args = training_arguments(out / "sft", SFTConfig, per_device_train_batch_size=GLOBAL_BATCH, max_steps=NUM_STEPS,
                              assistant_only_loss=True, max_length=MAX_LENGTH)
    trainer = SkrullSFTTrainer(model=build_model("tiny", attn_implementation="sdpa", seed=0), args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                               skrull=SkrullArguments(bucket_size=BUCKET_SIZE, cp=2, profile=PROFILE))
    sft_samples = trainer.data_collator([trainer.train_dataset[index] for index in range(len(rows))])["samples"]
    trainer.train()
    if rank == 0:
        (out / "results.json").write_text(json.dumps({
            "bundled": [(m.loss, m.grad_norm, m.tokens) for m in history],
            "sft": logged_steps(trainer.state.log_history),
            "samples": [[(s.input_ids.tolist(), s.labels.tolist()) for s in samples]
                        for samples in (bundled_samples, sft_samples)]}))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sft")
    spawn_gloo(_bundled_and_sft, 2, out)
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return results


def test_trls_assistant_only_labels_are_the_bundled_trainers_and_max_length_cuts_the_same(
    sft_run: dict[str, Any],
) -> None:
    bundled, sft = sft_run["samples"]
    assert sft == bundled
    assert max(len(input_ids) for input_ids, _ in sft) == MAX_LENGTH  # some chats were longer, and cut
    assert all(-100 in labels and any(label != -100 for label in labels) for _, labels in sft)
    source = PlanSource(scheduler="skrull", dp_size=1, cp_size=2, model="tiny", bucket_size=BUCKET_SIZE,
                        profile=PROFILE)
    plans = [source.decide(step, [len(input_ids) for input_ids, _ in sft[step * GLOBAL_BATCH:][:GLOBAL_BATCH]]).plan
             for step in range(NUM_STEPS)]
    micro_batches = [mb for plan in plans for rank in plan.dp_ranks for mb in rank.micro_batches]
    assert any(mb.distributed for mb in micro_batches) and any(any(mb.local) for mb in micro_batches)


def test_sft_losses_equal_the_bundled_trainers_masked_losses(sft_run: dict[str, Any]) -> None:
    bundled, sft = sft_run["bundled"], sft_run["sft"]
    assert len(sft) == len(bundled) == NUM_STEPS
    for step, (logs, (loss, grad_norm, _)) in enumerate(zip(sft, bundled, strict=True), start=1):
        assert logs["loss"] == pytest.approx(loss, rel=RELATIVE_TOLERANCE), f"step {step}"
        assert logs["grad_norm"] == pytest.approx(grad_norm, rel=RELATIVE_TOLERANCE), f"step {step}"


def test_trls_metrics_are_logged_of_the_whole_global_batch(sft_run: dict[str, Any]) -> None:
    tokens = np.cumsum([num_tokens for _, _, num_tokens in sft_run["bundled"]])
    assert [logs["num_tokens"] for logs in sft_run["sft"]] == tokens.tolist()
    for logs in sft_run["sft"]:
        assert 0.0 <= logs["mean_token_accuracy"] <= 1.0
        assert 0.0 < logs["entropy"] <= float(torch.log(torch.tensor(1024.0)))  # at most log(vocabulary)
