"""The simulation profile's value types: finite numbers, bounded counts, strict flags,
and frozen models that reject unknown and unused fields."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, got a boolean")
    return v


# Finite, bounded numbers (an .inf wattage would put Infinity into the annotation's JSON).
Number = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
Count = Annotated[int, BeforeValidator(_not_bool), Field(le=10**12)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _reject_unused(names: set[str], what: str) -> None:
    if names:
        raise ValueError(f"{', '.join(sorted(names))}: not used by {what} (remove it)")


Flag = Annotated[bool, Field(strict=True)]  # true/false, not 1 or "yes"
