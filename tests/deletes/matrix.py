"""The cells of the deletion matrix: each route by which Django deletes or detaches rows,
with each kind of key that can read through it, and the SQL truth of each.

A cell is ``(route, kind)``. Routes through a foreign key from ``Note`` to ``Post`` are
named ``<field>-<target>-<how>``: the note's foreign key the counter reads (its
``on_delete``, see :mod:`tests.deletes.models`), the row deleted (a post, or a blog whose
posts cascade) and how (``instance.delete()`` or ``QuerySet.delete()``). Cells that make
no sense are not generated: a natural key is the book's shelf code, a many-to-many key
is the through model's, and neither reads a note's foreign key to a post.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.db.models import ProtectedError, Q, RestrictedError

from tests.deletes.models import Blog, Book, Note, Person, Post, Shelf, Tag, Tagging

#: The foreign keys from a note to its post, by ``on_delete``.
FKS = ("hard", "post", "loose", "dflt", "kept", "guard", "rule")
#: The kinds of key read through one of them.
FK_KINDS = ("own", "hop1", "hop2", "cond", "composite")
#: Those whose delete is refused.
REFUSED = {"guard": ProtectedError, "rule": RestrictedError}


@dataclass(frozen=True)
class Cell:
    route: str
    kind: str

    @property
    def id(self) -> str:
        return f"{self.route}:{self.kind}"

    @property
    def fk(self) -> str:
        first = self.route.split("-")[0]
        return first if first in FKS else "post"


def cells() -> list[Cell]:
    """Every cell of the matrix, in a fixed order."""
    found = [
        Cell(f"{fk}-{target}-{how}", kind)
        for fk in FKS
        for target in ("post", "blog")
        for how in ("instance", "queryset")
        for kind in FK_KINDS
    ]
    found += [Cell(f"note-{how}", kind) for how in ("instance", "queryset") for kind in FK_KINDS]
    found += [
        Cell(route, "natural")
        for route in ("book-instance", "book-queryset", "shelf-cascade", "shelf-again")
    ]
    found += [
        Cell(route, "m2m")
        for route in (
            "clear",
            "clear-reverse",
            "remove",
            "note-end",
            "tag-end",
            "through-instance",
            "through-queryset",
        )
    ]
    return found


# -- declarations ---------------------------------------------------------------------


def declaration(cell: Cell) -> tuple[Any, dict[str, Any]]:
    """``(model, track() arguments)`` of the cell's counter."""
    f = cell.fk
    if cell.kind == "natural":
        return Book, {"key": "shelf", "into": "deletes.ShelfStats.n"}
    if cell.kind == "m2m":
        return Tagging, {"key": "tag__owner", "into": "deletes.PersonStats.n"}
    into = "deletes.PersonStats.n"
    return Note, {
        "own": {"key": "writer", "where": Q(**{f"{f}__isnull": False}), "into": into},
        "hop1": {"key": f"{f}__author", "into": into},
        "hop2": {"key": f"{f}__blog__owner", "into": into},
        "cond": {"key": "writer", "where": Q(**{f"{f}__published": True}), "into": into},
        "composite": {"key": ("writer", f), "into": "deletes.PairStats.n"},
    }[cell.kind]


# -- the truth --------------------------------------------------------------------------


def _rows(sql: str, params: list[Any] | None = None) -> dict[Any, int]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        found = {}
        for *key, n in cursor.fetchall():
            if None not in key:
                found[tuple(key) if len(key) > 1 else key[0]] = n
        return found


def truth(cell: Cell) -> dict[Any, int]:
    """``{key: value}`` of the cell's counter, by SQL over the tables (nonzero keys)."""
    f = cell.fk
    post = f"JOIN deletes_post p ON p.id = n.{f}_id"
    if cell.kind == "natural":
        return _rows("SELECT shelf_id, COUNT(*) FROM deletes_book GROUP BY shelf_id")
    if cell.kind == "m2m":
        return _rows(
            "SELECT t.owner_id, COUNT(*) FROM deletes_tagging g "
            "JOIN deletes_tag t ON t.id = g.tag_id GROUP BY t.owner_id"
        )
    sql = {
        "own": f"SELECT n.writer_id, COUNT(*) FROM deletes_note n WHERE n.{f}_id IS NOT NULL "
        "GROUP BY n.writer_id",
        "hop1": f"SELECT p.author_id, COUNT(*) FROM deletes_note n {post} GROUP BY p.author_id",
        "hop2": f"SELECT b.owner_id, COUNT(*) FROM deletes_note n {post} "
        "JOIN deletes_blog b ON b.id = p.blog_id GROUP BY b.owner_id",
        "cond": f"SELECT n.writer_id, COUNT(*) FROM deletes_note n {post} "
        "WHERE p.published = %s GROUP BY n.writer_id",
        "composite": f"SELECT n.writer_id, n.{f}_id, COUNT(*) FROM deletes_note n "
        f"WHERE n.{f}_id IS NOT NULL GROUP BY n.writer_id, n.{f}_id",
    }[cell.kind]
    return _rows(sql, [True] if cell.kind == "cond" else [])


