"""Which plans hand out CDI device names (whether a CDI spec is wanted at all), and `CdiError`.

Kept apart from `spec` so that a supervisor whose plans use no CDI strategy (NVIDIA's default,
`envvar`) never loads the spec builder.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.model import ResourcePlan

CDI_STRATEGIES = frozenset({"cdi-annotations", "cdi-cri"})


class CdiError(Exception):
    """The CDI spec cannot be built, is invalid, or cannot be written; the message says which and why."""


def uses_cdi(plan: ResourcePlan) -> bool:
    """Does this plan hand out CDI device names (a `cdi-annotations` or `cdi-cri` list strategy)?"""
    return bool(CDI_STRATEGIES.intersection(plan.allocate.device_list_strategies))


def cdi_plans(plans: Mapping[str, ResourcePlan]) -> list[ResourcePlan]:
    """The plans that hand out CDI device names."""
    return [p for p in plans.values() if uses_cdi(p)]
