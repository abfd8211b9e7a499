"""How the store's connections pack commands: hiredis's packer, given the arguments as they are.

redis-py's hiredis serializer runs every argument through Python first (a
generator step and an ``Encoder.encode`` call each, ~0.3 µs an argument)
before ``hiredis.pack_command`` packs them. The store's commands are mostly
scripts with many arguments: a execution record call (``start.lua``, ``finish.lua``)
has 13, a one-job ``schedule.lua`` 28, so that pass was ~7 µs of each call.
hiredis itself encodes ``str`` (UTF-8), ``bytes``, ``memoryview``, ``int``
and ``float`` (``repr``'s digits), the same bytes redis-py sends, so
:class:`DirectPacker` hands it the arguments directly. Anything else goes
through redis-py's own serializer (its pure-Python one, the same bytes), which
splits, encodes or refuses it as it always has: a command name with a space
(``"SCRIPT LOAD"``), ``None`` or a ``bool`` (redis-py's ``DataError``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from redis._parsers import Encoder
from redis.connection import PythonRespSerializer


def _hiredis() -> ModuleType | None:
    try:  # an optional extra (celery-delayed[hiredis]); without it redis-py packs as usual
        import hiredis
    except ImportError:  # pragma: no cover - the test environment installs it
        return None
    return hiredis if hasattr(hiredis, "pack_command") else None  # (hiredis 2.1 and later)


hiredis = _hiredis()

#: redis-py's chunk size for large arguments (``Connection._buffer_cutoff``).
_BUFFER_CUTOFF = 6000


class DirectPacker:
    """A redis-py ``command_packer``: ``hiredis.pack_command`` on the arguments as given.

    Only for connections that encode as UTF-8 with strict errors (redis-py's
    default): :func:`direct_packer` returns None otherwise.
    """

    __slots__ = ("_fallback",)

    def __init__(self) -> None:
        encode = Encoder("utf-8", "strict", decode_responses=False).encode  # type: ignore[no-untyped-call, unused-ignore]
        self._fallback: Callable[..., list[bytes]] = PythonRespSerializer(_BUFFER_CUTOFF, encode).pack

    def pack(self, *args: Any) -> list[bytes]:
        """The command as RESP bytes (a list of chunks, as redis-py's serializers return)."""
        name = args[0]
        if not (" " in name if isinstance(name, str) else isinstance(name, bytes) and b" " in name):
            try:
                return [hiredis.pack_command(args)]  # type: ignore[union-attr]
            except TypeError:  # an argument hiredis does not take: redis-py's serializer decides
                pass
        return self._fallback(*args)


def direct_packer(options: dict[str, Any]) -> DirectPacker | None:
    """The packer for a client made with ``options`` (redis-py keyword arguments), or None.

    None when hiredis is not installed, or the options choose another
    encoding than UTF-8 with strict errors (hiredis encodes only that way).
    """
    if hiredis is None:
        return None
    if str(options.get("encoding", "utf-8")).lower().replace("_", "-") not in ("utf-8", "utf8"):
        return None
    if options.get("encoding_errors", "strict") != "strict":
        return None
    return DirectPacker()
