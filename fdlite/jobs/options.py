"""The option schema shared by YAML jobs and the `fdlite` command line, read from the dataclasses.

`EngineConfig` and `SamplingParams` already hold every option's name, default and help text. This module
only adds what a text front end needs on top: the kind of value (from the field's type annotation), the
`--flag` spelling, and type checks for YAML values the dataclasses do not check themselves (a YAML
`enable_prefix_caching: "yes"` must fail, not become truthy). Nothing here repeats a help string.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass
from typing import Any

from fdlite.config import EngineConfig, GraphOptimizationConfig
from fdlite.sampling_params import SamplingParams

# Annotation (without "None") -> kind. A new field whose type is missing here fails at import, so the CLI
# and YAML schema can never silently skip an option.
_KINDS = {
    "bool": "bool",
    "int": "int",
    "float": "float",
    "str": "str",
    "list[int]": "int_list",
    "str | list[str]": "str_list",
    "list[str]": "str_list",
    "GraphOptimizationConfig": "json",
    "StructuredOutputsParams": "json",
    "dict[int, float]": "json",
}


@dataclass(frozen=True)
class OptionSpec:
    """One option as a front end sees it."""

    name: str  # the Python / YAML / FastDeploy name
    group: str  # "engine" or "sampling"
    kind: str  # one of _KINDS' values
    nullable: bool  # accepts None (YAML null, CLI "none")
    default: Any
    help: str
    flag: str  # the command-line spelling, e.g. --max-num-seqs

    @property
    def default_text(self) -> str:
        """The default as a user would type it."""
        if self.kind == "json" and self.name == "graph_optimization_config":
            return json.dumps(dataclasses.asdict(GraphOptimizationConfig()))
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)


def _kind(annotation: str) -> tuple[str, bool]:
    parts = [p.strip() for p in annotation.split("|")]
    nullable = "None" in parts
    key = " | ".join(p for p in parts if p != "None")
    if key not in _KINDS:
        raise TypeError(f"no option kind for annotation {annotation!r}; add it to fdlite.jobs.options._KINDS")
    return _KINDS[key], nullable


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _specs(cls: type, group: str, flag_prefix: str, taken: set[str]) -> list[OptionSpec]:
    out = []
    for f in dataclasses.fields(cls):
        kind, nullable = _kind(str(f.type))
        dashed = f.name.replace("_", "-")
        # A name both groups use (only `seed` today) keeps the plain flag for the engine.
        flag = f"--{flag_prefix}{dashed}" if f.name in taken else f"--{dashed}"
        out.append(OptionSpec(f.name, group, kind, nullable, _default(f), f.metadata["help"], flag))
    return out


ENGINE_OPTIONS: list[OptionSpec] = _specs(EngineConfig, "engine", "", set())
SAMPLING_OPTIONS: list[OptionSpec] = _specs(
    SamplingParams, "sampling", "sampling-", {s.name for s in ENGINE_OPTIONS}
)


def check_value(spec: OptionSpec, value: Any) -> Any:
    """Type-check a YAML value for `spec`; return it (JSON strings stay strings: the dataclass parses them).

    Range checks stay in the dataclasses; this only rejects values of the wrong type, with a message that
    names the option, the way the dataclasses' own errors do.
    """
    if value is None:
        if spec.nullable or spec.kind == "json":
            return None
        raise ValueError(f"{spec.name} must not be null")
    ok = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "int_list": lambda v: isinstance(v, list),
        "str_list": lambda v: isinstance(v, (str, list)),
        "json": lambda v: isinstance(v, (dict, str)),
    }[spec.kind](value)
    if not ok:
        wanted = {"bool": "true or false", "int": "an int", "float": "a number", "str": "a string",
                  "int_list": "a list of ints", "str_list": "a string or a list of strings",
                  "json": "a mapping or a JSON string"}[spec.kind]
        raise ValueError(f"{spec.name} must be {wanted}, got {value!r}")
    return value


def parse_cli_value(spec: OptionSpec, text: str) -> Any:
    """Convert one command-line word for `spec` (bool and list flags are handled by argparse actions)."""
    if spec.nullable and text.lower() in ("none", "null"):
        return None
    if spec.kind in ("int", "int_list"):
        return int(text)
    if spec.kind == "float":
        return float(text)
    return text
