"""Settings that name Python objects: `module:attribute`, imported when the run needs them.

`load_function(spec, field)` is the one loader every such setting goes through (reward
functions, environments, agents, OpenEnv clients and converters, the episode sources'
makers): an error names the config field and what was wrong (no such module, an import that
failed or called `sys.exit`, no such callable). It imports nothing itself until asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rollflow.errors import ConfigError


def load_function(spec: str, field: str) -> Callable[..., Any]:
    """`module:attribute` -> the callable it names; errors name the config `field`."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{field}: expected 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({err})") from None
    except SystemExit as err:  # a module that exits while loading must not end the run silently
        raise ConfigError(f"{field}: importing {module_name!r} called sys.exit({err.code!r})") from None
    except Exception as err:  # the module's own bug, in one line (its traceback is the user's to get)
        raise ConfigError(f"{field}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ConfigError(f"{field}: {module_name!r} has no function {attribute!r}")
    return func  # type: ignore[no-any-return]
