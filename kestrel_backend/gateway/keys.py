"""API keys and what each key may use: requests at once and requests a second, so that one caller cannot take every
slot of the servers behind the gateway.

Keys come from KESTREL_GATEWAY_API_KEYS (comma-separated, no limits) and a keys file, one key a line with optional
limits after it (`#` starts a comment):

    team-a-key  concurrency=8 rate=20/s
    batch-key   concurrency=2 rate=300/m
    admin-key
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ApiError


@dataclass
class KeyLimits:
    concurrency: int | None = None  # requests in flight at once
    rate: float | None = None  # requests a second, refilling a bucket of `burst` (rate=N/m: N a minute, N at once)
    burst: float = 1.0
    owner: str = ""  # who the key's batch jobs belong to: a digest of the key (its jobs are only its own)
    in_flight: int = 0
    _tokens: float = field(default=0.0, repr=False)
    _last: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self):
        self._tokens = self.burst

    def admit(self) -> None:
        """Take a slot and a token, or raise 429 with the seconds until one frees up."""
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            raise ApiError(429, f"this API key has {self.concurrency} requests in flight, its limit; retry when one "
                                "ends", code="rate_limited", retry_after=1)
        if self.rate is not None:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                wait = math.ceil((1.0 - self._tokens) / self.rate)
                raise ApiError(429, f"this API key is limited to {self.rate:g} requests a second", code="rate_limited",
                               retry_after=wait)
            self._tokens -= 1.0
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


class ApiKeys:
    def __init__(self, limits: dict[str, KeyLimits] | None = None):
        self._limits = limits or {}

    def __bool__(self) -> bool:  # no key configured: the gateway is open
        return bool(self._limits)

    @classmethod
    def load(cls, env: dict, keys_file: str | None) -> "ApiKeys":
        limits = {k.strip(): KeyLimits() for k in env.get("KESTREL_GATEWAY_API_KEYS", "").split(",") if k.strip()}
        if keys_file:
            for number, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
                words = line.split("#")[0].split()
                if words:
                    limits[words[0]] = _limits(words[1:], f"{keys_file}:{number}")
        for key, key_limits in limits.items():
            key_limits.owner = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cls(limits)

    def check(self, headers) -> KeyLimits | None:
        """The caller's key's limits (None where the gateway is open), or 401. X-Moondream-Auth, else
        Authorization: Bearer; an empty header counts as none. Compared as bytes: a header of any characters is
        just a wrong key."""
        if not self._limits:
            return None
        given = headers.get("x-moondream-auth", "").strip()
        auth = headers.get("authorization", "")
        if not given and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        raw = given.encode("utf-8", "surrogateescape")
        found = None
        for key, limits in self._limits.items():  # every key compared: the time taken says nothing
            if hmac.compare_digest(raw, key.encode()):
                found = limits
        if not given or found is None:
            raise ApiError(401, "a valid API key is required (X-Moondream-Auth, or Authorization: Bearer)")
        return found


def _limits(words: list[str], where: str) -> KeyLimits:
    concurrency = rate = None
    burst = 1.0
    for word in words:
        name, _, value = word.partition("=")
        try:
            if name == "concurrency" and int(value) > 0:
                concurrency = int(value)
                continue
            if name == "rate":
                count, _, unit = value.partition("/")
                per = {"s": 1.0, "m": 60.0, "h": 3600.0}[unit or "s"]
                if float(count) >= 1:
                    rate, burst = float(count) / per, float(count)
                    continue
        except (ValueError, KeyError):
            pass
        raise ValueError(f"{where}: {word!r} is not a limit (concurrency=N, rate=N/s, N/m or N/h)")
    return KeyLimits(concurrency, rate, burst)
