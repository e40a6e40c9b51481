"""Chaos on related keys: counters through a relation stay exact while flushers are killed.

The test blog's counters follow a relation of the counted comment:
``author_comments`` (approved comments per author of their post, key
``post__author``), ``thread_author_comments`` (the same through ``thread``, a nullable
``CASCADE`` foreign key, whose deletes Django does not order), ``editor_points`` (points
of approved comments on published posts per editor, ``post__editor``, ``SET_NULL``) and
``post_published_comments`` (``where=Q(post__published=True)``). Writer
processes (``tests.chaos.related_writer``) change the comments by every
counted path and, all along, the rows in the middle: posts moved to other
authors and editors, published and unpublished, created and deleted with
their comments, and authors deleted (``CASCADE`` and ``SET_NULL``), over a
few authors and posts and one hot post. The flush command and a Celery
worker flush under the chaos thread of ``test_chaos.py`` (SIGKILLs inside a
flush and at COMMIT, terminated DB connections); Redis is not restarted.

Every process runs with ``tests.settings``, where the blog's counters are
declared: a flusher that did not know them could not apply their deltas.

After the final drain, with no rebuild: for every key of each counter (the
authors and posts that exist, and the deleted ones the test created), the
stored row and ``get_values`` equal the SQL truth over the join (COUNT or
SUM of the approved comments through ``RelPost``); and the audit triggers on
``RelAuthorStats`` (three counters, one per column) and ``RelPostStats`` find
every counter change in exactly one ledgered transaction that matches its
ledger row.
"""

from __future__ import annotations

import shutil

import pytest
from django.db import connection

import counters
from tests.blog import related
from tests.blog.models import RelAuthor, RelComment, RelPost
from tests.chaos.conftest import soak_minutes
from tests.chaos.harness import CeleryFlusher, CommandFlusher, Config
from tests.chaos.trials import Trials, Wrong, run_all

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="chaos: writer and flusher subprocesses share the test database, kill its "
        "connections with pg_terminate_backend and audit it with triggers: PostgreSQL only",
    ),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]

KEEPERS = 3  # authors never deleted: the hot post's authors
OTHERS = 3  # authors the writers may delete (and create again, up to a bound)
POSTS = 10  # the hot post among them

#: The faults a related run must have seen (a Redis restart is not one: none is planned).
NEEDED = (
    "kills >= 3",
    "pg_terminate",
    "kill inside a flush",
    "batch recovered",
    "stranded_committed",
    "celery flushed",
    "command flushed",
)


@pytest.fixture
def chaos_settings_module() -> str:
    return "tests.settings"


@pytest.fixture
def chaos_config(request) -> Config:
    return Config.related(soak_minutes(request.config))


class RelatedTrials(Trials):
    """Comments, posts and authors of the test blog; its four related-key counters."""

    WRITER = "tests.chaos.related_writer"
    COUNTERS = tuple(related.COUNTERS)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        authors = RelAuthor.objects.bulk_create(
            [RelAuthor(name=f"chaos-{i}") for i in range(KEEPERS + OTHERS)]
        )
        self.keepers = [a.pk for a in authors[:KEEPERS]]
        self.hot = RelPost.objects.create(author=authors[0], editor=authors[1], published=True).pk
        for i in range(1, POSTS):
            RelPost.objects.create(
                author=authors[i % len(authors)],
                editor=authors[(i + 2) % len(authors)] if i % 3 else None,
                published=i % 2 == 0,
            )
        #: Keys the test made, checked even after a writer deleted their row.
        self.made = {
            "author_comments": [a.pk for a in authors],
            "editor_points": [a.pk for a in authors],
            "thread_author_comments": [a.pk for a in authors],
            "post_published_comments": list(RelPost.objects.values_list("pk", flat=True)),
        }

    def writer_args(self) -> list[str]:
        return [f"--hot={self.hot}", f"--keepers={','.join(map(str, self.keepers))}"]

    def wrong(self) -> Wrong:
        """{(counter, key): (stored, get_values, truth)} of every key whose figures disagree.

        The keys: every row of the key model (authors, posts), every stored
        counter row, and every key the test made.
        """
        found: Wrong = {}
        for name in self.COUNTERS:
            truth = related.truths(name)
            stored = related.stored(name)
            keys = sorted({*related.keys(name), *stored, *self.made[name]})
            exact = counters.get_values(name, keys)
            for key in keys:
                figures = (stored.get(key, 0), exact[key], truth.get(key, 0))
                if len(set(figures)) > 1:
                    found[(name, key)] = figures
        return found

    def sizes(self) -> dict[str, int]:
        approved = RelComment.objects.filter(approved=True)
        return {
            "authors": RelAuthor.objects.count(),
            "posts": RelPost.objects.count(),
            "comments": RelComment.objects.count(),
            "approved": approved.count(),
            "hot_approved": approved.filter(post_id=self.hot).count(),
        } | {name: sum(related.truths(name).values()) for name in self.COUNTERS}


def test_related_key_counts_stay_exact_under_kills_and_disconnects(
    chaos_config: Config,
    chaos_redis,
    command_flusher: CommandFlusher,
    celery_flusher: CeleryFlusher,
    writer_env,
    tmp_path,
):
    cfg = chaos_config
    mode = f"soak {cfg.minutes:g} min" if cfg.minutes else "quick"
    print(
        f"\nchaos related keys {mode}: seed={cfg.seed} writers={cfg.writers} "
        f"authors={KEEPERS}+{OTHERS} posts={POSTS} shards={cfg.shards} "
        f"batch_size={cfg.batch_size} trial={cfg.trial_seconds:.0f}s",
        flush=True,
    )
    trials = RelatedTrials(cfg, chaos_redis, command_flusher, celery_flusher, writer_env, tmp_path)
    run = run_all(trials, NEEDED)  # drift 0 and a clean audit in each trial; NEEDED all seen

    assert run.total("chaos", "redis_restart") == 0
    assert all(t.drift_before_rebuild is None for t in run.trials), "no rebuild ran"
    assert run.trials[-1].ledger["changes"] > 0, "the audit saw no change of the counter rows"
    middle = ("post_save", "publish_save", "post_update", "hot_update")
    assert all(run.ops[op] for op in middle), f"middle rows never changed: {run.ops}"
