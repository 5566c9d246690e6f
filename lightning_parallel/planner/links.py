"""The time model's links, and what every step pays: communication curves, host copies, the step's overhead.

Measured on the job's own group (:func:`links_from`, from :mod:`~lightning_parallel.distributed.link_timing`),
each kind of message is a :class:`Curve`: seconds at the sizes timed, interpolated on a log-log scale
between them (flat below the smallest: the latency; at the last segment's rate above the largest), so a
small message and a large one each cost what they cost, not what one latency + bandwidth pair says. A
collective over another number of ranks than the curve's is rescaled as a ring moves its bytes (an
all-reduce over ``k`` ranks is ``2 (k - 1)`` steps of ``b / k`` bytes; a reduce-scatter, an all-gather or
an all-to-all ``k - 1``). Given links (:func:`given_links`) are one :class:`Link` for everything:
``latency + b / bandwidth`` per message (the alpha-beta model), collectives as rings of those.

Also here, measured on the job beside the links: the **overlap** of a collective with compute (the
slowdown when both run at once, for a technique that overlaps a reduction with the backward) and the
**overhead** every step pays whatever the plan (:class:`StepOverhead`: the strategy's and the
Trainer's per-step, per-batch and per-action work).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_parallel.distributed.link_timing import LinkTimings, Timed


@dataclass(frozen=True)
class Link:
    """``latency`` seconds per message and ``bandwidth`` bytes per second.

    Example::

        >>> Link(1e-5, 1e9).time(1_000_000)
        0.00101
    """

    latency: float
    bandwidth: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Curve:
    """Seconds per message of ``sizes[i]`` bytes, interpolated piecewise linearly on a log-log scale.

    Below the smallest size a message costs the smallest's time (the latency: a tiny message is no
    cheaper); above the largest, the last segment's seconds per byte carry on (the bandwidth). The
    seconds never fall as the size grows (a smaller message's median above a larger one's is taken at the
    larger one's: noise only adds time).
    ``spread``: the widest relative spread of the repeats behind the medians (what :meth:`describe`
    reports).

    Example::

        >>> c = Curve((1000, 100_000), (1e-4, 1e-3))
        >>> round(c.time(10_000), 7)          # halfway on the log scale: the geometric mean
        0.0003162
        >>> c.time(10), round(c.time(200_000), 7)
        (0.0001, 0.0019091)
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]
    spread: float = 0.0

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"a curve needs as many seconds as sizes, got {self.sizes} and {self.seconds}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] <= 0:
            raise ValueError(f"a curve's sizes must be positive and increasing, got {self.sizes}")
        # Noise only adds time (a peer's late wake-up): a smaller message that measured slower than a
        # larger one is taken at the larger one's time, not the other way round.
        rising = list(self.seconds)
        for i in range(len(rising) - 2, -1, -1):
            rising[i] = min(rising[i], rising[i + 1])
        object.__setattr__(self, "seconds", tuple(rising))

    @property
    def latency(self) -> float:
        """What the smallest message costs."""
        return self.seconds[0]

    def time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        sizes, seconds = self.sizes, self.seconds
        if nbytes <= sizes[0]:
            return seconds[0]
        if nbytes >= sizes[-1]:
            if len(sizes) == 1:
                return seconds[0] * nbytes / sizes[0]
            per_byte = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            if per_byte <= 0:  # a flat last segment: the largest message's own rate
                per_byte = seconds[-1] / sizes[-1]
            return seconds[-1] + (nbytes - sizes[-1]) * per_byte
        i = next(i for i in range(len(sizes) - 1) if nbytes <= sizes[i + 1])
        (b0, b1), (t0, t1) = (sizes[i], sizes[i + 1]), (seconds[i], seconds[i + 1])
        if t0 <= 0 or t1 <= 0:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        share = math.log(nbytes / b0) / math.log(b1 / b0)
        return math.exp(math.log(t0) + share * math.log(t1 / t0))

    def describe(self) -> str:
        points = ", ".join(f"{_size(b)} {t * 1e3:.2f} ms" for b, t in zip(self.sizes, self.seconds))
        return f"{points} (spread {self.spread:.0%})"


