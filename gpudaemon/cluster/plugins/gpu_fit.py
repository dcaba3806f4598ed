"""Filter `gpu_fit`: room for the pod's whole GPUs and MIG devices, counting bound
pods only (kube-scheduler's own filter, which ran first, counts its in-flight pods)."""

from __future__ import annotations

from collections.abc import Mapping

from gpudaemon.cluster.checks import Rejection, gpu_fit
from gpudaemon.cluster.plugins.base import POD, CycleState, Handle, NodeFilter, PluginSpec
from gpudaemon.cluster.state import NodeState


class GpuFit:
    name = "gpu_fit"
    # Its filter judges a node by its state and freshness alone (and the pod's shape):
    # the framework may keep its verdicts between requests (extender/verdicts.py).
    pure = True

    def filter(self, state: CycleState) -> NodeFilter | None:
        shape = state.read(POD).shape
        gpus, mig = shape.gpus, shape.mig

        def fitting(
            names: list[str],
            states: Mapping[str, NodeState | None],
            fresh: Mapping[str, bool],
            failed: dict[str, Rejection],
        ) -> list[str]:
            out = []
            for n in names:
                st = states[n]
                # What gpu_fit passes, read inline for whole-GPU pods; it names the rest.
                if (not mig and st is not None and gpus <= st.gpus_free_bound) or (
                    why := gpu_fit(st, shape)
                ) is None:
                    out.append(n)
                else:
                    failed[n] = why
            return out

        return fitting


def _new(handle: Handle, args: object) -> GpuFit:
    return GpuFit()


SPEC = PluginSpec("gpu_fit", "filter", _new, "free whole GPUs and MIG devices for the pod")
