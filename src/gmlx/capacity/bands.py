"""Governor bands: how close the process is to its memory budget, as green < yellow < orange < red.

Pure arithmetic on the fraction of the budget in use; the sampler that measures it lives in
`gmlx.server.memory_governor`. A band rises as soon as the fraction reaches its threshold (straight to
the highest band reached), and falls only once the fraction is below that threshold minus the
hysteresis, one band per sample, so a fraction wobbling around a threshold does not flap and a
sudden release reopens admission gradually (red -> orange -> yellow -> green).
Under yellow, orange and red the sampler frees memory; `bytes_to_release` says how much.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BANDS = ("green", "yellow", "orange", "red")


@dataclass(frozen=True)
class Thresholds:
    yellow: float = 0.80
    orange: float = 0.90
    red: float = 0.97
    hysteresis: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.yellow < self.orange < self.red <= 1:
            raise ValueError(
                f"governor thresholds must rise within (0, 1]: yellow {self.yellow:g}, "
                f"orange {self.orange:g}, red {self.red:g}"
            )
        if not 0 <= self.hysteresis < self.yellow:
            raise ValueError(f"governor hysteresis {self.hysteresis:g} must be at least 0 and below yellow")

    def entry(self, band: str) -> float:
        """The fraction at which `band` starts (0 for green)."""
        return 0.0 if band == "green" else getattr(self, band)

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def band_for(fraction: float, t: Thresholds) -> str:
    """The band a fraction falls in, ignoring history."""
    return next(b for b in reversed(BANDS) if fraction >= t.entry(b))


def next_band(current: str | None, fraction: float, t: Thresholds) -> str:
    """The band after one sample of `fraction`, from `current` (None: no sample yet)."""
    reached = band_for(fraction, t)
    if current is None or BANDS.index(reached) > BANDS.index(current):
        return reached
    if current != "green" and fraction < t.entry(current) - t.hysteresis:
        return BANDS[BANDS.index(current) - 1]
    return current


def bytes_to_release(used: int, limit: int, t: Thresholds, band: str = "orange") -> int:
    """What to free, of `used` bytes against `limit`, for `band` to fall to the one below: the bytes
    above its threshold less the hysteresis. Anything short of that leaves the band where it is."""
    return max(0, used - int((t.entry(band) - t.hysteresis) * limit))
