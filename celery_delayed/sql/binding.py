"""A database's rows belong to one store: the binding, and what is refused.

The rows of one ``delayed_key_prefix`` are the jobs of one store (one Redis):
its reconciler indexes into its Redis every row that Redis lacks. A second
store (another Redis) given the same database and prefix would take them
all: its scheduler re-indexed 50,000 rows of the first into its own Redis,
without a word. So a database is bound to the store it belongs to:

- the store has an id, a random one written once into its layout record
  (``{prefix}:layout``, field ``store_id``);
- the database records, per prefix, the id of its store, with that store's
  Redis URL (passwords hidden) and when it was bound (``delayed_stores``);
- the first process to use the two binds them; after that a store whose id
  differs from the database's is refused with a :class:`ConfigurationError`
  that says which store the database belongs to and what to do.

**A store that lost its data** (Redis wiped, or restarted without
persistence) has no id any more. At the same Redis address as the bound
store, it takes the database's id again: this is the recovery the database
exists for (the reconciler then re-indexes the rows into the empty Redis),
and a WARNING says so. An empty store elsewhere is refused: it is another
Redis, or the store moved without its data, which only an operator can tell
(``celery -A proj delayed db bind --force`` binds the database to it).

Not told apart: two Redis servers reached by the same URL (each host's own
``localhost``), one of them empty. The empty one takes the id, and the
WARNING is all that is said.

Checked by every process before it writes rows, reads them into Redis or
moves them (producers, the scheduler at start and before each sweep and
reconciliation, ``delayed reconcile``, ``delayed reshard``), at most every
:data:`RECHECK_S` after the first time.
"""

from __future__ import annotations

import logging
import time
import uuid

from ..errors import ConfigurationError, StoreUnavailable
from ..redis_urls import is_sentinel_url, redact, same_redis
from ..store import Store
from ..timeutil import from_ms
from .rows import Binding, JobRows

logger = logging.getLogger("celery_delayed.binding")

#: How long a process trusts a binding it checked, seconds (a `db bind --force` elsewhere is seen within this).
RECHECK_S = 30.0


def ensure_bound(store: Store, rows: JobRows, max_age_s: float = RECHECK_S) -> None:
    """Check that ``rows`` belong to ``store``, binding them on first use (see the module docstring).

    With Redis unreachable, only the address is compared (rows may still be
    written: they are the jobs), and the check is made again next time.

    Raises:
        ConfigurationError: the database is bound to another store.
        DatabaseUnavailable: the database cannot be used.
    """
    if rows.bound_at and time.monotonic() - rows.bound_at < max_age_s:
        return
    held = rows.binding()
    try:
        _check(store, rows, held)
    except StoreUnavailable:
        if held is not None and not _same_place(held, store):
            raise ConfigurationError(_empty_elsewhere(store, rows, held)) from None
        return
    rows.bound_at = time.monotonic()


def _check(store: Store, rows: JobRows, held: Binding | None) -> None:
    """:func:`ensure_bound` with the database's binding read (``held``), Redis asked."""
    ours = store.layout.identity()
    if held is None:
        ours = ours or store.layout.claim_identity(_new_id())
        held = rows.bind(_binding_of(store, ours))
    if ours is None:  # an empty store: new, or its data lost
        if not _same_place(held, store):
            raise ConfigurationError(_empty_elsewhere(store, rows, held))
        ours = store.layout.claim_identity(held.store_id)
        if ours == held.store_id:
            logger.warning(
                "celery-delayed: the store at %s (prefix %r) has no id: it lost its data, and takes the id of "
                "the store the database %s is bound to, at this address (%s); the reconciler indexes the "
                "database's jobs into it. If this is another Redis server than that store's, stop now and give "
                "it another delayed_key_prefix or database", redact(store.url), store.config.key_prefix,
                rows.url_shown, held.store_id)
    if ours != held.store_id:
        raise ConfigurationError(_other_store(store, rows, held, ours))
    if not _same_place(held, store):  # the same store at a new address: remember it, for a recovery there
        rows.bind(_binding_of(store, ours, held.bound_ms), replacing=ours)


