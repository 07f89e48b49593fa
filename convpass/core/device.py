"""Device fingerprints: which GPU and cuDNN a measurement belongs to.

A measurement is only valid on the GPU model and cuDNN version it was taken with. The fingerprint
is part of every tuning-cache key and is recorded in every tuned model, so the executor can tell
when it runs somewhere else. The local device's fingerprint is asked of the driver by
:func:`convpass.native.device.detect`.
"""

from __future__ import annotations

import dataclasses
import re

from convpass.core.text import printable


@dataclasses.dataclass(frozen=True)
class DeviceFingerprint:
    """GPU name, compute capability, SM count and cuDNN version (e.g. 91900 for 9.19.0)."""

    name: str
    compute_capability: str
    sm_count: int
    cudnn_version: int

    def __str__(self) -> str:
        return f"{self.name}|sm_{self.compute_capability}|{self.sm_count}sm|cudnn{self.cudnn_version}"

    @property
    def cudnn_version_str(self) -> str:
        return cudnn_version_string(self.cudnn_version)

    @classmethod
    def parse(cls, text: str) -> DeviceFingerprint:
        m = re.fullmatch(r"(?P<name>.+)\|sm_(?P<cc>\d+\.\d+)\|(?P<sms>\d+)sm\|cudnn(?P<ver>\d+)", text.strip())
        if not m or len(text) > 512 or printable(m["name"]) != m["name"] or len(m["sms"]) > 9 or len(m["ver"]) > 9:
            # (a name with control characters would reach terminals raw; counts past 10^9 are no GPU's)
            raise ValueError(f"not a convpass device fingerprint: {text[:200]!r}")
        return cls(m["name"], m["cc"], int(m["sms"]), int(m["ver"]))

    def matches_name(self, name: str) -> bool:
        """Whether a user's ``--device-name`` (e.g. ``H200`` or ``NVIDIA H100 80GB HBM3``) names it."""
        wanted = name.strip().lower()
        return wanted == str(self).lower() or wanted in self.name.lower()


def cudnn_version_string(version: int) -> str:
    """cuDNN 9 encodes versions as major*10000 + minor*100 + patch (91900 -> '9.19.0')."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
