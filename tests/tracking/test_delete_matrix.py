"""Every route by which Django deletes or detaches rows, with every kind of key: exact.

The cells of :mod:`tests.deletes.matrix` (a note's foreign key to its post by each
``on_delete``, the post or its blog deleted by instance or queryset; the notes themselves;
a natural key; a many-to-many through model) each declare one counter, write rows, run the
delete, and check ``get_value`` of every key before the flush and the stored rows after it
against the SQL truth. A refused delete (``PROTECT``, ``RESTRICT``) changes nothing.

The default run takes a fixed-seed sample of the cells; ``DELETE_MATRIX=all`` runs them all.
"""

from __future__ import annotations

import os
import random

import pytest

import counters
from tests.deletes import matrix
from tests.deletes.cells import declare

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

__all__ = ["declare"]

#: How many cells the default run takes, and the seed that picks them.
SAMPLE = 32
SEED = 2026


def _chosen() -> list[matrix.Cell]:
    every = matrix.cells()
    if os.environ.get("DELETE_MATRIX") == "all":
        return every
    return sorted(random.Random(SEED).sample(every, SAMPLE), key=every.index)


@pytest.mark.parametrize("cell", _chosen(), ids=lambda cell: cell.id)
def test_cell(declare, cell):
    model, options = matrix.declaration(cell)
    declare("matrix", model, **options)
    world = matrix.world(cell)
    before = matrix.truth(cell)
    if world.refused is not None:
        with pytest.raises(world.refused):
            world.act()
        assert matrix.truth(cell) == before
    else:
        world.act()
    truth = matrix.truth(cell)
    read = counters.get_values("matrix", world.keys)
    assert {k: v for k, v in read.items() if v} == truth
    counters.flush()
    assert matrix.stored(cell) == truth
    read = counters.get_values("matrix", world.keys)
    assert {k: v for k, v in read.items() if v} == truth