def stored(cell: Cell) -> dict[Any, int]:
    """``{key: value}`` of the cell's nonzero stored counter rows."""
    from tests.deletes.models import PairStats, PersonStats, ShelfStats

    if cell.kind == "natural":
        rows: Any = ShelfStats.objects.values_list("shelf_id", "n")
    elif cell.kind == "composite":
        rows = (((w, p), n) for w, p, n in PairStats.objects.values_list("who_id", "on_id", "n"))
    else:
        rows = PersonStats.objects.values_list("person_id", "n")
    return {key: n for key, n in rows if n}


# -- the worlds and the deletes -----------------------------------------------------------


@dataclass
class World:
    keys: list[Any]  # every key the cell's counter may have had
    act: Callable[[], None]
    refused: type[Exception] | None = None


def world(cell: Cell) -> World:
    """Rows for the cell's counter, and the delete to run on them."""
    if cell.kind == "natural":
        return _shelves(cell)
    if cell.kind == "m2m":
        return _tags(cell)
    return _notes(cell)


def _notes(cell: Cell) -> World:
    f = cell.fk
    people = [Person.objects.create(code=c) for c in "abc"]
    anchor = Post.objects.create(author=people[2], anchor=True)
    blogs = [Blog.objects.create(owner=people[0]), Blog.objects.create(owner=people[1])]
    posts = [
        Post.objects.create(author=people[0], blog=blogs[0]),
        Post.objects.create(author=people[1], blog=blogs[0], published=False),
        Post.objects.create(author=people[0], blog=blogs[1]),
    ]
    for i, post in enumerate(posts * 3):
        Note.objects.create(**{"writer": people[i % 2], "hard": anchor, f: post})
    Note.objects.create(writer=people[0], hard=anchor)
    route = cell.route.split("-")
    keys: list[Any] = [p.pk for p in people]
    if cell.kind == "composite":
        keys = [(p.pk, q.pk) for p in people for q in [anchor, *posts]]
    if route[0] == "note":
        doomed = Note.objects.filter(**{f: posts[0]})
        if route[1] == "instance":
            return World(keys, lambda: doomed.first().delete())
        return World(keys, lambda: doomed.delete())
    model, row = (Post, posts[0]) if route[1] == "post" else (Blog, blogs[0])
    if route[2] == "instance":
        act: Callable[[], Any] = row.delete
    else:
        act = model.objects.filter(pk=row.pk).delete
    return World(keys, act, REFUSED.get(f))


def _shelves(cell: Cell) -> World:
    shelves = [Shelf.objects.create(code=c) for c in "AB"]
    for i in range(5):
        Book.objects.create(shelf=shelves[i % 2])
    Book.objects.create(shelf=None)
    keys = ["A", "B"]

    def again() -> None:
        Shelf.objects.get(code="A").delete()
        back = Shelf.objects.create(code="A")
        Book.objects.create(shelf=back)

    acts: dict[str, Callable[[], Any]] = {
        "book-instance": lambda: Book.objects.filter(shelf="A").first().delete(),
        "book-queryset": lambda: Book.objects.filter(shelf="A").delete(),
        "shelf-cascade": lambda: Shelf.objects.get(code="A").delete(),
        "shelf-again": again,
    }
    return World(keys, acts[cell.route])


def _tags(cell: Cell) -> World:
    people = [Person.objects.create(code=c) for c in "ab"]
    anchor = Post.objects.create(author=people[0], anchor=True)
    tags = [Tag.objects.create(owner=people[i % 2]) for i in range(3)]
    notes = [Note.objects.create(writer=people[0], hard=anchor) for _ in range(3)]
    for i, note in enumerate(notes):
        note.tags.add(*tags[: i + 1])
    acts: dict[str, Callable[[], Any]] = {
        "clear": notes[2].tags.clear,
        "clear-reverse": tags[0].notes.clear,
        "remove": lambda: notes[2].tags.remove(tags[0], tags[1]),
        "note-end": notes[2].delete,
        "tag-end": tags[0].delete,
        "through-instance": lambda: Tagging.objects.filter(tag=tags[1]).first().delete(),
        "through-queryset": lambda: Tagging.objects.filter(tag=tags[0]).delete(),
    }
    return World([p.pk for p in people], acts[cell.route])
