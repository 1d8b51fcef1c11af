"""What an unset sampling field means: the checkpoint's
generation_config.json says, as vLLM (`--generation-config auto`) and Ollama take it, and
the router's `--override-generation-config JSON` can change it; without either, kvferry's
defaults (temperature 1.0, top_p 1.0, top_k off). A request's own value always wins; greedy
is temperature 0, asked for."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any

DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0  # off

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any]) -> SamplingDefaults:
        """The sampling fields a generation_config.json sets (the others keep kvferry's);
        `top_k` 0 or below is off."""
        return cls().merged(raw, source="generation_config.json", strict=False)

    def merged(self, values: dict[str, Any], source: str, strict: bool = True
               ) -> SamplingDefaults:
        """These defaults with `values` over them; `strict`: an unknown or bad key is a
        ValueError naming `source` and the key (a checkpoint's extra keys are ignored)."""
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                if strict:
                    raise ValueError(f"{source}: unknown key {key!r}; one of {sorted(known)}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                if strict:
                    raise ValueError(f"{source}: {key} must be a number, got {value!r}")
                continue
            changes[key] = max(int(value), 0) if key == "top_k" else float(value)
        merged = replace(self, **changes)
        if merged.temperature < 0 or not 0 < merged.top_p <= 1:
            if strict:
                raise ValueError(f"{source}: temperature must be >= 0 and top_p in (0, 1], "
                                 f"got {merged.temperature} and {merged.top_p}")
            return self
        return merged

    def overridden(self, override_json: str | None) -> SamplingDefaults:
        """`--override-generation-config`: a JSON object over these defaults."""
        if not override_json:
            return self
        try:
            values = json.loads(override_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"override_generation_config: not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("override_generation_config: expected a JSON object, e.g. "
                             '\'{"temperature": 0.7}\'')
        return self.merged(values, "override_generation_config")


KVFERRY_DEFAULTS = SamplingDefaults()  # no generation config, no override
