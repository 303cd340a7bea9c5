"""Planning: the memory estimator and the planner that turns a Config and a Hardware into a Plan."""

from __future__ import annotations

from finetune.plan.plan import Decision, Plan


def plan(*args, **kwargs) -> Plan:
    """`finetune.plan.planner.plan`: compile `config` for `hardware`; raise PlanError when it cannot run there."""
    # the planner and its search load on the first plan: a rank reads a Plan back (Plan.from_json) and never plans
    from finetune.plan import planner

    return planner.plan(*args, **kwargs)


__all__ = ["Decision", "Plan", "plan"]
