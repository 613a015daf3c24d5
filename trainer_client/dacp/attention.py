"""DACP attention: local sequences stay on their rank, sharded ones attend over their block of CP ranks.

One CP rank's packed row is ``[local sequences | shards of collective 0 |
shards of collective 1 | …]`` (``packing.py``): a collective is the set of
sequences sharded over one aligned block of ``s`` CP ranks, the whole CP group
for the plan's ``distributed`` sequences or a hybrid group's block
(``DacpMetadata.sharded``, one ``ShardedSpec`` each). Each collective runs one of
three schemes, named by its Ulysses degree ``u``, a divisor of ``s``
(``CollectiveScheme.of``; the layouts are ``zigzag.shard_positions``):

- ``u = 1``, **all-gather-KV** (the Llama 3 scheme): zigzag shards; the K/V
  shards are all-gathered over the block and each of the rank's two chunks per
  sequence attends to its causal prefix of them. Exact with many packed
  documents, and any head count.
- ``u = s``, **Ulysses** (DeepSpeed Ulysses): contiguous shards; one all-to-all
  over the block turns the rank's ``[T, H | G | G heads]`` rows into every whole
  sequence of the collective for ``H/u`` query heads (and their K/V heads),
  plain causal varlen attention runs over them, one all-to-all takes the output
  back to the tokens' owners.
- ``1 < u < s``, **2D** (USP's layout, per collective): block position
  ``p = i·u + j``; the all-to-all runs over the ``u`` consecutive ranks of
  sub-block ``i`` and leaves the rank with the sub-block's zigzag shard for
  ``H/u`` heads; the K/V of those heads are then all-gathered over the ``g =
  s/u`` ranks with the same ``j`` (one per sub-block, ``ShardedSpec.stride_group``)
  and attended as in all-gather-KV over ``g`` ranks.

Per attention layer:

1. launch every collective's first communication (the all-gather of K/V, or
   the all-to-all of Q/K/V), asynchronously, all of them before any wait;
2. meanwhile run causal varlen attention over the local sequences, which never
   leave the rank (the overlap of the paper's Fig. 2(d));
3. wait for every all-to-all and launch the 2D collectives' all-gathers (they
   need the all-to-all's rows, so cannot start earlier);
4. per collective, wait for its K/V and run its attention; the Ulysses and 2D
   outputs' all-to-alls are launched as each finishes and waited at the end.

Backward mirrors it: the gradient of each gathered buffer is reduce-scattered
to the shards' owners, the gradient of each all-to-all's output goes back by an
all-to-all (its own adjoint). Each is *launched* in the backward of the node
that received the data and *waited* in the backward of an identity node placed
on the data sent, when it was sent (``_AwaitKVGrad``, ``_AwaitAllToAllGrad``); the
autograd engine runs the ready node made latest in forward first, so for the
first communications the order is: collective attention backward → gradient
collectives launched → local attention backward (the overlap) → wait. Forward
and backward equal unsharded attention.

Cost per layer, CP rank and collective of ``T`` tokens per rank, forward (backward
moves the same again); ``G' = max(G, u)`` K/V heads after repetition:

- all-gather-KV: an all-gather of ``s · T`` rows of ``2·G·D`` (a reduce-scatter
  back); attention of ``T`` queries, ``H`` heads, over keys up to the whole
  sequence;
- Ulysses: an all-to-all of ``T`` rows of ``(H + 2G')·D`` in and one of ``H·D``
  out, ``(u − 1)/u`` of each leaving the rank; attention of whole sequences,
  ``H/u`` heads (the rank holds a whole sequence's Q/K/V/O for its heads);
- 2D: both all-to-alls over ``u`` ranks, then an all-gather of ``s/u · u·T`` rows
  of ``2·G'/u·D``; attention of ``u·T`` queries, ``H/u`` heads.

So all-gather-KV receives ``(s − 1)·T`` K/V rows per rank, more the larger the
block; Ulysses moves fewer than ``T`` rows of Q/K/V and of O per rank whatever
the block's size, but needs ``u`` to split the heads; 2D trades between them. Local sequences
move no bytes. ``KVAllGather`` and ``UlyssesAllToAll`` hold all the
communication and raise on any out-of-order use.

GQA under Ulysses: each rank must get whole K/V heads for its query heads. ``u``
must divide ``H``, and either divide ``G`` (each rank gets ``G/u`` K/V heads) or
be a multiple of it (each K/V head is repeated ``u/G`` times before the
all-to-all and each rank gets one; the repeated heads' gradients are summed).
Any other degree raises ``ValueError`` (``check_ulysses_heads``): heads are never
split unevenly, as a rank with more of them would set the pace of all, and the
planner never chooses such a degree.

Each rank's attention runs a causal varlen kernel of ``dacp.kernels`` (flash-attn, torch's varlen
attention or SDPA, ``AttentionBackend``).

Shape legend: T query tokens, S key tokens, H query heads, G key/value heads,
D head dim, X = 2 (K and V stacked for one collective), N size of a block,
U the Ulysses degree, F heads sent to one rank of the Ulysses group (its query,
K and V heads), R rows a rank holds after an all-to-all (U · T).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainer_client.dacp.kernels import AttentionBackend, resolve_kernel
from trainer_client.dacp.packing import DacpMetadata, ShardedSpec
from trainer_client.distributed.torch_compat import VarlenKernel, torch_apis

__all__ = [
    "DacpAttention",
    "KVAllGather",
    "UlyssesAllToAll",
    "check_ulysses_heads",
    "dacp_attention_with_collectives",
    "dacp_attn_varlen_func",
]

# ---------------------------------------------------------------------------------------------------- communication


class _AwaitKVGrad(torch.autograd.Function):
    """Identity on a K/V shard forward, made before local attention; backward waits for its reduce-scatter.

    Its input gradient from ``_GatheredKV`` is only a placeholder: the reduced dK/dV come from the collective.
    """

    @staticmethod
    def forward(ctx: Any, kv_local_TXGD: torch.Tensor, comm: KVAllGather) -> torch.Tensor:
        ctx.comm = comm
        return kv_local_TXGD.view_as(kv_local_TXGD)

    @staticmethod
    def backward(ctx: Any, placeholder_TXGD: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm._wait_reduce_scatter(), None


class _GatheredKV(torch.autograd.Function):
    """The gathered buffer forward (after the wait); backward launches the reduce-scatter of its gradient."""

    @staticmethod
    def forward(ctx: Any, kv_local_TXGD: torch.Tensor, comm: KVAllGather) -> torch.Tensor:
        ctx.comm = comm
        ctx.shard_shape = kv_local_TXGD.shape
        return comm._wait_all_gather()

    @staticmethod
    def backward(ctx: Any, grad_gathered_NTXGD: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.comm._launch_reduce_scatter(grad_gathered_NTXGD)
        # Not the gradient (it is in flight): a free stand-in that lets the engine reach _AwaitKVGrad.
        return grad_gathered_NTXGD.new_zeros(()).expand(ctx.shard_shape), None


class KVAllGather:
    """One collective's K/V over a block of CP ranks: all-gather forward, reduce-scatter backward, both async.

    Use once per layer and collective: ``start`` (before local attention), then ``wait`` (after it). Backward
    calls ``_launch_reduce_scatter`` then ``_wait_reduce_scatter`` (again in that order for a retained graph).
    Every other order raises. Tensors are held only while a collective is in flight.
    """

    def __init__(self, group: dist.ProcessGroup | None, group_size: int) -> None:
        if group_size > 1 and group is None:
            raise ValueError(f"sequences sharded over {group_size} CP ranks need that block's process group "
                             "(ShardedSpec.group: pack with cp_group / cp_block_groups)")
        self.group = group
        self.group_size = group_size
        self._input: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._started = False
        self._waited = False
        self._gathered = False

    def start(self, kv_local_TXGD: torch.Tensor) -> None:
        """Launch the all-gather of this rank's shard ``[T, X, G, D]``."""
        if self._started:
            raise RuntimeError("KVAllGather.start called twice; make one object per collective")
        self._started = True
        if self.group_size == 1:
            self._input = kv_local_TXGD
            return
        assert dist.get_world_size(self.group) == self.group_size, "block group size disagrees with the metadata"
        # Made now, before local attention, so that its backward (the wait for dK/dV) runs after local attention's.
        self._input = _AwaitKVGrad.apply(kv_local_TXGD, self)
        self._send = kv_local_TXGD.detach().contiguous()
        self._buffer = self._send.new_empty((self.group_size * self._send.shape[0], *self._send.shape[1:]))
        self._work = torch_apis().all_gather_single(self._buffer, self._send, group=self.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """The gathered rows, rank-major ``[group_size · T, ...]``; gradients flow back to this rank's rows."""
        if not self._started:
            raise RuntimeError("KVAllGather.wait called before start")
        if self._waited:
            raise RuntimeError("KVAllGather.wait called twice")
        self._waited = True
        kv_input, self._input = self._input, None
        assert kv_input is not None
        if self.group_size == 1:
            return kv_input
        gathered: torch.Tensor = _GatheredKV.apply(kv_input, self)
        return gathered

    def _wait_all_gather(self) -> torch.Tensor:
        assert self._work is not None and self._buffer is not None
        self._work.wait()
        buffer, self._buffer, self._send, self._work = self._buffer, None, None, None
        self._gathered = True
        return buffer

    def _launch_reduce_scatter(self, grad_gathered_NTXGD: torch.Tensor) -> None:
        if not self._gathered:
            raise RuntimeError("KVAllGather reduce-scatter launched before the all-gather finished")
        if self._work is not None:
            raise RuntimeError("KVAllGather reduce-scatter launched twice without a wait")
        # Every rank holds dK/dV for every rank's shard; the owner gets their sum.
        self._send = grad_gathered_NTXGD.contiguous()
        self._buffer = self._send.new_empty((self._send.shape[0] // self.group_size, *self._send.shape[1:]))
        self._work = torch_apis().reduce_scatter_single(self._buffer, self._send, group=self.group,
                                                             async_op=True)

    def _wait_reduce_scatter(self) -> torch.Tensor:
        if self._work is None or not self._gathered:
            raise RuntimeError("KVAllGather reduce-scatter waited before it was launched")
        self._work.wait()
        grad_local_TXGD, self._buffer, self._send, self._work = self._buffer, None, None, None
        assert grad_local_TXGD is not None
        return grad_local_TXGD


class _AwaitAllToAllGrad(torch.autograd.Function):
    """Identity on the rows an all-to-all sends, made when they are sent; backward waits for the all-to-all of their
    gradient. Its input gradient from ``_AllToAllReceived`` is only a placeholder."""

    @staticmethod
    def forward(ctx: Any, send_UTFD: torch.Tensor, comm: UlyssesAllToAll) -> torch.Tensor:
        ctx.comm = comm
        return send_UTFD.view_as(send_UTFD)

    @staticmethod
    def backward(ctx: Any, placeholder_UTFD: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm._wait_backward(), None


class _AllToAllReceived(torch.autograd.Function):
    """The received rows forward (after the wait); backward launches the all-to-all of their gradient."""

    @staticmethod
    def forward(ctx: Any, send_UTFD: torch.Tensor, comm: UlyssesAllToAll) -> torch.Tensor:
        ctx.comm = comm
        ctx.send_shape = send_UTFD.shape
        return comm._wait_forward()

    @staticmethod
    def backward(ctx: Any, grad_received_UTFD: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.comm._launch_backward(grad_received_UTFD)
        # Not the gradient (it is in flight): a free stand-in that lets the engine reach _AwaitAllToAllGrad.
        return grad_received_UTFD.new_zeros(()).expand(ctx.send_shape), None


class UlyssesAllToAll:
    """One all-to-all over a Ulysses group of ``U`` ranks, asynchronous forward and backward.

    ``start`` sends block ``j`` of ``[U, T, ...]`` to rank ``j`` of the group; ``wait`` returns ``[U, T, ...]``,
    block ``j`` from rank ``j``. With even blocks an all-to-all is its own adjoint, so backward sends the gradient
    back the same way. Use once per layer and direction: ``start`` (as early as the data allows), then ``wait``.
    Backward calls ``_launch_backward`` then ``_wait_backward`` (again in that order for a retained graph). Every
    other order raises. Tensors are held only while an all-to-all is in flight.
    """

    def __init__(self, group: dist.ProcessGroup | None, group_size: int) -> None:
        if group is None:
            raise ValueError(f"a Ulysses all-to-all over {group_size} CP ranks needs their process group "
                             "(ShardedSpec.ulysses_group: pack with cp_group / cp_block_groups)")
        self.group = group
        self.group_size = group_size
        self._input: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._started = False
        self._waited = False
        self._received = False

    def _launch(self, send: torch.Tensor) -> None:
        assert send.shape[0] == self.group_size, "one block per rank of the Ulysses group"
        self._send = send.contiguous()
        self._buffer = torch.empty_like(self._send)
        self._work = dist.all_to_all_single(self._buffer, self._send, group=self.group, async_op=True)

    def start(self, send_UTFD: torch.Tensor) -> None:
        """Launch the all-to-all of ``[U, T, F, D]`` (any trailing shape): block ``j`` goes to group rank ``j``."""
        if self._started:
            raise RuntimeError("UlyssesAllToAll.start called twice; make one object per collective and direction")
        self._started = True
        assert dist.get_world_size(self.group) == self.group_size, "Ulysses group size disagrees with the metadata"
        # Made now, before the work it overlaps, so that its backward (the wait for the gradient) runs after that
        # work's backward.
        self._input = _AwaitAllToAllGrad.apply(send_UTFD, self)
        self._launch(send_UTFD.detach())

    def wait(self) -> torch.Tensor:
        """The received blocks, source-major ``[U, T, ...]``; gradients flow back to the rows this rank sent."""
        if not self._started:
            raise RuntimeError("UlyssesAllToAll.wait called before start")
        if self._waited:
            raise RuntimeError("UlyssesAllToAll.wait called twice")
        self._waited = True
        sent, self._input = self._input, None
        assert sent is not None
        received: torch.Tensor = _AllToAllReceived.apply(sent, self)
        return received

    def _wait_forward(self) -> torch.Tensor:
        assert self._work is not None and self._buffer is not None
        self._work.wait()
        buffer, self._buffer, self._send, self._work = self._buffer, None, None, None
        self._received = True
        return buffer

    def _launch_backward(self, grad_received: torch.Tensor) -> None:
        if not self._received:
            raise RuntimeError("UlyssesAllToAll gradient launched before the forward all-to-all finished")
        if self._work is not None:
            raise RuntimeError("UlyssesAllToAll gradient launched twice without a wait")
        self._launch(grad_received)

    def _wait_backward(self) -> torch.Tensor:
        if self._work is None or not self._received:
            raise RuntimeError("UlyssesAllToAll gradient waited before it was launched")
        self._work.wait()
        grad_sent, self._buffer, self._send, self._work = self._buffer, None, None, None
        assert grad_sent is not None
        return grad_sent


# ---------------------------------------------------------------------------------------------------- public


class DacpAttention:
    """One micro-batch's attention, as every layer receives it (the ``dacp`` keyword of ``model.model_inputs``): the
    packing metadata and the kernel resolved for it once.

    A plain object, on purpose: FSDP2 walks the dataclasses and containers among a layer's keyword arguments before
    and after every layer (for tensors to cast and to hook), and passes over an object like this one. Not a
    module-level global either: a layer recomputed under activation checkpointing, after another micro-batch's
    forward has run, must read its own micro-batch.
    """

    __slots__ = ("has_collectives", "kernel", "metadata")

    def __init__(self, metadata: DacpMetadata, kernel: VarlenKernel | None) -> None:
        self.metadata = metadata
        self.kernel = kernel  # None: resolved at each call from the query's device and dtype
        self.has_collectives = bool(metadata.sharded)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> None:
    """Raise ``ValueError`` unless ``ulysses_degree`` ranks split the heads evenly (module docstring, "GQA under
    Ulysses"): it must divide ``num_heads``, and divide ``num_kv_heads`` or be a multiple of it."""
    if num_heads % ulysses_degree or (num_kv_heads % ulysses_degree and ulysses_degree % num_kv_heads):
        raise ValueError(f"Ulysses degree {ulysses_degree} does not fit {num_heads} query heads and {num_kv_heads} "
                         f"key/value heads: it must divide the query heads, and divide the key/value heads or be a "
                         f"multiple of them (heads are never split unevenly)")


def _heads_to_ranks(q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor,
                    ulysses_degree: int) -> torch.Tensor:
    """One collective's rows as its all-to-all sends them, ``[U, T, F, D]``: for group rank ``j``, ``[its H/U query
    heads | their K heads | their V heads]``."""
    num_heads, num_kv_heads = q_THD.shape[1], k_TGD.shape[1]
    check_ulysses_heads(num_heads, num_kv_heads, ulysses_degree)
    if ulysses_degree > num_kv_heads:  # whole K/V heads for every rank: each repeated, as GQA maps query heads
        repeats = ulysses_degree // num_kv_heads
        k_TGD, v_TGD = k_TGD.repeat_interleave(repeats, dim=1), v_TGD.repeat_interleave(repeats, dim=1)
    qkv_TUFD = torch.cat([x_THD.unflatten(1, (ulysses_degree, -1)) for x_THD in (q_THD, k_TGD, v_TGD)], dim=2)
    return qkv_TUFD.transpose(0, 1)


class _CollectiveAttention:
    """One collective's attention within ``dacp_attn_varlen_func``, in the order its steps run there: ``launch``
    (before local attention), ``receive``, ``attend``, ``output``. Its communication objects raise on any other
    order."""

    __slots__ = ("gather", "heads_per_rank", "kv_SXGD", "out_THD", "q_RHD", "rows", "spec", "to_heads", "to_tokens")

    def __init__(self, spec: ShardedSpec, rows: slice) -> None:
        self.spec, self.rows = spec, rows
        self.gather: KVAllGather | None = None
        self.to_heads: UlyssesAllToAll | None = None
        self.to_tokens: UlyssesAllToAll | None = None
        self.q_RHD: torch.Tensor | None = None  # Ulysses, 2D: the queries the all-to-all brought
        self.kv_SXGD: torch.Tensor | None = None  # Ulysses: the K/V it brought
        self.out_THD: torch.Tensor | None = None  # all-gather-KV: this rank's output rows
        self.heads_per_rank = 0

    def launch(self, q_THD: torch.Tensor, k_TGD: torch.Tensor, v_TGD: torch.Tensor) -> None:
        """The first communication: the K/V all-gather (all-gather-KV), or the Q/K/V all-to-all."""
        spec, rows = self.spec, self.rows
        if spec.ulysses_degree == 1:
            self.gather = KVAllGather(spec.group, spec.group_size)
            self.gather.start(torch.stack([k_TGD[rows], v_TGD[rows]], dim=1))
            return
        send_UTFD = _heads_to_ranks(q_THD[rows], k_TGD[rows], v_TGD[rows], spec.ulysses_degree)  # checks the heads
        self.heads_per_rank = q_THD.shape[1] // spec.ulysses_degree
        self.to_heads = UlyssesAllToAll(spec.ulysses_group, spec.ulysses_degree)
        self.to_heads.start(send_UTFD)

    def receive(self) -> None:
        """Ulysses and 2D: the all-to-all's rows in attention order; for 2D, the launch of their K/V all-gather
        across the sub-blocks."""
        if self.to_heads is None:
            return
        spec, heads = self.spec, self.heads_per_rank
        qkv_RFD = self.to_heads.wait().flatten(0, 1)[spec.ulysses_index]
        self.q_RHD = qkv_RFD[:, :heads]
        kv_RXGD = qkv_RFD[:, heads:].unflatten(1, (2, -1))  # K then V heads, as _heads_to_ranks sent them
        if spec.kv_group_size == 1:
            self.kv_SXGD = kv_RXGD
            return
        self.gather = KVAllGather(spec.kv_group, spec.kv_group_size)
        self.gather.start(kv_RXGD)

    def attend(self, q_THD: torch.Tensor, kernel: VarlenKernel, softmax_scale: float | None) -> None:
        """Wait for the K/V, attend; Ulysses and 2D: launch the output's all-to-all back to the tokens' owners."""
        spec = self.spec
        if self.gather is not None:
            kv_gathered_SXGD = self.gather.wait()
            self.kv_SXGD = kv_gathered_SXGD[spec.kv_index]
        q_RHD = q_THD[self.rows] if self.to_heads is None else self.q_RHD
        assert q_RHD is not None and self.kv_SXGD is not None
        out_RHD = kernel(q_RHD, self.kv_SXGD[:, 0], self.kv_SXGD[:, 1], spec.cu_seqlens_q, spec.cu_seqlens_k,
                         spec.max_seqlen_q, spec.max_seqlen_k, softmax_scale)
        self.q_RHD = self.kv_SXGD = None
        if self.to_heads is None:
            self.out_THD = out_RHD  # all-gather-KV: this rank's own rows already
            return
        self.to_tokens = UlyssesAllToAll(spec.ulysses_group, spec.ulysses_degree)
        self.to_tokens.start(out_RHD[spec.ulysses_inverse].unflatten(0, (spec.ulysses_degree, -1)))

    def output(self) -> torch.Tensor:
        """This rank's output rows of the collective, ``[T, H, D]``."""
        if self.to_tokens is None:
            out_THD, self.out_THD = self.out_THD, None
            assert out_THD is not None
            return out_THD
        # Block j came from group rank j: its H/U heads of this rank's tokens.
        return self.to_tokens.wait().transpose(0, 1).flatten(1, 2)


def dacp_attn_varlen_func(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGD: torch.Tensor,
    metadata: DacpMetadata,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend = AttentionBackend.AUTO,
    kernel: VarlenKernel | None = None,
) -> torch.Tensor:
    """Causal attention of one CP rank's packed micro-batch; equal to unsharded per-sequence attention.
    ``kernel``: the varlen kernel, resolved already (else from ``backend``)."""
    num_local = metadata.num_local_tokens
    if q_THD.shape[0] != metadata.num_tokens:
        raise ValueError(f"packed tokens ({q_THD.shape[0]}) != local {num_local} + sharded "
                         f"{metadata.num_sharded_tokens} of the metadata")
    if kernel is None:
        kernel = resolve_kernel(backend, device=q_THD.device, dtype=q_THD.dtype)
    # Launch every collective first: local attention below runs while K/V (or Q/K/V) travel.
    collectives: list[_CollectiveAttention] = []
    first_row = num_local
    for spec in metadata.sharded:
        collective = _CollectiveAttention(spec, slice(first_row, first_row + spec.num_tokens))
        collective.launch(q_THD, k_TGD, v_TGD)
        collectives.append(collective)
        first_row += spec.num_tokens
    outputs = []
    if num_local:
        # the whole row is local where nothing is sharded: no slice (its backward would copy the gradient)
        local = slice(None) if num_local == q_THD.shape[0] else slice(num_local)
        outputs.append(kernel(q_THD[local], k_TGD[local], v_TGD[local], metadata.cu_seqlens_local,
                              metadata.cu_seqlens_local, metadata.max_seqlen_local, metadata.max_seqlen_local,
                              softmax_scale))
    # Every 2D all-gather is launched before any collective attends, so that each overlaps the attention before it.
    for collective in collectives:
        collective.receive()
    for collective in collectives:
        collective.attend(q_THD, kernel, softmax_scale)
    outputs.extend(collective.output() for collective in collectives)
    if not outputs:
        return q_THD.new_empty(q_THD.shape)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# The collectives, their autograd functions and the per-collective Python cannot be traced: a compiled block calls
# this eagerly (a micro-batch with collectives is dominated by them anyway); one without runs the local kernel alone,
# which Dynamo traces (``model.dacp_attention_forward``).
dacp_attention_with_collectives = torch.compiler.disable(dacp_attn_varlen_func, recursive=True)
