"""Every torch release the trainer supports, emulated on the installed one (``tests/torch_releases.py``): the
single-tensor collectives resolve to what the release has, torch's flash operator (given a CPU kernel) to the
varlen kernel, and DACP attention through them equals the SDPA backend's, forward and backward; a torch outside
the range is named with the range."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scheduler_service.core.plan import MicroBatch, ShardedGroup
from tests.torch_releases import RELEASES, emulated
from trainer_client.dacp.attention import dacp_attn_varlen_func
from trainer_client.dacp.kernels import AttentionBackend, varlen_causal_attn_func
from trainer_client.dacp.packing import pack_micro_batch
from trainer_client.data import Sample
from trainer_client.distributed import spawn_gloo
from trainer_client.distributed.torch_compat import (
    SUPPORTED_TORCH,
    CausalVarlenAttn,
    UnsupportedTorch,
    check_torch_version,
    torch_apis,
    torch_release,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
ROOT = Path(__file__).resolve().parents[1]


def test_the_supported_range_is_the_one_pyproject_declares() -> None:
    trainer_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trainer"]
    assert f"torch{SUPPORTED_TORCH}" in trainer_extra


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.0a0+git5ca73b4"])
def test_a_supported_torch_passes(version: str) -> None:
    assert check_torch_version(version) is None


@pytest.mark.parametrize("version", ["2.9.1", "1.13.1"])
def test_an_older_torch_is_refused_naming_it_and_the_range(version: str) -> None:
    with pytest.raises(UnsupportedTorch, match=rf"torch {version} is older .* torch>=2\.10,<2\.14"):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.14.0", "3.0.0"])
def test_a_newer_torch_is_warned_of_naming_it_and_the_range(version: str) -> None:
    warning = check_torch_version(version)
    assert warning is not None and f"torch {version} is newer" in warning and "torch>=2.10,<2.14" in warning


def test_a_release_is_read_from_any_version_string() -> None:
    assert torch_release("2.11.0+cu130") == (2, 11)
    with pytest.raises(UnsupportedTorch, match="nightly"):
        torch_release("nightly")


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_resolves_the_collective_it_has(release: str) -> None:
    with emulated(release):
        names = (torch_apis().all_gather_single.__name__, torch_apis().reduce_scatter_single.__name__)
    expected = (("all_gather_single", "reduce_scatter_single") if release == "2.13"
                else ("all_gather_into_tensor", "reduce_scatter_tensor"))
    assert names == expected


def _segments() -> tuple[torch.Tensor, ...]:
    """GQA inputs with query segments shorter than their keys (zigzag chunks against their prefixes) and equal."""
    generator = torch.Generator().manual_seed(0)
    lengths_q, lengths_k = [3, 7, 1, 6], [9, 7, 12, 6]
    q_THD = torch.randn(sum(lengths_q), NUM_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    k_SGD = torch.randn(sum(lengths_k), NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    v_SGD = torch.randn(sum(lengths_k), NUM_KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    return q_THD, k_SGD, v_SGD, cu_q, cu_k, torch.tensor(max(lengths_q)), torch.tensor(max(lengths_k))


def _forward_backward(backend: AttentionBackend, softmax_scale: float | None) -> list[torch.Tensor]:
    q, k, v, cu_q, cu_k, max_q, max_k = _segments()
    q, k, v = (tensor.requires_grad_() for tensor in (q, k, v))
    out = varlen_causal_attn_func(q, k, v, cu_q, cu_k, int(max_q), int(max_k), softmax_scale=softmax_scale,
                                  backend=backend)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach(), *(tensor.grad for tensor in (q, k, v))]


@pytest.mark.parametrize("softmax_scale", [None, 0.2])
@pytest.mark.parametrize("release", RELEASES)
def test_the_flash_operator_under_each_release_equals_sdpa_forward_and_backward(
    release: str, softmax_scale: float | None
) -> None:
    expected = _forward_backward(AttentionBackend.SDPA, softmax_scale)
    with emulated(release):
        got = _forward_backward(AttentionBackend.TORCH_VARLEN, softmax_scale)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{release} {name}: {m}")


def test_the_flash_operator_takes_fewer_kv_heads_and_differentiates_in_cpp() -> None:
    q, k, v, cu_q, cu_k, max_q, max_k = _segments()
    q = q.requires_grad_()
    with emulated("2.13"):
        out = torch_apis().varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), None)
    assert k.shape[1] < q.shape[1] == out.shape[1]  # no K/V heads repeated on the way in
    assert type(out.grad_fn).__name__ == "FlashAttentionBackward0"  # torch's C++ node, not a Python function


def test_a_kernel_aligned_top_left_is_detected_and_made_exact() -> None:
    expected = _forward_backward(AttentionBackend.SDPA, None)
    with emulated("2.13", bottom_right=False):
        kernel = torch_apis().varlen_attn
        assert isinstance(kernel, CausalVarlenAttn)
        assert not kernel.aligns_bottom_right(torch.device("cpu"), torch.float64, HEAD_DIM)
        got = _forward_backward(AttentionBackend.TORCH_VARLEN, None)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("release", RELEASES)
def test_every_supported_release_aligns_bottom_right(release: str) -> None:
    with emulated(release):
        kernel = torch_apis().varlen_attn
        assert isinstance(kernel, CausalVarlenAttn)
        assert kernel.aligns_bottom_right(torch.device("cpu"), torch.float64, HEAD_DIM)


def test_the_flash_attn_kernel_equals_sdpa_forward_and_backward() -> None:
    expected = _forward_backward(AttentionBackend.SDPA, 0.2)
    with emulated("2.13", flash_attn=True):
        got = _forward_backward(AttentionBackend.FLASH_ATTN, 0.2)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_emulated_releases_refuse_what_they_lack() -> None:
    installed = {name: getattr(dist, name, None) for name in ("all_gather_single", "all_gather_into_tensor")}
    with emulated("2.11"):
        assert not hasattr(dist, "all_gather_single")
    assert {name: getattr(dist, name, None) for name in installed} == installed  # restored
    q, k, v, cu_q, cu_k, max_q, max_k = _segments()
    with emulated("2.13"), pytest.raises(RuntimeError, match="must divide number of heads"):
        torch.ops.aten._flash_attention_forward(q[:, :3], k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, True,
                                                False)
    with pytest.raises(NotImplementedError):  # restored: no CPU kernel outside the emulation
        torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, True, False)


LENGTHS = (5, 17, 64, 33, 1, 100, 2, 9)
# Local sequences, the whole CP group's zigzag shards and a hybrid group's: every collective DACP attention runs.
MICRO_BATCH = MicroBatch(local=((0, 1), (4, 6)), distributed=(2, 5), sharded=(ShardedGroup(cp_ranks=(0, 1),
                                                                                             sequences=(3, 7)),))


def _dacp(backend: AttentionBackend) -> list[torch.Tensor]:
    rank = dist.get_rank()
    samples = [Sample(input_ids=torch.zeros(n, dtype=torch.int64).numpy(),
                      labels=torch.zeros(n, dtype=torch.int64).numpy()) for n in LENGTHS]
    pack = pack_micro_batch(samples, MICRO_BATCH, cp_size=2, cp_rank=rank, cp_group=dist.group.WORLD)
    generator = torch.Generator().manual_seed(rank)
    shapes = [(pack.num_tokens, NUM_HEADS, HEAD_DIM), (pack.num_tokens, NUM_KV_HEADS, HEAD_DIM),
              (pack.num_tokens, NUM_KV_HEADS, HEAD_DIM)]
    q, k, v = (torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes)
    out = dacp_attn_varlen_func(q, k, v, pack.metadata, backend=backend)
    out.backward(torch.randn(out.shape, generator=generator, dtype=torch.float64))
    return [out.detach(), *(tensor.grad for tensor in (q, k, v))]


def _check_every_release_on_two_ranks() -> None:
    warnings.simplefilter("error")  # a deprecated collective name is a failure, as under pytest
    expected = _dacp(AttentionBackend.SDPA)
    cases = [*((release, AttentionBackend.TORCH_VARLEN, True) for release in RELEASES),
             ("2.13", AttentionBackend.TORCH_VARLEN, False),
             ("2.13", AttentionBackend.FLASH_ATTN, True)]
    for release, backend, bottom_right in cases:
        with emulated(release, flash_attn=backend is AttentionBackend.FLASH_ATTN, bottom_right=bottom_right):
            got = _dacp(backend)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, name=name, where=(release, backend): f"{where} {name}: {m}")


def test_dacp_attention_under_each_release_equals_sdpa_on_two_ranks() -> None:
    spawn_gloo(_check_every_release_on_two_ranks, 2)
