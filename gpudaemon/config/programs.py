"""The whole file (`Config`: every key of every program, as the reference docs and the
chart's values schema list them), each program's model (`AgentSettings`,
`ExtenderSettings`, `RebalancerSettings`, `StatusSettings`), and the table of the
programs and the model each one validates. Here, beside `Config`, so a program's model
names the whole file without the sections' modules importing this one."""

from __future__ import annotations

from pydantic import BaseModel

from gpudaemon.config.agent import AgentFields
from gpudaemon.config.extender import ExtenderConfig
from gpudaemon.config.rebalancer import RebalanceConfig
from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.config.sections import (
    DraConfig,
    KubernetesConfig,
    LabelPrefix,
    LoggingConfig,
)
from gpudaemon.config.values import _View


class _Program(_View):
    """One program's model: the sections it uses, validated; the other programs' keys
    in a shared file checked by name only (see docs/configuration.md)."""

    @classmethod
    def whole(cls) -> type[BaseModel]:
        return Config  # the whole file, every program


class AgentSettings(AgentFields, _Program):
    """What `gpudaemon run` and `gpudaemon probe` validate."""


class ExtenderSettings(_Program):
    """What `gpudaemon extender` validates."""

    labels: LabelPrefix = LabelPrefix()
    kubernetes: KubernetesConfig = KubernetesConfig()
    extender: ExtenderConfig = ExtenderConfig()
    # On: watch ResourceSlices, ResourceClaims, ResourceClaimTemplates, DeviceClasses
    # and DeviceTaintRules, and judge pods that ask for NVIDIA GPUs through claims.
    # Off: those objects are not read (no RBAC needed); such pods pass unjudged.
    dra: DraConfig = DraConfig()
    logging: LoggingConfig = LoggingConfig.model_validate({})


class RebalancerSettings(_Program):
    """What `gpudaemon rebalance` validates: its section, and the extender's policy
    settings, which it plans with."""

    labels: LabelPrefix = LabelPrefix()
    kubernetes: KubernetesConfig = KubernetesConfig()
    extender: ExtenderConfig = ExtenderConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    # On: also drain pods that hold a sick GPU through an allocated ResourceClaim.
    dra: DraConfig = DraConfig()
    # On (and --apply): grant GPU resets, within the fleet's limits.
    remediation: RemediationConfig = RemediationConfig()
    logging: LoggingConfig = LoggingConfig.model_validate({})


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
