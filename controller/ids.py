"""The names of a cluster's processes, built and parsed here only.

An engine slot is ``g<group>-e<index>``; a group's spare engines run as ``g<group>-spare`` (the slot each becomes
comes with its start) under the name ``g<group>-engines`` (their processes and log); a group's cache daemon is
``g<group>-cache``, ``-gen<n>`` after ``cache`` for a later weight generation's, ``-r<rank>`` for the other ranks
of a tensor-parallel group.
"""

from __future__ import annotations

import re

ENGINE_ID = re.compile(r"g(\d+)-e(\d+)")


def engine_id(group: int, index: int) -> str:
    """The id of engine slot ``index`` of ``group``."""
    return f"g{group}-e{index}"


def engine_slot(member_id: str) -> tuple[int, int]:
    """(group, index) of an engine id; ValueError for anything that is not one."""
    if not (match := ENGINE_ID.fullmatch(member_id)):
        raise ValueError(f"{member_id!r} is not an engine id (g<group>-e<index>)")
    return int(match[1]), int(match[2])


def spare_engine_id(group: int) -> str:
    """The engine id in the command of the group's spare engines (the slot each starts as comes with its start)."""
    return f"g{group}-spare"


def spare_key(group: int) -> str:
    """What the group's spare engines are for (any of its slots): their processes' name and log."""
    return f"g{group}-engines"


def daemon_id(group: int, rank: int, generation: int = 0) -> str:
    """The cache daemon of ``group``'s ``rank`` for weight ``generation`` (module docstring)."""
    return f"g{group}-cache" + (f"-gen{generation}" if generation else "") + (f"-r{rank}" if rank else "")
