"""The install profiles of constraints/ (see pyproject.toml's comment on `dependencies`).

- cpu.txt is what `make install` uses: today's exact CPU pins (torch 2.13.0 is the local CPU
  wheel on CI machines; anything else would pull a multi-GB CUDA build). Checked offline.
- sglang-<version>.txt are the GPU cluster profiles (Python 3.12, manylinux x86_64, the platform
  of infra/Dockerfile). Each is resolved for real with pip's dry run against the package index:
  metadata only, nothing installed. Skipped, with the reason, when the index cannot be reached.
- infra/Dockerfile is built under the image name the Kubernetes manifests use.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from infra.k8s import DEFAULT_IMAGE
from miles_core.engines.sglang.args import SGLANG_VERSIONS_CHECKED
from tests.conftest import REPO

CONSTRAINTS = REPO / "constraints"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CLUSTER_PROFILES = sorted(CONSTRAINTS.glob("sglang-*.txt"))
# The platform of infra/Dockerfile: CPython 3.12 on Ubuntu 24.04 (glibc 2.39), x86_64. pip's
# target-platform flags do not imply older manylinux tags: each one is listed.
GLIBC_MINOR = 39
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(5, GLIBC_MINOR + 1))]
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError")


def pins(path: Path) -> dict[str, str]:
    """name -> exact version of a constraints file, following its `-c other.txt` lines."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-c"):
            out.update(pins(path.parent / line[2:].strip()))
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
        out[canonicalize_name(req.name)] = spec.version
    return out


def project_requirements(*extras: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return {canonicalize_name(r.name): r for r in reqs}


# ---- the CPU / CI path (offline) -------------------------------------------------------------

def test_make_install_uses_the_cpu_constraints():
    makefile = (REPO / "Makefile").read_text()
    install = [line.strip() for line in makefile.splitlines() if re.search(r"pip install .*-e ", line)]
    assert install == ['$(BIN)/pip install --quiet -e ".[test]" -c constraints/cpu.txt'], install


def test_cpu_profile_keeps_the_ci_pins():
    cpu = pins(CONSTRAINTS / "cpu.txt")
    assert cpu["torch"] == "2.13.0"  # the local CPU wheel; any other version downloads CUDA builds
    assert cpu["transformers"] == "5.24.0"
    # every runtime dependency is pinned exactly on the CI path, within the range pyproject allows
    for name, req in project_requirements("megatron").items():
        assert name in cpu, f"constraints/cpu.txt does not pin {name}"
        assert req.specifier.contains(cpu[name], prereleases=True), f"{name}=={cpu[name]} outside {req}"


@pytest.mark.parametrize("profile", CLUSTER_PROFILES, ids=lambda p: p.stem)
def test_cluster_profile_is_within_the_project_ranges(profile):
    version = profile.stem.removeprefix("sglang-")
    pinned = pins(profile)
    assert pinned["sglang"] == version
    assert version in SGLANG_VERSIONS_CHECKED, f"SGLang {version} is not one the client contract is checked against"
    for name, req in project_requirements("sglang", "megatron").items():
        if name in pinned:
            assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} outside {req}"
    # the orchestration stack matches what the manifests and prefect.yaml name
    rayjob = yaml.safe_load((REPO / "infra/k8s/rayjob.yaml").read_text())
    assert pinned["ray"] == rayjob["spec"]["rayClusterSpec"]["rayVersion"]
    assert pinned["prefect"] == yaml.safe_load((REPO / "prefect.yaml").read_text())["prefect-version"]


def test_supported_sglang_versions_have_profiles():
    assert {p.stem for p in CLUSTER_PROFILES} >= {"sglang-0.5.17", "sglang-0.5.23"}


# ---- the image ------------------------------------------------------------------------------

def test_dockerfile_builds_the_image_the_manifests_run():
    dockerfile = (REPO / "infra/Dockerfile").read_text()
    assert f"docker build -f infra/Dockerfile -t {DEFAULT_IMAGE} ." in dockerfile
    assert DEFAULT_IMAGE.rsplit(":", 1)[1] == PYPROJECT["project"]["version"]
    default_profile = re.search(r"^ARG CONSTRAINTS=(\S+)$", dockerfile, re.M).group(1)
    assert (REPO / default_profile).is_file() and default_profile in {str(p.relative_to(REPO)) for p in CLUSTER_PROFILES}
    assert not re.search(r"^ENTRYPOINT", dockerfile, re.M) and re.search(r"^USER (?!root)\w+", dockerfile, re.M)
    for manifests in (REPO / "infra/k8s", REPO / "tests/unit/snapshots"):
        rayjob = (manifests / "rayjob.yaml").read_text()
        assert set(re.findall(r"image: (\S+)", rayjob)) == {DEFAULT_IMAGE}, manifests
        template = json.loads((manifests / "work-pool-template.json").read_text())
        assert template["variables"]["properties"]["image"]["default"] == DEFAULT_IMAGE, manifests


# ---- the cluster profiles, resolved against the index (network) -------------------------------

