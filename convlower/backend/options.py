"""convlower's options: ``torch.compile(..., options={...})`` and ``CONVLOWER_*`` env vars.

Keys convlower does not own are passed to Inductor when they are Inductor config keys (so
``options={"max_autotune": True}`` works as with ``backend="inductor"``); anything else is an
error naming the bad key and listing the valid ones.  Env vars fill in keys the caller did not
pass; an explicit option wins.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from .. import torch_internals as ti
from ..device import PLATFORMS
from ..lowerings import RULES

SELECT_MODES = ("auto", "measure", "exhaustive", "heuristic", "always")
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
SNAKE_ROUTES = ("auto", "eager", "fused")
COMPUTE_DTYPES = (None, "bfloat16")
FALLBACKS = ("error", "inductor")
KERNEL_BUILDS = ("together", "separate")
PART_CALLS = ("direct", "wrapped")

ENV = {
    "rules": "CONVLOWER_RULES",
    "select": "CONVLOWER_SELECT",
    "snake": "CONVLOWER_SNAKE",
    "platform": "CONVLOWER_PLATFORM",
    "compute_dtype": "CONVLOWER_COMPUTE_DTYPE",
    "fallback": "CONVLOWER_FALLBACK",
    "regions": "CONVLOWER_REGIONS",
    "kernel_builds": "CONVLOWER_KERNEL_BUILDS",
    "part_calls": "CONVLOWER_PART_CALLS",
}


class OptionError(ValueError):
    """A bad convlower option: the message names the bad item and lists the valid ones."""


@dataclasses.dataclass(frozen=True)
class Options:
    rules: tuple[str, ...]
    select: str = "auto"  # compile-time cheap; see docs/selection.md
    snake: str = "auto"
    platform: str = "auto"
    compute_dtype: Optional[str] = None
    fallback: str = "error"
    inductor: tuple[tuple[str, Any], ...] = ()  # Inductor config keys passed through
    regions: Any = "off"  # "off" | "auto" | tuple of block class names (docs/regions.md)
    kernel_builds: str = "together"  # a graph's C++ kernels in a few libraries (docs/regions.md)
    part_calls: str = "direct"  # regions' inference calls straight into Inductor's code

    def key(self) -> dict:
        """What identifies these settings in cache keys (JSON-ready).  ``regions`` only
        decides which graphs are compiled, ``kernel_builds`` how the generated kernels are
        built and ``part_calls`` how compiled parts are called, not what a graph compiles to:
        left out."""
        d = dataclasses.asdict(self)
        d.pop("regions")
        d.pop("kernel_builds")
        d.pop("part_calls")
        d["inductor"] = [[k, repr(v)] for k, v in self.inductor]
        return d


def _parse_rules(value) -> tuple[str, ...]:
    valid = tuple(RULES)
    if isinstance(value, str):
        if value.strip() in ("all", ""):
            return valid if value.strip() == "all" else ()
        if value.strip() == "none":
            return ()
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise OptionError(f"convlower option 'rules' must be a list of rule names, 'all' or "
                          f"'none', got {value!r}; valid rules: {', '.join(valid)}")
    if "all" in value:
        return valid
    for name in value:
        if name not in valid:
            raise OptionError(f"unknown convlower rule {name!r}; valid rules: "
                              f"{', '.join(valid)} (or 'all' / 'none')")
    return tuple(n for n in valid if n in value)  # keep priority order


def _choice(key, value, allowed):
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise OptionError(f"bad value {value!r} for convlower option {key!r}; valid values: {shown}")
    return value


def parse(options: Optional[dict] = None, env: Optional[dict] = None,
          mode: Optional[str] = None) -> Options:
    """Validate ``options`` (+ env vars) into :class:`Options`; raise :class:`OptionError`.
    Under ``mode="max-autotune"`` the default ``select`` is "exhaustive" (measure everything),
    as Inductor then autotunes its own kernels."""
    env = os.environ if env is None else env
    if options is not None and not isinstance(options, dict):
        raise OptionError(f"convlower options must be a dict, got {type(options).__name__}")
    options = dict(options or {})
    ours = {k: options.pop(k) for k in list(options) if k in ENV}
    for key, var in ENV.items():
        if key not in ours and env.get(var):
            ours[key] = env[var]
    if ours.get("compute_dtype") in ("float32", "none", "None", ""):
        ours["compute_dtype"] = None
    inductor = _inductor_passthrough(options)
    return Options(
        rules=_parse_rules(ours.get("rules", "all")),
        select=_choice("select", ours.get("select", "exhaustive" if mode in AUTOTUNE_MODES
                                          else "auto"), SELECT_MODES),
        snake=_choice("snake", ours.get("snake", "auto"), SNAKE_ROUTES),
        platform=_choice("platform", ours.get("platform", "auto"), PLATFORMS),
        compute_dtype=_choice("compute_dtype", ours.get("compute_dtype"), COMPUTE_DTYPES),
        fallback=_choice("fallback", ours.get("fallback", "error"), FALLBACKS),
        inductor=inductor,
        regions=_parse_regions(ours.get("regions", "off")),
        kernel_builds=_choice("kernel_builds", ours.get("kernel_builds", "together"),
                              KERNEL_BUILDS),
        part_calls=_choice("part_calls", ours.get("part_calls", "direct"), PART_CALLS),
    )


def _parse_regions(value):
    if isinstance(value, str) and value.strip() in ("off", "auto"):
        return value.strip()
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, str) and v.isidentifier() for v in value):
        return tuple(value)
    raise OptionError(f"bad value {value!r} for convlower option 'regions'; valid values: "
                      f"'off', 'auto', or a list of module class names (e.g. "
                      f"['ResnetBlock2D', 'BasicTransformerBlock'])")


def _inductor_passthrough(rest: dict) -> tuple[tuple[str, Any], ...]:
    known = ti.inductor_config_keys()
    out = []
    for key, value in rest.items():
        name = key.replace("-", "_")
        if name not in known:
            raise OptionError(
                f"unknown convlower option {key!r}; convlower's options are: "
                f"{', '.join(ENV)}; any torch._inductor.config key is passed to Inductor")
        out.append((name, value))
    return tuple(sorted(out))
