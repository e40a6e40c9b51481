"""The buffer's Lua files: each loaded by one constant, headed by its KEYS and ARGV,
and flagged allow-oom exactly where the drain path needs it."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from counters.buffer import scripts
from counters.buffer.lease import Lease
from counters.buffer.store import Buffer

LUA = resources.files("counters.buffer") / "lua"
NAMES = sorted(p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua"))


def test_every_file_is_one_constant_named_after_it():
    constants = {k for k, v in vars(scripts).items() if k.endswith("_SCRIPT")}
    assert constants == {f"{name.upper()}_SCRIPT" for name in NAMES}
    for name in NAMES:
        assert getattr(scripts, f"{name.upper()}_SCRIPT") == scripts.load(name)
    assert scripts.load("push") is scripts.load("push")  # read once


@pytest.mark.parametrize("name", NAMES)
def test_the_header_says_what_it_does_and_names_every_key_and_arg(name):
    lines = scripts.load(name).removeprefix(scripts.ALLOW_OOM).splitlines()
    assert lines[0].startswith("-- ") and not lines[0].startswith("-- KEYS")
    header = [line for line in lines if line.startswith("-- ")]
    body = "\n".join(line for line in lines if not line.startswith("--"))
    for used in sorted(set(re.findall(r"\b(KEYS|ARGV)\[(\d+)\]", body))):
        assert any(h.startswith("-- {}[{}] ".format(*used)) for h in header), used
    assert "#!lua" not in "\n".join(lines)  # a flag line is the first line or nowhere


def test_the_drain_scripts_and_only_they_are_flagged(client):
    buffer, lease = Buffer(client, "t"), Lease(client, "t:lease", 1)
    found = {**vars(buffer), **vars(lease)}
    drain = {k for k, v in found.items() if isinstance(v, scripts.DrainScript)}
    plain = {k for k, v in found.items() if k.startswith("_") and hasattr(v, "sha")}
    assert drain and plain
    for text in (scripts.load(k.lstrip("_")) for k in drain):
        assert text.startswith(scripts.ALLOW_OOM)
    for text in (scripts.load(k.lstrip("_")) for k in plain):
        assert not text.startswith("#!")
