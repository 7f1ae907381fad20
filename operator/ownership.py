"""Whether the operator may apply a child: only over nothing, or over an object this pool controls.

Server-side apply with ``force`` would take over any object of the child's name and, through
the owner reference ``kopf.adopt`` adds, have it garbage-collected with the pool. So before a
pass applies anything, every child it would apply that the indexes do not show as the pool's
own is read by name; one that exists without the pool's controller reference is a conflict, and
the pass applies none of its children (no half-applied pool), touches nothing of the other
object, and says which object is in the way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Conflict:
    kind: str
    name: str
    controller: str  # "" when the object has no controller at all

    def describe(self) -> str:
        owner = f"controlled by {self.controller}" if self.controller else "not the pool's"
        return f"{self.kind} {self.name} already exists and is {owner}"


def controller_of(metadata: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference marked ``controller``, if any."""
    return next(
        (ref for ref in metadata.get("ownerReferences") or [] if ref.get("controller")), None
    )


def controlled_by(metadata: Mapping[str, Any], uid: str) -> bool:
    controller = controller_of(metadata)
    return controller is not None and controller.get("uid") == uid


def conflict(kind: str, metadata: Mapping[str, Any] | None, uid: str) -> Conflict | None:
    """A conflict when an object of the child's name exists that pool ``uid`` does not control."""
    if metadata is None or controlled_by(metadata, uid):
        return None
    controller = controller_of(metadata)
    described = ""
    if controller is not None:
        # Another pool of this name (deleted, its children not yet collected) shows as such.
        owner_kind, owner_name, owner_uid = (
            controller.get(k, "?") for k in ("kind", "name", "uid")
        )
        described = f"{owner_kind} {owner_name} (uid {owner_uid})"
    return Conflict(kind=kind, name=str(metadata.get("name", "")), controller=described)


def conflict_message(conflicts: Sequence[Conflict]) -> str:
    objects = "; ".join(c.describe() for c in conflicts)
    return (
        f"{objects}: the pool's children were not applied, and nothing of the existing object "
        "was changed; rename the pool or remove the object"
    )
