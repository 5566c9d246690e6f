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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as h

SIZE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip

CHILD = r"""
import json, sys, torch
import hf_decoders  # puts .hf_packages on the path where make test installed transformers
import transformers as tf
from lightning_parallel import load_pretrained
from lightning_parallel.grads.tied import alias_table
from lightning_parallel.sources.materialize import materialize
from lightning_parallel.sources.traced.split import keep_only

directory, variant = sys.argv[1], sys.argv[2]
def peak():  # VmHWM: this process's resident high-water mark (ru_maxrss would keep the parent's over exec)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

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
# Touch every tensor: transformers may leave weights memory-mapped from the file, resident only once read.
checksum = sum(float(t.float().sum()) for t in model.state_dict().values())
held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps({"held_bytes": held, "peak_rss_above_imports_bytes": peak() - before}))
"""


def measure(directory: Path, variant: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(directory), variant], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SIZE)).save_pretrained(tmp)
        for variant, label in (("whole", "whole model"), ("0", "stage 0 of 2"), ("1", "stage 1 of 2")):
            got = measure(Path(tmp), variant)
            rows.append({"variant": label, "held_mib": got["held_bytes"] / 2**20,
                         "peak_rss_mib": got["peak_rss_above_imports_bytes"] / 2**20})  # fmt: skip
    whole = rows[0]["peak_rss_mib"]
    for row in rows:
        row["peak_ratio_to_whole"] = row["peak_rss_mib"] / whole
    h.write_csv(args.out_dir / "hf_pretrained_memory.csv", rows)
    fig, ax = h.figure()
    ax.bar([r["variant"] for r in rows], [r["peak_rss_mib"] for r in rows], label="peak RSS above imports")
    ax.bar([r["variant"] for r in rows], [r["held_mib"] for r in rows], width=0.4, label="tensors held")
    ax.set_ylabel("MiB")
    ax.set_title("loading a 124M-parameter Llama: whole vs one stage per rank")
    ax.legend()
    h.save_figure(fig, args.out_dir / "hf_pretrained_memory.png")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
