"""What benchmarks/goodput.py reads from the servers after a run: the proxy's per-request
decisions and the adaptive scheduler's figures (its own metrics endpoint)."""

from __future__ import annotations

from typing import Any


def proxy_decisions(metrics_text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "splitserve_proxy_decisions_total":
                out[f"{s.labels['route']}/{s.labels['reason']}"] = s.value
    return out


def scheduler_figures(url: str) -> dict[str, Any]:
    """What the adaptive scheduler on that server saw so far (cumulative over the group's
    runs): steps, decisions by reason, and the share of steps whose relative prediction error
    stayed under 10%, 20% and 50% (its histogram's buckets)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": repr(e)}
    out: dict[str, Any] = {"decisions": {}, "error_le": {}}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "splitserve_scheduler_budget_decisions_total":
                out["decisions"][smp.labels["reason"]] = smp.value
            elif smp.name == "splitserve_scheduler_prediction_abs_error_ratio_bucket":
                out["error_le"][smp.labels["le"]] = smp.value
            elif smp.name == "splitserve_scheduler_prediction_abs_error_ratio_count":
                out["steps"] = smp.value
    steps = out.get("steps") or 0
    if steps:
        out["share_under"] = {
            le: v / steps for le, v in out["error_le"].items() if le in ("0.1", "0.2", "0.5")
        }
    return out
