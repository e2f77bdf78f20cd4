"""The one chapter protocol: settings in, ordered and memoised findings out, the results file derived once.

A chapter module holds its ``PROFILES``, its rules and finding functions, and a subclass of ``Chapter`` whose
methods decorated with ``@finding`` return one ``Finding`` each, in notebook order (the order they are defined
in). A finding is computed once per chapter object and timed; ``claims`` gathers the claims of the findings
computed so far in that order, and ``results()`` computes any the notebook skipped, so a claim never goes
missing and never appears twice. Measurements come from ``sinkbook.runs`` (models, trained runs, their
records); the chapter class only asks for them.

The notebook's second cell is ``chapter = SomeChapter.from_notebook(globals())``: it reads ``profile``,
``device`` and exactly the profile's keys from the parameters cell, so each parameter is written once, and a
name the chapter does not know (a typo papermill only warns about) stops the notebook with one line.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import time
import types
from typing import Callable, ClassVar

from ..core.claims import Finding
from ..core.profiles import Profiles, Settings, SettingsError


# names an IPython kernel puts into a notebook's namespace that are not parameters
_KERNEL_NAMES = {"In", "Out"}


def finding(method: Callable) -> Callable:
    """Mark a chapter method as a finding: computed on first call, kept, timed, listed in ``FINDINGS``."""
    @functools.wraps(method)
    def memoised(self) -> Finding:
        name = method.__name__
        if name not in self._findings:
            start = time.perf_counter()
            with self.computing():
                result = method(self)
            if not isinstance(result, Finding):
                raise TypeError(f"{type(self).__name__}.{name} returned {type(result).__name__}, not a Finding")
            self._findings[name] = result
            self.timings[name] = round(time.perf_counter() - start, 2)
        return self._findings[name]
    memoised.is_finding = True
    return memoised


class finding_of:
    """A finding method in one line: ``accuracy = finding_of(accuracy_finding, "measured", "settings.models")``
    is ``accuracy_finding(self.measured, self.settings.models)``, memoised like ``@finding``; a chapter class
    then reads as the notebook's table of contents."""

    def __init__(self, function: Callable[..., Finding], *inputs: str):
        self.function, self.getters = function, [operator.attrgetter(name) for name in inputs]

    def __set_name__(self, owner: type, name: str) -> None:
        def method(chapter) -> Finding:
            return self.function(*(get(chapter) for get in self.getters))
        method.__name__, method.__qualname__, method.__doc__ = name, f"{owner.__name__}.{name}", self.function.__doc__
        setattr(owner, name, finding(method))      # before __init_subclass__ lists the findings


def all_of(*conditions: tuple[bool, str]) -> tuple[bool, str]:
    """Preconditions combined: the first that is missing says why; (True, "") when all hold."""
    for ok, why in conditions:
        if not ok:
            return False, why
    return True, ""


class Chapter:
    """Base of every chapter class. Subclasses set ``NAME`` (the registry name) and ``PROFILES``, may override
    ``check`` (settings a profile's limits cannot express), ``model_records`` and ``extra``."""

    NAME: ClassVar[str]
    PROFILES: ClassVar[Profiles]
    FINDINGS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = [name for name, value in vars(cls).items() if getattr(value, "is_finding", False)]
        inherited = [name for name in cls.FINDINGS if name not in own]
        cls.FINDINGS = tuple(inherited + own)

    def __init__(self, settings: Settings):
        self.settings = settings
        self.check(settings)
        self._findings: dict[str, Finding] = {}
        self.timings: dict[str, float] = {}
        self.started = time.perf_counter()

    @classmethod
    def from_parameters(cls, profile: str = "default", device: str = "auto", **parameters) -> "Chapter":
        return cls(cls.PROFILES.resolve(profile, device=device, **parameters))

    @classmethod
    def from_notebook(cls, namespace: dict) -> "Chapter":
        """The chapter the notebook's parameters describe: ``profile``, ``device`` and the profile's keys are read
        from ``namespace`` (the notebook's ``globals()``); any other data name there is an unknown parameter."""
        known = set(cls.PROFILES.keys) | {"profile", "device"}
        unknown = sorted(name for name, value in namespace.items()
                         if name not in known and not name.startswith("_") and name not in _KERNEL_NAMES
                         and not callable(value) and not isinstance(value, types.ModuleType))
        if unknown:
            raise SettingsError(f"unknown parameter(s) {unknown} for chapter {cls.NAME}; "
                                f"parameters: profile, device, {', '.join(cls.PROFILES.keys)}")
        values = {name: namespace.get(name) for name in cls.PROFILES.keys}
        return cls.from_parameters(namespace.get("profile") or "default", namespace.get("device") or "auto",
                                   **values)

    def check(self, settings: Settings) -> None:
        """Raise ``SettingsError`` for settings that are valid one by one but not together."""

    def computing(self):
        """The context every finding is computed in (a chapter of small matrices limits BLAS threads here)."""
        return contextlib.nullcontext()

    @property
    def claims(self) -> list:
        return [c for name in self.FINDINGS if name in self._findings for c in self._findings[name].claims]

    def findings(self) -> dict[str, Finding]:
        """Every finding, in notebook order (computing those not yet computed)."""
        return {name: getattr(self, name)() for name in self.FINDINGS}

    def model_records(self) -> list[dict]:
        """What the results file says about each model the chapter ran (spec, id, file hashes)."""
        return []

    def extra(self) -> dict:
        """Numbers the results file keeps beside the claims (read after every finding is computed)."""
        return {}

    def results(self) -> dict:
        """The keyword arguments of ``book.results.write_results``."""
        self.findings()
        extra = {**self.extra(), "timings": {**self.timings, "total_s": round(time.perf_counter() - self.started, 1)}}
        return dict(chapter=self.NAME, parameters=self.settings.as_dict(), claims=self.claims,
                    models=self.model_records(), extra=extra)
