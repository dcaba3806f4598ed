"""The image, really built: scripts/build-image runs buildah on the project's Dockerfile
(on a Debian base made locally by mmdebstrap, as no registry is reachable), and the
image runs `gpudaemon probe --simulate dgx-h100` as it would in the chart's pod: as
the image's own user (uid 65532), with its entrypoint and environment, on a read-only
root filesystem.

How it runs without a container engine: the image's root filesystem (buildah mount) is
bind-mounted read-only in a private mount and PID namespace (unshare), /proc is
mounted, and chroot switches to the image's user. That is what a runtime does for
`readOnlyRootFilesystem` and `runAsUser`, minus cgroups and seccomp."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO

pytestmark = pytest.mark.integration

IMAGE_DIR = Path(os.environ.get("GPUDAEMON_IMAGE_DIR", Path.home() / ".cache/gpudaemon-image"))
TAG = "localhost/gpudaemon:test"
COMPILERS = ["gcc", "cc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc-12", "ld", "as", "make"]

# Runs inside `unshare --mount --pid --fork`: $1 image rootfs, $2 mount point, $3 user,
# then the command. The bind mount is made read-only by the remount (a plain
# `mount -o ro --bind` ignores ro on older kernels).
RUN_READ_ONLY = """
set -e
mount --bind "$1" "$2"
mount -o remount,bind,ro "$2"
mount -t proc proc "$2/proc"
root=$2 user=$3
shift 3
exec chroot --userspec="$user" "$root" "$@"
"""


def buildah(*args: str) -> str:
    proc = subprocess.run(
        ["buildah", "--root", str(IMAGE_DIR / "storage"), "--runroot", str(IMAGE_DIR / "run"),
         "--storage-driver", "vfs", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def image() -> str:
    proc = subprocess.run(
        [str(REPO / "scripts" / "build-image"), "--tag", TAG],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == TAG
    return TAG


@pytest.fixture(scope="module")
def config(image: str) -> dict[str, Any]:
    return dict(json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"])


@pytest.fixture(scope="module")
def rootfs(image: str) -> Iterator[Path]:
    ctr = buildah("from", "--pull=never", image)
    try:
        yield Path(buildah("mount", ctr))
    finally:
        buildah("umount", ctr)
        buildah("rm", ctr)


def run_in_image(
    rootfs: Path, config: dict[str, Any], tmp_path: Path, *args: str, user: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The image's entrypoint with `args`, its Env, as its User (or `user`), read-only."""
    env = dict(e.split("=", 1) for e in config.get("Env", []))
    mnt = tmp_path / "root"
    mnt.mkdir()
    return subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--kill-child", "sh", "-c", RUN_READ_ONLY,
         "run", str(rootfs), str(mnt), user or config["User"], *config["Entrypoint"], *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_image_runs_as_uid_65532_with_the_gpudaemon_entrypoint(config: dict[str, Any]) -> None:
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["gpudaemon"]
    assert config["Cmd"] == ["run"]
    assert {"9445/tcp", "9446/tcp"} <= set(config["ExposedPorts"])


def test_probe_works_as_non_root_on_a_read_only_root(
    rootfs: Path, config: dict[str, Any], tmp_path: Path
) -> None:
    proc = run_in_image(
        rootfs, config, tmp_path, "probe", "--simulate", "dgx-h100", "--format", "json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["gpus"]) == 8
    assert out["labels"]["gpudaemon.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert "gpudaemon.io/gpus" in out["annotations"]


def test_the_root_really_is_read_only_there(
    rootfs: Path, config: dict[str, Any], tmp_path: Path
) -> None:
    """Even uid 0 cannot write in the same set-up, so the probe above had no writable root."""
    # The entrypoint is gpudaemon; `python -c` needs the interpreter, so go by the venv.
    cfg = dict(config, Entrypoint=["/opt/gpudaemon/bin/python", "-c"])
    proc = run_in_image(rootfs, cfg, tmp_path, "open('/opt/x', 'w')", user="0:0")
    assert proc.returncode != 0
    assert "Read-only file system" in proc.stderr


def test_bad_input_is_one_line_and_exit_2_in_the_image(
    rootfs: Path, config: dict[str, Any], tmp_path: Path
) -> None:
    proc = run_in_image(rootfs, config, tmp_path, "probe", "--simulate", "no-such-profile")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_final_stage_has_no_compilers_and_no_build_secrets(
    rootfs: Path, config: dict[str, Any]
) -> None:
    for d in ("usr/bin", "usr/local/bin", "bin"):
        present = [c for c in COMPILERS if (rootfs / d / c).exists()]
        assert present == [], f"/{d}: {present}"
    assert not (rootfs / "opt/gpudaemon/bin/pip").exists()
    secrets = rootfs / "run" / "secrets"
    assert not secrets.exists() or not any(secrets.iterdir())
    assert not any(e.startswith(("PIP_CERT=", "PIP_CONFIG_FILE=")) for e in config["Env"])


def test_image_size_is_what_the_docs_record(image: str) -> None:
    """docs/install.md states the size; a change of more than 10% means updating it."""
    size_mb = _size_mb(image)
    doc = (REPO / "docs" / "install.md").read_text()
    recorded = [int(w.split()[0]) for w in doc.split("Image size: ")[1:]]
    assert recorded, "docs/install.md has no 'Image size: N MB' line"
    assert abs(size_mb - recorded[0]) <= recorded[0] * 0.10, (size_mb, recorded[0])


def _size_mb(image: str) -> float:
    for line in buildah("images", "--format", "{{.Name}}:{{.Tag}} {{.Size}}").splitlines():
        name, size, unit = line.split()[0], float(line.split()[1]), line.split()[2]
        if name == image:
            return size * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]
    raise AssertionError(f"{image} not in buildah images")
