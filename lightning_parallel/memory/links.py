"""The time model's links: latency and bandwidth between ranks, and between a device and its host.

A message of ``b`` bytes costs ``latency + b / bandwidth`` (the alpha-beta model). Collectives over
``k`` ranks are charged as ring algorithms move their bytes: an all-reduce ``2 (k - 1)`` messages of
``b / k`` bytes in sequence; a reduce-scatter or an all-gather half of that; a point-to-point send
one message. The figures are measured on the job's own group (:func:`links_from`, from
:mod:`~lightning_parallel.distributed.link_timing`), or given (:func:`given_links`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.distributed.link_timing import LinkTimings


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
class Links:
    """Point-to-point (stage boundaries), collectives (gradients, tensor parallelism) and host copies.

    Example::

        links = given_links(bandwidth=100e9, latency=10e-6, host_bandwidth=25e9)
        links.all_reduce(8, 2**30)     # seconds for a 1 GiB all-reduce over 8 ranks
    """

    p2p: Link
    collective: Link
    host: Link
    source: str = "given"

    def send(self, nbytes: float) -> float:
        return self.p2p.time(nbytes)

    def all_reduce(self, ranks: int, nbytes: float) -> float:
        return 2 * self.all_gather(ranks, nbytes)

    def all_gather(self, ranks: int, nbytes: float) -> float:
        """An all-gather (or a reduce-scatter) of ``nbytes`` in all over ``ranks``: ``k - 1`` ring steps."""
        if ranks < 2 or nbytes <= 0:
            return 0.0
        return (ranks - 1) * self.collective.time(nbytes / ranks)

    def more_messages(self, ranks: int, messages: float) -> float:
        """The latency of ``messages - 1`` more collectives over ``ranks`` than the one charged for the bytes.

        Example::

            links.all_gather(2, nbytes) + links.more_messages(2, units)   # one all-gather per FSDP2 unit
        """
        return max(0.0, messages - 1) * (ranks - 1) * self.collective.latency if ranks > 1 else 0.0

    def copy(self, nbytes: float) -> float:
        """A copy between the device and the host, one way."""
        return self.host.time(nbytes)

    def describe(self) -> str:
        def one(link: Link) -> str:
            return f"{link.latency * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s"

        return (
            f"links {self.source}: send {one(self.p2p)}, collectives {one(self.collective)} per ring step, "
            f"host copies {one(self.host)}"
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
    timings: LinkTimings, copy_seconds: float, copy_bytes: int, source: str | None = None
) -> Links:
    """Links fitted to measured timings: sends as they are, all-reduces as ``2 (k - 1)`` ring steps.

    Example::

        links = links_from(time_group(), time_copy(1 << 24), 1 << 24)
    """
    steps = 2 * (timings.ranks - 1)
    per_step = tuple(s / steps for s in timings.all_reduce)
    step_sizes = tuple(max(1, b // timings.ranks) for b in timings.sizes)
    return Links(
        p2p=fit_link(timings.sizes, timings.send),
        collective=fit_link(step_sizes, per_step),
        host=Link(0.0, copy_bytes / max(copy_seconds, 1e-9)),
        source=source or timings.where,
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
