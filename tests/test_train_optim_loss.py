"""One process: the chunked loss equals the plain one without holding whole logits, activation checkpointing trades
memory for recomputation without changing gradients, the LR schedule and clipping do what they say."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from trainer_client.data import IGNORE_INDEX
from trainer_client.loss import CausalLMLoss, chunked_cross_entropy
from trainer_client.model import build_model
from trainer_client.optim import clip_gradients, lr_factor, warmup_cosine_schedule
from trainer_client.parallelize import ActivationCheckpointing, apply_activation_checkpointing
from trainer_client.profiler.measure import local_pack

CPU = torch.device("cpu")


def _peak_bytes(fn: object) -> int:
    tracker = MemTracker()
    with tracker:
        fn()  # type: ignore[operator]
    return int(tracker.get_tracker_snapshot("peak")[CPU]["Total"])


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_the_whole_logits_loss_and_gradients(chunk_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (64,), generator=generator)
    targets[::5] = IGNORE_INDEX
    expected = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_never_holds_the_whole_fp32_logits() -> None:
    num_tokens, vocab, hidden_size = 2048, 4096, 32
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (num_tokens,))
    logits_bytes = num_tokens * vocab * 4

    def step(chunk_tokens: int) -> None:
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens).backward()

    assert _peak_bytes(lambda: step(num_tokens)) > logits_bytes  # one chunk: the whole logits, as unchunked
    assert _peak_bytes(lambda: step(128)) < logits_bytes / 4


def _tiny_step(mode: ActivationCheckpointing) -> tuple[int, dict[str, torch.Tensor]]:
    module = CausalLMLoss(build_model("tiny", seed=0))
    apply_activation_checkpointing(module, mode)
    pack = local_pack((384, 128), vocab_size=1024, device=CPU, seed=0)
    loss = module(pack, "sdpa")
    peak = _peak_bytes(lambda: (module(pack, "sdpa") / 1000).backward())
    module.zero_grad()
    (loss / 1000).backward()
    return peak, {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def test_activation_checkpointing_lowers_peak_memory_and_keeps_gradients() -> None:
    runs = {mode: _tiny_step(mode) for mode in ActivationCheckpointing}
    peaks = {mode: peak for mode, (peak, _) in runs.items()}
    assert peaks[ActivationCheckpointing.FULL] < peaks[ActivationCheckpointing.SELECTIVE] < peaks[
        ActivationCheckpointing.NONE]
    reference = runs[ActivationCheckpointing.NONE][1]
    for mode in (ActivationCheckpointing.SELECTIVE, ActivationCheckpointing.FULL):
        assert runs[mode][1].keys() == reference.keys()  # parameter names unchanged by the hooks
        for name, grad in reference.items():
            torch.testing.assert_close(runs[mode][1][name], grad, rtol=1e-5, atol=1e-7)


def test_lr_warms_up_linearly_then_follows_a_cosine_to_the_floor_at_the_last_step() -> None:
    factors = [lr_factor(step, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in itertools.pairwise(factors[4:]))
    assert factors[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 15)))
    assert lr_factor(0, warmup_steps=0, total_steps=1, min_lr_ratio=0.1) == 1.0


def test_a_schedule_built_at_a_restored_step_follows_its_own_schedule_not_the_saved_runs() -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    saved = torch.optim.AdamW([weight], lr=1e-3)
    short = warmup_cosine_schedule(saved, lr=1e-3, warmup_steps=1, total_steps=2, min_lr_ratio=0.1)
    for _ in range(2):
        weight.grad = torch.ones(3)
        saved.step()
        short.step()
    restored = torch.optim.AdamW([weight], lr=1e-3)
    restored.load_state_dict(saved.state_dict())  # holds the short schedule's learning rates
    extended = warmup_cosine_schedule(restored, lr=2e-3, warmup_steps=1, total_steps=5, min_lr_ratio=0.2,
                                      first_step=2)
    for step in range(2, 5):
        expected = 2e-3 * lr_factor(step, warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
        assert restored.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
        assert extended.get_last_lr()[0] == pytest.approx(expected, rel=1e-12)
        weight.grad = torch.ones(3)
        restored.step()
        extended.step()


def test_clipping_scales_every_gradient_by_the_global_norm() -> None:
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    norm = clip_gradients([a, b], max_norm=1.0)
    assert norm == pytest.approx(math.sqrt(3 * 9 + 4 * 16))
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)
    a.grad = torch.full((3,), 0.1)
    b.grad = None
    assert clip_gradients([a, b], max_norm=0.0) == pytest.approx(math.sqrt(3) * 0.1)  # 0: measured, not clipped
    assert a.grad.tolist() == pytest.approx([0.1] * 3)
