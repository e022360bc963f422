"""Config layering on pydantic-settings: the sources, their order, and errors that name their source.

pydantic-settings reads each source (its own ``TomlConfigSettingsSource``, ``EnvSettingsSource``
with ``KVTIER_`` prefix and ``__`` nesting, ``InitSettingsSource`` for ``--set``) and deep-merges
them, first source winning. Two things it cannot do are kept here as a thin layer on top:

- say where a bad value came from: a ValidationError carries the key, not the source, and
  tomllib keeps no positions. ``explain`` maps each error to the highest source that set the key:
  ``file:line`` for TOML (the key's line found in the file's text), the variable for the
  environment, the flag for ``--set``;
- refuse a missing file and an unknown ``KVTIER_<SECTION>__`` variable: its TOML source skips a
  missing file, and its env source reads only variables named after a field, so a typo in either
  would be dropped silently.

``--set`` values and nothing else are parsed as TOML values (``policy.name="lru"``; a bare word is
a string); environment values are read as pydantic-settings reads them (``KVTIER_POLICY__NAME=lru``,
JSON for a table value).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from pydantic import BaseModel, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "KVTIER_"
ENV_NESTING = "__"


class ConfigError(ValueError):
    """A config source is invalid; the message names the key, line and reason."""


class _Layered(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTING,
                                      case_sensitive=False)


def settings_class(model: type[BaseModel]) -> type[BaseSettings]:
    """A BaseSettings whose fields are ``model``'s sections, so a new section needs no edit here."""
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in model.model_fields.items()}
    return create_model(f"{model.__name__}Settings", __base__=_Layered, **fields)


class TomlFile(TomlConfigSettingsSource):
    """A TOML file that must exist and parse; keeps its text to find the line of a bad key."""

    def __init__(self, settings_cls: type[BaseSettings], path: "str | Path", label: str):
        self.label = label
        try:  # read here: the base class skips a file that is not there
            self.text = Path(path).read_text(encoding="utf-8")  # TOML is UTF-8 whatever the locale
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            line = Path(path).read_bytes()[:e.start].count(b"\n") + 1
            raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{e.object[e.start]:02x}); TOML files are UTF-8") from None
        super().__init__(settings_cls, toml_file=Path(path))

    def _read_file(self, file_path: object) -> dict[str, Any]:  # parses the text read in __init__
        try:
            return tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{self.label}: TOML syntax error: {e}") from None

    def where(self, loc: Sequence[str]) -> str:
        line = _line_of(self.text, loc)
        return f"{self.label}:{line}" if line else self.label


def env_names(environ: Mapping[str, str]) -> list[str]:
    """The variables the environment layer reads (``KVTIER_<SECTION>__<FIELD>``), sorted."""
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and ENV_NESTING in k)


class Environment(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping (``environ={}`` ignores the process env)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        self.names = env_names(environ)
        for name in self.names:
            section = name[len(ENV_PREFIX):].split(ENV_NESTING, 1)[0].lower()
            if section not in settings_cls.model_fields:
                raise ConfigError(f"environment {name}: unknown section {section!r} "
                                  f"(sections: {', '.join(settings_cls.model_fields)})")
        self._environ = {k: environ[k] for k in self.names}
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, Optional[str]]:  # the base reads os.environ
        return {k.lower(): v for k, v in self._environ.items()}

    def __call__(self) -> dict[str, Any]:
        try:
            return super().__call__()
        except SettingsError as e:  # it names the section only: name the variables set under it
            m = re.search(r'field "([^"]+)"', str(e))
            under = f"{ENV_PREFIX}{m.group(1)}{ENV_NESTING}".upper() if m else ""
            names = [n for n in self.names if n.upper().startswith(under)] or self.names
            if len(self.names) > 1:  # of those, the ones that fail on their own
                names = [n for n in names if self._fails_alone(n)] or names
            raise ConfigError(f"environment {', '.join(names)}: not a valid value (a table or a list is JSON, "
                              f"e.g. KVTIER_SCORING__SEGMENT_WEIGHTS='{{\"system\": 2.0}}')") from None

    def _fails_alone(self, name: str) -> bool:
        """Whether this variable, read on its own, is what pydantic-settings cannot decode."""
        try:
            Environment(self.settings_cls, {name: self._environ[name]})()
        except ConfigError:
            return True
        return False

    def where(self, loc: Sequence[str]) -> str:
        name = next((n for n in self.names if _overlaps(n[len(ENV_PREFIX):].lower().split(ENV_NESTING), loc)), None)
        return f"environment {name}" if name else "environment"


def redacted(pair: str) -> str:
    """A ``--set`` pair as it may be printed: a password's value never is, whether the key names
    it or a table value holds it (``tiers.remote={password="..."}``)."""
    key, eq, _ = pair.partition("=")
    return f"{key}=(hidden)" if eq and "password" in pair.lower().replace("password_env", "") else pair


