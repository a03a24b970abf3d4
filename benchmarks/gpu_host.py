"""What the tool reads through NVML on a real GPU host, beside what CUDA itself says there.

The tool finds GPUs, their memory and compute capability, and samples telemetry through NVML (nvidia-ml-py),
never through torch.cuda (optimizer/hardware/device.py says why). Its tests script NVML (tests/support/fake_nvml.py);
this runs the same code against a real driver and prints, for a user's GPU host or a lent one:

1. the driver, and each GPU as `visible_gpus` reads it, beside torch's own reading of the same device;
2. which GPUs `visible_gpus` keeps under each CUDA_VISIBLE_DEVICES form, beside the count CUDA gives a fresh
   process under the same variable (torch.cuda.device_count, which asks the CUDA runtime);
3. whether a process that ran the tool's detection (device, memory probe, telemetry) can still fork a child that
   initializes CUDA, as vLLM's engine core must; and the same after torch.cuda.is_available() and after
   torch.cuda.init() in the parent, for contrast;
4. the telemetry's summary, idle and while another process runs bf16 matrix products;
5. the decisions made from those readings: the memory probe, `vllm serve`'s batch defaults for this GPU, the CUDA
   knobs the default space adds, the machine fingerprint.

Needs a GPU, its driver, nvidia-ml-py and the tool's own dependencies; PyTorch with CUDA only for the comparisons
(without it those columns read "no torch"). vLLM is not needed.

    python benchmarks/gpu_host.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.hardware.device import driver_version, installed_build, visible_gpus  # noqa: E402
from optimizer.hardware.machine import gpus as fingerprint_gpus  # noqa: E402
from optimizer.measurement.telemetry import GpuTelemetry, device_handle  # noqa: E402
from optimizer.params.deploy import batch_defaults  # noqa: E402
from optimizer.params.open_space import cuda_knobs  # noqa: E402
from optimizer.params.preflight import DeviceMemory  # noqa: E402

GIB = 1024**3
TORCH_READING = """
import json, torch
n = torch.cuda.device_count()
out = {"count": n, "runtime_count": torch._C._cuda_getDeviceCount(), "devices": []}
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    out["devices"].append({"name": p.name, "total_memory": p.total_memory, "cc": [p.major, p.minor],
                           "uuid": str(getattr(p, "uuid", ""))})
