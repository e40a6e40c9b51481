"""An index for the unsettled direct writes where partial indexes do not exist (MySQL, MariaDB).

Every read looks for unsettled direct writes. Elsewhere the partial index
``counters_unsettled`` (0005) finds them at once; MySQL and MariaDB skip it, and
the read would scan the whole ledger. Only direct writes (``kind = 'fallback'``)
are ever unsettled, so an index on the kind finds them among the few direct
writes. It exists on those databases alone: the model does not declare it.
"""

from django.db import migrations, models

INDEX = models.Index(fields=["kind", "applied_at"], name="counters_fallback")


def add_index(apps, schema_editor):
    if not schema_editor.connection.features.supports_partial_indexes:
        schema_editor.add_index(apps.get_model("counters", "FlushBatch"), INDEX)


def remove_index(apps, schema_editor):
    if not schema_editor.connection.features.supports_partial_indexes:
        schema_editor.remove_index(apps.get_model("counters", "FlushBatch"), INDEX)


class Migration(migrations.Migration):

    dependencies = [
        ("counters", "0010_buffer_layout"),
    ]

    operations = [
        # DDL on MySQL commits implicitly: not inside a transaction.
        migrations.RunPython(add_index, remove_index, atomic=False, elidable=False),
    ]
