"""One way to set a chapter's profile: named settings, resolved together with the reader's overrides.

Every chapter module defines ``PROFILES = Profiles({"quick": {...}, "default": {...}, "gpu": {...}})``.
Its notebook's parameters cell holds ``profile``, ``device`` and the chapter's own parameters, each
``None`` unless the reader sets it (with papermill ``-p`` / ``-y``). ``PROFILES.resolve(profile, device=...,
**parameters)`` returns the settings: the profile's values with the non-None parameters put over them.
An unknown profile, an unknown parameter or a value of the wrong type fails at once with one line that
says what is allowed.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

PROFILE_NAMES = ("quick", "default", "gpu")


class SettingsError(ValueError):
    """A profile or parameter a chapter does not know, or a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved settings: attribute access (``s.models``), ``s.as_dict()`` for the results file."""
    profile: str
    device: str
    values: MappingProxyType

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "values")
        if name in values:
            return values[name]
        raise AttributeError(f"no setting {name!r}; settings: {', '.join(values)}")

    def as_dict(self) -> dict:
        return {"profile": self.profile, "device": self.device, **dict(self.values)}

    def replace(self, **changes) -> "Settings":
        unknown = set(changes) - set(self.values)
        if unknown:
            raise SettingsError(f"unknown setting(s) {sorted(unknown)}; settings: {', '.join(self.values)}")
        return Settings(self.profile, self.device, MappingProxyType({**self.values, **changes}))


def _compatible(default, value) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


class Profiles:
    def __init__(self, table: dict[str, dict]):
        missing = [p for p in PROFILE_NAMES if p not in table]
        if missing:
            raise ValueError(f"a chapter must define every profile; missing {missing}")
        keys = set(table["default"])
        for name, values in table.items():
            if set(values) != keys:
                raise ValueError(f"profile {name!r} sets {sorted(set(values) ^ keys)} differently from 'default'")
        self.table = {name: dict(values) for name, values in table.items()}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.table)

    def resolve(self, profile: str, device: str = "auto", **overrides) -> Settings:
        if profile not in self.table:
            raise SettingsError(f"unknown profile {profile!r}; choose one of {', '.join(self.table)}")
        if not isinstance(device, str) or not (device == "auto" or device.split(":")[0] in ("cpu", "cuda", "mps")):
            raise SettingsError(f"device must be 'auto', 'cpu', 'cuda[:N]' or 'mps', got {device!r}")
        values = dict(self.table[profile])
        unknown = set(overrides) - set(values)
        if unknown:
            raise SettingsError(f"unknown parameter(s) {sorted(unknown)} for this chapter; "
                                f"parameters: {', '.join(values)}")
        for name, value in overrides.items():
            if value is None:
                continue
            if not _compatible(values[name], value):
                raise SettingsError(f"parameter {name!r} should be like {values[name]!r} "
                                    f"({type(values[name]).__name__}), got {value!r}")
            values[name] = list(value) if isinstance(value, tuple) else value
        return Settings(profile, device, MappingProxyType(values))
