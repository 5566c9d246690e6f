"""Distributed checkpoints under faults: what a background save costs the training loop, and SIGKILLs.

Both parts run PipelineStrategy's DCP directories (``save_distributed_checkpoint=True``) on 2 CPU ranks.

* **stall** (``dcp_async.csv``, ``dcp_async.png``): on ``--size-mb`` MB of state per rank, the time the
  caller is blocked by a synchronous directory save (``write_checkpoint_dir`` over ``dcp.save``: every
  rank writes, hashes, rank 0 publishes) against a background one (``save_checkpoint_dir_async``, what
  ``Rank0Checkpoint(async_save=True)`` runs: a copy into reused buffers, the rest on the checkpoint
  group's thread), and the time until the background one is published. Interleaved, ``--repeats`` each;
  the ratio is taken per repeat.
* **kill campaign** (``dcp_kill.csv``): a real 2-rank Trainer (pp 2) saving a directory every step with
  Rank0Checkpoint, synchronously or in the background, SIGKILLed (one rank, or both) at a random instant,
  ``--kills`` times per mode; after each kill: the directories listed, how many are complete and load,
  the temporary ones left (removed at the next start), and whether the newest complete one, resumed by
  a fresh run to the end, ends on the uninterrupted run's weights exactly.

    python experiments/bench_dcp_faults.py             # 3 kills per mode and victim (about 9 min on 2
                                                       # cores; what `make experiments` runs)
    python experiments/bench_dcp_faults.py --kills 10  # docs/results.md's campaign: 84 short Trainer runs,
                                                       # 27 min on this project's shared 2 cores
    python experiments/bench_dcp_faults.py --quick    # small state, one kill
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import _tables as t
import lightning as L
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import PipelineStrategy, Rank0Checkpoint
from lightning_parallel.checkpoint import directory
from lightning_parallel.checkpoint.directory_async import background_writer, save_checkpoint_dir_async
from lightning_parallel.checkpoint.distributed import read_all
from lightning_parallel.data.resumable_sampler import ResumableDistributedSampler
from lightning_parallel.io.async_writer import SnapshotBuffers

SYNC, ASYNC = "synchronous DCP save", "background DCP save (async_save=True)"
STEPS = 12


# --------------------------------------------------------------------------------------- the stall
def _state(size_mb: int, rank: int) -> dict[str, Any]:
    n = size_mb * 2**20 // 4 // 8
    return {"state_dict": {f"rank{rank}.w{i}": torch.randn(n) for i in range(8)}}


def stall_worker(rank: int, world: int, args: dict) -> list[dict]:
    state, root = _state(args["size_mb"], rank), args["root"]
    writer, buffers, count = background_writer(), SnapshotBuffers(), [0]

    def save(background: bool) -> dict[str, float]:
        count[0] += 1
        path = os.path.join(root, f"save{count[0]}.ckpt")
        tag = {"step": count[0]}
        h.barrier()
        start = time.perf_counter()
        if background:
            save_checkpoint_dir_async(path, state, {"n": count[0]}, tag, writer, buffers)
        else:
            directory.write_checkpoint_dir(path, lambda d: dcp.save(state, checkpoint_id=d), {"n": 0}, tag)
        stall = time.perf_counter() - start
        error = writer.wait()
        if error is not None:
            raise error
        total = time.perf_counter() - start
        h.barrier()
        if rank == 0:
            directory.remove_dir(path)
        return {"stall_s": stall, "total_s": total}

    variants = {SYNC: lambda: save(False), ASYNC: lambda: save(True)}
    return h.interleave(variants, repeats=args["repeats"], warmup=True)


def measure_stall(args: Any) -> list[dict]:
    root = tempfile.mkdtemp(prefix="lp-dcp-stall-")
    try:
        samples = h.spawn(stall_worker, 2, {"size_mb": args.size_mb, "root": root, "repeats": args.repeats})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worst = [max(a, b, key=lambda s: s["stall_s"]) for a, b in zip(*samples)]  # the slower rank's
    rows = []
    for row in h.compare(worst, "stall_s", baseline=SYNC, ratio="stall_vs_sync"):
        done = h.spread(s["total_s"] for s in worst if s["variant"] == row["variant"])
        rows.append({"method": row["variant"], "size_mb": args.size_mb, **row, **done.cells("total_s")})
    return rows


# -------------------------------------------------------------------------------- the kill campaign
class MLP(L.LightningModule):
    def __init__(self, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(16, width)]
        for _ in range(depth):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        self.layers = nn.Sequential(*layers, nn.Linear(width, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 8, 16, generator=g)
    data = TensorDataset(x, x[:, :4].sin())
    # One pipeline replica; the sampler resumes mid-epoch exactly (Rank0Checkpoint keeps its position).
    return DataLoader(data, batch_size=8, sampler=ResumableDistributedSampler(data, num_replicas=1, rank=0))


class Final(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.path)


def train_rank(rank: int, port: int, out: str, background: bool, resume: bool, killed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE="2")
    h.quiet()
    if killed:  # the survivor's error on its dead peer is expected: keep it off the terminal
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    torch.manual_seed(0)
    ckpt = Rank0Checkpoint(
        dirpath=f"{out}/ckpt", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
        async_save=background,
    )  # fmt: skip
    strategy = PipelineStrategy(pipeline_size=2, num_microbatches=2, save_distributed_checkpoint=True)
    trainer = h.quiet_trainer(
        devices=2, strategy=strategy, callbacks=[ckpt, Final(f"{out}/final-rank{rank}.pt")], max_steps=STEPS,
        enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(MLP(), _data(), ckpt_path="last" if resume else None)


def _run(out: Path, background: bool, resume: bool, kill_after: float | None, victims: list[int]) -> None:
    context = mp.get_context("forkserver")
    port = h.free_port()
    killed = kill_after is not None
    args = (port, str(out), background, resume, killed)
    ranks = [context.Process(target=train_rank, args=(r, *args)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        if kill_after is not None:
            deadline = time.monotonic() + 120
            while not directory.list_tagged_dirs(str(out / "ckpt")) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(kill_after)
            for r in victims:
                os.kill(ranks[r].pid, signal.SIGKILL)
        for p in ranks:
            p.join(120 if kill_after is None else 5)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()


def _final(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for r in (0, 1) for k, v in torch.load(out / f"final-rank{r}.pt").items()}


def kill_campaign(args: Any, background: bool, victims_name: str, rng: random.Random) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="lp-dcp-kill-"))
    try:
        _run(root / "whole", background, resume=False, kill_after=None, victims=[])
        reference = _final(root / "whole")
        counts = dict(listed=0, complete=0, loadable=0, partial_left=0, removed_at_start=0, exact=0)
        for kill in range(args.kills):
            out = root / f"kill{kill}"
            (out / "ckpt").mkdir(parents=True)
            victims = [0, 1] if victims_name == "both" else [rng.choice([0, 1])]
            _run(out, background, resume=False, kill_after=rng.uniform(0.0, 1.0), victims=victims)
            partial = [n for n in os.listdir(out / "ckpt") if n.endswith(".partial")]
            listed = directory.list_tagged_dirs(str(out / "ckpt"))
            complete = [p for p, _ in listed if directory.verify_checkpoint_dir(p).ok]
            loadable = sum(1 for p in complete if read_all(p))
            counts["listed"] += len(listed)
            counts["complete"] += len(complete)
            counts["loadable"] += loadable
            counts["partial_left"] += len(partial)
            if listed:  # the next start: removes the leftovers, resumes the newest, runs to the end
                _run(out, background, resume=True, kill_after=None, victims=[])
                left = [n for n in os.listdir(out / "ckpt") if n.endswith(".partial")]
                counts["removed_at_start"] += len(partial) - len(left)
                final = _final(out)
                counts["exact"] += all(torch.equal(final[k], reference[k]) for k in reference)
        return {"mode": "background" if background else "synchronous", "killed": victims_name,
                "kills": args.kills, **counts}  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plot_stall(rows: list[dict], size_mb: int, path: Path) -> None:
    fig, ax = h.figure()
    names = ["synchronous", "background"]
    h.errorbars(ax, names, rows, "stall_s", label="training stall", marker="o", linestyle="none")
    h.errorbars(ax, names, rows, "total_s", label="save published", marker="s", linestyle="none")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"DCP directory save of {size_mb} MB per rank, 2 ranks")
    ax.legend()
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def dcp_async(rows: t.Rows) -> str:
    body = []
    for r in rows:
        sync = r["stall_vs_sync"] == r["stall_vs_sync_min"] == r["stall_vs_sync_max"] == "1.0"
        verdict = t.ratio_verdict(r, "stall_vs_sync", higher_is_better=False, words=("shorter", "longer"))
        ratio = "-" if sync else t.timed_col(r, "stall_vs_sync", 3, verdict)
        body.append([r["method"], r["size_mb"], r["repeats"], t.timed_col(r, "stall_s", 3)])
        body[-1] += [t.timed_col(r, "total_s", 3), ratio]
    header = ["save", "MB per rank", "repeats", "training stall s", "published after s"]
    return t.table([*header, "stall vs synchronous"], body) + (
        "\n\nEvery rank writes its own shards; the slower rank's times, interleaved saves, the ratio taken "
        "within each repeat. The background save's stall is the copy into its reused buffers and the "
        "start of the write on the checkpoint group; the rest overlaps training."
    )


def dcp_kill(rows: t.Rows) -> str:
    header = ["saves", "SIGKILL of", "kills", "directories listed", "complete", "load", "temporary left"]
    header += ["removed at the next start", "resumed runs ending on the uninterrupted weights"]
    keys = ("kills", "listed", "complete", "loadable", "partial_left", "removed_at_start", "exact")
    victims = {"one": "one rank", "both": "both ranks"}
    body = [[r["mode"], victims.get(r["killed"], r["killed"]), *(r[k] for k in keys)] for r in rows]
    return t.table(header, body) + (
        "\n\nA Trainer (pipeline of two ranks, a directory every step, Rank0Checkpoint keeping the newest "
        'two) killed at a random instant; after each kill the next run starts with `ckpt_path="last"` '
        "and trains to the end. Counted after every kill, before that start: only complete directories "
        "are ever listed (the temporary ones are hidden `.partial` siblings), and each loads; resumed, "
        "the run ends on the uninterrupted run's weights bit for bit."
    )


RESULTS = t.Results(
    "dcp_faults",
    t.Section(
        "Distributed checkpoints under faults: a background save's stall, and SIGKILL during saves",
        t.Table(dcp_async, ("stall_s", "total_s", "stall_vs_sync")),
        t.Table(
            dcp_kill, ("kills", "listed", "complete", "loadable", "partial_left", "removed_at_start", "exact")
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__)
    p.add_argument("--size-mb", type=int, default=128, help="state per rank for the stall (default 128)")
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per mode and victim (default 3)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.kills, args.repeats = 4, 1, 1
    h.quiet()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    h.record_machine("dcp_faults", args.out_dir)
    rows = measure_stall(args)
    h.write_csv(args.out_dir / "dcp_async.csv", rows)
    plot_stall(rows, args.size_mb, args.out_dir / "dcp_async.png")
    rng = random.Random(36)
    campaigns = [(bg, who) for bg in (False, True) for who in ("one", "both")]
    if args.quick:  # one kill of one rank during background saves (the stall measures both modes)
        campaigns = [(True, "one")]
    kills = [kill_campaign(args, bg, who, rng) for bg, who in campaigns]
    h.write_csv(args.out_dir / "dcp_kill.csv", kills)
    for row in rows + kills:
        print(row)


if __name__ == "__main__":
    main()
