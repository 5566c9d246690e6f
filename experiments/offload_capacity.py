"""The planner's answer: the largest Llama-shaped model that trains on a 24 GiB and an 80 GiB device per rank,
with and without offload, at a few pipeline shapes of one 8-device node.

No training: each model of a ladder of Llama shapes (Llama 2 and 3's widths, depths and heads, a
32000-token vocabulary; each but the largest also with half as many blocks again, for a finer ladder) is
built on the meta device and measured once by the memory planner on fake tensors (``measure_for``: its
units' activations, parameters, gradients and AdamW state in ``bf16-mixed``); every plan the search allows
at each pipeline size is then sized (``plan_search``), offload rows excluded or included (the optimizer
state and its step on the host, the activations of the micro-batches in flight on the host; FSDP2's
parameter offload is searched for a split ``nn.Sequential`` only, not for a traced model). A rung *trains*
at a device size when some plan of that pipeline size fits it with the planner's 10% margin: its fullest
rank's device peak at most 90% of the device, and the host bytes its node's 8 ranks keep at most 90% of
the node's host memory (``HOST_MEMORY``: 1 TiB, a common 8-GPU node).

The disk tier's question, on a node with less host memory (``LEAN_HOST``: 128 GiB, where the host no
longer holds the larger states): the largest model with every plan but the disk tier's, and with the
disk tier searched too (``offload_dir``: the optimizer state in files on the node's disk, ``DISK_MEMORY``,
within the same margin; each rank's buffer on the host; kept only where the host cannot hold the state).

The samples: 4096 tokens each, a global batch of 16 per optimizer step (accumulated where a replica's batch
is split further), so the micro-batch is 1 to 4 samples. What the planner's memory model is worth is checked
elsewhere (``memory_validation.py``: within 15% of MemTracker, offload rows included); on a GPU the device
column is the prediction to check (``gpu_check.py``).

Writes ``offload_capacity.csv`` (one row per model x pipeline size x column: the smallest device peak, the
host and disk bytes of its node, the plan) and ``offload_capacity.png`` (the largest model that trains).

Usage::

    python experiments/offload_capacity.py           # about 10 minutes on 2 cores
    python experiments/offload_capacity.py --quick   # two small rungs, eight stages
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import _harness as h
import _tables as t
import torch

from lightning_parallel.planner.estimate import format_bytes
from lightning_parallel.planner.ranking import Budget, Candidate, measure_for, plan_search
from lightning_parallel.planner.search import Search

DEVICES, GLOBAL_BATCH, SEQ_LEN, VOCAB = 8, 16, 4096, 32000
PIPELINE_SIZES = (1, 2, 4, 8)
DEVICE_MEMORY = {"24 GiB": 24 * 2**30, "80 GiB": 80 * 2**30}
HOST_MEMORY = 2**40  # one node's RAM, shared by its 8 ranks
LEAN_HOST = 128 * 2**30  # a node with less RAM: where the host no longer holds the larger states
DISK_MEMORY = 4 * 2**40  # the node's local NVMe for the disk tier's files
OFFLOAD_DIR = "/local_nvme/offload"  # (named in the plans only: the planner writes nothing there)
COLUMNS = {  # a column of the answer -> (its plans: OFFLOAD's keys; the node's host bytes)
    "without offload": ("no", HOST_MEMORY),
    "with offload": ("yes", HOST_MEMORY),
    "with offload, 128 GiB host": ("any", LEAN_HOST),
    "with the disk tier, 128 GiB host": ("disk", LEAN_HOST),
}
OFFLOAD = {  # which plans a column weighs
    "no": "no offload",
    "yes": "the plans that offload something to the host: what offload adds to the ladder",
    "any": "every plan, with or without offload to the host: the best the node's host allows",
    "disk": "every plan, the disk tier's among them (kept only where the host cannot hold the state)",
}


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder: width, blocks, heads, key-value heads, MLP width."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


PUBLISHED = (  # TinyLlama, OpenLLaMA 3B, Llama 2 7B/13B, Code Llama 34B, Llama 2 70B, Llama 3.1 405B's
    # shapes, with a 32000-token vocabulary throughout
    Shape("1.1B", 2048, 22, 32, 4, 5632),
    Shape("3B", 3200, 26, 32, 32, 8640),
    Shape("7B", 4096, 32, 32, 32, 11008),
    Shape("13B", 5120, 40, 40, 40, 13824),
    Shape("34B", 8192, 48, 64, 8, 22016),
    Shape("70B", 8192, 80, 64, 8, 28672),
    Shape("405B", 16384, 126, 128, 8, 53248),
)
LADDER = tuple(  # each published shape, and (below the largest) the same with half as many blocks again
    sorted(
        [
            *PUBLISHED,
            *(replace(s, name=f"{s.name} x1.5 depth", layers=s.layers * 3 // 2) for s in PUBLISHED[:-1]),
        ],
        key=lambda s: (s.hidden, s.layers),
    )
)


def build(shape: Shape) -> Any:
    """The model on the meta device, wrapped so its step is next-token cross-entropy on ``(ids, targets)``."""
    import hf_decoders  # noqa: F401  (puts the Hugging Face test packages on sys.path)
    import transformers as tf

    from lightning_parallel.planner.hf import CausalLMStep

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip
    with torch.device("meta"):
        return CausalLMStep(tf.LlamaForCausalLM(config))


def search(pipeline_size: int | None, offload: bool, disk: bool = False) -> Search:
    sizes = None if pipeline_size is None else (pipeline_size,)
    return Search(DEVICES, GLOBAL_BATCH, precision="bf16-mixed", pipeline_sizes=sizes, offload=offload,
                  ranks_per_node=DEVICES, offload_parameters=False,
                  offload_dir=OFFLOAD_DIR if disk else None)  # fmt: skip


def smallest(candidates: list[Candidate], budget: Budget) -> Candidate:
    """The plan the largest-model question needs: the smallest device peak among those that fit, else among
    those whose node's host bytes fit, else the smallest peak. (A disk-tier plan fits only where the host
    cannot hold its state: ``Budget.why_not``.)"""
    host = budget.usable_host
    host_ok = [c for c in candidates if host is None or c.host_per_node <= host] or candidates
    # (on a tie, no files: the disk tier where it lowers nothing is not the answer's plan)
    key = lambda c: (c.peak, c.disk_per_node > 0, c.host_per_node)  # noqa: E731
    return min([c for c in candidates if budget.fits(c)] or host_ok, key=key)


def offloaded(facts: Any, pipeline_size: int, offload: str) -> list[Candidate]:
    """The candidates a column weighs (:data:`OFFLOAD`)."""
    candidates = plan_search(facts, search(pipeline_size, offload != "no", disk=offload == "disk"))
    if offload == "yes":
        candidates = [c for c in candidates if c.plan.offload] or candidates
    return candidates


def rows_of(shape: Shape, pipeline_sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    model = build(shape)
    params = sum(p.numel() for p in model.parameters())
    everything = search(None, True)
    blocks = shape.layers
    samples = everything.micro_batch_sizes(blocks)[1]
    ids = torch.zeros(samples, SEQ_LEN, dtype=torch.long, device="meta")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t0 = time.perf_counter()
    facts = measure_for(model, (ids, ids), everything, optimizer)
    measured_s = time.perf_counter() - t0
    out = []
    for p in pipeline_sizes:
        searched = {o: offloaded(facts, p, o) for o in dict.fromkeys(o for o, _ in COLUMNS.values())}
        for column, (offload, host) in COLUMNS.items():
            candidates = searched[offload]
            row = {"model": shape.name, "parameters": params, "params_billion": f"{params / 1e9:.2f}",
                   "hidden": shape.hidden, "layers": shape.layers,
                   "pipeline_size": p, "data_parallel": DEVICES // p, "column": column,
                   "offload": offload, "host_budget_gib": host // 2**30, "plans": len(candidates),
                   "measure_s": round(measured_s, 1)}  # fmt: skip
            for label, device in DEVICE_MEMORY.items():
                budget = Budget(device, host, DEVICES, disk=DISK_MEMORY if offload == "disk" else None)
                best = smallest(candidates, budget)
                key = label.split()[0]
                row |= {f"fits_{key}": budget.fits(best), f"plan_{key}": best.plan.label(),
                        f"device_peak_{key}": best.peak, f"device_peak_gib_{key}": f"{best.peak / 2**30:.1f}",
                        f"host_gib_per_node_{key}": f"{best.host_per_node / 2**30:.0f}",
                        f"disk_gib_per_node_{key}": f"{best.disk_per_node / 2**30:.0f}"}  # fmt: skip
            out.append(row)
        print(f"  {shape.name}: pp {p} done", flush=True)
    return out


def mark_largest(rows: list[dict[str, Any]]) -> None:
    """Mark (``largest_24``, ``largest_80``) the largest rung that trains per pipeline size x column x
    device: the answer, decided here once; the plot, the printout and the results table read the marks."""
    for p, column in dict.fromkeys((r["pipeline_size"], r["column"]) for r in rows):
        mine = [r for r in rows if r["pipeline_size"] == p and r["column"] == column]
        for label in DEVICE_MEMORY:
            key = label.split()[0]
            fit = [r for r in mine if r[f"fits_{key}"]]
            top = max(fit, key=lambda r: r["parameters"]) if fit else None
            for r in mine:
                r[f"largest_{key}"] = r is top


def largest(rows: list[dict[str, Any]], pipeline_size: int, column: str, label: str) -> dict[str, Any] | None:
    """The marked row of ``pipeline_size`` x ``column`` at device ``label``, or None (nothing trains)."""
    key = label.split()[0]
    mine = (r for r in rows if r["pipeline_size"] == pipeline_size and r["column"] == column)
    return next((r for r in mine if r[f"largest_{key}"]), None)


def plot(path: Any, rows: list[dict[str, Any]]) -> None:
    fig, axes = h.figure(len(DEVICE_MEMORY), sharey=True, size=(13, 4.6))
    sizes = sorted({r["pipeline_size"] for r in rows})
    width = 0.8 / len(COLUMNS)
    for ax, label in zip(axes, DEVICE_MEMORY, strict=True):
        for i, column in enumerate(COLUMNS):
            tops = [largest(rows, p, column, label) for p in sizes]
            ys = [top["parameters"] / 1e9 if top else 0 for top in tops]
            xs = [j + (i - (len(COLUMNS) - 1) / 2) * width for j in range(len(sizes))]
            ax.bar(xs, ys, width=width * 0.95, label=column.replace("with offload", "offload to the host"))
        ax.set_xticks(range(len(sizes)), [f"pp {p} x dp {DEVICES // p}" for p in sizes])
        ax.set_yscale("log")
        ax.set_title(f"{label} per device, {DEVICES} devices (1 TiB host unless named)")
        ax.set_ylabel("largest Llama that trains (billion parameters)")
        ax.legend(fontsize=8)
    fig.suptitle(f"The planner: bf16-mixed AdamW, {SEQ_LEN} tokens x {GLOBAL_BATCH} per step, 10% margin")
    h.save_figure(fig, path)


# ------------------------------------------------------------------- its tables in docs/results.md


def offload_capacity(rows: t.Rows) -> str:
    def largest(p: str, column: str, key: str) -> str:
        mine = (r for r in rows if r["pipeline_size"] == p and r["column"] == column)
        top = next((r for r in mine if r[f"largest_{key}"] == "True"), None)  # marked by the script
        if top is None:
            return "none"
        host, disk = top[f"host_gib_per_node_{key}"], top[f"disk_gib_per_node_{key}"]
        on_host = f", host {host} GiB per node" if float(host) else ""
        on_host += f", disk {disk} GiB per node" if float(disk) else ""
        peak = top[f"device_peak_gib_{key}"]
        return f"{top['params_billion']} B, {top['model']} (`{top[f'plan_{key}']}`: {peak} GiB{on_host})"

    def table(columns: list[str]) -> str:
        body = []
        for p in dict.fromkeys(r["pipeline_size"] for r in rows):
            dp = next(r["data_parallel"] for r in rows if r["pipeline_size"] == p)
            body.append([f"pp {p} x dp {dp}"] + [largest(p, c, k) for k in ("24", "80") for c in columns])
        header = ["8 devices as"] + [f"{k} GiB, {c}" for k in ("24", "80") for c in columns]
        return t.table(header, body)

    ladder = ", ".join(dict.fromkeys(f"{r['model']} ({r['params_billion']} B)" for r in rows))
    lean = [c for c, (_, host) in COLUMNS.items() if host == LEAN_HOST]
    return (
        table([c for c in COLUMNS if c not in lean])
        + "\n\nThe largest model of the ladder that trains: some plan of that pipeline size fits the device "
        "with the planner's 10% margin (its fullest rank's predicted peak; the host bytes of the node's 8 "
        "ranks within 90% of 1 TiB), with its plan and its device peak. The planner only: each Llama shape "
        "built on the meta device and measured on fake tensors, bf16-mixed, AdamW, 4096 tokens x 16 per "
        f"optimizer step. Ladder: {ladder}. With offload: the rows that put the optimizer state and its "
        "step, or the activations in flight, on the host (the `+offload` rows of the search).\n\n"
        + table(lean)
        + f"\n\nThe same question on a node with {LEAN_HOST // 2**30} GiB of host memory: every plan, "
        "with or without offload to the host, and with the disk tier searched too (`offload_dir`: the "
        f"optimizer state in files on the node's disk, {DISK_MEMORY // 2**40} TiB, within the same margin; "
        "the host keeps each rank's 1 GiB "
        "buffer), which the planner keeps only where the host cannot hold the state."
    )


RESULTS = t.Results(
    "offload_capacity",
    t.Section(
        "Offload in the planner: the largest Llama that trains on a 24 GiB and an 80 GiB device",
        t.Table(
            offload_capacity,
            ("params_billion", "device_peak_gib_24", "device_peak_gib_80", "disk_gib_per_node_24"),
        ),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__, repeats=None).parse_args(argv)
    h.record_machine("offload_capacity", args.out_dir)
    h.quiet()
    ladder = LADDER[:2] if args.quick else LADDER  # (--quick: each rung is a planner search per size)
    sizes = PIPELINE_SIZES[-1:] if args.quick else PIPELINE_SIZES
    rows = []
    for shape in ladder:
        rows += rows_of(shape, sizes)
    mark_largest(rows)
    h.write_csv(args.out_dir / "offload_capacity.csv", rows)
    plot(args.out_dir / "offload_capacity.png", rows)
    for p in sizes:
        for label in DEVICE_MEMORY:
            for column in COLUMNS:
                top = largest(rows, p, column, label)
                what = (
                    f"{top['model']} ({top['parameters'] / 1e9:.1f} B) {top[f'plan_{label.split()[0]}']}"
                    if top
                    else "none"
                )
                print(f"pp {p} x dp {DEVICES // p}, {label}, {column}: {what}")
    print(f"host memory per node: {format_bytes(HOST_MEMORY)} (or {format_bytes(LEAN_HOST)} where named)")


if __name__ == "__main__":
    main()
