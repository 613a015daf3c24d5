"""One process: the chunked loss equals the plain one without holding whole logits, activation checkpointing trades
memory for recomputation without changing gradients, each LR schedule and clipping do what they say."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import get_scheduler

from trainer_client.components.optim import (
    LRSchedulerName,
    clip_gradients,
    lr_factors,
    lr_schedule,
    warmup_cosine_factor,
    wsd_decay_steps,
)
from trainer_client.config import TrainConfig
from trainer_client.data import IGNORE_INDEX
from trainer_client.models.loss import CausalLMLoss, chunked_cross_entropy
from trainer_client.models.model import build_model
from trainer_client.models.parallelize import ActivationCheckpointing, apply_activation_checkpointing
from trainer_client.profiler.measure import local_pack
from trainer_client.train import build_parser, config_from_args

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


def test_warmup_cosine_warms_up_linearly_then_follows_a_cosine_to_the_floor_at_the_last_step() -> None:
    factors = [warmup_cosine_factor(step, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in itertools.pairwise(factors[4:]))
    assert factors[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 15)))
    assert warmup_cosine_factor(0, warmup_steps=0, total_steps=1, min_lr_ratio=0.1) == 1.0


def _transformers_schedule(
    name: str, *, warmup_steps: int, total_steps: int, **specific: float,
) -> Callable[[int], float]:
    """transformers' schedule ``name`` as its Trainer builds it: the factor as a function of the step."""
    parameter = torch.zeros(1, requires_grad=True)
    schedule = get_scheduler(name, torch.optim.SGD([parameter], lr=1.0), num_warmup_steps=warmup_steps,
                             num_training_steps=total_steps, scheduler_specific_kwargs=specific)
    return schedule.lr_lambdas[0]


