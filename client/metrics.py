"""Reading a Triton server's Prometheus metrics endpoint: Triton's own metrics and the engine's kestrel_*.

    from client.metrics import metric_sum, scrape
    text = scrape("http://localhost:8002/metrics")
    metric_sum(text, "kestrel_engine_state", state="kv_pages_used")
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["scrape", "metric_sum"]


def scrape(url: str, timeout: float = 10, api_key: str | None = None) -> str:
    """The metrics page at url; api_key: the gateway's, where it has keys (its /metrics then needs one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        return response.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (as written, e.g. a histogram's name_sum) whose labels include
    `labels`; 0 if there is none."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # the parser names every counter sample name_total, also where the text has no suffix (Triton's)
            written = family.name if family.type == "counter" and sample.name == family.name + "_total" else None
            if name in (sample.name, written) and labels.items() <= sample.labels.items():
                total += sample.value
    return total
