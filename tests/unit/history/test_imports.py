"""influxdb-client is loaded only where InfluxDB is configured (issue 29): a whole
`gpudaemon run --once` in a fresh interpreter, then a look at sys.modules. Its import
costs ~11 MiB of RSS (docs/benchmarks.md), which an agent without history never pays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

PROBE = (
    "import sys\n"
    "from gpudaemon.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('MODULES', rc, 'influxdb_client' in sys.modules, 'kubernetes' in sys.modules)\n"
)
ARGS = ["run", "--once", "--simulate", "dgx-h100", "--labels-to", "none"]


def run_once(tmp_path: Path, env: dict[str, str]) -> tuple[str, bool, bool]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUDAEMON_", "KUBERNETES_SERVICE"))
    }
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *ARGS, "--listen", "127.0.0.1:0"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("MODULES ")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    _, rc, influx, kube = line[-1].split()
    return rc, influx == "True", kube == "True"


def test_no_influxdb_configured_no_influxdb_client_imported(tmp_path: Path) -> None:
    rc, influx, kube = run_once(tmp_path, {})
    assert rc == "0"
    assert not influx, "influxdb_client was imported with history off"
    assert not kube, "kubernetes was imported with labels to none"


def test_influxdb_configured_writes_through_influxdb_client(tmp_path: Path) -> None:
    # Nothing listens on port 9: the write fails, the points go to the spool; what
    # matters here is which client tried.
    rc, influx, _ = run_once(
        tmp_path,
        {
            "GPUDAEMON_INFLUXDB__URL": "http://127.0.0.1:9",
            "GPUDAEMON_INFLUXDB__BUCKET": "db",
            "GPUDAEMON_INFLUXDB__SPOOL_DIR": str(tmp_path / "spool"),
        },
    )
    assert rc == "0"
    assert influx, "history is on but influxdb_client was not used"