def binding_problem(store: Store, rows: JobRows) -> tuple[Binding | None, str | None]:
    """(the binding, what is wrong with it for ``store`` or None), changing nothing (``delayed status``)."""
    held = rows.binding()
    try:
        ours = store.layout.identity()
    except StoreUnavailable:
        ours = None
    if held is None:
        return None, None  # the first producer or scheduler binds it
    if ours is None:
        return held, None if _same_place(held, store) else _empty_elsewhere(store, rows, held)
    return held, None if ours == held.store_id else _other_store(store, rows, held, ours)


def bind(store: Store, rows: JobRows, *, force: bool = False) -> tuple[Binding, Binding | None]:
    """Bind the database's rows of this prefix to ``store``; return (the binding, the one it replaced).

    Without ``force`` this is :func:`ensure_bound` (refused when bound to
    another store). With ``force`` the database is bound to this store
    whatever it was bound to (the store gets an id if it has none): for a
    store that replaces the bound one (moved without its data).

    Raises:
        ConfigurationError: without ``force``, the database is bound to another store.
        StoreUnavailable: Redis cannot be reached.
    """
    if not force:
        store.layout.identity()  # Redis must answer (StoreUnavailable): a binding needs the store's id
        ensure_bound(store, rows, max_age_s=0)
        held = rows.binding()
        if held is None:
            raise StoreUnavailable(f"the store's Redis at {redact(store.url)} stopped answering: nothing was bound")
        return held, None
    before = rows.binding()
    ours = store.layout.claim_identity(_new_id())
    if before is None:
        after = rows.bind(_binding_of(store, ours))
    else:
        after = rows.bind(_binding_of(store, ours), replacing=before.store_id)
    if after.store_id != ours:
        raise ConfigurationError(f"the database {rows.url_shown} was bound to store {after.store_id} by another "
                                 "process meanwhile: run the command again")
    rows.bound_at = time.monotonic()
    return after, (before if before is not None and before.store_id != ours else None)


def describe(binding: Binding) -> str:
    """A binding in words: the store's id, its Redis, since when."""
    master = f" (master {binding.master})" if binding.master else ""
    return (f"store {binding.store_id} at {binding.redis}{master} (since "
            f"{from_ms(binding.bound_ms).isoformat(timespec='seconds')})")


def _new_id() -> str:
    return uuid.uuid4().hex


def _master(store: Store) -> str | None:
    if not is_sentinel_url(store.url):
        return None
    name = store.config.redis_options.get("master_name")
    return str(name) if name else None


def _binding_of(store: Store, store_id: str, bound_ms: int | None = None) -> Binding:
    return Binding(store_id, redact(store.url), _master(store),
                   int(time.time() * 1000) if bound_ms is None else bound_ms)


def _same_place(held: Binding, store: Store) -> bool:
    """Whether the bound store's Redis is this store's (by URL: the same server and database)."""
    try:
        return same_redis(held.redis, store.url) and held.master == _master(store)
    except ValueError:  # a URL that does not parse: not provably the same
        return False


def _other_store(store: Store, rows: JobRows, held: Binding, ours: str) -> str:
    return (
        f"the database {rows.url_shown} holds the jobs of another celery-delayed store under delayed_key_prefix "
        f"{store.config.key_prefix!r}: it is bound to {describe(held)}, and this app's store at "
        f"{redact(store.url)} is store {ours}. Two stores sharing a database and prefix would index and run each "
        "other's jobs. Give this app another delayed_key_prefix or another database; if the other store is gone "
        "for good and this one takes over its jobs, run `celery -A <app> delayed db bind --force`")


def _empty_elsewhere(store: Store, rows: JobRows, held: Binding) -> str:
    return (
        f"the database {rows.url_shown} holds the jobs of another celery-delayed store under delayed_key_prefix "
        f"{store.config.key_prefix!r}: it is bound to {describe(held)}, and this app's store at "
        f"{redact(store.url)} is another Redis (or that store, moved here without its data). Give this app "
        "another delayed_key_prefix or another database; if this Redis replaces that store, run "
        "`celery -A <app> delayed db bind --force`: the reconciler then indexes the database's jobs into it")
