"""The performance model of the Skrull paper, appendix C (its coefficients are fitted by ``fitting``).

* FLOPs of a sequence of ``S`` tokens (eq. 13, b = 1, summed over layers):
  ``L · (20·h²·S + 4·h·h_kv·S + 4·h·S²)``: a linear part and an attention part.
* Compute time ``T_comp = α·FLOPs + β`` (eq. 14); ``β`` is per layer, paid once
  per micro-batch by each CP rank (one packed row runs through the layers).
* The launch-bound floor. Eager execution on a GPU dispatches every kernel from
  the host while the device runs earlier ones, so a packed group takes about
  ``max(F, T_device)``, not their sum: ``F = floor·L`` is the host's dispatch
  of its layers (about 100–125 ms for the eager qwen2.5-0.5b on an H200,
  whatever the tokens up to ~4k). A profile with ``compute.floor_s_per_layer`` prices
  every CP rank with work at ``max(F, its device time)``, the device time
  being its compute, ``β`` and exposed communication; without it (0, the CPU
  profiles, where one process does both) times add as in the paper.
* Where a sequence runs: kept whole on one CP rank (degree 1), or zigzag-sharded
  over ``d`` ranks (a hybrid group, or the whole CP group). Each of the ``d``
  ranks computes ``1/d`` of its linear and attention FLOPs, but its attention
  runs as two query chunks of ``S/(2d)`` tokens, and attention kernels are less
  efficient on short queries (the paper's Figure 1(b)). A profile may carry that
  efficiency as a function of the query length (``compute.attention_efficiency``,
  relative throughput, interpolated in log length and held flat past its ends);
  the attention FLOPs are divided by it (``placement_flops``). Without it the
  efficiency is 1 everywhere.
* A measured profile may add what eq. 13 leaves out: a cost per token (LM head,
  norms, element-wise kernels) and per sequence (one attention call per
  sequence and layer where the kernel is not varlen, as SDPA on CPU). Both are
  folded into each sequence's FLOPs as FLOP-equivalents (``cost / α``), so
  ``T_comp = α·ΣFLOPs + β`` stays the one formula every scheduler and the
  simulator use; with ``h100-paper`` they are 0 and FLOPs are eq. 13's.
* Activation memory ``M(S) = α·S + β`` (eq. 12) → BucketSize: the tokens per CP
  rank that fit beside the static memory (weights, gradients and optimizer
  states under ZeRO-2).
* Communication volume ``V = S·h_kv`` per layer (eq. 15), sent for K and V;
  ``T_comm = α·V + T_fixed`` (eq. 16), fitted by least squares to the profile's
  all-gather (forward) and reduce-scatter (backward) latency tables; free when
  the profile measured no collective (a single-process profile). The tables
  were measured over ``communication.world_size`` ranks; a collective over a
  group of ``s`` ranks uses the table measured for ``s``
  (``communication.tables_by_group_size``) where there is one, else scales the
  bandwidth term by the ring volume ``(s−1)/s`` relative to the measured group
  (NCCL-tests' bus-bandwidth factor for all-gather and reduce-scatter).
* Topology (``gpus_per_node``, a power of two): CP groups are contiguous aligned ranks (``global_rank =
  dp_rank · cp_size + cp_rank``) and every block lies within one node or covers whole nodes (``make_problem``
  checks it), so a group of ``s`` ranks lies on one node iff ``s <= gpus_per_node``. A group that crosses
  nodes reads the profile's inter-node tables (``communication.inter_node``) by the same rules; a profile
  without them refuses such a group (``InvalidRequestError`` naming the profile and the field) rather than
  pricing it at intra-node speed. ``gpus_per_node`` None: every group lies on one node.
* Overlap (what the trainer does, ``trainer_client/dacp/attention.py``): per layer
  the all-gather of K/V runs while the rank's local attention forward runs, and
  the reduce-scatter of dK/dV while its local attention backward runs; the
  linear layers overlap nothing. ``costing.exposed_comm_s`` is what is left visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import numpy.typing as npt

from scheduler_service.core.errors import InvalidRequestError
from scheduler_service.core.memory import StaticBytes
from scheduler_service.core.models import ModelShape
from scheduler_service.core.profile import Profile, Tables

__all__ = [
    "ATTENTION_FORWARD_SHARE",
    "CollectiveCost",
    "LinearFit",
    "PerformanceModel",
    "SchemeCommCost",
    "eq13_flops",
    "fit_line",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearFit:
    """``y = slope·x + intercept``, fitted by least squares."""

    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


_NO_COST = LinearFit(slope=0.0, intercept=0.0)

# Forward share of attention's forward + backward time: backward does twice the forward's matrix products
# (dQ, dK, dV against the forward's Q·Kᵀ and P·V), the convention "fwd + bwd = 3 × fwd" the profiles use.
ATTENTION_FORWARD_SHARE = 1.0 / 3.0
@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCost:
    """All layers' all-gather (forward) and reduce-scatter (backward) time of one group size, per token."""

    all_gather_s_per_token: float
    all_gather_fixed_s: float
    reduce_scatter_s_per_token: float
    reduce_scatter_fixed_s: float

    def all_gather_s(self, num_tokens: float) -> float:
        return self.all_gather_s_per_token * num_tokens + self.all_gather_fixed_s if num_tokens > 0 else 0.0

    def reduce_scatter_s(self, num_tokens: float) -> float:
        return self.reduce_scatter_s_per_token * num_tokens + self.reduce_scatter_fixed_s if num_tokens > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SchemeCommCost:
    """One collective's communication over all layers, forward and backward, by how the trainer overlaps it, per
    token sharded over its block (``T``, all ranks' tokens) and once per micro-batch where it has a sequence:
    ``hidden_forward`` is launched before local attention's forward and hides behind it, ``hidden_backward``
    likewise behind its backward, and ``exposed`` waits with nothing to hide behind."""

    hidden_forward: LinearFit
    hidden_backward: LinearFit
    exposed: LinearFit

    def hidden_forward_s(self, num_tokens: float) -> float:
        return self.hidden_forward(num_tokens) if num_tokens > 0 else 0.0

    def hidden_backward_s(self, num_tokens: float) -> float:
        return self.hidden_backward(num_tokens) if num_tokens > 0 else 0.0

    def exposed_s(self, num_tokens: float) -> float:
        return self.exposed(num_tokens) if num_tokens > 0 else 0.0