def curve_of(timed: Timed) -> Curve:
    """The curve of one kind of timed message (its medians; its spread).

    Example::

        curve_of(time_group().timed["all_reduce"]).time(3 << 20)
    """
    return Curve(tuple(float(s) for s in timed.sizes), tuple(timed.median), timed.spread)


@dataclass(frozen=True)
class StepOverhead:
    """Seconds every step pays whatever the plan computes, measured on the job (a trivial stage run by the
    strategy's own step: the schedule's set-up, the loss's and the logs' way back, the gradient sync's and
    the optimizer's bookkeeping).

    ``per_step``: once per optimizer step; ``per_batch``: each batch of the accumulation window (one run
    of the schedule, its log broadcast); ``per_action``: each forward or backward of a stage on a
    micro-batch (the pipeline runtime's bookkeeping around the unit's own compute). ``compute``: a
    stage's forward or backward as the strategy's step runs it, over the seconds its units' timed lines
    add up to (1: as timed). The last two are measured on the job's own model: its replicas' plan run by
    the strategy's step at two accumulation windows
    (:func:`~lightning_parallel.planner.calibration.as_run`), what that plan's steps take beyond the
    prediction per batch going to ``compute`` and the rest of its step to ``per_step``.
    ``pipelined_batch`` and ``pipelined_action``: what a plan of several pipeline ranks pays more, per
    batch and per forward or backward (the point-to-point sends and receives between the ranks, their
    waits, the runtime's work around them), measured on the job's own model as a pipeline of two ranks
    at two micro-batch counts (:func:`~lightning_parallel.planner.calibration.pipelined_as_run`).
    ``loop_step`` and ``loop_batch``: Lightning's loop around the strategy's step (its hooks, the
    closure, the logger connector, the data loader's next batch), per optimizer step and per batch,
    measured on a trivial module run by a one-device Trainer on each rank of the job.

    Example::

        >>> round(StepOverhead(1e-3, 2e-3, 1e-4).of(batches=2, actions=8), 6)
        0.0058
        >>> round(StepOverhead(1e-3, 2e-3, 1e-4, pipelined_action=1e-4).of(2, 8, pipelined=True), 6)
        0.0066
    """

    per_step: float = 0.0
    per_batch: float = 0.0
    per_action: float = 0.0
    compute: float = 1.0
    pipelined_batch: float = 0.0
    pipelined_action: float = 0.0
    loop_step: float = 0.0
    loop_batch: float = 0.0

    def step(self) -> float:
        """Seconds each optimizer step pays once."""
        return self.per_step + self.loop_step

    def batch(self, pipelined: bool = False) -> float:
        """Seconds each batch pays (``pipelined``: the plan has several pipeline ranks)."""
        return self.per_batch + self.loop_batch + (self.pipelined_batch if pipelined else 0.0)

    def action(self, pipelined: bool = False) -> float:
        """Seconds each forward or backward pays beside its compute."""
        return self.per_action + (self.pipelined_action if pipelined else 0.0)

    def of(self, batches: int, actions: int, pipelined: bool = False) -> float:
        """The overhead of one optimizer step of ``batches`` batches, ``actions`` actions on the rank."""
        return self.step() + batches * self.batch(pipelined) + actions * self.action(pipelined)

    def describe(self) -> str:
        scaled = f", the stages' compute as run {self.compute:.2f}x their units' timed sum"
        piped = (
            f"; on several pipeline ranks {self.pipelined_batch * 1e3:+.2f} ms per batch and "
            f"{self.pipelined_action * 1e3:+.3f} ms per forward or backward more"
        )
        loop = (
            f"; Lightning's loop {self.loop_step * 1e3:.2f} ms per step + {self.loop_batch * 1e3:.2f} ms per "
            "batch"
        )
        return (
            f"{self.per_step * 1e3:.2f} ms per step + {self.per_batch * 1e3:.2f} ms per batch + "
            f"{self.per_action * 1e3:.3f} ms per forward or backward{scaled if self.compute != 1.0 else ''}"
            f"{piped if self.pipelined_batch or self.pipelined_action else ''}"
            f"{loop if self.loop_step or self.loop_batch else ''}"
        )


RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1}
"""Ring steps of each collective per ``k - 1`` ranks (an all-reduce is a reduce-scatter + an all-gather);
each step moves ``b / k`` bytes, but a broadcast's the whole message."""


