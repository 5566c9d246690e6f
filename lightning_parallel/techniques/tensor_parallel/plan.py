"""Tensor parallelism inside pipeline stages: which linears of a block are split over the tp ranks.

Megatron's split of a transformer block, as torchtitan's ``parallelize`` writes it: the attention's
q, k, v projections and the MLP's first projection(s) column-wise (``ColwiseParallel``: each
tensor-parallel rank computes its share of the heads / hidden units), the output projections
row-wise (``RowwiseParallel``: partial sums, all-reduced into the block's replicated output). The
block's input and output stay whole on every tensor-parallel rank, so the pipeline stages send what
they sent before, and embeddings, norms and heads stay whole (replicated) too.

Each rank then runs ``heads / tp`` heads: the plan divides the attention module's head-count
attribute (``heads``, ``n_head``, ``num_heads``, ... as torchtitan sets ``attention.n_heads``), so an
attention whose forward reshapes with that count and ``-1`` (``view(b, t, self.heads, -1)`` ...
``reshape(b, t, -1)``) runs on its local heads unchanged.

A fused q/k/v projection (one ``qkv`` Linear whose output is ``[q; k; v]``) cannot be split as one
column-wise shard (rank 0's rows would hold all of q and part of k): the default plan refuses it; a
model with one gets split with separate q, k, v layers or with a ``tensor_parallel_plan`` of its own.

This module decides the plans; :mod:`lightning_parallel.techniques.tensor_parallel.apply` carries them out.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_parallel.pipeline.blocks import find_block_list

ATTENTION_INPUTS = (
    ("q", "k", "v"),
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("wq", "wk", "wv"),
)
ATTENTION_OUTPUTS = ("proj", "o_proj", "out_proj", "c_proj", "wo", "dense")
FUSED_QKV = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj")
MLP_INPUTS = ("fc", "c_fc", "fc1", "fc_1", "fc_2", "up_proj", "gate_proj", "w1", "w3")
MLP_OUTPUTS = ("proj", "c_proj", "fc2", "down_proj", "w2")
HEAD_COUNTS = ("heads", "n_head", "n_heads", "num_heads", "num_attention_heads")
KV_HEAD_COUNTS = ("kv_heads", "n_kv_heads", "num_key_value_heads", "n_query_groups")


@dataclass(frozen=True)
class TensorPlan:
    """How the layers of a split ``nn.Sequential`` are divided over ``tp_size`` tensor-parallel ranks.

    ``styles`` maps module paths (in the LightningModule, e.g. ``"layers.1.attn.q"``) to the
    ``ParallelStyle`` ``parallelize_module`` applies; ``head_counts`` maps attention modules to the
    local head counts set on them (``{"layers.1.attn": {"heads": 2}}``).

    Example::

        plan = default_plan(model.layers, "layers", tp_size=2)
        print(plan.format_table())
    """

    tp_size: int
    styles: Mapping[str, ParallelStyle]
    head_counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def format_table(self) -> str:
        """One line per module pattern: the block index written ``*``, the number of blocks after it.

        Example::

            print(plan.format_table())
            # tensor-parallel plan over 2 ranks:
            #   layers.*.attn.q: ColwiseParallel (2 blocks)
        """
        rows: dict[str, int] = {}
        for path, style in self.styles.items():
            key = f"{_pattern(path)}: {type(style).__name__}"
            rows[key] = rows.get(key, 0) + 1
        for path, attrs in self.head_counts.items():
            key = f"{_pattern(path)}: {attrs} per rank"
            rows[key] = rows.get(key, 0) + 1
        lines = [f"  {key}" + (f" ({n} blocks)" if n > 1 else "") for key, n in rows.items()]
        return f"tensor-parallel plan over {self.tp_size} ranks:\n" + "\n".join(lines)


def _pattern(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def default_plan(seq: nn.Sequential, seq_name: str, tp_size: int) -> TensorPlan:
    """Split the attention and MLP blocks of ``seq``'s layers; keep single layers (embedding, head) whole.

    Args:
        seq: the pipelined ``nn.Sequential`` (on any device, meta included).
        seq_name: its attribute name in the LightningModule (the paths' prefix).
        tp_size: the tensor-parallel ranks.

    Raises:
        ValueError: a fused q/k/v projection, head counts or widths that ``tp_size`` does not divide, a
            layer holding Linear layers of no known attention/MLP shape, or nothing to split at all; the
            message names the module and the fix (``tensor_parallel_plan=``).

    Example::

        plan = default_plan(model.layers, "layers", 2)
        plan.styles["layers.1.attn.q"]      # ColwiseParallel()
    """
    layers = [
        (f"{seq_name}.{name}", layer)
        for name, layer in seq.named_children()
        # an embedding, a norm or a single Linear (a head) stays whole on every rank
        if any(isinstance(m, nn.Linear) for m in layer.modules()) and not isinstance(layer, nn.Linear)
    ]
    return block_plan(layers, tp_size, f"`{seq_name}`")


def block_plan(
    blocks: Sequence[tuple[str, nn.Module]], tp_size: int, where: str, local_heads: bool = True
) -> TensorPlan:
    """The default plan of each block (attention and MLP split, see :func:`default_plan`).

    Args:
        blocks: ``(path in the LightningModule, block)`` of each block to split.
        where: how errors name the blocks' home (``"`layers`"``).
        local_heads: set each attention's head counts to those of one rank (a module that runs on
            local shards); off for a traced stage, whose DTensors keep the global shapes, where the
            head counts are only checked (divisible by ``tp_size``).

    Example::

        plan = block_plan([(f"h.{i}", b) for i, b in enumerate(gpt.h)], 2, "`h`", local_heads=False)
    """
    styles: dict[str, ParallelStyle] = {}
    heads: dict[str, dict[str, int]] = {}
    for prefix, layer in blocks:
        layer_styles: dict[str, ParallelStyle] = {}
        for path, module in layer.named_modules():
            full = f"{prefix}.{path}" if path else prefix
            found = _attention(module, full, tp_size, local_heads) or _mlp(module, full, tp_size)
            if found is not None:
                layer_styles.update({f"{full}.{c}": s for c, s in found[0].items()})
                if found[1] and local_heads:
                    heads[full] = found[1]
        _check_covered(layer, prefix, layer_styles, tp_size)
        styles.update(layer_styles)
    if not styles:
        raise ValueError(
            f"tensor_parallel_size={tp_size}, but the default tensor-parallel plan found no attention or "
            f"MLP block to split in {where}: pass tensor_parallel_plan={{module path: ParallelStyle}} "
            f"(as parallelize_module takes), or use tensor_parallel_size=1"
        )
    return TensorPlan(tp_size, styles, heads)


def hf_plan(module: nn.Module, tp_size: int) -> TensorPlan | None:
    """The plan a Hugging Face model inside ``module`` ships (``config.base_model_tp_plan``), or None.

    Its ``"colwise"`` / ``"rowwise"`` entries become ``ColwiseParallel()`` / ``RowwiseParallel()`` on
    the matching modules (patterns are relative to the base model, ``"layers.*.self_attn.q_proj"``).

    Raises:
        ValueError: a style other than those two, or head counts / widths that ``tp_size`` does not
            divide (the message names the config field).

    Example::

        hf_plan(lit_module, 2).styles["model.model.layers.0.self_attn.q_proj"]   # ColwiseParallel()
    """
    for path, sub in module.named_modules():
        config = getattr(sub, "config", None)
        base = getattr(sub, "base_model", None)
        entries = getattr(config, "base_model_tp_plan", None)
        if not entries or not isinstance(base, nn.Module):
            continue
        base_path = next(p for p, m in module.named_modules() if m is base)
        for field_name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(config, field_name, None)
            if isinstance(value, int) and value % tp_size:
                raise ValueError(
                    f"`{path or type(module).__name__}`'s config has {field_name}={value}, which "
                    f"tensor_parallel_size={tp_size} does not divide: use a tensor_parallel_size that "
                    f"divides it"
                )
        styles: dict[str, ParallelStyle] = {}
        for pattern, kind in entries.items():
            if kind not in _HF_STYLES:
                raise ValueError(
                    f"{type(sub).__name__}.config.base_model_tp_plan splits `{pattern}` as {kind!r}, which "
                    f"this strategy does not take (it takes {sorted(_HF_STYLES)}): pass "
                    f"tensor_parallel_plan={{module path: ParallelStyle}} for this model"
                )
            full = f"{base_path}.{pattern}" if base_path else pattern
            styles.update(dict.fromkeys(_matching(module, full), _HF_STYLES[kind]))
        return TensorPlan(tp_size, styles)
    return None


_HF_STYLES: dict[str, ParallelStyle] = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}


def traced_plan(
    module: nn.Module,
    tp_size: int,
    styles: Mapping[str, ParallelStyle] | None = None,
    local_heads: bool = False,
) -> TensorPlan:
    """The plan of a module the traced path splits: ``styles`` (the user's), else a Hugging Face model's
    own ``base_model_tp_plan`` (:func:`hf_plan`), else the default plan of its block list.

    Args:
        local_heads: divide the attention head counts (the planner's local model); a traced stage
            keeps them (its DTensors have the global shapes).

    Example::

        traced_plan(gpt, 2).styles["h.0.attn.q"]       # ColwiseParallel()
    """
    if styles is not None:
        return user_plan(module, "", tp_size, styles)
    found = hf_plan(module, tp_size)
    if found is not None:
        return found
    try:
        path, names = find_block_list(module)
    except ValueError:
        raise ValueError(
            f"tensor_parallel_size={tp_size}: {type(module).__name__} has no nn.ModuleList of blocks for "
            f"the default tensor-parallel plan to split: pass tensor_parallel_plan={{module path: "
            f"ColwiseParallel() | RowwiseParallel()}}"
        ) from None
    blocks = [(f"{path}.{n}", module.get_submodule(f"{path}.{n}")) for n in names]
    return block_plan(blocks, tp_size, f"`{path}`", local_heads=local_heads)


def user_plan(
    seq: nn.Sequential, seq_name: str, tp_size: int, plan: Mapping[str, ParallelStyle]
) -> TensorPlan:
    """The user's ``{module path pattern: ParallelStyle}`` resolved to the modules of ``seq``.

    Patterns are module paths in the LightningModule, ``*`` matching one path segment
    (``"layers.*.mlp.fc"``), as ``parallelize_module`` matches them. The user's modules run on what the
    styles hand them: head counts are theirs to adapt.

    Raises:
        TypeError: a key that is no string or a value that is no ``ParallelStyle``.
        ValueError: a pattern that matches no module of ``seq``.

    Example::

        styles = {"layers.*.fc": ColwiseParallel(), "layers.*.out": RowwiseParallel()}
        user_plan(model.layers, "layers", 2, styles)
    """
    paths = [f"{seq_name}.{p}" if seq_name else p for p, _ in seq.named_modules() if p]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tensor_parallel_plan maps module paths (str) to ParallelStyle instances "
                f"(ColwiseParallel(), "
                f"RowwiseParallel(), ...), got {pattern!r}: {style!r}"
            )
        matched = [p for p in paths if _matches(pattern, p)]
        if not matched:
            shown = ", ".join(paths[:8]) + (" ..." if len(paths) > 8 else "")
            home = seq_name or type(seq).__name__
            raise ValueError(
                f"tensor_parallel_plan pattern {pattern!r} matches no module of `{home}` (paths are "
                f"written from the LightningModule, e.g. {shown})"
            )
        styles.update(dict.fromkeys(matched, style))
    return TensorPlan(tp_size, styles)


def _attention(
    module: nn.Module, path: str, tp: int, local_heads: bool = True
) -> tuple[dict[str, ParallelStyle], dict[str, int]] | None:
    linears = {n for n, c in module.named_children() if isinstance(c, nn.Linear)}
    fused = linears.intersection(FUSED_QKV)
    if fused and not linears.intersection(MLP_INPUTS):
        raise ValueError(
            f"`{path}` ({type(module).__name__}) projects q, k and v with one fused Linear "
            f"`{sorted(fused)[0]}`: one column-wise split of it would give rank 0 all of q and part of k, "
            f"not its share of each. Use separate q, k, v Linear layers, or pass tensor_parallel_plan= "
            f"with styles for this model"
        )
    inputs = next((trio for trio in ATTENTION_INPUTS if linears.issuperset(trio)), None)
    if inputs is None:
        return None
    output = next((o for o in ATTENTION_OUTPUTS if o in linears), None)
    if output is None:
        raise ValueError(
            f"`{path}` ({type(module).__name__}) has q/k/v projections {inputs} but no output projection "
            f"named one of {ATTENTION_OUTPUTS}: pass tensor_parallel_plan= for this model"
        )
    counts = {
        a: getattr(module, a)
        for a in (*HEAD_COUNTS, *KV_HEAD_COUNTS)
        if isinstance(getattr(module, a, None), int)
    }
    if local_heads and not any(a in counts for a in HEAD_COUNTS):
        raise ValueError(
            f"`{path}` ({type(module).__name__}) holds no head count in an attribute named one of "
            f"{HEAD_COUNTS}: the default plan sets it to heads / tensor_parallel_size so each rank runs its "
            f"local heads. Name the attribute so, or pass tensor_parallel_plan= and adapt the heads yourself"
        )
    for attr, value in counts.items():
        if value % tp:
            raise ValueError(
                f"`{path}` ({type(module).__name__}) has {attr}={value}, which "
                f"tensor_parallel_size={tp} does "
                f"not divide: use a tensor_parallel_size that divides {value}"
            )
    styles = {n: ColwiseParallel() for n in inputs}
    styles[output] = RowwiseParallel()
    return styles, {a: v // tp for a, v in counts.items()}


def _mlp(module: nn.Module, path: str, tp: int) -> tuple[dict[str, ParallelStyle], dict[str, int]] | None:
    children = dict(module.named_children())
    linears = [n for n, c in children.items() if isinstance(c, nn.Linear)]
    inputs = [n for n in linears if n in MLP_INPUTS]
    output = next((n for n in linears if n in MLP_OUTPUTS), None)
    if isinstance(module, nn.Sequential) and len(linears) == 2 and not inputs:
        inputs, output = linears[:1], linears[1]  # Sequential(Linear, activation, Linear)
    if not inputs or output is None:
        return None
    for n in inputs:
        width = children[n].out_features
        if width % tp:
            raise ValueError(
                f"`{path}.{n}` has {width} output features, which tensor_parallel_size={tp} does not "
                f"divide: use a tensor_parallel_size that divides {width}"
            )
    return {**{n: ColwiseParallel() for n in inputs}, output: RowwiseParallel()}, {}


def _check_covered(layer: nn.Module, prefix: str, styles: Mapping[str, ParallelStyle], tp: int) -> None:
    missing = [
        f"{prefix}.{p}"
        for p, m in layer.named_modules()
        if isinstance(m, nn.Linear) and f"{prefix}.{p}" not in styles
    ]
    if missing:
        raise ValueError(
            f"tensor_parallel_size={tp}: the default tensor-parallel plan does not know how to split "
            f"`{prefix}` ({type(layer).__name__}): its Linear layers {missing} are in no attention "
            f"(q/k/v + output projection) or MLP (first + output projection) it knows. Pass "
            f"tensor_parallel_plan={{module path: ParallelStyle}} for this model"
        )


def _matching(module: nn.Module, pattern: str) -> list[str]:
    return [p for p, _ in module.named_modules() if p and _matches(pattern, p)]


def _matches(pattern: str, path: str) -> bool:
    atoms, parts = pattern.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))
