"""Plans built by hand that certainly carry hybrid groups (the heuristic decides for itself whether groups pay
off), checked with the core checker and simulated, for the tests of every edge that carries them."""

from __future__ import annotations

from scheduler_service.core.check import check_plan
from scheduler_service.core.plan import (
    DPRankPlan,
    MicroBatch,
    Plan,
    PlanningProblem,
    SchedulerName,
    ShardedGroup,
    make_problem,
)
from scheduler_service.core.planner import PlanResult
from scheduler_service.core.simulate import iteration_lower_bound_s, simulate

__all__ = ["BINARY_PLAN", "BUCKET_SIZE", "CP", "DP", "GROUPED_PLAN", "LENGTHS", "problem", "result_of"]

LENGTHS = [9000, 9432, 3000, 2000, 1000, 500, 20000, 8000, 700, 800]
DP, CP, BUCKET_SIZE = 2, 4, 12000

# dp 0: a micro-batch with one group over [0, 1] (two sequences) and locals on 2 and 3; then groups over [0, 1]
# and [2, 3] side by side. dp 1: a distributed sequence, a local one and a group over [2, 3] in one micro-batch.
GROUPED_PLAN = Plan(dp_ranks=(
    DPRankPlan(micro_batches=(
        MicroBatch(local=((), (), (2,), (3,)), distributed=(),
                   sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(0, 1)),)),
        MicroBatch(local=((4,), (5,), (), ()), distributed=(),
                   sharded=(ShardedGroup(cp_ranks=(0, 1), sequences=(9,)),
                            ShardedGroup(cp_ranks=(2, 3), sequences=(8,)))),
    )),
    DPRankPlan(micro_batches=(
        MicroBatch(local=((), (), (), ()), distributed=(6,), sharded=(ShardedGroup(cp_ranks=(2, 3), sequences=(7,)),)),
    )),
))
BINARY_PLAN = Plan(dp_ranks=(
    DPRankPlan(micro_batches=(MicroBatch(local=((2,), (3,), (4, 5), (9,)), distributed=(6,)),)),
    DPRankPlan(micro_batches=(MicroBatch(local=((0,), (1,), (7,), (8,)), distributed=()),)),
))


def problem() -> PlanningProblem:
    return make_problem(sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, model="qwen2.5-0.5b",
                        bucket_size=BUCKET_SIZE)


def result_of(plan: Plan, planning_problem: PlanningProblem | None = None,
              scheduler: SchedulerName = SchedulerName.SKRULL) -> PlanResult:
    planning_problem = planning_problem or problem()
    check_plan(plan, sequence_lengths=LENGTHS, dp_size=DP, cp_size=CP, bucket_size=BUCKET_SIZE)
    estimate = simulate(planning_problem, plan)
    return PlanResult(scheduler=scheduler, problem=planning_problem, plan=plan, estimate=estimate,
                      baseline_time_s=2 * estimate.iteration_time_s, solve_time_s=1e-3,
                      lower_bound_s=iteration_lower_bound_s(planning_problem))
