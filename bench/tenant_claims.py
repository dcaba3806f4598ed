"""bench/tenant_claims: what a tenant's large ResourceClaims cost the extender and the
rebalancer in memory.

A real etcd + kube-apiserver (resource.k8s.io/v1); a tenant creates `--claims`
ResourceClaims of about `--mib` MiB each, within the API server's limits (32 requests
of 32 CEL selectors, each a long string literal: under CEL's 10 KiB per expression, and
under etcd's 1.5 MiB request limit). Then a fresh `gpudaemon extender` and a fresh
`gpudaemon rebalance`, `dra.enabled`, each run until ready (its first list of every
kind has landed) and a few seconds more; their peak RSS (VmHWM in /proc) against half
the chart's memory limit. `--before REV` runs the programs from the gpudaemon package
at an earlier commit beside this tree's, on the same servers and claims.

  scripts/bench tenant_claims [--claims 100] [--mib 1.3] [--selectors 5] [--before REV]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.memory import checkout, rss_mib
from bench.table import print_table
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.support import REPO, ProcessExited, free_port, http_get, start_agent, stop, tools_bin
from tests.support import wait_for as wait_until

CLAIMS_PATH = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
# deploy/helm/gpudaemon/values.yaml: extender.resources.limits.memory 512Mi,
# rebalancer.resources.limits.memory 256Mi; the target is half of each.
LIMIT_MIB = {"extender": 512, "rebalance": 256}
REQUESTS = 32  # resource.k8s.io/v1's DeviceRequestsMax
# Selectors per request (at most DeviceSelectorsMaxSize, 32), each CEL expression under
# its 10 KiB cap: few long ones are created faster (the API server compiles each).
SELECTORS = 5


def tenant_claim(
    name: str, mib: float, namespace: str = "tenant", selectors: int = SELECTORS
) -> dict[str, Any]:
    """A valid, unallocated claim of about `mib` MiB of JSON: its bulk is CEL the
    extender does not understand (never filtered for, but listed and watched)."""
    pad = max(1, int(mib * (1 << 20) / (REQUESTS * selectors)) - 90)
    requests = []
    for r in range(REQUESTS):
        sels = [{"cel": {"expression": f'device.driver == "gpu.nvidia.com" && '
                                       f'"{"x" * pad}-{r}-{s}" != ""'}}
                for s in range(selectors)]  # fmt: skip
        requests.append(
            {"name": f"r{r}", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": sels}}
        )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": requests}},
    }


def create_claims(
    cp: ControlPlane, n: int, mib: float, namespace: str = "tenant", selectors: int = SELECTORS
) -> int:
    """`n` claims in `namespace` (created if missing); the size of one in bytes."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    cp.admin.request("POST", "/api/v1/namespaces", ns)
    path = CLAIMS_PATH.format(ns=namespace)

    def one(i: int) -> None:
        cp.admin.request("POST", path, tenant_claim(f"big-{i:04d}", mib, namespace, selectors))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))
    return len(json.dumps(tenant_claim("big-0000", mib, namespace, selectors)))


def peak_rss(program: str, cp: ControlPlane, workdir: Path, code: Path, settle_s: float) -> float:
    """A fresh `gpudaemon <program>` with DRA on: its VmHWM in MiB once ready and
    `settle_s` more seconds."""
    port, metrics = free_port(), free_port()
    conf: dict[str, Any] = {
        "dra": {"enabled": True},
        "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig), "lease_namespace": "gpudaemon"},
        "extender": {
            "policy": "binpack",
            "listen": f"127.0.0.1:{port}",
            "metrics_listen": f"127.0.0.1:{metrics}",
        },
    }
    if program == "extender":
        args, ready = ["extender"], f"http://127.0.0.1:{metrics}/readyz"
    else:
        conf["rebalance"] = {"interval_s": 5}
        args = ["rebalance", "--listen", f"127.0.0.1:{metrics}", "--identity", "bench"]
        ready = f"http://127.0.0.1:{metrics}/readyz"
    cfg = workdir / f"{program}-{code.name}.yaml"
    cfg.write_text(yaml.safe_dump(conf))
    log = workdir / f"{program}-{code.name}.log"
    proc = start_agent([args[0], "--config", str(cfg), *args[1:]], log=log, cwd=code)

    def is_ready() -> bool:
        if proc.poll() is not None:
            raise ProcessExited(log.read_text(errors="replace")[-3000:])
        return http_get(ready)[0] == 200

    try:
        wait_until(is_ready, 180, interval=0.2, what=f"{program} ready")
        time.sleep(settle_s)
        return rss_mib(proc.pid)[1]
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", type=int, default=100)
    ap.add_argument("--mib", type=float, default=1.3, help="size of one claim, MiB of JSON")
    ap.add_argument(
        "--selectors", type=int, default=SELECTORS,
        help="CEL selectors per request (1 to 32): more is more objects, each smaller",
    )  # fmt: skip
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after ready")
    ap.add_argument("--before", metavar="REV", help="also run the programs as of this commit")
    args = ap.parse_args()
    cp = ControlPlane(tools_bin("k8s", "etcd"))
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        codes = [("this tree", REPO)]
        if args.before:
            codes.insert(0, (args.before, checkout(args.before, tmp / "before")))
        try:
            cp.start()
            cp.apply_manifest(RBAC)
            t0 = time.monotonic()
            size = create_claims(cp, args.claims, args.mib, selectors=args.selectors)
            print(f"{args.claims} claims of {size / (1 << 20):.2f} MiB created in "
                  f"{time.monotonic() - t0:.0f} s")  # fmt: skip
            rows = []
            for program in ("extender", "rebalance"):
                row = [program, f"{LIMIT_MIB[program] / 2:.0f}"]
                for _, code in codes:
                    row.append(f"{peak_rss(program, cp, tmp, code, args.settle):.0f}")
                rows.append(row)
        finally:
            cp.stop()
    print_table(["program", "target (half the limit), MiB",
                 *(f"peak RSS, MiB ({name})" for name, _ in codes)], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
