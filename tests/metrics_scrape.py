"""Reading a ``/metrics`` answer in tests: every sample by name and labels."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: Every family a scrape shows (counters by their family name, without ``_total``).
PROCESS_FAMILIES = {
    "tally_flush_runs",
    "tally_flush_duration_seconds",
    "tally_flush_in_progress",
    "tally_flushed_batches",
    "tally_flushed_keys",
    "tally_flushed_deltas",
    "tally_recovered_batches",
    "tally_dropped_keys",
    "tally_fallback_writes",
    "tally_fallback_keys",
    "tally_late_pushes",
    "tally_drift_found",
    "tally_drift_repaired",
    "tally_outbox_pushed",
    "tally_outbox_repaired",
}
STATE_FAMILIES = {
    "tally_redis_up",
    "tally_backlog_keys",
    "tally_lag_seconds",
    "tally_inflight_keys",
    "tally_quarantined_deltas",
    "tally_repair_queue_keys",
    "tally_last_flush_timestamp_seconds",
    "tally_last_flush_failed_shards",
    "tally_database_up",
    "tally_epoch_losses",
    "tally_rebuild_needed",
    "tally_unsettled_fallbacks",
    "tally_outbox_oldest_age_seconds",
    "tally_outbox_rows",
}


@dataclass
class Scrape:
    text: str
    types: dict[str, str]
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        types, samples = {}, {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in samples, f"duplicate sample {key}"
                samples[key] = sample.value
        return cls(text, types, samples)

    def value(self, name: str, **labels: str) -> float:
        """The one sample ``name`` with exactly ``labels`` (``database`` defaults to "default")."""
        labels.setdefault("database", "default")
        return self.samples[(name, frozenset(labels.items()))]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, lbl), v in self.samples.items() if n == name and want <= lbl)

    def by_shard(self, name: str) -> dict[int, float]:
        return {
            int(dict(lbl)["shard"]): v
            for (n, lbl), v in self.samples.items()
            if n == name and dict(lbl).get("database") == "default"
        }
