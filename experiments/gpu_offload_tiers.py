"""Issue 54's two offload mechanics on a GPU (not part of ``make experiments``): FSDP2 shards with their
optimizer on the host (pinned, non-blocking copies), the disk tier (a pinned work area, files under
``--scratch``), and replicas, each against the run without offload; prints and writes a JSON summary.

    python3 experiments/gpu_offload_tiers.py                       # one GPU, a process group of one rank
    python3 experiments/gpu_offload_tiers.py --cpu                 # the same check, small, on the CPU

What it reports: per run the median optimizer step (ms, after the first), the device's peak bytes, the
growth of the process's resident memory, for the disk tier its buffer's measured peak, its files' bytes,
its chunks and the seconds the steps waited on the disk; then the largest parameter difference against
the run without offload (fp32: expect ~1e-6; bf16: against fp32 masters stepped on the device) and
whether the disk tier is bitwise the host tier; the scratch disk's write (with fsync) and read speed.

The mechanics are pure torch: the package is imported without its ``__init__`` (and so without
Lightning), so the check runs on whatever torch the GPU machine has.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_pkg = types.ModuleType("lightning_parallel")  # the mechanics are pure torch: skip the package's Lightning
_pkg.__path__ = [os.path.join(ROOT, "lightning_parallel")]
sys.modules["lightning_parallel"] = _pkg

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from lightning_parallel.distributed.dtensors import full_tensors  # noqa: E402
from lightning_parallel.techniques.offload.disk_optimizer import DiskTier, disk_step  # noqa: E402
from lightning_parallel.techniques.offload.host_optimizer import host_step  # noqa: E402
from lightning_parallel.techniques.offload.scratch import ScratchDir  # noqa: E402
from lightning_parallel.techniques.offload.shard_optimizer import MASTER, host_step_shards  # noqa: E402

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--cpu", action="store_true", help="run small, on the CPU (gloo, nothing pinned)")
ARGS.add_argument("--scratch", default=None, help="the directory the disk tier's files go under")
ARGS.add_argument("--out-dir", default=os.environ.get("OUT"), help="where summary.json goes")
ARGS = ARGS.parse_args()
CPU = ARGS.cpu
DEV = torch.device("cpu") if CPU else torch.device("cuda", 0)
PIN = not CPU
W, LAYERS, STEPS, ACC = (256, 2, 3, 2) if CPU else (2048, 4, 6, 2)
BUFFER = (64 << 10) if CPU else (64 << 20)
TMP = tempfile.mkdtemp(dir=ARGS.scratch)
out: dict = {"torch": torch.__version__, "device": str(torch.cuda.get_device_name(0)) if not CPU else "cpu"}


def sync():
    if not CPU:
        torch.cuda.synchronize()


def model(dtype, shard=True):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(W, W), nn.GELU()]
    m = nn.Sequential(*layers).to(DEV, dtype)
    if shard:
        mesh = init_device_mesh(DEV.type, (1,))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


def build(m, kind, masters=None):
    params = list(masters.values()) if masters is not None else m.parameters()
    o = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=(masters is not None and not CPU) or None)
    s = torch.optim.lr_scheduler.StepLR(o, 1, 0.9)
    if kind == "host_shards":
        o = host_step_shards(o, PIN, [s])
    elif kind == "host":
        o = host_step(o, None, False, PIN, [s])
    elif kind == "disk":
        o = disk_step(o, DiskTier(TMP, BUFFER, rank=0, pin_memory=PIN), schedulers=[s])
    return o, s


def train(m, o, s, masters=None):
    times = []
    dtype = next(m.parameters()).dtype
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        for _ in range(ACC):
            x, y = torch.randn(64, W, generator=g), torch.randn(64, W, generator=g)
            (nn.functional.mse_loss(m(x.to(DEV, dtype)).float(), y.to(DEV)) / ACC).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        sync()
        t = time.perf_counter()
        if masters is None:
            o.step()
        else:
            with torch.no_grad():
                for p, mm in masters.items():
                    mm.grad, p.grad = p.grad.float(), None
                o.step()
                for p, mm in masters.items():
                    p.copy_(mm.to(p.dtype))
        sync()
        times.append(time.perf_counter() - t)
        o.zero_grad()
        s.step()
    return times


def full(m):
    return {k: v.detach().float().cpu() for k, v in full_tensors(m.state_dict()).items()}


def diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run(name, dtype, kind, shard=True, reference=False):
    if not CPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    m = model(dtype, shard)
    masters = {p: nn.Parameter(p.detach().float()) for p in m.parameters()} if reference else None
    rss = psutil.Process().memory_info().rss
    o, s = build(m, kind, masters)
    times = train(m, o, s, masters)
    row = {
        "step_ms_median": round(1000 * sorted(times[1:])[len(times[1:]) // 2], 2),
        "device_peak_MiB": round(torch.cuda.max_memory_allocated() / 2**20, 1) if not CPU else None,
        "rss_growth_MiB": round((psutil.Process().memory_info().rss - rss) / 2**20, 1),
    }
    if kind == "disk":
        row.update(buffer_peak=o.buffers.peak, buffer=BUFFER, disk_bytes=o.disk_bytes())
        row.update(
            chunks=sum(len(f.layout.chunks) for f in o._disk), waiting_s=round(o.seconds["waiting"], 3)
        )
        row["step_s_total"] = round(o.seconds["step"], 3)
    if kind == "host_shards" and dtype != torch.float32:
        p = next(iter(o.state))
        row["master_in_state"] = MASTER in o.state[p] and o.state[p][MASTER].to_local().device.type == "cpu"
    params = full(m)
    if kind == "disk":
        o.close()
    out[name] = row
    print(name, row, flush=True)
    return params


def bandwidth():
    scratch = ScratchDir.acquire(TMP, rank=9)
    n = 256 << 20 if not CPU else 8 << 20
    buf = torch.ones(n, dtype=torch.uint8, pin_memory=PIN)
    f = scratch.new_file(n)
    t = time.perf_counter()
    f.write_from(0, buf)
    os.fsync(f.fd)
    w = time.perf_counter() - t
    t = time.perf_counter()
    f.read_into(0, buf)
    r = time.perf_counter() - t
    f.close()
    scratch.release()
    out["disk_write_GBps_fsync"] = round(n / w / 1e9, 2)
    out["disk_read_GBps_cached"] = round(n / r / 1e9, 2)
    print("bandwidth", out["disk_write_GBps_fsync"], out["disk_read_GBps_cached"], flush=True)


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo" if CPU else "cuda:nccl,cpu:gloo", rank=0, world_size=1)
    if not CPU:
        torch.cuda.set_device(DEV)
    plain = run("fsdp_fp32_plain", torch.float32, "plain")
    host = run("fsdp_fp32_host_shards", torch.float32, "host_shards")
    disk = run("fsdp_fp32_disk", torch.float32, "disk")
    out["fsdp_fp32_host_vs_plain_maxdiff"] = diff(host, plain)
    out["fsdp_fp32_disk_vs_host_bitwise"] = all(torch.equal(disk[k], host[k]) for k in host)
    ref = run("fsdp_bf16_reference_device_masters", torch.bfloat16, "plain", reference=True)
    host16 = run("fsdp_bf16_host_shards", torch.bfloat16, "host_shards")
    disk16 = run("fsdp_bf16_disk", torch.bfloat16, "disk")
    out["fsdp_bf16_host_vs_device_masters_maxdiff"] = diff(host16, ref)
    out["fsdp_bf16_disk_vs_host_bitwise"] = all(torch.equal(disk16[k], host16[k]) for k in host16)
    rplain = run("replicas_fp32_plain", torch.float32, "plain", shard=False)
    rhost = run("replicas_fp32_host", torch.float32, "host", shard=False)
    rdisk = run("replicas_fp32_disk", torch.float32, "disk", shard=False)
    out["replicas_host_vs_plain_maxdiff"] = diff(rhost, rplain)
    out["replicas_disk_vs_host_bitwise"] = all(torch.equal(rdisk[k], rhost[k]) for k in rhost)
    bandwidth()
    out["scratch_left"] = os.listdir(TMP)
    print(json.dumps(out, indent=1), flush=True)
    if ARGS.out_dir:
        with open(os.path.join(ARGS.out_dir, "summary.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
