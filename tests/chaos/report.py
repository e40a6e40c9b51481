"""Figures of a chaos trial and of a whole run, and their one-line reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def kills(chaos: Counter[str]) -> str:
    """Kills by process and by the phase of the flush they hit."""
    phases = ("in_flush", "in_tx", "at_commit", "elsewhere")
    return f"command={chaos['kill_command']} celery={chaos['kill_celery']}; " + " ".join(
        f"{p}={chaos[f'kill_{p}']}" for p in phases
    )


@dataclass
class Trial:
    number: int
    restart_redis: bool
    seconds: float = 0.0
    ops: Counter[str] = field(default_factory=Counter)
    writer_errors: Counter[str] = field(default_factory=Counter)
    chaos: Counter[str] = field(default_factory=Counter)
    flushes: Counter[str] = field(default_factory=Counter)
    ledger: dict[str, int] = field(default_factory=dict)  # the whole ledger after the trial
    batches: int = 0  # ledger rows written during this trial
    fallback: int = 0  # of which direct DB writes while Redis was down
    by_flusher: Counter[str] = field(default_factory=Counter)  # of which by each flusher
    #: What the trial wrote, e.g. {"users": 81, "unread": 912}, in the order printed.
    sizes: dict[str, int] = field(default_factory=dict)
    lost_epochs: int = 0
    drift_before_rebuild: tuple[int, int] | None = None  # (wrong keys, sum of |error|)
    repaired: int = 0
    drift: tuple[int, int] = (0, 0)

    @property
    def kills(self) -> int:
        return self.chaos["kill_command"] + self.chaos["kill_celery"]

    def line(self) -> str:
        c, f = self.chaos, self.flushes
        kind = "Redis restarted" if self.restart_redis else "no restart"
        text = (
            f"chaos trial {self.number} ({kind}, {self.seconds:.0f}s): ops={self.ops.total()} "
            f"kills={self.kills} ({kills(c)}) pg_terminate={c['pg_terminate']} "
            f"(in_tx={c['pg_terminate_in_tx']}, at_commit={c['pg_terminate_at_commit']}) "
            f"redis_restarts={c['redis_restart']} "
            f"batches={self.batches} (fallback={self.fallback} "
            f"command={self.by_flusher['command']} celery={self.by_flusher['celery']}) "
            f"stranded={c['stranded_committed']}+{c['stranded_uncommitted']} "
            f"recovered={f['recovered']} already_applied={f['already_applied']} "
            + " ".join(f"{name}={value}" for name, value in self.sizes.items())
        )
        if self.drift_before_rebuild is not None:
            wrong, error = self.drift_before_rebuild
            text += (
                f" lost_epochs={self.lost_epochs} drift_before_rebuild={wrong} keys/{error} "
                f"repaired={self.repaired}"
            )
        wrong, error = self.drift
        return text + f" drift={wrong} keys/{error}"


@dataclass
class Run:
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0

    def total(self, attr: str, key: str | None = None) -> int:
        values = [getattr(t, attr) for t in self.trials]
        return sum(v[key] if key else v for v in values)

    @property
    def ops(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for trial in self.trials:
            total.update(trial.ops)
        return total

    @property
    def drift(self) -> int:
        return sum(t.drift[1] for t in self.trials)

    def line(self) -> str:
        chaos: Counter[str] = Counter()
        flushes: Counter[str] = Counter()
        for trial in self.trials:
            chaos.update(trial.chaos)
            flushes.update(trial.flushes)
        last = self.trials[-1].ledger if self.trials else {}
        before = sum(t.drift_before_rebuild[1] for t in self.trials if t.drift_before_rebuild)
        return (
            f"chaos total: trials={len(self.trials)} seconds={self.seconds:.0f} "
            f"ops={self.ops.total()} kills={chaos['kill_command'] + chaos['kill_celery']} "
            f"({kills(chaos)}) pg_terminate={chaos['pg_terminate']} "
            f"(in_tx={chaos['pg_terminate_in_tx']}, at_commit={chaos['pg_terminate_at_commit']}) "
            f"redis_restarts={chaos['redis_restart']} "
            f"batches={last.get('batches', 0)} stranded: committed="
            f"{chaos['stranded_committed']} uncommitted={chaos['stranded_uncommitted']} "
            f"recovered={flushes['recovered']} "
            f"already_applied={flushes['already_applied']} "
            f"drift_before_rebuild={before} drift={self.drift}"
        )

    def ops_line(self) -> str:
        return "chaos operations: " + ", ".join(f"{k}={v}" for k, v in sorted(self.ops.items()))
