from django.apps import AppConfig


class DeletesConfig(AppConfig):
    """Models for the deletion routes: every ``on_delete`` between a counted note and its post.

    The counters are declared by the tests themselves (``tests.deletes.cells``), one or a
    few at a time, so each route and kind of key is counted alone.
    """

    name = "tests.deletes"
    label = "deletes"
    default_auto_field = "django.db.models.BigAutoField"
