"""MkDocs hooks of the docs site (mkdocs.yml ``hooks``).

The docstrings name other objects with Sphinx roles (``:class:`InvalidKey```,
``:func:`~counters.verify.drift.default_confirm_delay```). mkdocstrings renders
them as text; this shows each as the code it names, the last part alone after
a ``~``, as Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>(~?)([^<]*)</code>")


def shown(match: re.Match[str]) -> str:
    name = match[2].rsplit(".", 1)[-1] if match[1] else match[2]
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub(shown, html)
