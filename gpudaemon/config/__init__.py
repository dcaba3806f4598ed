"""Configuration: YAML file, then GPUDAEMON_* environment variables, then CLI flags.

One model per program, built from shared sections: `AgentSettings` (run, probe),
`ExtenderSettings`, `RebalancerSettings`, `StatusSettings`; `Config` is the whole file
(every key of every program). Validated once at load by pydantic, with no file I/O;
the files a program needs are checked when it starts (`check_files`). Each field's
comment says why its default is what it is. Modules: values.py (shared value types),
sections.py (labels, kubernetes, logging), agent.py, extender.py, rebalancer.py,
programs.py (Config, each program's model, the program table), environment.py (every
environment read), loading.py, files.py. docs/configuration.md says how a shared file is read.
"""

from gpudaemon.config.agent import (
    DEFAULT_SPOOL_DIR,
    HealthConfig,
    InfluxConfig,
    MetricsConfig,
    Schedules,
    check_history_timeout,
)
from gpudaemon.config.environment import ENV_PREFIX, PROCESS_UUID, env_overrides
from gpudaemon.config.extender import (
    ExtenderConfig,
    ExtenderTls,
    PluginsConfig,
    ScorePluginConfig,
    TypicalPod,
)
from gpudaemon.config.files import check_files, influx_token
from gpudaemon.config.loading import load_config, load_settings
from gpudaemon.config.programs import (
    PROGRAMS,
    AgentSettings,
    Config,
    ExtenderSettings,
    RebalancerSettings,
    StatusSettings,
)
from gpudaemon.config.rebalancer import RebalanceConfig
from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.config.sections import (
    DraConfig,
    KubernetesConfig,
    LabelPrefix,
    LabelsConfig,
    LoggingConfig,
)
from gpudaemon.config.values import (
    DNS1123_LABEL_PATTERN,
    DNS1123_SUBDOMAIN,
    DNS1123_SUBDOMAIN_PATTERN,
    LABEL_OUTPUTS,
    NFD_FEATURES_DIR,
    redact_url,
)

__all__ = [
    "DEFAULT_SPOOL_DIR",
    "DNS1123_LABEL_PATTERN",
    "DNS1123_SUBDOMAIN",
    "DNS1123_SUBDOMAIN_PATTERN",
    "ENV_PREFIX",
    "LABEL_OUTPUTS",
    "NFD_FEATURES_DIR",
    "PROCESS_UUID",
    "PROGRAMS",
    "AgentSettings",
    "Config",
    "DraConfig",
    "ExtenderConfig",
    "ExtenderSettings",
    "ExtenderTls",
    "HealthConfig",
    "InfluxConfig",
    "KubernetesConfig",
    "LabelPrefix",
    "LabelsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "PluginsConfig",
    "RebalanceConfig",
    "RebalancerSettings",
    "RemediationConfig",
    "Schedules",
    "ScorePluginConfig",
    "StatusSettings",
    "TypicalPod",
    "check_files",
    "check_history_timeout",
    "env_overrides",
    "influx_token",
    "load_config",
    "load_settings",
    "redact_url",
]
