"""bench/replay: the openb arrivals through a policy in process. Small lists whose
outcome is known, and one clear line for bad input."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.packing_replay import replay

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Node:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class Pod:
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_spec: tuple[str, ...] = ()


def test_one_gpu_pods_fill_every_gpu() -> None:
    nodes = [Node("a", 8000, 32768, 4, "T4"), Node("b", 8000, 32768, 4, "T4")]
    at100, _, skipped = replay(nodes, [Pod(1000, 1024, 1)] * 8, 1, "fragmentation-model", "random")
    assert (at100, skipped) == (0.0, [])


def test_a_pod_pinned_to_a_model_no_node_has_is_turned_away() -> None:
    nodes = [Node("a", 8000, 32768, 2, "T4")]
    at100, _, skipped = replay(
        nodes, [Pod(1000, 1024, 1, ("V100M32",))] * 2, 1, "binpack", "random"
    )
    assert at100 == 100.0
    assert skipped == [[1, 1000, 1024], [1, 1000, 1024]]


def test_pods_asking_for_no_gpu_go_to_the_full_node_first() -> None:
    """Node a's one GPU is taken first (it is the pick by name); the 4-core pods that
    follow fill a's CPU before touching b under full_nodes_first, so b's GPU stays
    usable. At random, some land on b, and the last GPU pod finds no CPU there."""
    nodes = [Node("a", 16000, 65536, 1, "T4"), Node("b", 16000, 65536, 1, "T4")]
    seq = [Pod(4000, 1024, 1)] + [Pod(4000, 1024, 0)] * 3 + [Pod(16000, 1024, 1)]
    at100, _, skipped = replay(nodes, seq, 1, "binpack", "full_nodes_first")
    assert (at100, skipped) == (0.0, [])
    outcomes = {replay(nodes, seq, seed, "binpack", "random")[0] for seed in range(20)}
    assert 50.0 in outcomes  # the rule is what made the difference


def run_replay(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`python -m bench.replay ARGS` as a user runs it (tests do not import bench/)."""
    return subprocess.run(
        [sys.executable, "-m", "bench.replay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--policies", "nope"], "unknown policy 'nope'"),
        (["--gpuless-pods", "first"], "--gpuless-pods: unknown rule 'first'"),
        (["--seeds", "x"], "--seeds: whole numbers"),
        (["--pin", "2"], "--pin must be between 0 and 1"),
        (["--lists", "/nonexistent.csv"], "no pod list '/nonexistent.csv'"),
    ],
)
def test_bad_arguments_get_one_line(args: list[str], says: str) -> None:
    out = run_replay(args)
    assert out.returncode == 2
    assert says in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("nodes", "pods", "says"),
    [
        ("n1,abc,1,1,T4\n", None, "row 2: bad or missing column"),
        ("", None, "no node with a GPU"),
        (None, "p0,1000,1024,0,0,\n", "no pod asking for a GPU"),
        (None, "p0,1000\n", "row 2: bad or missing column"),
    ],
)
def test_bad_lists_get_one_line(
    tmp_path: Path, nodes: str | None, pods: str | None, says: str
) -> None:
    args = ["--seeds", "1"]
    if nodes is not None:
        (tmp_path / "nodes.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\n" + nodes)
        args += ["--nodes", str(tmp_path / "nodes.csv"), "--lists", "multigpu50"]
    if pods is not None:
        (tmp_path / "pods.csv").write_text(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + pods
        )
        args += ["--lists", str(tmp_path / "pods.csv")]
    out = run_replay(args)
    assert out.returncode != 0
    assert says in out.stderr
    assert "Traceback" not in out.stderr