@cache  # profiles are parsed once but performance models are built per request
def fit_line(points: tuple[tuple[float, float], ...], relative: bool = False) -> LinearFit:
    """Least-squares line through (x, y) points, on absolute or (``relative``) relative error; both coefficients
    clamped at 0 (latencies never fall with size)."""
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    weights = 1.0 / np.maximum(ys, 1e-12) if relative else None
    slope, intercept = np.polyfit(xs, ys, deg=1, w=weights)
    return LinearFit(slope=max(float(slope), 0.0), intercept=max(float(intercept), 0.0))


def eq13_flops(model: ModelShape, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Forward FLOPs of eq. 13 (b = 1) summed over layers, one entry per sequence length."""
    return _linear_flops(model, lengths) + _attention_flops(model, lengths)


def _linear_flops(model: ModelShape, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
    s = np.asarray(lengths, dtype=np.float64)
    h, h_kv = float(model.hidden_size), float(model.kv_hidden_size)
    return model.num_layers * (20 * h * h * s + 4 * h * h_kv * s)


def _attention_flops(model: ModelShape, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
    s = np.asarray(lengths, dtype=np.float64)
    return model.num_layers * 4 * float(model.hidden_size) * s * s


@dataclass(frozen=True, kw_only=True, slots=True)
class PerformanceModel:
    """Estimates for one model on one profiled machine."""

    model: ModelShape
    profile: Profile
    gpus_per_node: int | None = None  # None: every group lies on one node
    all_gather: LinearFit = field(init=False)
    reduce_scatter: LinearFit = field(init=False)
    _flops_per_token: float = field(init=False, repr=False)  # measured per-token cost, in FLOP-equivalents
    _flops_per_sequence: float = field(init=False, repr=False)  # measured per-sequence cost, in FLOP-equivalents
    _flops_per_shard: float = field(init=False, repr=False)  # a sharded sequence's own cost per rank, the same units
    _flops_per_ulysses_shard: float = field(init=False, repr=False)  # the same, sharded by Ulysses or 2D
    _collectives: dict[int, CollectiveCost] = field(init=False, repr=False)  # by group size, filled on demand
    _schemes: dict[tuple[int, int], SchemeCommCost | None] = field(init=False, repr=False)  # by (degree, u)

    def __post_init__(self) -> None:
        measured_for = self.profile.model
        if measured_for is not None and measured_for.lower() != self.model.name.lower():
            raise InvalidRequestError(
                f"profile {self.profile.name} was measured for model {measured_for}, not {self.model.name}: its "
                f"compute and memory coefficients hold for that model only; measure one for {self.model.name} "
                f"with python -m trainer_client.profile --model {self.model.name}",
                field="profile",
            )
        if self.gpus_per_node is not None and not _is_power_of_two(self.gpus_per_node):
            raise InvalidRequestError(f"gpus_per_node must be a positive power of two, got {self.gpus_per_node}",
                                      field="gpus_per_node")
        tables, relative = self.profile.communication.tables, self.profile.communication.relative_fit
        object.__setattr__(self, "all_gather", fit_line(tables["all_gather"], relative) if tables else _NO_COST)
        object.__setattr__(self, "reduce_scatter",
                           fit_line(tables["reduce_scatter"], relative) if tables else _NO_COST)
        compute = self.profile.compute
        object.__setattr__(self, "_flops_per_token", compute.alpha_s_per_token / compute.alpha_s_per_flop)
        object.__setattr__(self, "_flops_per_sequence", compute.alpha_s_per_sequence / compute.alpha_s_per_flop)
        object.__setattr__(self, "_flops_per_shard", compute.alpha_s_per_shard / compute.alpha_s_per_flop)
        object.__setattr__(self, "_flops_per_ulysses_shard",
                           compute.alpha_s_per_ulysses_shard / compute.alpha_s_per_flop)
        object.__setattr__(self, "_collectives", {})
        object.__setattr__(self, "_schemes", {})

    # -- compute --------------------------------------------------------------
    def flops(self, num_tokens: float) -> float:
        """Compute cost of one sequence of ``num_tokens`` tokens: eq. 13 × layers, plus the profile's measured
        per-token and per-sequence costs as FLOP-equivalents (0 in profiles that do not measure them)."""
        return float(self.flops_array([num_tokens])[0])

    def flops_array(self, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``flops`` of many sequences at once."""
        s = np.asarray(lengths, dtype=np.float64)
        flops = eq13_flops(self.model, s)
        if self._flops_per_token or self._flops_per_sequence:
            flops = flops + self._flops_per_token * s + np.where(s > 0, self._flops_per_sequence, 0.0)
        return flops

    def attention_efficiency(self, query_tokens: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Relative attention-kernel throughput at this query length (1 without a measured curve)."""
        q = np.asarray(query_tokens, dtype=np.float64)
        points = self.profile.compute.attention_efficiency
        if not points:
            return np.ones_like(q)
        log_lengths = np.log2([length for length, _ in points])
        return np.interp(np.log2(np.maximum(q, 1.0)), log_lengths, [efficiency for _, efficiency in points])

    def placement_flops(self, lengths: npt.ArrayLike, degree: int, ulysses_degree: int = 1) -> npt.NDArray[np.float64]:
        """FLOP-equivalents each of ``degree`` CP ranks computes for a sequence kept whole (``degree`` 1) or sharded
        over ``degree`` ranks by the scheme of ``ulysses_degree`` (``CollectiveScheme.of``): ``1/degree`` of its work,
        attention at the efficiency of its query segments (``_attention_at_efficiency``), one attention call per
        segment, and when sharded the profile's cost of a shard (``alpha_s_per_shard``; by Ulysses or 2D,
        ``alpha_s_per_ulysses_shard``)."""
        s = np.asarray(lengths, dtype=np.float64)
        attention = self._attention_at_efficiency(s, degree, ulysses_degree)
        flops = (_linear_flops(self.model, s) + self._flops_per_token * s + attention) / degree
        calls = 1 if degree == ulysses_degree else 2
        own = (0.0 if degree == 1 else self._flops_per_shard if ulysses_degree == 1
               else self._flops_per_ulysses_shard)
        per_sequence = calls * self._flops_per_sequence + own
        return flops + np.where(s > 0, per_sequence, 0.0)

    def placement_attention_flops(self, lengths: npt.ArrayLike, degree: int) -> npt.NDArray[np.float64]:
        """The attention part of ``placement_flops(lengths, degree)``: what each of the ``degree`` ranks computes
        of the sequence's attention."""
        return self._attention_at_efficiency(np.asarray(lengths, dtype=np.float64), degree) / degree

    def _attention_at_efficiency(self, s: npt.NDArray[np.float64], degree: int,
                                 ulysses_degree: int = 1) -> npt.NDArray[np.float64]:
        """A sequence's attention FLOPs over all its ranks, at the efficiency of its query segments: the whole
        sequence where one rank (or a Ulysses group, each for its heads) attends all of it, else the two zigzag
        chunks of ``S / 2g`` tokens, ``g = degree / ulysses_degree`` the ranks the K/V are gathered over."""
        gathered_over = degree // ulysses_degree
        query_tokens = s if gathered_over == 1 else s / (2 * gathered_over)
        return _attention_flops(self.model, s) / self.attention_efficiency(query_tokens)

    def local_attention_flops(self, lengths: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The attention part of ``placement_flops(lengths, 1)``: what hides a rank's collectives."""
        return self.placement_attention_flops(lengths, 1)

    @property
    def padding_flops_per_token(self) -> float:
        """What one padding token of a packed row costs (a row padded to a token bucket): the linear layers' and the
        profile's per-token FLOP-equivalents; its attention is over a few padding tokens, left out."""
        return float(_linear_flops(self.model, [1.0])[0]) + self._flops_per_token

    @property
    def compute_beta_s(self) -> float:
        return self.profile.compute.beta_s_per_layer * self.model.num_layers

    @property
    def compute_floor_s(self) -> float:
        """The launch-bound floor of one packed group, ``floor·L`` (0 for additive profiles)."""
        return self.profile.compute.floor_s_per_layer * self.model.num_layers

    def device_time_s(self, flops: float) -> float:
        """``T_comp`` (eq. 14) of a packed group of sequences: the device's work, whatever the host's dispatch;
        nothing to run costs nothing."""
        if flops <= 0:
            return 0.0
        return self.profile.compute.alpha_s_per_flop * flops + self.compute_beta_s

    def compute_time_s(self, flops: float) -> float:
        """The time of a packed group of sequences: its device time, at least the launch-bound floor."""
        if flops <= 0:
            return 0.0
        return max(self.compute_floor_s, self.device_time_s(flops))

    # -- communication ----------------------------------------------------------
    def comm_bytes_per_layer(self, num_tokens: float) -> float:
        """Bytes of K and V of ``num_tokens`` distributed tokens in one layer (eq. 15, for K and V)."""
        return 2.0 * num_tokens * self.model.kv_hidden_size * self.profile.communication.kv_bytes_per_element

    def collective_cost(self, group_size: int) -> CollectiveCost:
        """``T_comm`` (eq. 16) coefficients of one group size, over all layers, per distributed token."""
        cost = self._collectives.get(group_size)
        if cost is None:
            cost = self._collective_cost(group_size)
            self._collectives[group_size] = cost
        return cost

    def crosses_nodes(self, group_size: int) -> bool:
        """Whether an aligned group of ``group_size`` ranks spans several nodes (module docstring, "Topology")."""
        return self.gpus_per_node is not None and group_size > self.gpus_per_node

    def _link_tables(self, group_size: int) -> tuple[Tables, dict[int, Tables], int | None]:
        """The tables, tables by group size and measured world size of the link a group of ``group_size`` uses."""
        communication = self.profile.communication
        if not self.crosses_nodes(group_size):
            return communication.tables, communication.tables_by_group_size, communication.world_size
        inter_node = communication.inter_node
        if inter_node is None or not inter_node.tables:
            raise InvalidRequestError(
                f"a group of {group_size} ranks spans nodes of {self.gpus_per_node} GPUs, and profile "
                f"{self.profile.name} has no inter-node collective table (communication.inter_node.tables): "
                f"measure one with python -m trainer_client.profile under torchrun across nodes, or keep CP "
                f"groups within a node", field="profile")
        return inter_node.tables, inter_node.tables_by_group_size, inter_node.world_size

    def _collective_cost(self, group_size: int) -> CollectiveCost:
        if group_size == 1:  # nothing to gather: the trainer skips the collectives of a one-rank group
            return CollectiveCost(all_gather_s_per_token=0.0, all_gather_fixed_s=0.0, reduce_scatter_s_per_token=0.0,
                                  reduce_scatter_fixed_s=0.0)
        tables, by_group_size, world_size = self._link_tables(group_size)
        relative = self.profile.communication.relative_fit
        measured = by_group_size.get(group_size)
        if measured is not None:
            all_gather = fit_line(measured["all_gather"], relative)
            reduce_scatter = fit_line(measured["reduce_scatter"], relative)
            bandwidth_scale = 1.0
        else:
            all_gather, reduce_scatter = ((fit_line(tables["all_gather"], relative),
                                           fit_line(tables["reduce_scatter"], relative)) if tables
                                          else (_NO_COST, _NO_COST))
            bandwidth_scale = _ring_volume(group_size) / _ring_volume(world_size or group_size)
        bytes_per_token, layers = self.comm_bytes_per_layer(1.0), self.model.num_layers
        return CollectiveCost(
            all_gather_s_per_token=layers * all_gather.slope * bytes_per_token * bandwidth_scale,
            all_gather_fixed_s=layers * all_gather.intercept,
            reduce_scatter_s_per_token=layers * reduce_scatter.slope * bytes_per_token * bandwidth_scale,
            reduce_scatter_fixed_s=layers * reduce_scatter.intercept,
        )

    def comm_time_s(self, num_tokens: float, group_size: int | None = None) -> float:
        """``T_comm`` (eq. 16) of ``num_tokens`` tokens sharded over ``group_size`` ranks (default: the group the
        tables were measured on): an all-gather of K/V per layer forward and a reduce-scatter of dK/dV backward."""
        cost = self.collective_cost(group_size or self.profile.communication.world_size or 2)
        return cost.all_gather_s(num_tokens) + cost.reduce_scatter_s(num_tokens)

    # -- schemes ------------------------------------------------------------------
    def ulysses_degrees(self, degree: int) -> tuple[int, ...]:
        """The Ulysses degrees ``u > 1`` a collective over ``degree`` ranks may have (``CollectiveScheme``): ``u``
        divides the degree and the query heads, and the K/V heads divide ``u`` or ``u`` them (K/V heads repeated
        where ``u`` is larger), and the profile prices its all-to-all (``scheme_comm``). An uneven split of
        heads is never chosen: its ranks would wait for the one with most heads, and the trainer refuses it."""
        return tuple(u for u in range(2, degree + 1)
                     if degree % u == 0 and self.heads_allow(u) and self.scheme_comm(degree, u) is not None)

    def heads_allow(self, ulysses_degree: int) -> bool:
        """Whether the model's heads split evenly over ``ulysses_degree`` ranks (``ulysses_degrees``)."""
        heads, kv_heads = self.model.num_attention_heads, self.model.num_key_value_heads
        return heads % ulysses_degree == 0 and (kv_heads % ulysses_degree == 0 or ulysses_degree % kv_heads == 0)

    def scheme_comm(self, degree: int, ulysses_degree: int) -> SchemeCommCost | None:
        """The communication of a collective over ``degree`` ranks with Ulysses degree ``u`` (docs/concepts/
        schemes.md, "The price"), all layers; None where the profile cannot price it (no ``all_to_all`` table for
        the link the Ulysses group uses).

        * u = 1, all-gather-KV: the all-gather of K/V hides behind local attention's forward, the reduce-scatter
          of their gradients behind its backward (``collective_cost``).
        * u > 1: per layer one all-to-all takes Q, K and V to their heads' ranks (``(H + 2G')·D`` values per
          token, ``G' = max(G, u)``: K/V heads repeated), launched before local attention, and one takes the
          output back (``H·D``), after the collective's attention, with nothing left to hide behind; backward
          mirrors it. Each moves the rank's ``T/degree`` tokens, ``(u−1)/u`` of them to other ranks.
        * 1 < u < degree, 2D: between the two, the all-gather of the K/V (``2G'/u`` heads) over the ``g =
          degree/u`` sub-blocks, forward, and its reduce-scatter backward, exposed too (they need the
          all-to-all's result first).
        """
        key = (degree, ulysses_degree)
        if key not in self._schemes:
            self._schemes[key] = self._scheme_comm(degree, ulysses_degree)
        return self._schemes[key]

    def _scheme_comm(self, degree: int, ulysses_degree: int) -> SchemeCommCost | None:
        layers = self.model.num_layers
        if ulysses_degree == 1:
            cost = self.collective_cost(degree)
            return SchemeCommCost(
                hidden_forward=LinearFit(slope=cost.all_gather_s_per_token, intercept=cost.all_gather_fixed_s),
                hidden_backward=LinearFit(slope=cost.reduce_scatter_s_per_token,
                                          intercept=cost.reduce_scatter_fixed_s),
                exposed=_NO_COST)
        all_to_all = self._all_to_all_fit(ulysses_degree)
        if all_to_all is None:
            return None
        model, element_bytes = self.model, self.profile.communication.kv_bytes_per_element
        kv_heads = max(model.num_key_value_heads, ulysses_degree)
        bytes_per_token = model.head_dim * element_bytes / degree  # a token's share of a rank's buffer, per head
        inbound = LinearFit(slope=layers * all_to_all.slope * bytes_per_token * (model.num_attention_heads
                                                                                 + 2 * kv_heads),
                            intercept=layers * all_to_all.intercept)
        outbound = LinearFit(slope=layers * all_to_all.slope * bytes_per_token * model.num_attention_heads,
                             intercept=layers * all_to_all.intercept)
        exposed = LinearFit(slope=2 * outbound.slope, intercept=2 * outbound.intercept)
        gathered_over = degree // ulysses_degree
        if gathered_over > 1:
            if self.crosses_nodes(degree) and not self.crosses_nodes(gathered_over):
                return None  # a strided group across nodes: the tables of its link are not the ones of its size
            gather = self.collective_cost(gathered_over)
            kv_share = kv_heads / ulysses_degree / model.num_key_value_heads  # the K/V heads a rank gathers
            exposed = LinearFit(
                slope=exposed.slope + kv_share * (gather.all_gather_s_per_token + gather.reduce_scatter_s_per_token),
                intercept=exposed.intercept + gather.all_gather_fixed_s + gather.reduce_scatter_fixed_s)
        return SchemeCommCost(hidden_forward=inbound, hidden_backward=inbound, exposed=exposed)

    def _all_to_all_fit(self, group_size: int) -> LinearFit | None:
        """One all-to-all over ``group_size`` ranks: seconds per byte of a rank's buffer and per call; from the
        table measured for that size, else the link's table with its bandwidth term scaled by ``(n−1)/n`` (the
        share each rank sends away) relative to the measured group; None without an ``all_to_all`` table."""
        try:
            tables, by_group_size, world_size = self._link_tables(group_size)
        except InvalidRequestError:
            return None
        relative = self.profile.communication.relative_fit
        measured = by_group_size.get(group_size, {})
        if measured.get("all_to_all"):
            return fit_line(measured["all_to_all"], relative)
        if not tables.get("all_to_all"):
            return None
        fit = fit_line(tables["all_to_all"], relative)
        scale = _ring_volume(group_size) / _ring_volume(world_size or group_size)
        return LinearFit(slope=fit.slope * scale, intercept=fit.intercept)

    def has_all_to_all(self) -> bool:
        """Whether the profile measured an all-to-all: without one, no collective is ever priced but by
        all-gather-KV."""
        return bool(self.profile.communication.tables.get("all_to_all"))

    # -- memory -------------------------------------------------------------------
    @property
    def activation_bytes_per_token(self) -> float:
        """α of eq. 12 for this model."""
        memory, model = self.profile.memory, self.model
        return (
            memory.activation_fixed_bytes_per_token
            + memory.activation_per_layer_hidden * model.hidden_size * model.num_layers
            + memory.activation_per_vocab * model.vocab_size
        )

    def activation_bytes(self, num_tokens: float) -> float:
        """``M(S) = α·S + β`` (eq. 12)."""
        return self.activation_bytes_per_token * num_tokens + self.profile.memory.beta_bytes

    def static_bytes(self, num_state_shards: int) -> float:
        """Weights replicated; gradients and optimizer states sharded over ``num_state_shards`` ranks (ZeRO-2)."""
        memory = self.profile.memory
        static = StaticBytes(replicated=memory.replicated_bytes_per_parameter,
                             sharded=memory.sharded_bytes_per_parameter)
        return static.per_rank(self.model.num_parameters, num_state_shards)

    def peak_bytes(self, num_tokens: float, num_state_shards: int) -> float:
        """Predicted peak device memory of a micro-batch of ``num_tokens`` tokens per rank."""
        return (self.profile.memory.reserved_bytes + self.static_bytes(num_state_shards)
                + self.activation_bytes(num_tokens))

    def gathered_kv_bytes_per_token(self, cp_size: int) -> float:
        """The most gathered K/V a token of a CP rank's bucket can bring: a sequence sharded over ``d`` ranks puts
        ``S/d`` tokens in each bucket and keeps all ``S`` tokens' K/V of every layer for its attention backward,
        so at most ``cp_size`` tokens' K/V per bucket token (the whole group; smaller groups bring less)."""
        if cp_size <= 1:
            return 0.0
        return cp_size * self.comm_bytes_per_layer(1.0) * self.model.num_layers

    def bucket_size(self, num_state_shards: int, device_memory_bytes: float | None = None, cp_size: int = 1) -> int:
        """BucketSize C: tokens per CP rank whose activations, and the gathered K/V they may bring, fit beside the
        static memory (appendix C.1)."""
        budget = device_memory_bytes if device_memory_bytes is not None else self.profile.device_memory_bytes
        free = budget - self.profile.memory.reserved_bytes - self.static_bytes(num_state_shards)
        free -= self.profile.memory.beta_bytes
        return max(int(free // self._bucket_bytes_per_token(cp_size)), 0)

    def bucket_bytes(self, num_tokens: float, num_state_shards: int, cp_size: int) -> float:
        """The device memory ``bucket_size`` charges a CP rank holding ``num_tokens`` tokens: reserved, static,
        ``β``, and per token its activations and the most gathered K/V it may bring."""
        memory = self.profile.memory
        return (memory.reserved_bytes + self.static_bytes(num_state_shards) + memory.beta_bytes
                + num_tokens * self._bucket_bytes_per_token(cp_size))

    def _bucket_bytes_per_token(self, cp_size: int) -> float:
        return self.activation_bytes_per_token + self.gathered_kv_bytes_per_token(cp_size)


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def _ring_volume(group_size: int) -> float:
    """Fraction of the gathered bytes each rank sends and receives in a ring all-gather or reduce-scatter."""
    return (group_size - 1) / group_size if group_size > 1 else 1.0
