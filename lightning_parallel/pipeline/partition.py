"""Split a sequence of layers into contiguous stages: uniform, balanced by a cost, or explicit."""

from __future__ import annotations

from collections.abc import Sequence


def partition_uniform(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible (earlier stages take the remainder).

    Example::

        >>> partition_uniform(10, 4)
        [3, 3, 2, 2]
    """
    check_stage_count(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def partition_balanced(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layer counts per stage that minimise the largest stage cost (contiguous stages).

    An exact dynamic program over split points, O(stages x layers^2): fine for the hundreds of
    layers a Sequential holds. Every stage gets at least one layer.

    Example::

        >>> partition_balanced([4, 1, 1, 1, 1], 2)
        [1, 4]
    """
    n = len(costs)
    check_stage_count(n, num_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: smallest max-stage-cost placing the first i layers on s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    counts, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def check_explicit(
    layers_per_stage: Sequence[int],
    num_layers: int,
    num_stages: int,
    unit: str = "layers",
    owner: str = "the Sequential",
) -> list[int]:
    """Validate an explicit list of layer (or block) counts per stage and return it as a list."""
    counts = list(layers_per_stage)
    if len(counts) != num_stages:
        raise ValueError(
            f"partition lists {len(counts)} stages ({counts}) but the pipeline has {num_stages}: "
            f"give one {unit[:-1]} count per stage"
        )
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"every stage needs at least one {unit[:-1]}, got partition={counts}")
    if sum(counts) != num_layers:
        raise ValueError(
            f"partition={counts} places {sum(counts)} {unit} but {owner} has {num_layers}: "
            f"the counts must add up to {num_layers}"
        )
    return counts


def check_stage_count(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages ({num_stages}) is larger than the number of layers in the pipelined "
            f"Sequential ({num_layers}): use at most {num_layers} stages, or split the model into "
            f"more layers"
        )


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Total cost of each stage for a given split."""
    out, start = [], 0
    for c in counts:
        out.append(float(sum(costs[start : start + c])))
        start += c
    return out
