"""What a related key costs per counted change: the test blog's comments, one writer.

One writer process inserts comments, in ``--rounds`` interleaved rounds of
``--inserts`` per mode, and reports per change the median of its own CPU time
and of its PostgreSQL backend's (``/proc/<pid>/stat``, so PostgreSQL must run
on this machine). The models and counters are those of ``tests.blog``:

- ``plain_off`` / ``plain``: ``Comment.objects.create(approved=True)``, paused /
  counted by its two counters keyed by the comment's own column
  (``post_comments``, ``post_points``);
- ``plain_floor``: the paused insert of ``plain_off``, and the least a writer can
  do that keeps Tally's guarantees for those two counters: a ``post_save``
  receiver that pushes both members after the COMMIT with Tally's push script,
  under a push id, one call per shard they fall on
  (:class:`benchmarks.writers.PushFloor`), and nothing else;
- ``related_off`` / ``related``: ``RelComment.objects.create(approved=True)``,
  paused / counted by its three counters over related paths
  (``post__author``, ``post__editor`` with ``post__published``, and ``post``
  with ``post__published``): each insert reads its post share-locked;
- ``move_off`` / ``move``: ``RelPost.objects.filter(pk=…).update(author=…)``
  of a post with ``--below`` comments, paused / counted: the middle-row route,
  one grouped query moving the post's comments between authors;
- ``hops_off`` / ``hops``: ``HopComment.objects.create(approved=True)``, paused /
  counted by its four counters over paths of several relations
  (``post__blog__owner`` twice, with ``post__published`` and with
  ``post__blog__owner__active``; ``post__blog__founder`` with
  ``post__blog__public``; ``post__blog`` with ``post__published``);
- ``hop_move_off`` / ``hop_move``: ``HopBlog.objects.filter(pk=…).update(owner=…)``
  of a blog with one post of ``--below`` comments, paused / counted: a change
  two relations up the path, moving every comment under the blog.

``--modes`` runs some of them, each beside the paused mode it is measured
over (``--modes plain_off,plain,plain_floor``: the two counters and their
floor alone).

The database must be migrated with the test settings first::

    createdb -h 127.0.0.1 -U postgres tally_related
    export DJANGO_SETTINGS_MODULE=tests.settings
    export DATABASE_URL=postgres://postgres@127.0.0.1:5432/tally_related
    python manage.py migrate
    python scripts/related_cost.py --redis-url redis://127.0.0.1:6393/0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.write_cost import backend_cpu  # noqa: E402

if TYPE_CHECKING:
    from benchmarks.writers import PushFloor

MODES = (
    *("plain_off", "plain", "plain_floor", "related_off", "related", "move_off", "move"),
    *("hops_off", "hops", "hop_move_off", "hop_move"),
)


def operations(below: int) -> tuple[dict[str, Callable[[], None]], PushFloor]:
    """One change per mode, and the floor of ``plain_floor``. Django must be set up."""
    from benchmarks.writers import PushFloor
    from counters import paused
    from tests.blog.models import (
        Comment,
        HopBlog,
        HopComment,
        HopOwner,
        HopPost,
        Post,
        RelAuthor,
        RelComment,
        RelPost,
    )

    post = Post.objects.create(title="cost")
    authors = [RelAuthor.objects.create(name=f"cost-{i}") for i in range(2)]
    rel_post = RelPost.objects.create(author=authors[0], editor=authors[1], published=True)
    moved = RelPost.objects.create(author=authors[0], published=True)
    RelComment.objects.bulk_create([RelComment(post=moved, approved=True) for _ in range(below)])
    owners = [HopOwner.objects.create(name=f"cost-{i}") for i in range(2)]
    hop_blog = HopBlog.objects.create(owner=owners[0], founder=owners[1])
    hop_post = HopPost.objects.create(blog=hop_blog, published=True)
    hop_moved = HopBlog.objects.create(owner=owners[0], founder=owners[1])
    hop_below = HopPost.objects.create(blog=hop_moved, published=True)
    HopComment.objects.bulk_create(
        [HopComment(post=hop_below, approved=True) for _ in range(below)]
    )
    turn = [0]

    def plain() -> None:
        Comment.objects.create(post=post, approved=True)

    def related() -> None:
        RelComment.objects.create(post=rel_post, approved=True)

    def move() -> None:
        turn[0] ^= 1
        RelPost.objects.filter(pk=moved.pk).update(author=authors[turn[0]])

    def hops() -> None:
        HopComment.objects.create(post=hop_post, approved=True)

    def hop_move() -> None:
        turn[0] ^= 1
        HopBlog.objects.filter(pk=hop_moved.pk).update(owner=owners[turn[0]])

    def off(op: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with paused():
                op()

        return run

    counted = {"plain": plain, "related": related, "move": move, "hops": hops, "hop_move": hop_move}
    ops = {**counted, **{f"{name}_off": off(op) for name, op in counted.items()}}
    floor = PushFloor(lambda _: ops["plain_off"](), "blog.Comment", comment_deltas)
    return {**ops, "plain_floor": lambda: floor(0)}, floor


def baseline(mode: str) -> str:
    """The paused mode that counted ``mode`` is measured over."""
    return "plain_off" if mode == "plain_floor" else f"{mode}_off"


def comment_deltas(comment: Any) -> dict[str, int] | None:
    """What ``post_comments`` and ``post_points`` count of a created comment."""
    if not comment.approved:
        return None
    return {f"post_comments:{comment.post_id}": 1, f"post_points:{comment.post_id}": comment.points}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=1000, help="changes per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--below", type=int, default=10, help="comments under the moved post")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6393/0")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes to run, each counted one with its paused one (default: all)",
    )
    args = parser.parse_args()
    asked = set(args.modes.split(","))
    if unknown := asked - set(MODES):
        parser.error(f"unknown modes: {', '.join(sorted(unknown))} (known: {', '.join(MODES)})")
    modes = tuple(m for m in MODES if m in asked)
    for mode in modes:
        if not mode.endswith("_off") and baseline(mode) not in asked:
            parser.error(f"{mode} is measured over {baseline(mode)}: add it to --modes")

    os.environ["COUNTERS_REDIS_URL"] = args.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.test.signals import setting_changed

    import counters
    from benchmarks.writers import drop_floor_keys

    if connection.vendor != "postgresql":
        parser.error("needs PostgreSQL on this machine (DATABASE_URL=postgres://...)")
    # The defaults of a project (the test settings wait on every push).
    settings.COUNTERS_DEFER_ACKS = True
    setting_changed.send(type(settings), setting="COUNTERS_DEFER_ACKS", value=True, enter=True)
    ops, floor = operations(args.below)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]

    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
            if mode == "plain_floor":
                floor.begin()
            for _ in range(50):
                ops[mode]()
            counters.push_queued()
            cpu, db = time.process_time(), backend_cpu(backend)
            for _ in range(args.inserts):
                ops[mode]()
            counters.push_queued()
            if mode == "plain_floor":
                floor.finish()  # its replies read, as push_queued() sends Tally's
            spent = (time.process_time() - cpu, backend_cpu(backend) - db)
            results[mode].append(tuple(t / args.inserts * 1e6 for t in spent))  # type: ignore[arg-type]
        counters.flush()
    floor.close()
    drop_floor_keys(counters.get_client(), counters.get_buffer().prefix)

    print(f"one writer, {args.inserts} changes x {args.rounds} rounds, µs per change (median)")
    print(f"{'mode':<12} {'writer':>7} {'postgres':>9} {'extra writer':>13} {'extra postgres':>15}")
    for mode in modes:
        writer = statistics.median(r[0] for r in results[mode])
        db = statistics.median(r[1] for r in results[mode])
        if mode.endswith("_off"):
            base = (writer, db)
            print(f"{mode:<12} {writer:>7.0f} {db:>9.0f}")
        else:
            extra = f"{writer - base[0]:>+13.0f} {db - base[1]:>+15.0f}"
            print(f"{mode:<12} {writer:>7.0f} {db:>9.0f} {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
