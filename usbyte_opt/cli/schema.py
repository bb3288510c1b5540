"""``usbyte-opt schema profile|schedule``: print the JSON Schema of a file format."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from .. import console
from ..formats import profile_schema, schedule_schema


class Kind(str, Enum):
    profile = "profile"
    schedule = "schedule"


def schema(kind: Annotated[Kind, typer.Argument(help="Which format: profile or schedule.")]) -> None:
    """Print the JSON Schema (draft 2020-12) of the profile or schedule format.

    It is generated from the definition every file is validated against (docs/design.md §4),
    physical bounds included, so a file the schema accepts loads, save for the checks across
    fields that the schema's descriptions state (ready_ms <= backward_ms, unique names, blocks
    covering each buffer once, ...).
    """
    console.emit_json(profile_schema() if kind is Kind.profile else schedule_schema())


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)
