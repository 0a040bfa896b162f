"""Process memory facts for stage logs and tests: current and peak RSS, and which encoder models are alive here."""

from __future__ import annotations

import gc
import sys

from rayflux.families import ENCODER_CLASSES

# ENCODER_CLASSES: every family's VAE and text encoders, which must live only in the cache stage's actors (and,
# the validation render actor: rayflux.train.observe.renderer).


def rss_mb() -> float:
    """Resident set size of this process now, in MiB (psutil: Linux, macOS and Windows alike)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB.

    psutil reports a peak only on Windows (``peak_wset``); elsewhere ``getrusage`` has it, in KiB on Linux and in
    bytes on macOS.
    """
    import psutil

    info = psutil.Process().memory_info()
    if hasattr(info, "peak_wset"):
        return info.peak_wset / 2**20
    import resource

    unit = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20


def live_encoders() -> dict[str, int]:
    """Count live instances of encoder model classes in this process, without importing anything new."""
    wanted = []
    for module, names in ENCODER_CLASSES.items():
        mod = sys.modules.get(module)
        if mod is not None:
            wanted.extend(getattr(mod, n) for n in names if hasattr(mod, n))
    counts = {cls.__name__: 0 for cls in wanted}
    if not wanted:
        return counts
    gc.collect()
    for obj in gc.get_objects():
        # type() rather than isinstance(): some lazy proxies warn when their __class__ is read.
        kind = type(obj)
        for cls in wanted:
            if issubclass(kind, cls):
                counts[cls.__name__] += 1
    return counts


def snapshot(start_rss_mb: float) -> dict:
    """Memory fields for a metrics record."""
    now = rss_mb()
    return {
        "rss_mb": round(now, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "rss_growth_mb": round(now - start_rss_mb, 1),
        "encoders_alive": sum(live_encoders().values()),
    }
