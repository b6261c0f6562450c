"""Adds an out-of-tree transfer backend to a stock SGLang: enum member, CLI choice, class lookup.

Runs in every SGLang process, from the splitserve plugin (``splitserve.plugins``), before SGLang
parses its arguments and applies its hooks. SGLang 0.5.23 has no registration API for transfer
backends: ``TransferBackend`` is a closed enum, the CLI choices a module-level list, and
``get_kv_class(backend, KVClassType)`` an if-chain. So a backend is added in three steps:

1. a ``TransferBackend`` member whose value is the CLI name (``TransferBackend("name")`` works);
2. the name appended to ``DISAGG_TRANSFER_BACKEND_CHOICES`` through SGLang's own
   ``add_disagg_transfer_backend_choices`` (the same list object argparse holds);
3. an ``AROUND`` hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that answers the
   backend's classes for that member and defers to SGLang otherwise (``HookRegistry`` also
   patches the modules that imported ``get_kv_class`` earlier).

``load_classes`` is called lazily, on the first lookup, so registering costs no import.

Invariants: idempotent per process (a second registration of the same name changes nothing);
lookups of SGLang's own backends are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"

# name -> loader of {KVClassType member name ("MANAGER", ...): class}
_loaders: dict[str, Callable[[], dict[str, type]]] = {}
_classes: dict[str, dict[str, type]] = {}
_hook_registered = False


def _add_enum_member(enum_cls: Any, member_name: str, value: str) -> Any:
    """Add ``member_name = value`` to a plain (non-flag) Enum class; returns the member."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    enum_cls._member_map_[member_name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member_name)
    type.__setattr__(enum_cls, member_name, member)
    return member


def around_get_kv_class(original: Callable, transfer_backend: Any, class_type: Any) -> Any:
    name = getattr(transfer_backend, "value", None)
    loader = _loaders.get(name) if isinstance(name, str) else None
    if loader is None or class_type.name == "KVARGS":
        return original(transfer_backend, class_type)
    classes = _classes.get(name)
    if classes is None:
        classes = _classes[name] = loader()
    return classes.get(class_type.name)


def register_transfer_backend(name: str, load_classes: Callable[[], dict[str, type]]) -> None:
    """Make ``--disaggregation-transfer-backend NAME`` select the classes ``load_classes``
    returns (keys: ``MANAGER``, ``SENDER``, ``RECEIVER``, ``BOOTSTRAP_SERVER``)."""
    global _hook_registered
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _add_enum_member(TransferBackend, name.upper(), name)
    if name not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([name])
    _loaders[name] = load_classes
    if not _hook_registered:
        HookRegistry.register(GET_KV_CLASS, around_get_kv_class, HookType.AROUND)
        _hook_registered = True
    logger.debug("registered SGLang transfer backend %r", name)