print(json.dumps(out))
"""
LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def torch_reading(env: dict[str, str]) -> dict[str, Any]:
    """What a fresh process's torch (the CUDA runtime) sees under `env`."""
    try:
        done = subprocess.run([sys.executable, "-c", TORCH_READING], env=env, capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": "no torch" if "No module named 'torch'" in last else last[:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_uses_cuda(conn: Any) -> None:
    try:
        import torch

        value = torch.ones(4, device="cuda").sum().item()
        conn.send(f"ok: a CUDA tensor summed to {value:g}")
    except Exception as exc:  # what the child of a fork meets is the finding
        conn.send(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    finally:
        conn.close()


def fork_check(before: str) -> str:
    """Run `before` in this process, then fork a child that uses CUDA; its outcome in words."""
    if before == "detection":
        visible_gpus()
        driver_version()
        DeviceMemory.probe("cuda")
        with GpuTelemetry(interval_s=0.05):
            time.sleep(0.2)
        if "torch" in sys.modules:
            return "failed: the detection imported torch"
    else:
        import torch

        if before == "is_available":
            torch.cuda.is_available()
        else:
            torch.cuda.init()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_uses_cuda, args=(child,))
    proc.start()
    outcome = parent.recv() if parent.poll(120) else "failed: no answer in 120 s"
    proc.join(30)
    return outcome


def fork_check_in_fresh_process(before: str) -> str:
    done = subprocess.run([sys.executable, __file__, "--fork-check", before], capture_output=True, text=True,
                          timeout=300)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"failed: exit {done.returncode}: {done.stderr.strip()[-200:]}"


def telemetry_under(load_s: float, hold_gib: float) -> dict[str, Any]:
    """Telemetry's summary while another process runs matrix products for `load_s` (0: idle for 2 s)."""
    with GpuTelemetry(interval_s=0.1) as telemetry:
        if load_s:
            subprocess.run([sys.executable, "-c", LOAD, str(hold_gib), str(load_s)], timeout=300, check=False)
        else:
            time.sleep(2.0)
    return telemetry.summary()


def watched(env: dict[str, str]) -> str:
    """Which GPU the telemetry watches under `env` (its UUID's start), or none."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update({k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"})
    import pynvml

    pynvml.nvmlInit()
    try:
        return str(pynvml.nvmlDeviceGetUUID(device_handle(pynvml)))[:12]
    except LookupError:
        return "none"
    finally:
        pynvml.nvmlShutdown()
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def visible_forms(uuid: str) -> list[str | None]:
    return [None, "0", "1", "", "-1", uuid[:12], uuid, "GPU-00000000", "0,1", "1,0", "0,0", "foo,0", "0gpu", " 0",
            "+0", "0,-1", f"{uuid[:12]},0", f"{uuid[:12]},{uuid}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every reading to this file")
    parser.add_argument("--fork-check", choices=["detection", "is_available", "init"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fork_check:
        print(fork_check(args.fork_check))
        return 0

    report: dict[str, Any] = {"build": installed_build().describe(), "driver": driver_version()}
    base_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    gpus = visible_gpus(env=base_env)
    theirs = torch_reading(base_env)
    report["gpus"] = [g.__dict__ | {"compute_capability": list(g.compute_capability)} for g in gpus]
    report["torch"] = theirs
    print(f"vLLM build: {report['build']}; NVIDIA driver (NVML): {report['driver']}")
    if not gpus:
        print("NVML sees no GPU here: nothing more to read")
        return 1
    for g in gpus:
        print(f"GPU {g.index}: {g.name}, {g.uuid}, total {g.memory_total_bytes / GIB:.2f} GiB "
              f"({g.memory_total_bytes} B), free {g.memory_free_bytes / GIB:.2f} GiB, compute capability "
              f"{g.compute_capability[0]}.{g.compute_capability[1]}")
    for i, d in enumerate(theirs.get("devices", [])):
        print(f"  torch's device {i}: {d['name']}, total {d['total_memory'] / GIB:.2f} GiB ({d['total_memory']} B), "
              f"compute capability {d['cc'][0]}.{d['cc'][1]}, uuid {d['uuid']}")
    if "error" in theirs:
        print(f"  torch: {theirs['error']}")

    print("\nCUDA_VISIBLE_DEVICES          ours (NVML indices)   torch's count, the CUDA runtime's count")
    forms = []
    for form in visible_forms(gpus[0].uuid):
        env = dict(base_env) if form is None else {**base_env, "CUDA_VISIBLE_DEVICES": form}
        ours = [g.index for g in visible_gpus(env=env)]
        cuda = torch_reading(env)
        count, runtime = cuda.get("count", cuda.get("error")), cuda.get("runtime_count")
        agree = "" if not isinstance(count, int) else ("agree" if count == runtime == len(ours) else "DIFFER")
        forms.append({"form": form, "ours": ours, "cuda_count": count, "runtime_count": runtime,
                      "telemetry_watches": watched(env)})
        shown = "(unset)" if form is None else repr(form)
        print(f"{shown:<30}{str(ours):<22}{count}, {runtime}  {agree}; telemetry: {forms[-1]['telemetry_watches']}")
    report["visible_forms"] = forms

    print("\nA forked child using CUDA, after this in the parent:")
    report["fork"] = {}
    for before in ("detection", "is_available", "init"):
        outcome = fork_check_in_fresh_process(before)
        report["fork"][before] = outcome
        label = {"detection": "the tool's detection (NVML)", "is_available": "torch.cuda.is_available()",
                 "init": "torch.cuda.init()"}[before]
        print(f"  {label:<30} {outcome}")

    print("\nTelemetry (GpuTelemetry, 0.1 s interval):")
    report["telemetry_idle"] = telemetry_under(0, 0)
    report["telemetry_load"] = telemetry_under(4.0, 16.0)
    print(f"  idle 2 s:                          {report['telemetry_idle']}")
    print(f"  bf16 products 4 s, 16 GiB held:    {report['telemetry_load']}")

    memory = DeviceMemory.probe("cuda")
    smallest = min(gpus, key=lambda g: g.memory_total_bytes)
    serve = batch_defaults("serve", "cuda", smallest.memory_total_bytes, smallest.name)
    llm = batch_defaults("llm", "cuda", smallest.memory_total_bytes, smallest.name)
    knobs = sorted(cuda_knobs([g.compute_capability for g in gpus]))
    report["decisions"] = {"memory_probe": memory and memory.__dict__, "serve_batch_defaults": serve,
                           "llm_batch_defaults": llm, "cuda_knobs": knobs, "fingerprint_gpus": fingerprint_gpus()}
    print("\nDecisions from these readings:")
    if memory:
        print(f"  memory probe: total {memory.total_bytes / GIB:.2f} GiB, "
              f"available {memory.available_bytes / GIB:.2f} GiB")
    print(f"  vllm serve's defaults here: max_num_seqs {serve[0]}, max_num_batched_tokens {serve[1]}; "
          f"vllm.LLM's: {llm[0]}, {llm[1]}")
    print(f"  CUDA knobs the default space adds: {', '.join(knobs)}")
    print(f"  fingerprint: {report['decisions']['fingerprint_gpus']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