@dataclass(frozen=True)
class Links:
    """Point-to-point (stage boundaries), collectives (gradients, tensor parallelism) and host copies;
    the overlap of a collective with compute and the overhead every step pays.

    ``p2p`` and ``host`` are a :class:`Link` or a :class:`Curve`; ``collective`` is the alpha-beta link of
    one ring step, used for a kind of collective without a curve; ``curves``: measured collectives
    (:data:`RING_STEPS`' kinds) over ``ranks`` ranks; ``overlap``: the slowdown when a collective and
    compute run at once (1: perfect overlap, 2: none; see :meth:`overlapped`).

    Example::

        links = given_links(bandwidth=100e9, latency=10e-6, host_bandwidth=25e9)
        links.all_reduce(8, 2**30)     # seconds for a 1 GiB all-reduce over 8 ranks
    """

    p2p: Link | Curve
    collective: Link
    host: Link | Curve
    source: str = "given"
    curves: Mapping[str, Curve] = field(default_factory=dict)
    ranks: int = 0
    overlap: float = 1.0
    overhead: StepOverhead = field(default_factory=StepOverhead)
    disk: Link | None = None
    """One pass (a write or a read) over the disk tier's files (``offload_to="disk"``), measured once in
    ``offload_dir`` (``techniques/offload/disk_rate.py``) or given; None: not charged."""

    def send(self, nbytes: float) -> float:
        return self.p2p.time(nbytes)

    def all_reduce(self, ranks: int, nbytes: float) -> float:
        if "all_reduce" not in self.curves:
            return 2 * self.all_gather(ranks, nbytes)
        return self._collective("all_reduce", ranks, nbytes)

    def all_gather(self, ranks: int, nbytes: float) -> float:
        """An all-gather of ``nbytes`` in all over ``ranks``: ``k - 1`` ring steps of ``nbytes / k``."""
        return self._collective("all_gather", ranks, nbytes)

    def reduce_scatter(self, ranks: int, nbytes: float) -> float:
        """A reduce-scatter of ``nbytes`` in all over ``ranks`` (an all-gather's, without its curve)."""
        return self._collective("reduce_scatter" if "reduce_scatter" in self.curves else "all_gather", ranks,
                                nbytes)  # fmt: skip

    def all_to_all(self, ranks: int, nbytes: float) -> float:
        """An all-to-all of ``nbytes`` per rank over ``ranks`` (an all-gather's, without its curve)."""
        return self._collective("all_to_all" if "all_to_all" in self.curves else "all_gather", ranks, nbytes)

    def broadcast(self, ranks: int, nbytes: float) -> float:
        """A broadcast of ``nbytes`` from one rank to ``ranks`` (an all-gather's of ``k`` times the bytes,
        without its curve: ``k - 1`` steps of the whole message)."""
        if "broadcast" not in self.curves:
            return self._collective("all_gather", ranks, nbytes * ranks)
        return self._collective("broadcast", ranks, nbytes)

    def _collective(self, kind: str, ranks: int, nbytes: float) -> float:
        if ranks < 2 or nbytes <= 0:
            return 0.0
        curve = self.curves.get(kind)
        if curve is None:
            return RING_STEPS[kind] * (ranks - 1) * self.collective.time(nbytes / ranks)
        if ranks == self.ranks:
            return curve.time(nbytes)
        # Another group size: the curve's ring step at this chunk size, as many steps as this ring takes.
        whole = kind == "broadcast"
        step = curve.time(nbytes if whole else nbytes / ranks * self.ranks) / (self.ranks - 1)
        return (ranks - 1) * step

    def more_messages(self, ranks: int, messages: float, kind: str = "all_gather") -> float:
        """The latency of ``messages - 1`` more collectives over ``ranks`` than the one charged for the bytes.

        Example::

            links.all_gather(2, nbytes) + links.more_messages(2, units)   # one all-gather per FSDP2 unit
        """
        if ranks < 2 or messages <= 1:
            return 0.0
        curve = self.curves.get(kind)
        if curve is None:
            return (messages - 1) * (ranks - 1) * self.collective.latency
        return (messages - 1) * self._collective(kind, ranks, curve.sizes[0])

    def copy(self, nbytes: float) -> float:
        """A copy between the device and the host, one way."""
        return self.host.time(nbytes)

    def overlapped(self, compute: float, communication: float) -> float:
        """Seconds for ``compute`` and ``communication`` run at once: while both run, each goes at
        ``1 / overlap`` of its speed alone (``distributed/link_timing.py``'s ``OverlapTiming``).

        Example::

            exposed = links.overlapped(backward, reduce) - backward   # what the overlap leaves exposed
        """
        longer, shorter = max(compute, communication), min(compute, communication)
        return longer + (self.overlap - 1.0) * shorter

    def describe(self) -> str:
        def one(link: Link | Curve) -> str:
            if isinstance(link, Curve):
                return link.describe()
            return f"{link.latency * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s"

        disk = f", disk {one(self.disk)} each way" if self.disk is not None else ""
        if not self.curves:
            return (
                f"links {self.source}: send {one(self.p2p)}, collectives {one(self.collective)} per ring "
                f"step, host copies {one(self.host)}{disk}"
            )
        kinds = "; ".join(f"{k.replace('_', '-')} {one(c)}" for k, c in self.curves.items())
        return (
            f"links {self.source}: send {one(self.p2p)}; {kinds} (over {self.ranks} ranks); host copies "
            f"{one(self.host)}{disk}; a collective beside compute slows both {self.overlap:.2f}x; every step "
            f"pays {self.overhead.describe()}"
        )


