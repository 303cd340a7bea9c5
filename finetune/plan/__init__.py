"""Planning: the memory estimator and the planner that turns a Config and a Hardware into a Plan."""

from finetune.plan.plan import Decision, Plan
from finetune.plan.planner import plan

__all__ = ["Decision", "Plan", "plan"]
