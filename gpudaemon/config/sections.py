"""The sections every program reads: `labels` (its prefix), `kubernetes` and `logging`.
`LabelPrefix` is the part of `labels` the extender, the rebalancer and `status` use; the
rest of that section is the agent's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from gpudaemon.config.values import (
    NFD_FEATURES_DIR,
    NFD_PATH_PATTERN,
    Number,
    Switch,
    WholeNumber,
    _check_labels_to,
    _check_nfd_path,
    _Section,
    _View,
)
from gpudaemon.labels.sanitize import DEFAULT_PREFIX, validate_prefix


class LabelsConfig(_Section):
    prefix: str = DEFAULT_PREFIX
    # apiserver | stdout | nfd | none | a file path. With no Kubernetes credentials, the
    # default falls back to stdout, saying why, so a laptop run still shows the labels;
    # "apiserver" set explicitly is an error instead (docs/configuration.md).
    to: Annotated[str, Field(min_length=1), AfterValidator(_check_labels_to)] = "apiserver"
    # `labels.to: nfd` writes GFD's `key=value` lines here, for NFD's local source. It
    # reads only its features directory (mounted from the host at the same path), so a
    # path anywhere else is refused.
    nfd_path: Annotated[
        str,
        AfterValidator(_check_nfd_path),
        Field(json_schema_extra={"pattern": NFD_PATH_PATTERN}),
    ] = NFD_FEATURES_DIR + "gpudaemon"
    # Taint the Node `<prefix>gpu-unhealthy:NoSchedule` while any GPU is unhealthy. Off:
    # a taint also keeps CPU-only pods off a node with seven good GPUs, which is the
    # operator's call; the `gpu.unhealthy` label and `GPUHealthy` condition are always on.
    taint_unhealthy: Switch = False
    # The NVIDIA device plugin's MIG strategy on this node, which decides what MIG
    # labels mean (GFD's rules): none (MIG devices not advertised), single (every MIG
    # device is an nvidia.com/gpu and gpu.* describe them), mixed (nvidia.com/mig-<p>
    # per profile, with mig-<p>.* labels). Set it to the device plugin's.
    mig_strategy: Literal["none", "single", "mixed"] = "none"

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return validate_prefix(v)


class LabelPrefix(_View):
    """`labels` as the programs off the GPU node read it: the prefix, validated; the
    agent's keys beside it checked by name only."""

    prefix: str = DEFAULT_PREFIX

    @classmethod
    def whole(cls) -> type[BaseModel]:
        return LabelsConfig

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return validate_prefix(v)


class KubernetesConfig(_Section):
    # Empty: in a cluster, its service account; else the first file in $KUBECONFIG
    # that exists, then ~/.kube/config (resolved when the config is loaded).
    kubeconfig: str = ""
    # None: in a cluster when $KUBERNETES_SERVICE_HOST is set and the service-account
    # token is mounted (resolved when the config is loaded).
    in_cluster: Switch | None = None
    # Who this process is in Leases: the agent's node Lease holder is `<this>/<pid>`.
    # Empty: $POD_NAME, then the hostname (resolved when the config is loaded).
    holder_identity: str = ""
    # The rebalancer's identity in its leader Lease. Empty: holder_identity when that
    # was set explicitly, else `<$POD_NAME or hostname>_<random UUID>`, as client-go
    # makes it: two replicas on one hostname (no $POD_NAME) must never both lead.
    leader_identity: str = ""
    # Stale after this; renewed every third of it (`kube.lease.renew_period_s`). 6 min
    # gives 30 Lease writes per node-hour (kubelet's own node lease costs 360) and a
    # stale threshold the extender can live with: GPU data needs no liveness precision.
    lease_duration_seconds: Annotated[WholeNumber, Field(ge=10, le=86400)] = 360
    # The namespace of the agents' node Leases and the rebalancer's leader Lease (the
    # chart sets its release namespace). `gpudaemon status` uses it when it is set here
    # or in the environment; otherwise it finds the agents' Leases by their label.
    lease_namespace: str = "gpudaemon"
    # Backoff cap after API errors: bounds recovery time without hammering a sick server.
    backoff_max_seconds: Annotated[Number, Field(gt=0, le=3600)] = 60.0
    # Per-request read timeout: a hung API server must never hold a job for long.
    request_timeout_seconds: Annotated[Number, Field(gt=0, le=600)] = 10.0
    # Connect timeout: a dead server refuses at once; a black-holed one should not
    # hold a job for long.
    connect_timeout_seconds: Annotated[Number, Field(gt=0, le=600)] = 3.0
    # Re-read the Node this often to repair drift (someone removed our label);
    # a read, not a write, so it costs the API server little.
    resync_seconds: Annotated[Number, Field(gt=0, le=7 * 86400)] = 600.0


class LoggingConfig(_Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_: Switch = Field(False, alias="json")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class DraConfig(_Section):
    """Dynamic Resource Allocation (docs/dra.md): GPUs published by NVIDIA's DRA driver
    in ResourceSlices and handed to pods through ResourceClaims. One switch for every
    program: the agent writes DeviceTaintRules, the extender judges claims, the
    rebalancer drains pods that hold a sick GPU through one."""

    # Off: most clusters still give GPUs through the device plugin, and on the agent
    # this means writing DeviceTaintRules, a power the chart grants only with it.
    enabled: Switch = False
    # The effect of the DeviceTaintRule for a device of an unhealthy GPU: NoSchedule
    # keeps new claims off it; None only shows it. Never NoExecute: evicting the pods
    # that hold it is the rebalancer's job (Eviction API, PDBs).
    taint_effect: Literal["None", "NoSchedule"] = "NoSchedule"