def fit_link(sizes: tuple[int, ...], seconds: tuple[float, ...]) -> Link:
    """The line through two timings (a noisy pair that slopes down: the larger message's rate, no latency).

    Example::

        >>> fit_link((1000, 2000), (0.002, 0.003))
        Link(latency=0.001, bandwidth=1000000.0)
    """
    (small, large), (t_small, t_large) = (sizes[0], sizes[-1]), (seconds[0], seconds[-1])
    if t_large > t_small and large > small:
        per_byte = (t_large - t_small) / (large - small)
        return Link(max(0.0, t_small - per_byte * small), 1 / per_byte)
    return Link(0.0, large / max(t_large, 1e-9))


def links_from(
    timings: LinkTimings, source: str | None = None, overhead: StepOverhead | None = None
) -> Links:
    """Links interpolated from measured timings: a curve per kind of message (the collectives over the
    group's ranks), the host copies' curve, the overlap's slowdown; and the step's ``overhead``.

    Example::

        links = links_from(time_group(device=torch.device("cuda", 0)))
    """
    curves = {k: curve_of(t) for k, t in timings.timed.items() if k in RING_STEPS}
    reduce = timings.timed.get("all_reduce")
    ring = Link(0.0, 1e12)
    if reduce is not None:  # (what a kind without a curve falls back on: the all-reduce's ring step)
        steps = 2 * (timings.ranks - 1)
        sizes = tuple(max(1, s // timings.ranks) for s in reduce.sizes)
        ring = fit_link(sizes, tuple(t / steps for t in reduce.median))
    copy = timings.timed.get("copy")
    return Links(
        p2p=curve_of(timings.timed["send"]) if "send" in timings.timed else Link(0.0, 1e12),
        collective=ring,
        host=curve_of(copy) if copy is not None else Link(0.0, 1e12),
        source=source or timings.where,
        curves=curves,
        ranks=timings.ranks,
        overlap=timings.overlap.slowdown if timings.overlap is not None else 1.0,
        overhead=overhead or StepOverhead(),
    )


def given_links(
    bandwidth: float, latency: float = 0.0, host_bandwidth: float | None = None, source: str = "given"
) -> Links:
    """Links of one bandwidth (bytes/s) and latency (s) for sends and collectives alike.

    Example::

        given_links(bandwidth=50e9, latency=5e-6, host_bandwidth=20e9)
    """
    if bandwidth <= 0 or latency < 0 or (host_bandwidth is not None and host_bandwidth <= 0):
        raise ValueError(
            f"links need a positive bandwidth and a latency >= 0, got bandwidth={bandwidth}, "
            f"latency={latency}, host_bandwidth={host_bandwidth}"
        )
    link = Link(latency, bandwidth)
    return Links(link, link, Link(0.0, host_bandwidth or bandwidth), source)


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"
