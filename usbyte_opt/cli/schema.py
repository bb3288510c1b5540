"""``usbyte-opt schema profile|schedule``: print the JSON Schema of a file format."""

from __future__ import annotations

from enum import Enum

import typer

from .. import console
from ..formats import profile_schema, schedule_schema


class Kind(str, Enum):
    profile = "profile"
    schedule = "schedule"


def schema(kind: Kind = typer.Argument(..., help="Which format: profile or schedule.")) -> None:
    """Print the JSON Schema (draft 2020-12) of the profile or schedule format."""
    console.emit_json(profile_schema() if kind is Kind.profile else schedule_schema())


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)
