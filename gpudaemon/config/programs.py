"""The whole file (`Config`: every key of every program, as the reference docs and the
chart's values schema list them), `StatusSettings`, and the table of the programs and
the model each one validates."""

from __future__ import annotations

from typing import Self

from pydantic import model_validator

from gpudaemon.config.agent import (
    AgentSettings,
    HealthConfig,
    InfluxConfig,
    MetricsConfig,
    NodeFields,
    Schedules,
    history_defaults,
)
from gpudaemon.config.extender import ExtenderConfig, ExtenderSettings
from gpudaemon.config.files import influx_token
from gpudaemon.config.rebalancer import RebalanceConfig, RebalancerSettings
from gpudaemon.config.sections import (
    DraConfig,
    KubernetesConfig,
    LabelPrefix,
    LabelsConfig,
    LoggingConfig,
    _Program,
)


class StatusSettings(_Program):
    """What `gpudaemon status` validates."""

    labels: LabelPrefix = LabelPrefix()
    kubernetes: KubernetesConfig = KubernetesConfig()


class Config(NodeFields):
    """The whole configuration file: every key of every program, each validated."""

    schedules: Schedules = Schedules()
    labels: LabelsConfig = LabelsConfig()
    metrics: MetricsConfig = MetricsConfig()
    influxdb: InfluxConfig = InfluxConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    extender: ExtenderConfig = ExtenderConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    health: HealthConfig = HealthConfig()
    dra: DraConfig = DraConfig()
    logging: LoggingConfig = LoggingConfig.model_validate({})

    @model_validator(mode="after")
    def _history(self) -> Self:
        history_defaults(self.influxdb, self.schedules)
        return self

    def influx_token(self) -> str:
        """The token from the environment or token_file (read now); never logged."""
        return influx_token(self.influxdb)


# The program -> its model (`check-config --program`, and each command of cli.py).
PROGRAMS: dict[str, type[_Program]] = {
    "agent": AgentSettings,
    "extender": ExtenderSettings,
    "rebalancer": RebalancerSettings,
    "status": StatusSettings,
}
