"""Our fast encoder writes exactly what prometheus-client's encoders write."""

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from gpudaemon.httpserver.exposition import encode_families


class Families:
    def __init__(self, families: list) -> None:  # type: ignore[type-arg]
        self.families = families

    def collect(self) -> list:  # type: ignore[type-arg]
        return self.families


def tricky() -> list:  # type: ignore[type-arg]
    g = GaugeMetricFamily(
        "gpudaemon_x_ratio", 'Help \\ with\nnewline and "quotes"', labels=["zeta", "alpha", "pod"]
    )
    g.add_metric(["0", "a", ""], 0.5)
    g.add_metric(["1", 'q"uo\\te\nnl', "p"], 1e21)
    g.add_metric(["2", "nan", "-"], float("nan"))
    g.add_metric(["3", "inf", "-"], float("inf"))
    c = CounterMetricFamily("gpudaemon_e_joules", "Energy.", labels=["gpu"])
    c.add_metric(["0"], 12.0)
    c.add_metric(["1"], 0.0)
    bare = GaugeMetricFamily("gpudaemon_age_seconds", "No labels.")
    bare.add_metric([], 3.25)
    empty = GaugeMetricFamily("gpudaemon_empty", "No samples.", labels=["gpu"])
    return [g, c, bare, empty]


def test_text_format_is_byte_identical() -> None:
    assert encode_families(tricky(), openmetrics=False) == text_latest(Families(tricky()))  # type: ignore[arg-type]


def test_openmetrics_is_byte_identical_without_the_eof() -> None:
    assert encode_families(tricky(), openmetrics=True) + b"# EOF\n" == om_latest(Families(tricky()))  # type: ignore[arg-type]


def test_other_metric_types_are_refused_not_misencoded() -> None:
    h = HistogramMetricFamily(
        "gpudaemon_h_seconds", "H.", buckets=[("1.0", 1), ("+Inf", 2)], sum_value=3
    )
    with pytest.raises(ValueError, match="histogram"):
        encode_families([h], openmetrics=False)