def test_cosine_with_min_lr_is_the_default_one_step_shorter_without_warmup_and_differs_only_in_its_decay() -> None:
    for total_steps, min_lr_ratio in itertools.product(range(1, 65), (0.0, 0.1, 0.5, 1.0)):
        shorter = _transformers_schedule("cosine_with_min_lr", warmup_steps=0, total_steps=total_steps - 1,
                                         min_lr_rate=min_lr_ratio)
        for step in range(total_steps):  # bit for bit
            assert shorter(step) == warmup_cosine_factor(step, warmup_steps=0, total_steps=total_steps,
                                                         min_lr_ratio=min_lr_ratio), (total_steps, step)
    # With a warmup and the run's own length: the default's warmup, above the floor at the last step.
    own = lr_factors(LRSchedulerName.COSINE_WITH_MIN_LR, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    default = [warmup_cosine_factor(step, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for step in range(10)]
    assert [own(step) for step in range(3)] == default[:3] == [0.5, 1.0, 1.0]
    assert own(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert default[9] == pytest.approx(0.1)


def _cosine(progress: float, floor: float = 0.0) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# warmup 2 of 10 steps, min-lr-ratio 0.1; warmup_stable_decay decays over ⌈8 / 5⌉ = 2 steps. Every warmup is
# (s + 1) / W, warmup_stable_decay's from the floor: m + (1 − m) · (s + 1) / W.
EXPECTED_FACTORS = {
    LRSchedulerName.WARMUP_COSINE: [0.5, 1.0] + [_cosine((step - 2) / 7, 0.1) for step in range(2, 10)],
    LRSchedulerName.LINEAR: [0.5, 1.0] + [(10 - step) / 8 for step in range(2, 10)],
    LRSchedulerName.COSINE: [0.5, 1.0] + [_cosine((step - 2) / 8) for step in range(2, 10)],
    LRSchedulerName.COSINE_WITH_MIN_LR: [0.5, 1.0] + [_cosine((step - 2) / 8, 0.1) for step in range(2, 10)],
    LRSchedulerName.CONSTANT_WITH_WARMUP: [0.5, 1.0] + [1.0] * 8,
    LRSchedulerName.WARMUP_STABLE_DECAY: [0.55, 1.0] + [1.0] * 6 + [1.0, _cosine(1 / 2, 0.1)],
}


@pytest.mark.parametrize("scheduler", list(LRSchedulerName))
def test_each_named_schedule_follows_its_formula(scheduler: LRSchedulerName) -> None:
    factors = lr_factors(scheduler, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert [factors(step) for step in range(10)] == pytest.approx(EXPECTED_FACTORS[scheduler], rel=1e-12)


@pytest.mark.parametrize("scheduler", list(LRSchedulerName))
@pytest.mark.parametrize("warmup_steps", [1, 2, 5])
def test_no_step_trains_at_lr_0_and_the_first_step_after_warmup_trains_at_the_peak(
    scheduler: LRSchedulerName, warmup_steps: int,
) -> None:
    total_steps = 12
    factors = [lr_factors(scheduler, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=0.1)(step)
               for step in range(total_steps)]
    assert min(factors) > 0, factors
    assert factors[warmup_steps] == 1.0
    assert factors[warmup_steps - 1] == 1.0  # the warmup reaches the peak on its last step
    assert factors[0] == pytest.approx(0.1 + 0.9 / warmup_steps if scheduler is LRSchedulerName.WARMUP_STABLE_DECAY
                                       else 1 / warmup_steps)


@pytest.mark.parametrize("scheduler", [name for name in LRSchedulerName if name is not LRSchedulerName.WARMUP_COSINE])
def test_after_the_warmup_each_transformers_schedule_decays_as_transformers_decays_it(
    scheduler: LRSchedulerName,
) -> None:
    specific = ({"min_lr_rate": 0.1} if scheduler is LRSchedulerName.COSINE_WITH_MIN_LR else
                {"min_lr_ratio": 0.1, "num_decay_steps": wsd_decay_steps(warmup_steps=3, total_steps=20)}
                if scheduler is LRSchedulerName.WARMUP_STABLE_DECAY else {})
    theirs = _transformers_schedule(scheduler.value, warmup_steps=3, total_steps=20, **specific)
    ours = lr_factors(scheduler, warmup_steps=3, total_steps=20, min_lr_ratio=0.1)
    assert [ours(step) for step in range(3, 20)] == [theirs(step) for step in range(3, 20)]
    assert [ours(step) for step in range(3)] == [theirs(step + 1) for step in range(3)]  # the warmup a step ahead


def test_warmup_stable_decay_decays_over_a_fifth_of_the_steps_after_warmup() -> None:
    assert [wsd_decay_steps(warmup_steps=100, total_steps=total) for total in (100, 101, 105, 106, 1100)] == [
        1, 1, 1, 2, 200]


@pytest.mark.parametrize("scheduler", list(LRSchedulerName))
def test_a_schedule_built_at_a_restored_step_follows_its_own_schedule_not_the_saved_runs(
    scheduler: LRSchedulerName,
) -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    saved = torch.optim.AdamW([weight], lr=1e-3)
    short = lr_schedule(saved, scheduler=LRSchedulerName.WARMUP_COSINE, lr=1e-3, warmup_steps=1, total_steps=2,
                        min_lr_ratio=0.1)
    for _ in range(2):
        weight.grad = torch.ones(3)
        saved.step()
        short.step()
    restored = torch.optim.AdamW([weight], lr=1e-3)
    restored.load_state_dict(saved.state_dict())  # holds the short schedule's learning rates
    extended = lr_schedule(restored, scheduler=scheduler, lr=2e-3, warmup_steps=1, total_steps=5, min_lr_ratio=0.2,
                           first_step=2)
    factors = lr_factors(scheduler, warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    for step in range(2, 5):
        assert restored.param_groups[0]["lr"] == pytest.approx(2e-3 * factors(step), rel=1e-12)
        assert extended.get_last_lr()[0] == pytest.approx(2e-3 * factors(step), rel=1e-12)
        weight.grad = torch.ones(3)
        restored.step()
        extended.step()


def test_the_lr_scheduler_flag_takes_the_names_and_refuses_another_naming_them() -> None:
    args = build_parser().parse_args(["--dp", "1", "--cp", "1", "--lr-scheduler", "warmup_stable_decay"])
    assert config_from_args(args).lr_scheduler is LRSchedulerName.WARMUP_STABLE_DECAY
    assert TrainConfig(dp=1, cp=1).lr_scheduler is LRSchedulerName.WARMUP_COSINE
    with pytest.raises(ValueError, match=r"^--lr-scheduler 'step' is unknown; known: warmup_cosine, linear, cosine, "
                                         r"cosine_with_min_lr, constant_with_warmup, warmup_stable_decay$"):
        TrainConfig(dp=1, cp=1, lr_scheduler="step")  # type: ignore[arg-type]


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


def test_every_schedule_but_the_default_is_named_as_transformers_names_it() -> None:
    from transformers import SchedulerType

    assert {name.value for name in LRSchedulerName} - {SchedulerType(name).value for name in LRSchedulerName
                                                         if name is not LRSchedulerName.WARMUP_COSINE} \
        == {LRSchedulerName.WARMUP_COSINE.value}
