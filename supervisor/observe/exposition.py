"""The Prometheus text exposition format (version 0.0.4), written by gpuvisor itself.

Not prometheus_client: its package root imports its push-gateway and WSGI code, and with them
`http.server`, `email`, `urllib.request` and `ssl`, which is OpenSSL, into the supervisor at the
first scrape, on every node the chart deploys with metrics on (docs/performance.md). What
gpuvisor exports is a few dozen counter, gauge and histogram families; this module holds them and
writes them as the format says (https://prometheus.io/docs/instrumenting/exposition_formats/),
line for line as prometheus_client's `generate_latest` writes the same families (the tests
compare the two), so a dashboard or alert sees no difference.

A family is built the way prometheus_client's metric families are (`add` per series), and a
collector is anything with `collect()` yielding families.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


class Family:
    """One metric family: its name (a counter's without `_total`), help text, kind and samples."""

    def __init__(self, name: str, documentation: str, kind: str, labelnames: Sequence[str] = ()) -> None:
        if kind not in KINDS:
            raise ValueError(f"metric kind {kind!r} is not one of {', '.join(KINDS)}")
        self.name = name.removesuffix("_total") if kind == "counter" else name
        self.documentation = documentation
        self.kind = kind
        self.labelnames = tuple(labelnames)
        self.samples: list[Sample] = []

    def _labels(self, values: Sequence[str]) -> dict[str, str]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(values)} label values for labels {self.labelnames}")
        return dict(zip(self.labelnames, values, strict=True))

    def add(self, values: Sequence[str], value: float, created: float | None = None) -> None:
        """One series of a counter (`<name>_total`, and `<name>_created` when `created` is given)
        or of a gauge (`<name>`)."""
        labels = self._labels(values)
        if self.kind == "counter":
            self.samples.append(Sample(self.name + "_total", labels, value))
            if created is not None:
                self.samples.append(Sample(self.name + "_created", labels, created))
        elif self.kind == "gauge":
            self.samples.append(Sample(self.name, labels, value))
        else:
            raise TypeError(f"{self.name} is a histogram: add_histogram")

    def add_histogram(
        self, values: Sequence[str], buckets: Sequence[tuple[str, float]], total: float
    ) -> None:
        """One series of a histogram: cumulative `buckets` as (upper bound as written, count), the
        last one `+Inf`, then `_count` (the `+Inf` count) and `_sum`."""
        if self.kind != "histogram":
            raise TypeError(f"{self.name} is a {self.kind}, not a histogram")
        if not buckets or buckets[-1][0] != "+Inf":
            raise ValueError(f"{self.name}: a histogram's last bucket is +Inf")
        labels = self._labels(values)
        for bound, count in buckets:
            self.samples.append(Sample(self.name + "_bucket", {**labels, "le": bound}, count))
        self.samples.append(Sample(self.name + "_count", labels, buckets[-1][1]))
        self.samples.append(Sample(self.name + "_sum", labels, total))


def go_float(value: float) -> str:
    """A sample value as Go's strconv writes it ('g', shortest), which Prometheus's own clients
    follow: +Inf, -Inf and NaN by name, and an exponent from 1e+07 on where Python waits to 1e+16."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(float(value))
    point = text.find(".")
    if value > 0 and point > 6:  # "12345678.0" -> "1.2345678e+07"
        digits = (text[:point] + text[point + 1 :]).rstrip("0")
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{mantissa}e+{point - 1:02d}"
    return text


def _escape(text: str, quotes: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quotes else text


def _line(sample: Sample) -> str:
    labels = ""
    if sample.labels:
        inner = ",".join(f'{k}="{_escape(v, True)}"' for k, v in sorted(sample.labels.items()))
        labels = "{" + inner + "}"
    return f"{sample.name}{labels} {go_float(sample.value)}\n"


def render(families: Iterable[Family]) -> bytes:
    """The text exposition of `families`, in their order. A counter's `_created` samples follow
    its series under a HELP and TYPE of their own (a gauge), as prometheus_client writes them."""
    out: list[str] = []
    for family in families:
        name = family.name + "_total" if family.kind == "counter" else family.name
        help_text = _escape(family.documentation, False)
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {family.kind}\n")
        created = [s for s in family.samples if s.name == family.name + "_created"]
        out.extend(_line(s) for s in family.samples if s.name != family.name + "_created")
        if created:
            out.append(f"# HELP {family.name}_created {help_text}\n# TYPE {family.name}_created gauge\n")
            out.extend(_line(s) for s in created)
    return "".join(out).encode("utf-8")


def sample_value(families: Iterable[Family], name: str, labels: Mapping[str, str]) -> float | None:
    """The value of the sample `name` with exactly `labels`; None when there is none."""
    for family in families:
        for sample in family.samples:
            if sample.name == name and dict(sample.labels) == dict(labels):
                return sample.value
    return None


@functools.cache
def _machine() -> tuple[float, int, float]:
    """Clock ticks a second, the page size and the boot time: read once, they do not change."""
    with open("/proc/stat", encoding="ascii") as fh:
        boot = next(float(line.split()[1]) for line in fh if line.startswith("btime "))
    return float(os.sysconf("SC_CLK_TCK")), os.sysconf("SC_PAGE_SIZE"), boot


def process_families(namespace: str, proc: str = "/proc/self") -> list[Family]:
    """This process's CPU, memory, start time and file descriptors as `<namespace>_process_*`,
    the families (names, help, kinds) Prometheus's clients export, read from `proc`. Empty when
    it cannot be read (no /proc): a scrape still answers."""
    try:
        with open(f"{proc}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
        ticks, page, boot = _machine()
        figures = {
            "virtual_memory_bytes": float(fields[20]),
            "resident_memory_bytes": float(int(fields[21]) * page),
            "start_time_seconds": boot + int(fields[19]) / ticks,
            "cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks,
        }
    except (OSError, ValueError, IndexError, StopIteration):
        return []
    prefix = f"{namespace}_process_"
    out = []
    for key, help_text in (
        ("virtual_memory_bytes", "Virtual memory size in bytes."),
        ("resident_memory_bytes", "Resident memory size in bytes."),
        ("start_time_seconds", "Start time of the process since unix epoch in seconds."),
    ):
        family = Family(prefix + key, help_text, "gauge")
        family.add([], figures[key])
        out.append(family)
    cpu = Family(prefix + "cpu_seconds", "Total user and system CPU time spent in seconds.", "counter")
    cpu.add([], figures["cpu_seconds"])
    out.append(cpu)
    try:
        fds = Family(prefix + "open_fds", "Number of open file descriptors.", "gauge")
        fds.add([], float(len(os.listdir(f"{proc}/fd"))))
        out.append(fds)
        with open(f"{proc}/limits", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Max open files"):
                    limit = Family(prefix + "max_fds", "Maximum number of open file descriptors.", "gauge")
                    limit.add([], float(line.split()[3]))
                    out.append(limit)
    except (OSError, ValueError, IndexError):
        pass  # the figures read so far are still worth a scrape
    return out
