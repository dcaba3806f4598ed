"""The whole file (`Config`: every key of every program, as the reference docs and the
chart's values schema list them), `StatusSettings`, and the table of the programs and
the model each one validates."""

from __future__ import annotations

from gpudaemon.config.agent import (
    AgentFields,
    AgentSettings,
)
from gpudaemon.config.extender import ExtenderConfig, ExtenderSettings
from gpudaemon.config.rebalancer import RebalanceConfig, RebalancerSettings
from gpudaemon.config.sections import (
    KubernetesConfig,
    LabelPrefix,
    _Program,
)


class StatusSettings(_Program):
    """What `gpudaemon status` validates."""

    labels: LabelPrefix = LabelPrefix()
    kubernetes: KubernetesConfig = KubernetesConfig()


class Config(AgentFields):
    """The whole configuration file: every key of every program, each validated."""

    extender: ExtenderConfig = ExtenderConfig()
    rebalance: RebalanceConfig = RebalanceConfig()


# The program -> its model (`check-config --program`, and each command of cli.py).
PROGRAMS: dict[str, type[_Program]] = {
    "agent": AgentSettings,
    "extender": ExtenderSettings,
    "rebalancer": RebalancerSettings,
    "status": StatusSettings,
}