def _scalar(text: str) -> Any:
    """A ``--set`` value as a TOML value when it is one, else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class SetFlags(InitSettingsSource):
    """``--set section.field=value`` flags as pydantic-settings init values (the last flag wins)."""

    def __init__(self, settings_cls: type[BaseSettings], pairs: Sequence[str]):
        self.pairs = list(pairs)
        data: dict[str, Any] = {}
        for pair in self.pairs:
            if "=" not in pair:
                raise ConfigError(f"--set {redacted(pair)!r}: expected section.field=value")
            key, value = (s.strip() for s in pair.split("=", 1))
            parts = [p for p in key.split(".") if p]
            if len(parts) < 2:
                raise ConfigError(f"--set {redacted(pair)}: {key!r} must be section.field")
            node = data
            for p in parts[:-1]:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"--set {redacted(pair)}: {key!r} is not a table")
            node[parts[-1]] = _scalar(value)
        super().__init__(settings_cls, data)

    def where(self, loc: Sequence[str]) -> str:
        pair = next((p for p in reversed(self.pairs) if _overlaps(p.split("=", 1)[0].strip().split("."), loc)), None)
        return f"--set {redacted(pair)}" if pair else "--set"


def layers(settings_cls: type[BaseSettings], files: Sequence[tuple["str | Path", str]],
           environ: Mapping[str, str], overrides: Sequence[str]) -> tuple[PydanticBaseSettingsSource, ...]:
    """Sources highest precedence first (pydantic-settings' order): --set, env, then ``files``
    given lowest first as (path, label)."""
    tomls = [TomlFile(settings_cls, path, label) for path, label in files]
    return (SetFlags(settings_cls, overrides), Environment(settings_cls, environ), *reversed(tomls))


def _overlaps(path: Sequence[str], loc: Sequence[str]) -> bool:
    """One key path lies inside the other (a variable may set a whole table, or one key of it)."""
    n = min(len(path), len(loc))
    return list(path[:n]) == list(loc[:n])


def _has(data: Any, loc: Sequence[str]) -> bool:
    for key in loc:
        if not isinstance(data, Mapping) or key not in data:
            return False
        data = data[key]
    return True


def explain(error: ValidationError, sources: Sequence[PydanticBaseSettingsSource],
            related: Mapping[str, Sequence[str]] = {}) -> ConfigError:
    """One line per error: the source that set the key (``file:line``, variable, flag), key, reason.
    ``related``: a key checked against others (``tiers.low_watermark`` against the high one) is
    blamed on the highest-precedence source that set any of them: the user's file that lowered
    the high mark, not the shipped default's low one."""
    out = []
    for err in error.errors():
        loc = [str(x) for x in err["loc"] if not isinstance(x, int)]
        where = ".".join(loc) or "(top level)"
        keys = [loc, *(k.split(".") for k in related.get(where, ()))] if loc else []
        src, key = next(((s, k) for s in sources for k in keys if _has(s(), k)), (None, loc))
        at = src.where(key) if src is not None and hasattr(src, "where") else "config"
        why = "unknown key (not a field of this section)" if err["type"] == "extra_forbidden" else err["msg"]
        out.append(f"{at}: {where}: {why}")
    return ConfigError("invalid configuration\n  " + "\n  ".join(out))


def _line_of(text: str, loc: Sequence[str]) -> Optional[int]:
    """Best-effort line of ``section.key`` (or of ``[section]``) in TOML text, at any depth:
    ``tiers.remote.enabled`` is ``enabled =`` under ``[tiers.remote]``; a location inside a
    value (``scoring.segment_weights.system``: an inline table) is the line of its key."""
    loc = [str(x) for x in loc]
    if len(loc) == 1:
        return _find(text, loc[0], None)
    for k in range(len(loc), 1, -1):  # the deepest key that is written as a line of its own
        line = _find(text, ".".join(loc[: k - 1]), loc[k - 1])
        if line:
            return line
    return _find(text, loc[0], None)


def _find(text: str, table: str, key: Optional[str]) -> Optional[int]:
    """Line of ``key =`` under ``[table]``, or of the ``[table]`` header when ``key`` is None."""
    current = None
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        m = re.match(r"^\[\s*([A-Za-z0-9_.\-]+)\s*\]", line)
        if m:
            current = m.group(1)
            if key is None and current == table:
                return i
            continue
        if key is not None and current == table and re.match(rf"^{re.escape(key)}\s*=", line):
            return i
    return None


__all__ = ["ConfigError", "ENV_PREFIX", "Environment", "SetFlags", "TomlFile", "env_names", "explain", "layers",
           "settings_class"]
