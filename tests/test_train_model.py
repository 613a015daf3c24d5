"""The transformers model with DACP attention equals the stock model; checkpoints load from a local directory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from scheduler_service.core.models import MODEL_CATALOGUE
from scheduler_service.core.plan import MicroBatch
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.data import Sample
from trainer_client.models.model import build_model, model_inputs, model_shape

LENGTHS = (40, 7, 129, 1, 64)


def _samples() -> list[Sample]:
    rng = np.random.default_rng(0)
    return [Sample(input_ids=(ids := rng.integers(0, 1024, size=n, dtype=np.int64)), labels=ids) for n in LENGTHS]


def test_dacp_model_matches_stock_sdpa_model_on_a_packed_row() -> None:
    samples = _samples()
    # cp_size 1: local sequences and a "distributed" one (two chunks against their prefixes), no communication.
    packed = pack_micro_batch(samples, MicroBatch(local=((0, 1, 3),), distributed=(2, 4)), cp_size=1, cp_rank=0)
    dacp, stock = build_model("tiny", seed=0), build_model("tiny", attn_implementation="sdpa", seed=0)
    with torch.no_grad():
        logits_TV = dacp(**model_inputs(packed, "sdpa")).logits[0]
        expected = []
        for index in (0, 1, 3, 2, 4):
            ids_T = torch.from_numpy(samples[index].input_ids)
            padding = (-len(ids_T)) % 2  # the zigzag pads a distributed sequence to a multiple of 2 · cp_size
            if index in (2, 4) and padding:
                ids_T = torch.cat([ids_T, torch.zeros(padding, dtype=torch.int64)])
            expected.append(stock(input_ids=ids_T[None], use_cache=False).logits[0])
    torch.testing.assert_close(logits_TV, torch.cat(expected), rtol=1e-4, atol=1e-5)


def test_model_without_its_micro_batch_fails_with_a_clear_error() -> None:
    model = build_model("tiny", seed=0)
    with pytest.raises(ValueError, match=r"DACP attention needs its micro-batch: call the model with "
                                         r"\*\*model_inputs\(pack\)"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.int64), use_cache=False)


def test_same_seed_gives_the_same_weights_in_every_process() -> None:
    first, second = build_model("tiny", seed=7), build_model("tiny", seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


def test_checkpoint_directory_loads_with_dacp_attention(tmp_path: Path) -> None:
    build_model("tiny", seed=0).save_pretrained(tmp_path)
    loaded, original = build_model(str(tmp_path)), build_model("tiny", seed=0)
    assert loaded.config._attn_implementation == "dacp"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values(),
                                                 strict=True))
    assert model_shape(str(tmp_path)) == replace(MODEL_CATALOGUE["tiny"], name=tmp_path.name)


def test_shape_without_attention_bias_builds_a_llama_model() -> None:
    from trainer_client.models.model import _config_from_shape

    config = _config_from_shape(MODEL_CATALOGUE["llama-3-8b"])
    assert config.model_type == "llama" and config.attention_bias is False


def test_rejects_unknown_model() -> None:
    with pytest.raises(ValueError, match="neither a built-in model"):
        build_model("gpt-9")