def _index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = got.stdout.strip() if got.returncode == 0 and got.stdout.strip() else "https://pypi.org/simple"
    return url.rstrip("/")


class Skip(str):
    """Why the cluster profiles cannot be resolved here (the tests skip with it)."""


def project_wheel(src: Path, out: Path) -> Path | Skip:
    """This project's wheel, built from a copy of its sources (the checkout stays untouched)."""
    pip_version = importlib.metadata.version("pip")  # not `import pip`: it would change distutils for later tests
    if Version(pip_version) < Version("23.0"):
        return Skip(f"pip {pip_version} is too old for `install --dry-run --report`")
    index = _index_url()
    try:
        urllib.request.urlopen(urllib.request.Request(f"{index}/sglang/", method="HEAD"), timeout=20).close()
    except (urllib.error.URLError, OSError) as exc:
        return Skip(f"the package index {index} cannot be reached ({exc}); the cluster profiles were not resolved")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("miles_core", "flows", "tasks", "infra"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("miles_posttrain-*.whl")
    return wheel


def _pip(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run pip at a lower CPU priority: it mostly waits on the index, and it may run beside
    other tests (start_resolving), which must not be slowed by its share of the CPU."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
    except OSError:  # exited already, or not permitted: only the priority is lost
        pass
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def dry_run(wheel: Path, constraints: Path, report: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
           *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
           # Where the index serves no PEP 658 metadata files, read each wheel's metadata with
           # HTTP range requests instead of downloading it (torch alone is 0.5 GB).
           "--use-feature=fast-deps",
           "--report", str(report), "-c", str(constraints), f"{wheel}[sglang,megatron]"]
    done = _pip(cmd)
    if done.returncode and "fast-deps" in done.stderr and "invalid choice" in done.stderr:
        cmd.remove("--use-feature=fast-deps")  # a pip without the feature: plain metadata downloads
        done = _pip(cmd)
    return done


Resolutions = dict[Path, tuple[subprocess.CompletedProcess, Path]]


def resolve_all(root: Path) -> Resolutions | Skip:
    """Every cluster profile's dry run, all at once: each waits on the index for most of its
    minute, so they overlap instead of adding up."""
    for sub in ("src", "wheel", "reports"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    wheel = project_wheel(root / "src", root / "wheel")
    if isinstance(wheel, Skip):
        return wheel
    with ThreadPoolExecutor(max_workers=len(CLUSTER_PROFILES)) as pool:
        runs = {p: pool.submit(dry_run, wheel, p, root / "reports" / f"{p.stem}.json") for p in CLUSTER_PROFILES}
        return {p: (run.result(), root / "reports" / f"{p.stem}.json") for p, run in runs.items()}


_started: Future | None = None


def start_resolving(root: Path) -> None:
    """Start resolve_all in a background thread, once per session. tests/conftest.py calls this
    when the session begins, if test_cluster_profile_resolves is selected: the dry runs wait
    on the index for 50-100 s, during which the tests before this module run, instead of
    waiting for them here. A daemon thread: an interrupted session does not wait for pip."""
    global _started
    if _started is not None:
        return
    _started = Future()

    def work(result: Future) -> None:
        try:
            result.set_result(resolve_all(root))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the fixture, in the test that needs it
            result.set_exception(exc)

    threading.Thread(target=work, args=(_started,), name="cluster-profile-dry-runs", daemon=True).start()


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> Resolutions:
    """resolve_all's result: started early by the session (start_resolving), or here when this
    module runs in a session that did not start it."""
    if _started is None:
        start_resolving(tmp_path_factory.mktemp("cluster-profiles"))
    got = _started.result()
    if isinstance(got, Skip):
        pytest.skip(got)
    return got


@pytest.mark.parametrize("profile", CLUSTER_PROFILES, ids=lambda p: p.stem)
def test_cluster_profile_resolves(profile, resolutions):
    """`pip install -c constraints/sglang-X.txt ".[sglang,megatron]"` resolves on the image's
    platform: SGLang at X, torch at the version SGLang X pins, and the rest of the stack."""
    done, report = resolutions[profile]
    if done.returncode and any(err in done.stderr for err in NETWORK_ERRORS):
        pytest.skip(f"the package index went away during the resolution: {done.stderr[-500:]}")
    assert done.returncode == 0, f"{profile.name} does not resolve:\n{done.stderr[-6000:]}"
    installs = json.loads(report.read_text())["install"]
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in installs}
    version = profile.stem.removeprefix("sglang-")
    assert got["sglang"]["version"] == version
    sglang_pins = {canonicalize_name(r.name): r for r in map(Requirement, got["sglang"].get("requires_dist", []))
                   if r.marker is None}
    torch_pin = str(sglang_pins["torch"].specifier)
    assert torch_pin.startswith("=="), torch_pin
    assert got["torch"]["version"] == torch_pin[2:]
    for name, pinned in pins(profile).items():
        assert got[name]["version"] == pinned, f"{name}: resolved {got[name]['version']}, pinned {pinned}"
    for name in ("megatron-core", "ray", "prefect", "mlflow", "transformers", "miles-posttrain"):
        assert name in got, f"{name} is not in the resolution"
