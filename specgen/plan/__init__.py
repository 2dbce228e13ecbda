"""Plan: frozen values derived from a spec, everything the templates print."""

from specgen.plan.make import ConfigPlan, Plan, TargetPlan, make_plan, procedural_name

__all__ = ["ConfigPlan", "Plan", "TargetPlan", "make_plan", "procedural_name"]
