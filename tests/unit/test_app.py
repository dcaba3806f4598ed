"""The wired agent: one cycle, failures isolated per job, readiness, SIGTERM."""

import sys

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon.agent.app import Agent
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import load_config
from gpudaemon.errors import BackendError, KubeUnavailableError
from gpudaemon.labels import LabelSet
from gpudaemon.labels.outputs import LocalOutput
from gpudaemon.logsetup import setup_logging
from gpudaemon.schedule import Job


class RecordingSink(LocalOutput):
    name = "recording"

    def __init__(self) -> None:
        self.applied: list[LabelSet] = []
        self.closed = False

    def apply(self, ls: LabelSet) -> bool:
        self.applied.append(ls)
        return True

    def close(self) -> None:
        self.closed = True


class FlakyBackend(SimulatedBackend):
    fail = False

    def sample(self):  # type: ignore[no-untyped-def]
        if self.fail:
            raise BackendError("driver went away")
        return super().sample()


def make_agent(
    backend: SimulatedBackend | None = None,
) -> tuple[Agent, RecordingSink, CollectorRegistry]:
    cfg = load_config(environ={}, overrides={"simulate": "dgx-h100", "node_name": "n1"})
    sink, reg = RecordingSink(), CollectorRegistry()
    agent = Agent(
        cfg,
        backend=backend or SimulatedBackend(load_profile("dgx-h100")),
        registry=reg,
        label_sink=sink,
    )
    return agent, sink, reg


def test_run_once_goes_backend_cache_labels() -> None:
    agent, sink, reg = make_agent()
    assert agent.run(once=True) == 0
    assert sink.applied and sink.applied[-1].labels["gpudaemon.io/gpu.count"] == "8"
    assert sink.closed
    assert reg.get_sample_value("gpudaemon_poll_duration_seconds_count", {"task": "telemetry"}) == 1
    assert (
        reg.get_sample_value(
            "gpudaemon_gpu_utilization_ratio",
            {
                "gpu": "0",
                "uuid": agent.cache.get().samples[0].uuid,
                "model": "NVIDIA H100 80GB HBM3",
                "node": "n1",
                "pod": "",
                "namespace": "",
                "container": "",
            },
        )
        is not None
    )


def test_a_failing_poll_keeps_the_last_good_data_and_is_counted() -> None:
    backend = FlakyBackend(load_profile("dgx-h100"))
    agent, _, reg = make_agent(backend)
    assert agent.poll_telemetry()
    good = agent.cache.get()
    backend.fail = True
    assert not agent.poll_telemetry()
    assert agent.cache.get() is good
    assert reg.get_sample_value("gpudaemon_poll_errors_total", {"task": "telemetry"}) == 1


def test_readiness_needs_a_fresh_reading() -> None:
    now = [1000.0]
    cfg = load_config(
        environ={}, overrides={"simulate": "dgx-h100", "metrics": {"stale_after_seconds": 30}}
    )
    agent = Agent(
        cfg, registry=CollectorRegistry(), label_sink=RecordingSink(), clock=lambda: now[0]
    )
    assert agent.readiness()[0] is False
    agent.poll_telemetry()
    assert agent.readiness()[0] is True
    now[0] += 31
    ok, why = agent.readiness()
    assert not ok and "31s old" in why


class JobsSink(RecordingSink):
    """A sink with jobs of its own, like the API server writer (kube-retry, lease)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def jobs(self) -> list[Job]:
        return [Job("lease", "*/2 * * * * *", self.beat)]

    def beat(self) -> bool:
        if self.fail:
            raise KubeUnavailableError("lease not renewed: down")
        return True


def test_a_sinks_jobs_go_through_the_one_wrapper(capfd: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(
        environ={},
        overrides={
            "simulate": "dgx-h100",
            "node_name": "n1",
            "metrics": {"pod_resources_socket": ""},
        },
    )
    sink, reg = JobsSink(), CollectorRegistry()
    agent = Agent(cfg, registry=reg, label_sink=sink)
    assert list(agent.jobs) == ["inventory", "telemetry", "labels", "energy", "health", "lease"]
    assert agent.jobs["lease"].cron == "*/2 * * * * *"
    errors = {"task": "lease"}
    assert reg.get_sample_value("gpudaemon_poll_errors_total", errors) == 0  # exists at 0
    logger.remove()
    logger.add(sys.stderr, format="{message}")
    try:
        assert not agent.run_job("lease")
        assert not agent.run_job("lease")
        sink.fail = False
        assert agent.run_job("lease")
    finally:
        setup_logging("WARNING")
    assert reg.get_sample_value("gpudaemon_poll_errors_total", errors) == 2
    assert reg.get_sample_value("gpudaemon_poll_duration_seconds_count", errors) == 3
    err = capfd.readouterr().err
    assert err.count("lease failed: lease not renewed: down") == 1  # once per run of failures
    assert "lease works again" in err
    assert agent.run_job("not-configured")
