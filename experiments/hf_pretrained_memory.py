"""Peak host memory of loading pretrained weights: the whole model against one pipeline stage per rank.

A Hugging Face Llama (width 768, 12 blocks, vocabulary 32000: 124M parameters, 0.5 GB in fp32) is
saved with ``save_pretrained``; then each variant runs in a fresh process and reports its peak
resident memory (``ru_maxrss``) above the process's own after its imports:

* ``whole``: ``AutoModelForCausalLM.from_pretrained(dir)``, what a rank holding the whole model does;
* ``stage k of 2``: the model built on the meta device, kept to stage ``k`` of a 2-stage split at the
  blocks (``keep_only``, as PipelineStrategy does), then materialised, which reads that stage's tensors
  with ``load_pretrained`` (``lightning_parallel/pipeline/pretrained.py``).

Writes ``hf_pretrained_memory.csv`` and ``hf_pretrained_memory.png``. Byte counts, not timings: one run
each. Usage::

    python experiments/hf_pretrained_memory.py            # ~1-2 minutes on 2 cores
    python experiments/hf_pretrained_memory.py --quick    # a 2-block Llama of width 32, one process: it runs
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import _harness as h
import _tables as t

SIZE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
# --quick: the same code on a Llama of 2 blocks and width 32 (~20k parameters): checks that it runs.
QUICK_SIZE = SIZE | dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

CHILD = r"""
import json, sys, torch
import hf_decoders  # puts .hf_packages on the path where make test installed transformers
import transformers as tf
from lightning_parallel import load_pretrained
from lightning_parallel.sources.twin import alias_table
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.traced.split import keep_only

directory, variants = sys.argv[1], sys.argv[2:]
def peak():  # VmHWM: this process's resident high-water mark (ru_maxrss would keep the parent's over exec)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

for variant in variants:  # (one per process, but under --quick: there the peaks are not the point)
    before = peak()
    if variant == "whole":
        model = tf.AutoModelForCausalLM.from_pretrained(directory)
    else:
        stage = int(variant)
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(directory))
        aliases = alias_table(model)
        load_pretrained(model, directory)
        n = model.config.num_hidden_layers
        mine = range(n // 2) if stage == 0 else range(n // 2, n)
        blocks = tuple(f"model.layers.{i}." for i in mine)
        ends = ("model.embed_tokens.",) if stage == 0 else ("model.norm.", "lm_head.")
        keep = {k for k in model.state_dict() if k.startswith(blocks + ends)} | {"model.rotary_emb.inv_freq"}
        keep_only(model, keep)
        materialize(model, torch.device("cpu"), aliases)
    # Touch every tensor: transformers may leave weights memory-mapped from the file, resident once read.
    checksum = sum(float(t.float().sum()) for t in model.state_dict().values())
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"held_bytes": held, "peak_rss_above_imports_bytes": peak() - before}))
"""
VARIANTS = {"whole": "whole model", "0": "stage 0 of 2", "1": "stage 1 of 2"}


def measure(directory: Path, variants: list[str]) -> list[dict]:
    """Each variant's bytes held and peak, measured in one fresh process for ``variants``."""
    # The child imports this folder's hf_decoders and the package (from PYTHONPATH as the script has it).
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = h.run_child(
        [sys.executable, "-c", CHILD, str(directory), *variants], env={**os.environ, "PYTHONPATH": path}
    )
    return [json.loads(line) for line in out.strip().splitlines()[-len(variants) :]]


# ------------------------------------------------------------------- its tables in docs/results.md


def hf_pretrained_memory(rows: t.Rows) -> str:
    header = [
        "load",
        "tensors held (MiB)",
        "peak resident memory above imports (MiB)",
        "of the whole model's",
    ]
    table = [
        [
            r["variant"],
            t.fixed(r["held_mib"], 1),
            t.fixed(r["peak_rss_mib"], 1),
            t.fixed(r["peak_ratio_to_whole"], 2),
        ]
        for r in rows
    ]
    return t.table(header, table) + (
        "\n\nA 124M-parameter `transformers` Llama saved with `save_pretrained`: `from_pretrained` of the "
        "whole model, against a rank's stage built on the meta device and read with `load_pretrained` "
        "(its tensors plus the largest tensor being read). One run each, in fresh processes (bytes)."
    )


RESULTS = t.Results(
    "hf_pretrained_memory",
    t.Section(
        "Loading a Hugging Face model's pretrained weights: the whole model against one stage per rank",
        t.Table(hf_pretrained_memory, ("held_mib", "peak_rss_mib", "peak_ratio_to_whole")),
    ),
)
"""What docs/results.md shows of this experiment (experiments/run_all.py finds it here)."""


def main(argv: list[str] | None = None) -> None:
    p = h.parser(__doc__, repeats=None)
    args = p.parse_args(argv)
    h.quiet()
    h.record_machine("hf_pretrained_memory", args.out_dir)
    import hf_decoders  # noqa: F401  (transformers' place)
    import torch
    import transformers as tf

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        size = QUICK_SIZE if args.quick else SIZE
        model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**size))
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        model.save_pretrained(tmp)
        del model
        # A fresh process per variant: a peak is a process's. --quick runs them in one (the imports once).
        runs = [list(VARIANTS)] if args.quick else [[v] for v in VARIANTS]
        got = [g for variants in runs for g in measure(Path(tmp), variants)]
        for label, g in zip(VARIANTS.values(), got, strict=True):
            rows.append({"variant": label, "held_mib": g["held_bytes"] / 2**20,
                         "peak_rss_mib": g["peak_rss_above_imports_bytes"] / 2**20})  # fmt: skip
    whole = rows[0]["peak_rss_mib"]
    for row in rows:
        row["peak_ratio_to_whole"] = row["peak_rss_mib"] / whole if whole else float("nan")
    h.write_csv(args.out_dir / "hf_pretrained_memory.csv", rows)
    fig, ax = h.figure()
    ax.bar([r["variant"] for r in rows], [r["peak_rss_mib"] for r in rows], label="peak RSS above imports")
    ax.bar([r["variant"] for r in rows], [r["held_mib"] for r in rows], width=0.4, label="tensors held")
    ax.set_ylabel("MiB")
    ax.set_title(f"loading a {millions:.3g}M-parameter Llama: whole vs one stage per rank")
    ax.legend()
    h.save_figure(fig, args.out_dir / "hf_pretrained_memory.png")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
