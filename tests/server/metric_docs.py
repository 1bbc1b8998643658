"""The metrics table of docs/serving/endpoints.md, and the families a live /metrics exposes."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving" / "endpoints.md"
#: Families only a server with a shared tier (--remote-cache) exposes.
SHARED_TIER_PREFIX = "skippy_remote_"


def documented_metrics() -> dict[str, str]:
    """Family name -> type, from the rows of the page's metrics table."""
    row = re.compile(r"^\| `(skippy_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.MULTILINE)
    rows = row.findall(PAGE.read_text())
    return dict(rows)


def exposed_metrics(text: str) -> dict[str, str]:
    """Family name -> type, as prometheus_client parses a /metrics page (counters without `_total`).

    prometheus_client's own counters and histograms also export `NAME_created` (their start
    time), which the text parser reads as a family of its own: it is part of NAME, not a metric.
    """
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    return {name: kind for name, kind in families.items()
            if not (name.endswith("_created") and name.removesuffix("_created") in families)}


def undocumented(text: str) -> list[str]:
    """Families /metrics exposes that the page leaves out or gives another type."""
    documented = documented_metrics()
    return sorted(f"{name} ({kind}; documented: {documented.get(name)})"
                  for name, kind in exposed_metrics(text).items() if documented.get(name) != kind)
